"""Random model parameters drawn with numpy, for tests.

Compiling jax's initialiser costs 10-15 s of CPU here (a threefry graph per tensor), which
tests that only need *some* parameters should not pay; `model.init_params` itself is tested
in test_sharding.py. Shapes and tree come from `jax.eval_shape` of the real initialiser.
"""

import flax.linen as nn
import jax
import numpy as np

from jaxgrpo import model


def random_params(cfg, seed, scale_noise=0.0):
  """Fan-in-scaled normal kernels, N(0, 0.02) embeddings, norm scales 1 + scale_noise * N(0, 1)
  (a non-zero noise makes a dropped norm scale visible). Host float32 numpy arrays."""
  # Drawn layer by layer (the unstacked tree, in its order), then stacked: the draws do not
  # depend on the in-memory layout, so every test's numbers survived the stacking of layers.
  shapes = jax.eval_shape(lambda key: model.unstack_layers(nn.unbox(model.init_params(cfg, key))),
                          jax.random.key(0))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = path[-1].key
    if name == "scale":
      value = 1.0 + scale_noise * rng.standard_normal(leaf.shape)
    elif name == "embedding":
      value = 0.02 * rng.standard_normal(leaf.shape)
    else:  # fan-in scaling; the output kernel o is [heads, head_dim, embed]
      fan_in = leaf.shape[0] * (leaf.shape[1] if name == "o" else 1)
      value = rng.standard_normal(leaf.shape) / np.sqrt(fan_in)
    return np.asarray(value, np.float32)

  return model.stack_layers(jax.tree_util.tree_map_with_path(draw, shapes))

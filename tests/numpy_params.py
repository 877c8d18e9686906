"""Random model parameters drawn with numpy, and a float comparison at scale, for tests.

Compiling jax's initialiser costs 10-15 s of CPU here (a threefry graph per tensor), which
tests that only need *some* parameters should not pay; `model.init_params` itself is tested
in test_sharding.py. Shapes and tree come from `jax.eval_shape` of the real initialiser.
"""

import flax.linen as nn
import jax
import numpy as np

from jaxgrpo.model import decoder as model


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


def peaked_params(cfg, seed=0):
  """random_params with the final norm scale 25 rather than 1: with the tied head's small
  embedding the logits would be near-uniform (std ~0.1), where greedy ties and top-p
  boundaries are fragile (and end ids are rarely drawn); this gives logits with std ~3."""
  p = random_params(cfg, seed)
  p["final_norm"]["scale"] = p["final_norm"]["scale"] * 25.0
  return p


def left_padded_prompts(vocab_size, pad_id):
  """8 prompts left-padded (with pad_id) to width 6; real lengths 1..6. (tokens, mask)."""
  rng = np.random.default_rng(0)
  lengths = np.array([6, 3, 5, 1, 4, 6, 2, 5])
  width = 6
  mask = np.arange(width)[None, :] >= width - lengths[:, None]
  tokens = np.where(mask, rng.integers(1, vocab_size, size=(8, width)), pad_id)
  return tokens.astype(np.int32), mask


def assert_close_at_scale(got, want, rtol, scale_tol, err_msg=""):
  """got == want elementwise to rtol, or to scale_tol x want's largest magnitude.

  Two float32 computations of one quantity in another order (chunked or micro-batched against
  whole) differ by rounding relative to the magnitudes summed, not to each result: an entry
  that cancels down to 1e-2 in a gradient of magnitude 50 carries the 50's rounding. A fixed
  atol passed on one CPU and failed on another (a 4.8e-6 gap at 0.013, 1e-7 of the scale),
  where XLA's kernels sum in another order. A real defect (a dropped chunk, a wrong scale)
  moves entries by a large fraction of the scale.
  """
  want = np.asarray(want)
  scale = float(np.max(np.abs(want))) if want.size else 0.0
  np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=scale_tol * scale,
                             err_msg=err_msg)

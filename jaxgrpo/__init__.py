"""jaxgrpo: GRPO for language models in JAX/Flax.

`import jaxgrpo` stays cheap (no jax import) so that the command line can reject a bad
config before any device work; the heavy names load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "Policy": ("jaxgrpo.rollout.policy", "Policy"),
    "SamplingParams": ("jaxgrpo.rollout.sampling", "SamplingParams"),
    "ModelConfig": ("jaxgrpo.model.decoder", "ModelConfig"),
}


def __getattr__(name):
  if name in _LAZY:
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
  raise AttributeError(f"module 'jaxgrpo' has no attribute {name!r}")

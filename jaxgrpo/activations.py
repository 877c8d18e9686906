"""Where activations live: the model pins its activations' layouts by logical axis names.

Under FSDP (weights split on `embed` over the `fsdp` axis, rows split over `fsdp` too) the
partitioner may resolve the conflict by computing whole-batch activations on every chip, so
per-chip memory grew as chips were added (tests/test_sharding.py measures it). Pinned to
rows over the data axes, with the model dimension whole, every chip gathers a layer's
weights and computes its own rows, as MaxText does. The names map to mesh axes through
sharding.RULES; `sharding.activation_sharding(mesh)` switches the pinning on while a step is
traced, and outside it (a forward without a mesh: tests, `Policy.logits`) nothing changes.
"""

from __future__ import annotations

import contextvars

import flax.linen as nn

# The mesh `constrain` pins activations to, set while a step is traced (jax's own mesh
# context cannot be entered inside jit, where the trace happens).
ACTIVATION_MESH: contextvars.ContextVar = contextvars.ContextVar("activation_mesh",
                                                                default=None)


def constrain(x, *logical_axes):
  """Pins an activation's layout by logical axis names (sharding.RULES: `batch` over the data
  axes, `act_mlp` / `act_vocab` over `tensor`, an unnamed axis whole); a no-op unless a
  mesh is set (module docstring)."""
  mesh = ACTIVATION_MESH.get()
  if mesh is None:
    return x
  return nn.with_logical_constraint(x, logical_axes, mesh=mesh)


def constrain_rows(x):
  """`constrain` for a [rows..., D] activation: split by its first (batch) axis only."""
  return constrain(x, "batch", *([None] * (x.ndim - 1)))

"""Device mesh and logical-axis sharding.

The mesh has three named axes: `data` (pure data parallelism), `fsdp` (data parallelism whose
parameters and optimizer state are also split over it) and `tensor` (heads, MLP and vocab
split over it). Batch rows are split over `data` x `fsdp`.

Model code names axes logically (`embed`, `q_heads`, `mlp`, ...); `RULES` maps those names to
mesh axes in one place, the way maxtext and t5x do, so a new layout is a rules change, not a
model change. Parameters are created already sharded: `init_sharded` traces the initialiser
with `jax.eval_shape` and jits it with `out_shardings`, so no host ever holds the whole model.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxgrpo import decode
from jaxgrpo import model as model_lib

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical name -> mesh axis (or axes, or None for replicated).
RULES: tuple[tuple[str, Any], ...] = (
    # Parameters.
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    # Activations and caches.
    ("batch", BATCH_AXES),
    ("samples", None),
    ("cache_heads", "tensor"),
    ("length", None),
)


def resolve_mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Sizes for (data, fsdp, tensor); one axis may be -1, meaning "the remaining devices"."""
  unknown = sorted(set(mesh_config) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh: unknown axes {unknown}; allowed {list(MESH_AXES)}")
  sizes = [int(mesh_config.get(a, 1)) for a in MESH_AXES]
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  for axis, size in zip(MESH_AXES, sizes):
    if size == 0 or size < -1:
      raise ValueError(f"mesh.{axis}={size}: must be a positive size or -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"mesh: the fixed axes {dict(zip(MESH_AXES, sizes))} use {known} "
                       f"devices, which does not divide the {num_devices} available")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh: {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {num_devices} are available")
  return tuple(sizes)


def make_mesh(mesh_config: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh. Auto axis types: jax 0.10 defaults to Explicit."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_config, len(devices))
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * 3)


def batch_size_multiple(mesh: Mesh) -> int:
  """Rows of a batch must divide evenly over the data axes."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def logical_sharding(mesh: Mesh, *logical_axes: str | None) -> NamedSharding:
  """NamedSharding for an array whose axes carry the given logical names."""
  spec = nn.logical_to_mesh_axes(logical_axes, RULES)
  return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading axis split over the data axes, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def param_shardings(cfg: model_lib.ModelConfig, mesh: Mesh):
  """NamedShardings for the (unboxed) parameter tree, from the logical names."""
  abstract = jax.eval_shape(lambda r: model_lib.init_params(cfg, r), jax.random.key(0))
  specs = nn.get_partition_spec(abstract)
  return nn.logical_to_mesh_sharding(specs, mesh, RULES)


def init_sharded(cfg: model_lib.ModelConfig, mesh: Mesh, rng):
  """Parameters initialised directly into their shardings (never whole on one host)."""
  shardings = param_shardings(cfg, mesh)
  init = jax.jit(lambda r: nn.unbox(model_lib.init_params(cfg, r)), out_shardings=shardings)
  return init(rng)


def shard_params(params, cfg: model_lib.ModelConfig, mesh: Mesh):
  """Places an existing (e.g. loaded) parameter tree onto the mesh."""
  return jax.device_put(params, param_shardings(cfg, mesh))


def cache_shardings(mesh: Mesh) -> decode.Cache:
  """Shardings of the decode cache (a tree prefix: one entry per field applies to every
  layer's array): rows over the data axes, KV heads over tensor."""
  return decode.Cache(
      prompt_k=logical_sharding(mesh, "batch", "cache_heads", None, "length"),
      prompt_v=logical_sharding(mesh, "batch", "cache_heads", "length", None),
      prompt_bias=logical_sharding(mesh, "batch", None, None, "length"),
      gen_k=logical_sharding(mesh, "batch", "cache_heads", "samples", None, "length"),
      gen_v=logical_sharding(mesh, "batch", "cache_heads", "samples", "length", None))

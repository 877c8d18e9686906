"""Device mesh and logical-axis sharding.

The mesh has five named axes: `data` (pure data parallelism), `fsdp` (data parallelism whose
parameters and optimizer state are also split over it), `expert` (expert parallelism: a
mixture-of-experts layer's experts split over it, model/moe.py; for everything else one more
data axis, whose chips also split the dense weights as fsdp does; 1 unless set), `context`
(context parallelism: the update's packed rows split along their sequence,
algo/packing.py; 1 unless set) and `tensor` (heads, MLP and vocab split over it). Batch
rows are split over `data` x `fsdp` x `expert`; the chips of one `context` group hold the
same rows.

Multi-slice (several TPU slices joined by the data-centre network, DCN): `dcn_data` slices
each hold a copy of the model and a share of the batch, so the `data` axis is `dcn_data`
slices x the `data` size inside one slice (ICI); fsdp and tensor stay inside a slice, where
the links are fast. The mesh is built with `mesh_utils.create_hybrid_device_mesh`; on
devices without a slice index (CPU rehearsals) each process stands for a slice.

On several hosts (multi-controller JAX) each process holds only its rows of a batch:
`to_global` assembles the global arrays from every process's rows and `to_local` gives a
process its rows of a global array back.

Model code names axes logically (`embed`, `q_heads`, `mlp`, ...); `RULES` (model/axes.py)
maps those names to mesh axes in one place, the way maxtext and t5x do, so a new layout is a
rules change, not a model change. Parameters are created already sharded: `init_sharded` takes the shapes from
`jax.eval_shape` and jits only the initialisers with `out_shardings`, so no host ever holds
the whole model and the forward pass is never compiled to create it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxgrpo.model import decode
from jaxgrpo.model import decoder as model_lib
# The mesh's axes and the logical names' rules live in model/axes.py (the model code reads
# them too); they are this module's vocabulary.
from jaxgrpo.model.axes import BATCH_AXES, MESH_AXES, RULES
from jaxgrpo.runtime import config_checks

MESH_KEYS = MESH_AXES + ("dcn_data",)
# Keys of the config's mesh section that shape no axis: the memory 'auto' batch sizes plan
# against (jaxgrpo/run/sizing.py).
PLAN_KEYS = ("memory_limit_gib",)


def resolve_mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Sizes for (data, fsdp, context, tensor); one axis may be -1, meaning "the remaining
  devices".

  With `dcn_data` = S > 1 slices, the sizes apply inside one slice (num_devices / S devices)
  and the returned data size is S times the per-slice one.
  """
  unknown = sorted(set(mesh_config) - set(MESH_KEYS) - set(PLAN_KEYS))
  if unknown:
    raise ValueError(f"mesh: unknown axes {unknown}; allowed {list(MESH_KEYS)}")
  slices = int(mesh_config.get("dcn_data", 1))
  if slices < 1 or num_devices % slices:
    raise ValueError(f"mesh.dcn_data={slices}: must be a positive number of slices that "
                     f"divides the {num_devices} devices")
  per_slice = num_devices // slices
  sizes = [int(mesh_config.get(a, 1)) for a in MESH_AXES]
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  for axis, size in zip(MESH_AXES, sizes):
    if size == 0 or size < -1:
      raise ValueError(f"mesh.{axis}={size}: must be a positive size or -1")
  where = f"the {per_slice} devices of a slice" if slices > 1 else f"the {num_devices} available"
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if per_slice % known:
      raise ValueError(f"mesh: the fixed axes {dict(zip(MESH_AXES, sizes))} use {known} "
                       f"devices, which does not divide {where}")
    sizes[sizes.index(-1)] = per_slice // known
  if math.prod(sizes) != per_slice:
    have = f"a slice has {per_slice}" if slices > 1 else f"{num_devices} are available"
    raise ValueError(f"mesh: {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {have}")
  sizes[0] *= slices
  return tuple(sizes)


def make_mesh(mesh_config: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  """A (data, fsdp, context, tensor) mesh. Auto axis types: jax 0.10 defaults to Explicit.

  mesh_config may hold resolved sizes (config.json's) or -1s; `dcn_data` > 1 splits the
  data axis over slices first (see the module docstring).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_config, len(devices))
  slices = int(mesh_config.get("dcn_data", 1))
  auto = (AxisType.Auto,) * len(MESH_AXES)
  if slices > 1:
    ici = (shape[0] // slices,) + shape[1:]
    # CPU devices have no slice index: each process is one "slice" in a rehearsal.
    granule = getattr(devices[0], "slice_index", None) is None
    grid = mesh_utils.create_hybrid_device_mesh(ici, (slices,) + (1,) * (len(MESH_AXES) - 1),
                                                devices,
                                                process_is_granule=granule)
    return Mesh(grid, MESH_AXES, axis_types=auto)
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  # A subset, or compile-only TPU descriptions (launch/compile_check.py): laid out by the
  # physical topology as make_mesh would, so the checked mesh is the one a pod builds.
  grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  return Mesh(grid, MESH_AXES, axis_types=auto)


def batch_size_multiple(mesh: Mesh) -> int:
  """Rows of a batch must divide evenly over the data axes."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def data_parallel_rows(mesh_config) -> int:
  """The ways a batch's rows split (data x fsdp x expert, every slice's), from the config's
  mesh section once `_check_mesh` has resolved it."""
  return mesh_config.data * mesh_config.dcn_data * mesh_config.fsdp * mesh_config.expert


def logical_sharding(mesh: Mesh, *logical_axes: str | None) -> NamedSharding:
  """NamedSharding for an array whose axes carry the given logical names."""
  spec = nn.logical_to_mesh_axes(logical_axes, RULES)
  return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading axis split over the data axes, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def to_global(mesh: Mesh, tree):
  """This process's rows (numpy, leading axis) -> global arrays split over the data axes.

  Every process passes its own rows, in the order of its batch slice; on one process this
  is a device_put. Leaves that are already jax Arrays (a rollout's outputs) pass through.
  """
  def one(x):
    if isinstance(x, jax.Array):
      return x
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim), x)
  return jax.tree.map(one, tree)


def replicate_key(mesh: Mesh, key):
  """A PRNG key (the same on every process) as a global array replicated over the mesh; on
  one process the key is returned as it is."""
  if jax.process_count() == 1:
    return key
  data = np.asarray(jax.random.key_data(key))
  data = jax.make_array_from_callback(data.shape, replicated(mesh), lambda index: data[index])
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def to_local(tree):
  """Global arrays split over the data axes -> this process's rows as numpy (the inverse
  of `to_global`); fully replicated arrays come back whole."""
  def one(x):
    if jax.process_count() == 1 or x.is_fully_replicated:
      return np.asarray(jax.device_get(x))
    shards = {}
    for shard in x.addressable_shards:  # replicas along other axes repeat a row block
      shards.setdefault(shard.index[0].start or 0, shard.data)
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)], axis=0)
  return jax.tree.map(one, tree)


def adapter_shardings(cfg: model_lib.ModelConfig, mesh: Mesh, targets):
  """NamedShardings for LoRA adapters (lora.init's tree): each follows its base weight's
  logical axes, the rank axis unsplit."""
  from jaxgrpo.model import lora  # pylint: disable=g-import-not-at-top
  return {target: {k: nn.logical_to_mesh_sharding(P(*names), mesh, RULES)
                   for k, names in axes.items()}
          for target, axes in lora.logical_axes(cfg, targets).items()}


def param_shardings(cfg: model_lib.ModelConfig, mesh: Mesh):
  """NamedShardings for the (unboxed) parameter tree, from the logical names."""
  specs = nn.get_partition_spec(model_lib.param_structure(cfg))
  return nn.logical_to_mesh_sharding(specs, mesh, RULES)


def abstract_params(cfg: model_lib.ModelConfig, mesh: Mesh):
  """The parameter tree as ShapeDtypeStructs carrying their shardings (a restore target)."""
  abstract = nn.unbox(model_lib.param_structure(cfg))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, param_shardings(cfg, mesh))


def init_sharded(cfg: model_lib.ModelConfig, mesh: Mesh, rng):
  """Parameters initialised directly into their shardings (never whole on one host).

  Only the initialisers run: the tree's shapes come from `jax.eval_shape` (a trace, no
  compile), and leaf i is drawn by `model.initializer` (the modules' own rule) from
  fold_in(rng, i), straight into its sharding. One small program is compiled per distinct
  (name, shape, dtype, sharding); the layers are stacked, so one program draws a kind of
  tensor for every layer at once and the compile does not grow with depth. Jitting flax's
  init instead compiles the forward pass it runs to create the parameters: 124 s for a 28-layer 1.7B model on an H200 (../shared/device/README.md).
  The draws are not flax init's (another key per leaf); their distributions are.
  """
  abstract = nn.unbox(jax.eval_shape(lambda r: model_lib.init_params(cfg, r), rng))
  leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
  shardings = jax.tree.leaves(param_shardings(cfg, mesh))
  programs = {}
  out = []
  for i, ((path, leaf), sharding) in enumerate(zip(leaves, shardings)):
    name, stacked = path[-1].key, path[0].key == "layers"
    spec = (name, leaf.shape, leaf.dtype, sharding)
    if spec not in programs:
      init = model_lib.initializer(name, leaf.shape, stacked)
      programs[spec] = jax.jit(  # the leaf index is an argument: one program per spec
          lambda key, index, init=init, shape=leaf.shape, dtype=leaf.dtype: init(
              jax.random.fold_in(key, index), shape, dtype),
          out_shardings=sharding)
    out.append(programs[spec](rng, i))
  return jax.tree.unflatten(tree, out)


def shard_params(params, cfg: model_lib.ModelConfig, mesh: Mesh):
  """Places an existing (e.g. loaded) parameter tree onto the mesh."""
  return jax.device_put(params, param_shardings(cfg, mesh))


def cache_shardings(mesh: Mesh, stacked: bool = False) -> decode.Cache:
  """Shardings of the decode cache (a tree prefix: one entry per field applies to every
  layer's array): rows over the data axes, KV heads over tensor. stacked: the fields carry
  a leading [num_layers] axis (decode.init_cache(stacked=True)), held whole on every chip."""
  layers = (None,) if stacked else ()
  return decode.Cache(
      prompt_k=logical_sharding(mesh, *layers, "batch", "cache_heads", None, "length"),
      prompt_v=logical_sharding(mesh, *layers, "batch", "cache_heads", "length", None),
      prompt_bias=logical_sharding(mesh, "batch", None, None, "length"),
      gen_k=logical_sharding(mesh, *layers, "batch", "cache_heads", "samples", None, "length"),
      gen_v=logical_sharding(mesh, *layers, "batch", "cache_heads", "samples", "length", None))


@config_checks.register(order=20)
def _check_mesh(c, num_devices: int) -> None:
  """mesh.*: sizes that resolve over the devices (stored resolved, per slice: resolving the
  stored sizes again gives the same mesh), and the batches that must split over them."""
  try:
    sizes = resolve_mesh_shape(c.mesh.to_dict(), num_devices)
  except ValueError as e:
    raise config_checks.ConfigError(f"config.{e}") from None
  for axis, size in zip(MESH_AXES, sizes):
    c.mesh[axis] = size // c.mesh.dcn_data if axis == "data" else size
  rows, g = sizes[0] * sizes[1] * sizes[2], c.grpo
  if g.num_prompts_per_step % rows:
    config_checks.fail("grpo.num_prompts_per_step", g.num_prompts_per_step,
                       f"a multiple of {rows} (mesh data x fsdp x expert), so prompts split "
                       "evenly over devices")


@config_checks.register(order=23)
def _check_val_batch(c, num_devices: int) -> None:
  del num_devices
  rows, g = data_parallel_rows(c.mesh), c.grpo
  if g.val_batch_size != "auto" and g.val_batch_size % rows:
    config_checks.fail("grpo.val_batch_size", g.val_batch_size,
                       f"a multiple of {rows} (mesh data x fsdp x expert)")


def shape_problems(mesh_config, arch) -> list[tuple[str, Any, str]]:
  """(model key, value, allowed) for each architecture value that does not split over the
  mesh (`arch`: model keys to values, None where unset), in the order they are checked:
  the config's own keys at validation, a checkpoint's values once it is read
  (loading.check_architecture)."""
  out = []
  tensor, fsdp, expert = mesh_config.tensor, mesh_config.fsdp, mesh_config.expert
  heads, kv_heads = arch.get("num_heads"), arch.get("num_kv_heads")
  if heads and kv_heads and heads % kv_heads:
    out.append(("num_heads", heads, f"a multiple of model.num_kv_heads={kv_heads}"))
  if tensor > 1:
    for key in ("num_kv_heads", "num_heads", "mlp_dim", "vocab_size"):
      if arch.get(key) is not None and arch[key] % tensor:
        out.append((key, arch[key], f"a multiple of mesh.tensor={tensor}"))
  d_model, experts = arch.get("d_model"), arch.get("num_experts")
  if fsdp > 1 and d_model is not None and d_model % fsdp:
    out.append(("d_model", d_model, f"a multiple of mesh.fsdp={fsdp}"))
  if expert > 1 and d_model is not None and d_model % (fsdp * expert):
    out.append(("d_model", d_model, f"a multiple of mesh.fsdp x mesh.expert={fsdp * expert} "
                                    "(dense weights split over both)"))
  moe_dim = arch.get("moe_mlp_dim")
  if experts and moe_dim is not None and tensor > 1 and moe_dim % tensor:
    out.append(("moe_mlp_dim", moe_dim, f"a multiple of mesh.tensor={tensor}"))
  return out


@config_checks.register(order=31)
def _check_model_shapes(c, num_devices: int) -> None:
  """Divisibility rules for the architecture keys that are set (a checkpoint's own values are
  checked again once it is read: loading.check_architecture)."""
  del num_devices
  m = c.model
  if c.mesh.expert > 1 and m.num_experts is not None and (
      not m.num_experts or m.num_experts % c.mesh.expert):
    config_checks.fail("mesh.expert", c.mesh.expert,
                       "1, or a divisor of model.num_experts="
                       f"{m.num_experts} (each chip of an expert group holds "
                       "num_experts / expert experts)")
  for key, value, allowed in shape_problems(c.mesh, m.to_dict())[:1]:
    config_checks.fail(f"model.{key}", value, allowed)
  for key in ("top_k", "val_top_k"):
    if m.vocab_size is not None and c.generation[key] > m.vocab_size:
      config_checks.fail(f"generation.{key}", c.generation[key], f"0 (off) or at most model.vocab_size="
            f"{m.vocab_size}")


@config_checks.register_model(order=20)
def _check_experts_on_the_mesh(c, model_cfg) -> None:
  """mesh.expert against the model as loaded (a checkpoint names its own experts). Its
  shapes against the mesh: loading.check_architecture, which names the file's keys."""
  experts = model_cfg.num_experts
  if c.mesh.expert > 1 and (not experts or experts % c.mesh.expert):
    config_checks.fail("mesh.expert", c.mesh.expert, "1, or a divisor of the experts (each "
                       "chip of an expert group holds experts / expert)",
                       reason=f"the model has {experts} experts")

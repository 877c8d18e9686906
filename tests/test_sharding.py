"""Tests for jaxgrpo.model.sharding: mesh shapes, parameter placement, sharded forward."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxgrpo.model import sharding
from jaxgrpo.model import decoder as model

CFG = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64)
# For the initialiser tests: one layer has every kind of parameter (with the untied head),
# and the initialiser's XLA compile time grows with the number of tensors (~0.7 s each).
INIT_CFG = dataclasses.replace(CFG, num_layers=1, tie_embeddings=False)

# A dense weight's model dimension: split over fsdp and expert (with expert=1, fsdp's split).
EMBED = ("fsdp", "expert")

def test_resolve_mesh_shape_minus_one_fills_the_rest():
  # (data, fsdp, expert, context, tensor)
  assert sharding.resolve_mesh_shape({"data": -1}, 8) == (8, 1, 1, 1, 1)
  assert sharding.resolve_mesh_shape({"data": -1, "tensor": 2}, 8) == (4, 1, 1, 1, 2)
  assert sharding.resolve_mesh_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == (2, 2, 1, 1, 2)
  assert sharding.resolve_mesh_shape({"data": 2, "fsdp": 2, "tensor": 2}, 8) == (2, 2, 1, 1, 2)
  assert sharding.resolve_mesh_shape({"data": 2, "expert": -1}, 8) == (2, 1, 4, 1, 1)
  assert sharding.resolve_mesh_shape({}, 1) == (1, 1, 1, 1, 1)


def test_resolve_mesh_shape_rejects_two_minus_ones():
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    sharding.resolve_mesh_shape({"data": -1, "fsdp": -1}, 8)


def test_resolve_mesh_shape_rejects_unknown_axis():
  with pytest.raises(ValueError, match="'model'"):
    sharding.resolve_mesh_shape({"data": 2, "model": 4}, 8)


def test_resolve_mesh_shape_rejects_wrong_device_count():
  with pytest.raises(ValueError, match=r"'data': 3.*needs 3 devices.*8 are available"):
    sharding.resolve_mesh_shape({"data": 3}, 8)
  with pytest.raises(ValueError, match=r"'tensor': 4.*needs 16 devices"):
    sharding.resolve_mesh_shape({"data": 4, "tensor": 4}, 8)
  # -1 cannot absorb a remainder: 3 fixed devices do not divide 8.
  with pytest.raises(ValueError, match="does not divide"):
    sharding.resolve_mesh_shape({"data": -1, "tensor": 3}, 8)


def test_resolve_mesh_shape_rejects_zero_or_negative_size():
  with pytest.raises(ValueError, match=r"mesh\.fsdp=0"):
    sharding.resolve_mesh_shape({"fsdp": 0}, 8)
  with pytest.raises(ValueError, match=r"mesh\.tensor=-2"):
    sharding.resolve_mesh_shape({"tensor": -2}, 8)


def test_make_mesh_axes_and_auto_types():
  mesh = sharding.make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
  assert mesh.axis_names == sharding.MESH_AXES
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert sharding.batch_size_multiple(mesh) == 4
  one = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  assert dict(one.shape) == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
  # Context parallelism (issue 51): its own axis, between the data axes and tensor.
  cp = sharding.make_mesh({"data": 2, "context": 2, "tensor": 2})
  assert dict(cp.shape) == {"data": 2, "fsdp": 1, "expert": 1, "context": 2, "tensor": 2}
  assert sharding.batch_size_multiple(cp) == 2  # a context group's chips share their rows


def test_resolve_mesh_shape_multi_slice_sizes_are_per_slice():
  # 2 slices of 4 devices: the sizes given apply inside a slice; data spans the slices.
  assert sharding.resolve_mesh_shape({"data": -1, "dcn_data": 2}, 8) == (8, 1, 1, 1, 1)
  assert sharding.resolve_mesh_shape({"data": 1, "fsdp": -1, "dcn_data": 2}, 8) == (2, 4, 1, 1, 1)
  assert sharding.resolve_mesh_shape({"data": 1, "fsdp": 2, "tensor": 2, "dcn_data": 2},
                                     8) == (2, 2, 1, 1, 2)
  with pytest.raises(ValueError, match=r"mesh\.dcn_data=3"):
    sharding.resolve_mesh_shape({"data": -1, "dcn_data": 3}, 8)
  with pytest.raises(ValueError, match="a slice has 4"):
    sharding.resolve_mesh_shape({"fsdp": 8, "dcn_data": 2}, 8)


@dataclasses.dataclass(frozen=True)
class _SliceDevice:
  """What create_hybrid_device_mesh reads of a device: TPU devices carry slice_index."""
  id: int
  slice_index: int
  process_index: int = 0
  platform: str = "cpu"
  device_kind: str = "cpu"


def test_make_mesh_multi_slice_keeps_fsdp_and_tensor_inside_a_slice():
  devices = [_SliceDevice(i, slice_index=i // 4) for i in range(8)]
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 2, "dcn_data": 2}, devices)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
  # Each index of the data axis is one slice: its fsdp x tensor block never crosses DCN.
  for d in range(2):
    assert {dev.slice_index for dev in mesh.devices[d].ravel()} == {d}


@pytest.fixture(scope="module")
def mesh222():
  return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


@pytest.fixture(scope="module")
def single_device_init():
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  return sharding.init_sharded(INIT_CFG, mesh, jax.random.key(7))


@pytest.fixture(scope="module")
def single_device_params():
  """Random parameters for CFG drawn with numpy (no initialiser compile)."""
  shapes = jax.eval_shape(lambda key: nn.unbox(model.init_params(CFG, key)), jax.random.key(0))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), s.dtype),
                      shapes)


def test_init_sharded_places_params_by_logical_axes(mesh222, single_device_init):
  params = sharding.init_sharded(INIT_CFG, mesh222, jax.random.key(7))
  attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
  # ("layers", "embed", "q_heads", "head_dim") -> every layer on every chip, embed over
  # fsdp, heads over tensor.
  assert attn["q"].sharding.spec == P(None, EMBED, "tensor", None)
  assert attn["k"].sharding.spec == P(None, EMBED, "tensor", None)
  assert attn["o"].sharding.spec == P(None, "tensor", None, EMBED)
  # ("vocab", "embed") -> vocab over tensor, embed over fsdp; the head is its transpose.
  assert params["embedding"].sharding.spec == P("tensor", EMBED)
  assert params["lm_head"].sharding.spec == P(EMBED, "tensor")
  assert mlp["gate"].sharding.spec == P(None, EMBED, "tensor")
  assert mlp["down"].sharding.spec == P(None, "tensor", EMBED)
  assert params["final_norm"]["scale"].sharding.spec == P(None)
  for leaf in jax.tree.leaves(params):
    assert leaf.sharding.mesh == mesh222
  # q kernels [L, 32, 4, 8] split 2 ways on embed and 2 ways on heads: shards [L, 16, 2, 8].
  assert attn["q"].addressable_shards[0].data.shape == (INIT_CFG.num_layers, 16, 2, 8)
  # Same values as on one device with the same key: the mesh never changes the draws.
  assert jax.tree.structure(params) == jax.tree.structure(single_device_init)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               params, single_device_init)


def test_init_sharded_draws_what_flax_init_draws(single_device_init):
  # The same tree as flax's init, each leaf from the modules' own initialisers: kernels
  # N(0, 1 / fan_in) (fan_in 32 for q, 4 x 8 = 32 for o, 64 for down), the embedding
  # N(0, 0.02^2), norm scales 1. Sample std within 15% of the rule (>= 1024 draws each).
  flax_init = nn.unbox(model.init_params(INIT_CFG, jax.random.key(7)))
  assert jax.tree.structure(flax_init) == jax.tree.structure(single_device_init)
  layer = jax.tree.map(lambda a: a[0], single_device_init["layers"])  # layer 0 of the stack
  for array, std in ((layer["attn"]["q"], 32 ** -0.5), (layer["attn"]["o"], 32 ** -0.5),
                     (layer["mlp"]["down"], 64 ** -0.5),
                     (single_device_init["embedding"], 0.02)):
    assert abs(float(np.std(array)) / std - 1) < 0.15, (array.shape, np.std(array), std)
    assert abs(float(np.mean(array))) < 0.2 * std
  np.testing.assert_array_equal(single_device_init["final_norm"]["scale"], 1.0)
  # Distinct draws per leaf (each leaf folds its own index into the key).
  assert not np.allclose(layer["attn"]["q"].ravel()[:64], layer["attn"]["k"].ravel()[:64])


def test_shard_params_uses_the_same_layout(mesh222, single_device_params):
  placed = sharding.shard_params(single_device_params, CFG, mesh222)
  assert placed["layers"]["attn"]["v"].sharding.spec == P(None, EMBED, "tensor", None)
  jax.tree.map(np.testing.assert_array_equal, placed, single_device_params)


@pytest.mark.parametrize("mesh_config", [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 8}],
                         ids=["2x2x2", "data8"])
def test_forward_on_mesh_matches_single_device(mesh_config, single_device_params):
  mesh = sharding.make_mesh(mesh_config)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CFG.vocab_size, size=(8, 9)).astype(np.int32)
  mask = np.arange(9)[None, :] >= rng.integers(0, 6, size=(8, 1))  # left padding 0..5
  forward = jax.jit(model.forward, static_argnums=1)
  expected = forward(single_device_params, CFG, tokens, mask)
  params = sharding.shard_params(single_device_params, CFG, mesh)
  rows = sharding.batch_sharding(mesh, 2)
  logits = forward(params, CFG, jax.device_put(tokens, rows), jax.device_put(mask, rows))
  assert len(logits.sharding.device_set) == 8
  np.testing.assert_allclose(logits, expected, atol=1e-5)


# FSDP divides the activations: each chip gathers a layer's weights and computes its own
# rows (activations.constrain), so per-device memory falls as devices are added. The update's
# temporary bytes come from the compiler (memory_analysis of the compiled update), at one
# global batch: 16 prompts x 4 rollouts of 32 + 96 tokens, 2 layers, d_model 256, 32k vocab.
# Before the activations were pinned: 1 device 2.65 GiB, data=8 0.39, fsdp=8 1.73 (4.4x).
MEMORY_CFG = model.ModelConfig(vocab_size=32768, d_model=256, num_layers=2, num_heads=4,
                                   num_kv_heads=2, head_dim=64, mlp_dim=1024)


def _update_temp_bytes(mesh_shape, scan_layers=None):
  from jaxgrpo.bench import memory as bench_memory  # pylint: disable=g-import-not-at-top
  devices = jax.devices()[:int(np.prod(list(mesh_shape.values())))]
  mesh = sharding.make_mesh(mesh_shape, devices=devices)
  return bench_memory.update_memory(MEMORY_CFG, mesh, prompts=16, generations=4, prompt_len=32,
                                    new_tokens=96, scan_layers=scan_layers)["temp_bytes"]


@pytest.fixture(scope="module")
def update_temp_bytes():
  shapes = {"1": {"data": 1}, "data8": {"data": 8}, "fsdp8": {"fsdp": 8},
            "241": {"data": 2, "fsdp": 4}, "222": {"data": 2, "fsdp": 2, "tensor": 2}}
  out = {name: _update_temp_bytes(shape) for name, shape in shapes.items()}
  # The layers scanned (TPU's and GPU's default; CPU unrolls by default).
  for name in ("1", "data8", "fsdp8"):
    out[f"{name}-scanned"] = _update_temp_bytes(shapes[name], scan_layers=True)
  return out


@pytest.mark.parametrize("name", ["fsdp8", "241", "222", "fsdp8-scanned"])
def test_fsdp_divides_the_update_activations(update_temp_bytes, name):
  suffix = "-scanned" if name.endswith("-scanned") else ""
  got, data8, one = (update_temp_bytes[k] for k in (name, "data8" + suffix, "1" + suffix))
  assert got <= 1.5 * data8, (name, got / 2**30, data8 / 2**30)
  assert got <= one / 4, (name, got / 2**30, one / 2**30)

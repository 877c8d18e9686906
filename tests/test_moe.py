"""Mixture of experts (model/moe.py): routing by hand, the grouped and dense paths agree, the
expert-parallel layer on 8 devices equals one device (the update and the sampler), the
load-balancing loss by hand. The sampler's log-probs against the update's on the Qwen3-MoE
fixture: tests/test_hf.py."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import moe
from jaxgrpo.model import sharding
from jaxgrpo.rollout import policy as policy_lib
from jaxgrpo.rollout import sampling

from numpy_params import random_params  # noqa: E402  tests/numpy_params.py

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "qwen3_moe")
CFG = model_lib.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                            num_experts=8, num_experts_per_tok=2, moe_mlp_dim=16)


def test_routing_by_hand():
  # d_model 2, 3 experts. x = [1, 0] reads the router's first row: logits [2, 1, 0],
  # probabilities e^[2,1,0] / (e^2 + e + 1) = [.6652, .2447, .0900]; the top 2 are experts
  # 0 and 1, renormalised to .6652 / .9100 = .7311 and .2689 (= 1 / (1 + e^-1)).
  # x = [0, 1] reads the second row [0, 0, 3]: expert 2 first (e^3 / (e^3 + 2) = .9094),
  # then a tie of experts 0 and 1 at .0453 each, which goes to the lower id, 0.
  router = jnp.array([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
  x = jnp.array([[1.0, 0.0], [0.0, 1.0]])
  w, e, p = moe.route(x, router, 2, normalize=True)
  np.testing.assert_array_equal(e, [[0, 1], [2, 0]])
  np.testing.assert_allclose(p[0], [0.6652, 0.2447, 0.0900], atol=1e-4)
  np.testing.assert_allclose(w, [[0.7311, 0.2689], [0.9526, 0.0474]], atol=1e-4)
  # norm_topk_prob False keeps the probabilities as they are.
  w, _, _ = moe.route(x, router, 2, normalize=False)
  np.testing.assert_allclose(w, [[0.6652, 0.2447], [0.9094, 0.0453]], atol=1e-4)


def test_router_logits_in_float32_do_not_turn_on_bfloat16_rounding():
  """Issue 63: with a bfloat16 model the router's logits were bfloat16 (x W_router rounded
  to 8 bits of mantissa), so near-ties picked experts by rounding. route(dtype=float32)
  (model.router_dtype's default) gives the float32 computation's probabilities exactly;
  dtype=None (router_dtype='compute', transformers' choice) the bfloat16 ones."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
  router = jnp.asarray(rng.standard_normal((32, 8)), jnp.bfloat16)
  want = moe.route(x.astype(jnp.float32), router.astype(jnp.float32), 2, True)
  f32 = moe.route(x, router, 2, True, jnp.float32)
  bf16 = moe.route(x, router, 2, True)
  np.testing.assert_array_equal(f32[2], want[2])
  np.testing.assert_array_equal(f32[1], want[1])
  assert float(jnp.max(jnp.abs(bf16[2] - want[2]))) > 1e-4  # bfloat16 logits round


def _layer_args(seed=0, t=24, e=8, d=16, f=12):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((t, d)), jnp.float32),
          jnp.asarray(rng.standard_normal((d, e)), jnp.float32),
          *(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
            for s in ((e, d, f), (e, d, f), (e, f, d))))


def test_one_expert_by_hand():
  # Experts that are the identity's halves: with k = 1 every token gets exactly its one
  # expert's output times weight 1, which a plain SwiGLU gives.
  x, router, gate, up, down = _layer_args(t=6, e=3)
  for matmul in ("dense", "ragged"):
    y, _, e = moe.moe(x, router, gate, up, down, k=1, normalize=True, matmul=matmul)
    want = jnp.stack([jax.nn.silu(x[i] @ gate[j]) * (x[i] @ up[j]) @ down[j]
                      for i, j in enumerate(np.asarray(e)[:, 0])])
    np.testing.assert_allclose(y, want, atol=1e-5, err_msg=matmul)


def test_grouped_and_dense_paths_agree_forward_and_backward():
  args = _layer_args()

  def loss(matmul, *a):
    y, _, _ = moe.moe(*a, k=2, normalize=True, matmul=matmul)
    return jnp.sum(jnp.sin(y))

  dense = jax.value_and_grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2, 3, 4))(*args)
  ragged = jax.value_and_grad(lambda *a: loss("ragged", *a), argnums=(0, 1, 2, 3, 4))(*args)
  np.testing.assert_allclose(dense[0], ragged[0], rtol=1e-5)
  for a, b in zip(dense[1], ragged[1]):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert all(float(jnp.abs(g).max()) > 0 for g in dense[1])  # every input gets a gradient


def test_rows_outside_every_group_are_dropped_whatever_ragged_dot_writes_there(monkeypatch):
  """Issue 63: the expert-parallel path multiplied rows outside every expert group by 0,
  trusting ragged_dot to write zeros there, which JAX does not promise (CPU does). Here
  ragged_dot writes NaN in those rows, and the experts held here (first=4 of 8: the other
  chip's pairs fall outside every group) must still give the dense reference, forward and
  backward."""
  real = jax.lax.ragged_dot

  def nan_outside(lhs, rhs, group_sizes, **kwargs):
    out = real(lhs, rhs, group_sizes, **kwargs)
    inside = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(inside[:, None], out, jnp.nan)

  x, router, gate, up, down = _layer_args()
  w, e, _ = moe.route(x, router, 2, normalize=True)
  half = lambda a: a[4:]  # this chip holds experts 4..7

  def loss(matmul, x, gate, up, down):
    y = moe.experts(x, w, e, half(gate), half(up), half(down), matmul, first=4)
    return jnp.sum(jnp.sin(y)), y

  want = jax.value_and_grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2, 3),
                            has_aux=True)(x, gate, up, down)
  monkeypatch.setattr(jax.lax, "ragged_dot", nan_outside)
  got = jax.value_and_grad(lambda *a: loss("ragged", *a), argnums=(0, 1, 2, 3),
                           has_aux=True)(x, gate, up, down)
  assert int(jnp.sum(e < 4)) > 0  # some pairs do fall outside every group here
  np.testing.assert_allclose(got[0][1], want[0][1], atol=1e-5)
  for a, b in zip(got[1], want[1]):
    assert bool(jnp.all(jnp.isfinite(a)))
    np.testing.assert_allclose(a, b, atol=1e-5)


def _update_loss(cfg, mesh=None):
  """The training forward's loss (score_groups, as the update runs it) and its gradient,
  under `mesh`'s activation layout (expert-parallel mixture) or on one device."""
  rng = np.random.default_rng(3)
  prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 5)), jnp.int32)
  prompt_mask = jnp.asarray(np.arange(5)[None] >= np.array([0, 2, 1, 0, 3, 0, 1, 4])[:, None])
  completions = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 2, 3)), jnp.int32)
  completion_mask = jnp.ones((8, 2, 3), bool)
  weights = jnp.asarray(rng.standard_normal((8, 2, 3, cfg.vocab_size)), jnp.float32)

  def loss(params):
    # On a mesh as the update runs it: activations pinned, the mixture expert-parallel.
    logits = model_lib.score_groups(params, cfg, prompts, prompt_mask, completions,
                                    completion_mask, scan_layers=True, mesh=mesh,
                                    pin=mesh is not None)
    return jnp.sum(jax.nn.log_softmax(logits) * weights)

  params = random_params(cfg, 0, scale_noise=0.1)
  if mesh is not None:
    params = sharding.shard_params(params, cfg, mesh)
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("mesh_shape, matmul", [
    (dict(data=2, fsdp=1, expert=4, context=1, tensor=1), "ragged"),
    (dict(data=1, fsdp=2, expert=2, context=1, tensor=2), "dense"),
])
def test_expert_parallel_forward_and_backward_equal_one_device(mesh_shape, matmul):
  cfg = dataclasses.replace(CFG, moe_matmul=matmul)
  mesh = sharding.make_mesh(mesh_shape)
  want_loss, want_grads = _update_loss(cfg)
  got_loss, got_grads = _update_loss(cfg, mesh)
  # The experts' weights are split over `expert` (each chip 8 / ep of them).
  gate = got_grads["layers"]["mlp"]["gate"]
  assert gate.sharding.spec[1] == "expert"
  assert gate.addressable_shards[0].data.shape[1] == 8 // mesh_shape["expert"]
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                          jax.tree.leaves(got_grads)):
    # Float noise of summing in another order: 1e-5 of the largest entry of the gradient.
    scale = max(1.0, float(np.abs(a).max()))
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, err_msg=str(path))


def test_balance_loss_by_hand():
  # 2 tokens, 2 experts, k = 1: token 0 -> expert 0 (p = [.8, .2]), token 1 -> expert 0
  # (p = [.6, .4]). f = [2/2, 0/2] = [1, 0], P = [.7, .3]: E * sum f P = 2 * .7 = 1.4.
  # Balanced routing (f = [.5, .5], P = [.5, .5]) gives the minimum, 1.
  assert float(moe.balance_loss(jnp.array([1.0, 0.0]), jnp.array([0.7, 0.3]), 2)) == \
      pytest.approx(1.4)
  assert float(moe.balance_loss(jnp.array([0.5, 0.5]), jnp.array([0.5, 0.5]), 2)) == \
      pytest.approx(1.0)


def test_expert_parallel_sampler_draws_what_one_device_draws():
  # The fixture's 4 experts over expert=4 (one a chip; rows over data 2 x expert 4): the
  # sampler's prefill and decode steps run the mixture in shard_map, and draw the tokens
  # one device draws, with the same log-probs.
  sp = sampling.SamplingParams(1.0, 1.0, 0)
  prompts = [[5 + i, 17, 42 + 3 * i, 9][: 2 + i % 3] for i in range(8)]
  outs = []
  for mesh in (None, sharding.make_mesh(dict(data=2, fsdp=1, expert=4, context=1, tensor=1))):
    policy = policy_lib.Policy.from_pretrained(FIXTURE, mesh=mesh)
    policy.cfg = dataclasses.replace(policy.cfg, moe_matmul="ragged")
    policy.eos_id = None
    outs.append(policy.generate(prompts, sp, num_samples=2, max_new_tokens=6, seed=3))
  np.testing.assert_array_equal(outs[1].tokens_NxT, outs[0].tokens_NxT)
  np.testing.assert_allclose(outs[1].logp_NxT, outs[0].logp_NxT, atol=1e-5)

"""Mixture-of-experts feed-forward (Qwen3-MoE), as pure functions of raw parameters.

Each token's hidden state x is routed to K of E SwiGLU experts (Shazeer et al. 2017;
Qwen3-MoE's published routing):

    p = softmax(x W_router)            (float32; the logits in model.router_dtype)
    (w_1..K, e_1..K) = top_K(p)        (w normalised to sum 1 when norm_topk_prob)
    y = sum_k w_k * down_e_k(silu(gate_e_k(x)) * up_e_k(x))

**Dropless**: every token reaches all K of its experts (no capacity factor, no token
dropping), so a token's output depends on that token alone, never on the others in its
batch. That is what makes the sampler's routing and the update's the same computation: the
decode step (decode.py) and the training forward (decoder.py) call these same functions on
the same parameters, and a token that sees the same hidden state picks the same experts in
both. (A capacity-based router would drop different tokens in a 64-row decode step than
in a 4,096-row update, and the recomputed log-probs would differ by more than noise.)

Two ways to compute the experts, one result (tests/test_moe.py pins them together):
  * "ragged": the (token, slot) pairs sorted by expert and three grouped matmuls,
    `jax.lax.ragged_dot` (what MaxText and Tunix use; TPU runs it as a grouped kernel).
    Work: T*K rows. On CPU XLA lowers ragged_dot to a dense dot masked per group (E times
    the rows), so there it costs more than "dense" (BENCHMARKS.md has the ratio).
  * "dense": the reference; every expert on every token, combined with the router's
    weights (zero for the experts not chosen). Work: T*E rows.
"auto" (`resolve_matmul`) picks dense on CPU and ragged elsewhere.

Expert parallelism (`expert` mesh axis, sharding.py): the experts' weights are split over
`expert` (each chip E/ep experts) and the rows over data x fsdp x expert, as MaxText does.
Under a mesh the layer runs in `shard_map`: each chip gathers the rows of its `expert` group
(an all-gather of [T, D]), computes its own experts' share of every gathered row, and a
reduce-scatter sums the shares and hands each chip its rows back. The gather/scatter pair
moves T*D per chip each way, where an all-to-all dispatch would move T*K*D/ep; it is
dropless by construction and its shapes are static. The weights' model dimension is
gathered over `fsdp` on entry (as FSDP gathers any layer) and their hidden dimension stays
split over `tensor` (each chip its slice of every expert, summed over `tensor` on exit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgrpo.runtime import config_checks

MATMULS = ("auto", "ragged", "dense")


def resolve_matmul(value: str, platform: str) -> str:
  """`model.moe_matmul`: 'auto' is dense on CPU (where ragged_dot becomes a masked dense dot
  over every group, measured slower) and ragged elsewhere."""
  if value != "auto":
    return value
  return "dense" if platform == "cpu" else "ragged"


def route(x_TxD, router_DxE, k: int, normalize: bool, dtype=None):
  """(weights [T, K] float32, experts [T, K] int32, probabilities [T, E] float32).

  The router's logits are taken in `dtype` (None: x's, as transformers' Qwen3-MoE does;
  model.router_dtype defaults to float32, as slime keeps them, so a bfloat16 mixture's
  choice of experts does not turn on bfloat16 rounding) and the softmax in float32; ties
  go to the lower expert id (lax.top_k, as torch.topk). The sampler and the update call
  this same function with the same dtype (decoder.experts_layer)."""
  dtype = x_TxD.dtype if dtype is None else dtype
  logits_TxE = x_TxD.astype(dtype) @ router_DxE.astype(dtype)
  probs_TxE = jax.nn.softmax(logits_TxE.astype(jnp.float32), axis=-1)
  weights_TxK, experts_TxK = jax.lax.top_k(probs_TxE, k)
  if normalize:
    weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
  return weights_TxK, experts_TxK.astype(jnp.int32), probs_TxE


def _dense_experts(x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                   first: int):
  """The reference: every expert held here (ids first .. first + E_here - 1) on every
  token, each output scaled by its combine weight (0 where not chosen)."""
  e_here = gate_ExDxF.shape[0]
  ids_E = first + jnp.arange(e_here, dtype=jnp.int32)
  chosen_TxKxE = experts_TxK[..., None] == ids_E
  combine_TxE = jnp.sum(jnp.where(chosen_TxKxE, weights_TxK[..., None], 0.0), axis=1)
  h_TxExF = (jax.nn.silu(jnp.einsum("td,edf->tef", x_TxD, gate_ExDxF))
             * jnp.einsum("td,edf->tef", x_TxD, up_ExDxF))
  y_TxExD = jnp.einsum("tef,efd->ted", h_TxExF, down_ExFxD)
  return jnp.einsum("ted,te->td", y_TxExD, combine_TxE.astype(x_TxD.dtype))


def _ragged_experts(x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                    first: int):
  """Grouped matmuls over the (token, slot) pairs sorted by expert; pairs routed to experts
  not held here sort last, outside every group, and their rows are dropped."""
  t, k = experts_TxK.shape
  e_here = gate_ExDxF.shape[0]
  local_M = experts_TxK.reshape(-1) - first  # M = T*K pairs
  here_M = (local_M >= 0) & (local_M < e_here)
  group_M = jnp.where(here_M, local_M, e_here)
  order_M = jnp.argsort(group_M, stable=True)
  token_M = order_M // k
  sizes_E = jnp.bincount(group_M, length=e_here + 1)[:e_here].astype(jnp.int32)
  xs_MxD = jnp.take(x_TxD, token_M, axis=0)
  h_MxF = (jax.nn.silu(jax.lax.ragged_dot(xs_MxD, gate_ExDxF, sizes_E))
           * jax.lax.ragged_dot(xs_MxD, up_ExDxF, sizes_E))
  ys_MxD = jax.lax.ragged_dot(h_MxF, down_ExFxD, sizes_E)
  w_M = weights_TxK.reshape(-1)[order_M]
  # Rows outside every group (pairs routed to experts not held here) are selected away,
  # not multiplied by 0: JAX does not promise what ragged_dot writes there (CPU writes 0;
  # a kernel may leave anything, and NaN x 0 is NaN).
  ys_MxD = jnp.where(here_M[order_M][:, None], ys_MxD * w_M.astype(ys_MxD.dtype)[:, None], 0)
  return jnp.zeros_like(x_TxD).at[token_M].add(ys_MxD)


_EXPERTS = {"dense": _dense_experts, "ragged": _ragged_experts}


def experts(x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF, down_ExFxD,
            matmul: str, first: int = 0):
  """The experts' combined output [T, D] for routed tokens (`matmul`: 'dense' or 'ragged';
  `first`: the id of the first expert these weights hold)."""
  return _EXPERTS[matmul](x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF,
                          down_ExFxD, first)


def moe(x_NxD, router_DxE, gate_ExDxF, up_ExDxF, down_ExFxD, *, k: int, normalize: bool,
        matmul: str, router_dtype=None, mesh=None, row_spec=None):
  """The layer: (y [N..., D], probabilities [N..., E] float32, experts [N..., K]).

  x's leading axes are rows (any number); weights in the compute dtype. mesh: run
  expert-parallel in shard_map (module docstring), x's layout given by `row_spec` (the
  PartitionSpec of x: rows over the data axes); None: plain jit (one device, or GSPMD)."""
  lead, d = x_NxD.shape[:-1], x_NxD.shape[-1]
  if mesh is None:
    x_TxD = x_NxD.reshape(-1, d)
    w, e, probs = route(x_TxD, router_DxE, k, normalize, router_dtype)
    y = experts(x_TxD, w, e, gate_ExDxF, up_ExDxF, down_ExFxD, matmul)
    return y.reshape(x_NxD.shape), probs.reshape(*lead, -1), e.reshape(*lead, k)
  out_spec = P(*row_spec[:-1], None)
  body = functools.partial(_expert_parallel, k=k, normalize=normalize, matmul=matmul,
                           router_dtype=router_dtype)
  return jax.shard_map(
      body, mesh=mesh,
      in_specs=(row_spec, P(), P("expert", None, "tensor"), P("expert", None, "tensor"),
                P("expert", "tensor", None)),
      out_specs=(row_spec, out_spec, out_spec), check_vma=False)(
          x_NxD, router_DxE, gate_ExDxF, up_ExDxF, down_ExFxD)


def _expert_parallel(x_NxD, router_DxE, gate_ExDxF, up_ExDxF, down_ExFxD, *, k, normalize,
                     matmul, router_dtype):
  """One chip's part (inside shard_map): route its rows, gather its `expert` group's rows,
  compute its experts' share of them (its `tensor` slice of each), sum and scatter back."""
  shape, d = x_NxD.shape, x_NxD.shape[-1]
  x_TxD = x_NxD.reshape(-1, d)
  w, e, probs = route(x_TxD, router_DxE, k, normalize, router_dtype)
  gather = functools.partial(jax.lax.all_gather, axis_name="expert", tiled=True)
  first = jax.lax.axis_index("expert") * gate_ExDxF.shape[0]
  y_all = experts(gather(x_TxD), gather(w), gather(e), gate_ExDxF, up_ExDxF, down_ExFxD,
                  matmul, first)
  y_all = jax.lax.psum(y_all, "tensor")
  y_TxD = jax.lax.psum_scatter(y_all, "expert", scatter_dimension=0, tiled=True)
  return y_TxD.reshape(shape), probs.reshape(*shape[:-1], -1), e.reshape(*shape[:-1], k)


def balance_loss(counts_E, probs_E, num_experts: int):
  """The router's load-balancing loss (Switch Transformer, eq. 4; transformers'
  `load_balancing_loss_func`, which Qwen3-MoE trains with): E * sum_e f_e P_e, with f_e the
  share of (token, slot) assignments to expert e times K (sum_e f_e = K, as transformers
  sums its per-slot fractions) and P_e the mean router probability, both over every real
  token of every layer. counts_E, probs_E: sums over those tokens, divided by their number."""
  return num_experts * jnp.sum(counts_E * probs_E)


@config_checks.register_model(order=10)
def _check_experts(c, model_cfg) -> None:
  """What needs a mixture of experts, against the model as loaded: a chosen expert matmul
  and a router loss weight (a dense model has neither experts nor a router)."""
  if model_cfg.num_experts:
    return
  if c.model.moe_matmul != "auto":
    config_checks.fail("model.moe_matmul", c.model.moe_matmul, "'auto', or a mixture of "
                       "experts (model.num_experts > 0)",
                       reason="the model is dense (no experts to compute)")
  if c.model.router_dtype != "float32":
    config_checks.fail("model.router_dtype", c.model.router_dtype, "'float32', or a "
                       "mixture of experts (model.num_experts > 0)",
                       reason="the model is dense (no router)")
  coef = c.grpo.router_aux_loss_coef
  if coef:
    config_checks.fail("grpo.router_aux_loss_coef", coef, "0, or a mixture of experts "
                       "(model.num_experts > 0)", reason="the model is dense (no router)")

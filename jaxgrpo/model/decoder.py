"""A decoder-only transformer of the Llama / Qwen / Gemma 3 families, in Flax linen.

Pieces: token embedding (optionally tied to the output head), RMSNorm, rotary position
embeddings with a configurable theta, grouped-query attention (num_heads query heads share
num_kv_heads key/value heads), optional QK-norm (Qwen3), and a SwiGLU MLP or a mixture of
SwiGLU experts (Qwen3-MoE, moe.py). Gemma 3's departures are switches of ModelConfig: GeGLU,
(1 + w) norms also after each sublayer, scaled embeddings, its query scale, and local layers
that attend within a sliding window with their own RoPE base (the layer's index is scanned
beside its parameters, so one compiled layer body serves local and global layers).

Entry points sharing the same parameters:
  * `Decoder.__call__`: a full causal forward over left-padded rows (teacher forcing, and
    prompt prefill, which returns the last position's logits and the per-layer K/V).
  * `Decoder.score_groups`: the training loss's forward, each prompt computed once for its
    G completions.
The sampler's token-by-token step lives in decode.py: the same function of the same
parameters, arranged for speed and pinned to `forward` by tests/test_decode.py. The
attention maths (einsums or cuDNN's fused kernel) and RoPE live in attention.py.

The layers' parameters are stacked ([num_layers, ...] under `layers`, the leading axis named
"layers" and never sharded) and a scan runs one block over them (`over_layers`): one
compiled layer body in a loop (`scan_layers` True, MaxText's scan_layers) or the same scan
unrolled. Files on disk (jaxgrpo's own folders and Hugging Face's) name each layer's
tensors apart; `stack_layers` and `unstack_layers` convert.

Every parameter carries logical axis names, and `constrain` pins the activations' layouts
by the same names (sharding.py maps them to mesh axes). Under FSDP (weights split on
`embed` over `fsdp`, rows split over `fsdp` too) the partitioner may resolve the conflict
by computing whole-batch activations on every chip, so per-chip memory grew as chips were
added (tests/test_sharding.py measures it). Pinned to rows over the data axes, with the
model dimension whole, every chip gathers a layer's weights and computes its own rows, as
MaxText does. The pinning is on where a forward is told so (`pin`: the update step's
forward, on its mesh); a sampler's forward and one without a mesh (tests, `Policy.logits`)
keep the placement the partitioner chooses.

Nothing reaches the model through ambient state: the program's mesh (`mesh`: the
attention kernels' shard_map, a mixture's expert parallelism, the platform), whether to
pin activations on it (`pin`) and whether a packed row's positions split over `context`
(`split_sequence`) are module attributes, passed by the one call that builds the program.
A mixture's layers run expert-parallel on any program's mesh, so every engine gets them by
construction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.model import attention as attention_lib
from jaxgrpo.model import axes as axes_lib
from jaxgrpo.model import moe as moe_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# model.hidden_act -> the MLP gate's activation: SwiGLU's silu, GeGLU's tanh-approximated gelu
# (transformers' gelu_pytorch_tanh, which Gemma uses).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
# A window no sequence reaches: a global layer's, where the window is per layer data.
NO_WINDOW = 1 << 30


# --- Where activations live. ----------------------------------------------------------------
def constrain(x, mesh, *logical_axes):
  """Pins an activation's layout by logical axis names (axes.RULES: `batch` over the data
  axes, `act_mlp` / `act_vocab` over `tensor`, an unnamed axis whole) on `mesh`; a no-op
  without one (module docstring: the update's forward pins, samplers do not). The rules go
  in explicitly: no flax rules context is needed around the trace."""
  if mesh is None:
    return x
  return nn.with_logical_constraint(x, logical_axes, rules=axes_lib.RULES, mesh=mesh)


def platform_of(mesh) -> str:
  """The platform a program on `mesh` is compiled for: its devices' (compile-only TPU
  descriptions under launch/compile_check.py, whatever this host runs), or for a program
  without a mesh the default backend's, where it then runs. Every choice that changes what
  a program contains (splash interpreted or a TPU kernel, scanned layers, ragged experts)
  reads this, never the default backend alone, so the compile check compiles what a TPU
  host runs."""
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _middle(ndim: int, split_sequence: bool = False) -> tuple:
  """Logical names of an activation's axes between the rows and the last: the positions of
  a packed row split over `context` with split_sequence, else whole."""
  if split_sequence and ndim == 3:
    return ("act_length",)
  return (None,) * (ndim - 2)


def constrain_rows(x, mesh, split_sequence: bool = False):
  """`constrain` for a [rows..., D] activation: split by its first (batch) axis (and a
  packed row's positions over `context`, with split_sequence)."""
  return constrain(x, mesh, "batch", *_middle(x.ndim, split_sequence), None)


# --- The layers as one stack. --------------------------------------------------------------
LAYER_PREFIX = "layer_"
# A train-state checkpoint's meta names its layout; those written before the layers were
# stacked have none (their trees hold layer_0 ... and cannot restore into this one).
PARAM_LAYOUT = "stacked_layers"


def resolve_scan_layers(value: bool | None, platform: str) -> bool:
  """`model.scan_layers`; None picks by platform. Unrolled on CPU, where the steady update
  measured 1.12x and the tiny preset's rollout 1.45x faster unrolled (BENCHMARKS.md) and a
  model small enough for CPU compiles quickly either way; scanned on TPU and GPU, where a
  real model's 28+ layers would otherwise each be compiled (a 7B compile check: 308 s
  unrolled, 95 s scanned; MaxText's scan_layers default)."""
  return platform != "cpu" if value is None else bool(value)


def over_layers(body, num_layers: int, scan_layers: bool, num_broadcast: int):
  """`body` run over the stacked layers: params["layers"] holds every layer's parameters
  with a leading [num_layers] axis (logical name "layers"), sliced one layer per step.

  scan_layers=True compiles one layer body in a loop (MaxText's scan_layers); False unrolls
  the same scan into num_layers copies, as a Python loop over layers would, which lets XLA
  schedule and fuse across layers at the price of a compile that grows with depth. Both
  read the same parameter tree, so the choice is the compiler's, never the checkpoint's.
  The body's last argument is the layer's index (`layer_ids`: a local layer's window and
  RoPE), scanned beside its parameters.
  """
  return nn.scan(body, variable_axes={"params": 0, "intermediates": 0},
                 split_rngs={"params": True},
                 in_axes=(nn.broadcast,) * num_broadcast + (0,), length=num_layers,
                 unroll=1 if scan_layers else num_layers,
                 metadata_params={nn.PARTITION_NAME: "layers"})


def unstack_layers(params) -> dict:
  """{..., "layers": {...[L, ...]}} -> {..., "layer_0": {...}, ..., "layer_{L-1}": {...}}."""
  out = {k: v for k, v in params.items() if k != "layers"}
  stacked = params["layers"]
  num = len(jax.tree.leaves(stacked)[0])
  for i in range(num):
    out[f"{LAYER_PREFIX}{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
  return out


def stack_layers(params) -> dict:
  """The inverse of `unstack_layers` on a host tree of numpy arrays (layer_0 ...
  layer_{L-1} must all be there)."""
  names = [k for k in params if k.startswith(LAYER_PREFIX)]
  out = {k: v for k, v in params.items() if not k.startswith(LAYER_PREFIX)}
  layers = [params[f"{LAYER_PREFIX}{i}"] for i in range(len(names))]
  out["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *layers)
  return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the decoder. Names follow Hugging Face's Llama/Qwen configs."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qk_norm: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"
  qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections
  # Llama 3.1+ "llama3" RoPE frequency scaling; factor 0 = off (plain RoPE).
  rope_scaling_factor: float = 0.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  # Mixture-of-experts (Qwen3-MoE; moe.py): 0 experts = a dense SwiGLU MLP of mlp_dim.
  # Otherwise every layer's MLP is num_experts experts of moe_mlp_dim, each token routed to
  # num_experts_per_tok of them (weights renormalised to sum 1 when norm_topk_prob).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_mlp_dim: int = 0
  norm_topk_prob: bool = True
  # Not architecture: how the experts are computed (moe.MATMULS; 'auto' by platform), and
  # the router's logits' dtype ('compute': the compute dtype, as transformers; float32 keeps
  # a bfloat16 mixture's routing off bfloat16 rounding, as slime does).
  moe_matmul: str = "auto"
  router_dtype: str = "float32"
  # Gemma 3's departures from the Llama layout (all off: Llama / Qwen).
  hidden_act: str = "silu"           # the MLP gate's activation: silu (SwiGLU), gelu_tanh (GeGLU)
  norm_plus_one: bool = False        # RMSNorm scales by (1 + w), not w
  post_norms: bool = False           # a norm on the attention's and the MLP's outputs too
  embed_scale: bool = False          # embeddings times sqrt(d_model)
  query_pre_attn_scalar: float = 0.0  # scores scaled by its ** -0.5; 0 = head_dim's
  sliding_window: int = 0            # local layers: a token sees the last this many (itself
  sliding_window_pattern: int = 0    # included); every this-many-th layer is global (0: none)
  rope_local_theta: float = 0.0      # the local layers' RoPE base (0: rope_theta)
  rope_scaling_type: str = "llama3"  # of rope_scaling_factor > 0: llama3, or linear (Gemma 3:
                                     # the global layers' positions divided by the factor)

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model.{name}={value!r}: must be a positive integer")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                       f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.num_experts:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok!r}: must be "
                         f"1 to model.num_experts={self.num_experts}")
      if self.moe_mlp_dim <= 0:
        raise ValueError(f"model.moe_mlp_dim={self.moe_mlp_dim!r}: must be a positive "
                         "integer with model.num_experts > 0")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"model.hidden_act={self.hidden_act!r}: allowed {sorted(ACTIVATIONS)}")
    if self.rope_scaling_type not in ("llama3", "linear"):
      raise ValueError(f"model.rope_scaling_type={self.rope_scaling_type!r}: allowed "
                       "['linear', 'llama3']")
    if self.sliding_window < 0 or self.sliding_window_pattern < 0:
      raise ValueError(f"model.sliding_window={self.sliding_window}, sliding_window_pattern="
                       f"{self.sliding_window_pattern}: must be >= 0")
    if self.router_dtype not in (*DTYPES, "compute"):
      raise ValueError(f"model.router_dtype={self.router_dtype!r}: allowed "
                       f"{sorted(DTYPES) + ['compute']}")
    if self.moe_matmul not in moe_lib.MATMULS:
      raise ValueError(f"model.moe_matmul={self.moe_matmul!r}: allowed {list(moe_lib.MATMULS)}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r}: allowed {sorted(DTYPES)}")
    for name, low in (("rope_theta", "> 0"), ("norm_eps", ">= 0")):
      value = getattr(self, name)
      if (isinstance(value, bool) or not isinstance(value, (int, float))
          or value < 0 or (value == 0 and low == "> 0")):
        raise ValueError(f"model.{name}={value!r}: must be a number {low}")

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"model: unknown keys {unknown}; allowed {sorted(known)}")
    return cls(**values)


def initializer(name: str, shape: tuple, stacked: bool = False):
  """The initializer of the parameter called `name` (the last part of its path): the one
  rule the modules and `sharding.init_sharded` share. Kernels are N(0, 1/fan_in) with fan-in
  the input axes (the output kernel `o` [heads, head_dim, d_model] has two), the embedding
  N(0, 0.02^2), norm scales 1 and biases 0; an expert's kernels [E, in, out] have fan-in
  `in` (the expert axis is not fan-in). stacked: `shape` has the layers' leading axis,
  which is not fan-in."""
  if stacked:
    shape = shape[1:]
  if name == "embedding":
    return nn.initializers.normal(stddev=0.02)
  if name == "scale":
    return nn.initializers.ones
  if name.endswith("_bias"):
    return nn.initializers.zeros
  if name in ("gate", "up", "down") and len(shape) == 3:  # experts [E, in, out]
    return nn.initializers.normal(stddev=shape[1] ** -0.5)
  fan_in = math.prod(shape[:2]) if name == "o" else shape[0]
  return nn.initializers.normal(stddev=fan_in ** -0.5)


def _param(module, name, shape, axes, cfg):
  init = nn.with_logical_partitioning(initializer(name, shape), axes)
  return module.param(name, init, shape, DTYPES[cfg.param_dtype])


def dense(x, w, in_dims: int = 1):
  """x's last `in_dims` axes contracted with w's first `in_dims`, as ONE 2-D matmul.

  Leading axes (batch, group, time) are flattened into rows first. Written as an einsum
  over [B, G, T, d], the weight gradient contracts three axes, and XLA's CPU backend then
  materialised the activation gradient transposed, fused into the elementwise producer
  (e.g. SwiGLU's backward) as a strided loop: ~40 ms per [2048, 1024] tensor, ~12% of
  the small-preset update. As a 2-D matmul the gradient is one plain dot (BENCHMARKS.md).
  """
  lead, out = x.shape[:x.ndim - in_dims], w.shape[in_dims:]
  k = math.prod(w.shape[:in_dims])
  y = x.reshape(math.prod(lead), k) @ w.reshape(k, math.prod(out))
  return y.reshape(*lead, *out)


# `model.remat`: what a layer keeps for the backward pass. "full" keeps only its inputs and
# recomputes the rest; "save_dots" keeps the projections' outputs (matmuls without batch
# dimensions) and recomputes norms, rotations, attention and activations.
REMAT_POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class RMSNorm(nn.Module):
  """x / rms(x) * scale, computed in float32 whatever the compute dtype."""

  cfg: ModelConfig
  dim: int

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", (self.dim,), ("norm",), self.cfg)
    return rms_norm(x, scale, self.cfg)


def rms_norm(x, scale, cfg: ModelConfig):
  """RMSNorm as a pure function (the sampler's decode step calls it on raw parameters)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
  return (x32 * norm_scale(scale, cfg)).astype(DTYPES[cfg.dtype])


def norm_scale(scale, cfg: ModelConfig):
  """The factor RMSNorm multiplies by, float32: w, or Gemma's 1 + w."""
  scale = scale.astype(jnp.float32)
  return scale + 1.0 if cfg.norm_plus_one else scale


def is_local(layer, cfg: ModelConfig):
  """Whether layer `layer` (an index, traced inside the layers' scan) attends within the
  sliding window: every layer but each sliding_window_pattern-th (Gemma 3: 5 of 6)."""
  if not cfg.sliding_window:
    return False
  if not cfg.sliding_window_pattern:
    return True
  return (layer + 1) % cfg.sliding_window_pattern != 0


def layer_frequencies(layer, cfg: ModelConfig):
  """RoPE's inv_freq for layer `layer`: the local base on a local layer (Gemma 3's 1e4,
  unscaled), else rope_theta with its scaling."""
  inv_freq = attention_lib.rope_frequencies(cfg, cfg.head_dim)
  if not cfg.sliding_window:
    return inv_freq
  local = attention_lib.rope_frequencies(cfg, cfg.head_dim, local=True)
  return jnp.where(is_local(layer, cfg), local, inv_freq)


def query_factor(cfg: ModelConfig) -> float:
  """What q is multiplied by so that the attention's head_dim ** -0.5 makes Gemma's
  query_pre_attn_scalar ** -0.5 (1 when unset)."""
  if not cfg.query_pre_attn_scalar:
    return 1.0
  return (cfg.head_dim / cfg.query_pre_attn_scalar) ** 0.5


def layer_window(layer, cfg: ModelConfig):
  """The keys layer `layer` sees behind a query (itself included): the window on a local
  layer, NO_WINDOW on a global one."""
  return jnp.where(is_local(layer, cfg), cfg.sliding_window, NO_WINDOW)


class Attention(nn.Module):
  """Grouped-query attention; query head h uses key/value head h // (H / H_kv).

  attention: "xla" (scores as einsums, the softmax in float32), "cudnn" (fused) or "splash"
  (Pallas' flash kernel, TPU); see attention.py. Resolved by `resolve_attention` before it
  gets here.
  """

  cfg: ModelConfig
  attention: str = "xla"
  # The program's mesh: splash runs its kernel under shard_map on it (rows over the data
  # axes), compiled for its devices; None: one device (attention.splash).
  mesh: Any = None
  # Packed rows whose positions split over `context` (Decoder.split_sequence): splash
  # splits its queries too.
  split_sequence: bool = False

  def setup(self):
    c = self.cfg
    self.wq = _param(self, "q", (c.d_model, c.num_heads, c.head_dim),
                     ("embed", "q_heads", "head_dim"), c)
    self.wk = _param(self, "k", (c.d_model, c.num_kv_heads, c.head_dim),
                     ("embed", "kv_heads", "head_dim"), c)
    self.wv = _param(self, "v", (c.d_model, c.num_kv_heads, c.head_dim),
                     ("embed", "kv_heads", "head_dim"), c)
    self.wo = _param(self, "o", (c.num_heads, c.head_dim, c.d_model),
                     ("q_heads", "head_dim", "embed"), c)
    if c.qkv_bias:
      self.bq = _param(self, "q_bias", (c.num_heads, c.head_dim),
                       ("q_heads", "head_dim"), c)
      self.bk = _param(self, "k_bias", (c.num_kv_heads, c.head_dim),
                       ("kv_heads", "head_dim"), c)
      self.bv = _param(self, "v_bias", (c.num_kv_heads, c.head_dim),
                       ("kv_heads", "head_dim"), c)
    if c.qk_norm:
      self.q_norm = RMSNorm(c, c.head_dim)
      self.k_norm = RMSNorm(c, c.head_dim)

  def _qkv(self, x, positions, layer):
    dt = DTYPES[self.cfg.dtype]
    q = dense(x, self.wq.astype(dt))
    k = dense(x, self.wk.astype(dt))
    v = dense(x, self.wv.astype(dt))
    if self.cfg.qkv_bias:
      q, k, v = q + self.bq.astype(dt), k + self.bk.astype(dt), v + self.bv.astype(dt)
    if self.cfg.qk_norm:  # Qwen3 normalises each head before the rotation.
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = layer_frequencies(layer, self.cfg)
    q = attention_lib.rope(q, positions, inv_freq)
    factor = query_factor(self.cfg)
    if factor != 1.0:  # scores scaled by query_pre_attn_scalar ** -0.5, not head_dim's
      q = (q.astype(jnp.float32) * factor).astype(q.dtype)
    return q, attention_lib.rope(k, positions, inv_freq), v

  def _out(self, o):
    return dense(o, self.wo.astype(DTYPES[self.cfg.dtype]), in_dims=2)

  def __call__(self, x_BxTxD, positions_BxT, mask_BxT, layer=0):
    """Causal self-attention. mask_BxT: a boolean padding mask (real tokens True), or, for
    packed rows (algo/packing.py), int segment ids: a token sees the earlier tokens of its
    own segment only (0: padding). layer: this layer's index (a local layer's window and
    RoPE)."""
    q, k, v = self._qkv(x_BxTxD, positions_BxT, layer)
    o = attention_lib.causal(q, k, v, mask_BxT, positions_BxT, self._window(layer),
                             self.attention, self.mesh, split_queries=self.split_sequence)
    # K/V returned in the cache layout [B, H_kv, T, D] for prefill.
    return self._out(o), (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))

  def extend(self, x_BxGxTxD, positions_BxGxT, prompt_k, prompt_v, prompt_mask_BxL,
             mask_BxGxT, return_kv: bool = False, layer=0, prompt_positions_BxL=None):
    """T new tokens per sample, attending to the shared prompt K/V and causally to
    themselves (the training-time twin of decode.step); see attention.extend. return_kv:
    also the new tokens' K/V [B, G, T, H_kv, D] (multi-turn episodes append them to their
    cache: decode.extend). layer: this layer's index; prompt_positions_BxL: the prompt
    keys' positions (a local layer's window; default: counted from the mask)."""
    q, k, v = self._qkv(x_BxGxTxD, positions_BxGxT, layer)  # q [B,G,T,H,D], k/v [B,G,T,Hkv,D]
    window = self._window(layer)
    if window is not None and prompt_positions_BxL is None:
      prompt_positions_BxL = positions_from_mask(prompt_mask_BxL)
    out = self._out(attention_lib.causal_extend(
        q, k, v, prompt_k, prompt_v, prompt_mask_BxL, mask_BxGxT, positions_BxGxT,
        prompt_positions_BxL, window, self.attention, self.mesh))
    return (out, (k, v)) if return_kv else out

  def _window(self, layer):
    """The keys `layer` sees behind a query (layer_window), None without sliding windows."""
    return layer_window(layer, self.cfg) if self.cfg.sliding_window else None


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)); with cfg.num_experts, a mixture of such experts
  (moe.py), its router `router` [d_model, E] and the experts' gate, up [E, d_model, F] and
  down [E, F, d_model] under the same names."""

  cfg: ModelConfig
  mesh: Any = None             # the program's: a mixture's experts run expert-parallel on it
  pin: bool = False            # pin the hidden activation's layout on it (Decoder.pin)
  split_sequence: bool = False  # packed rows' positions over `context` (Decoder's)

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    dt = DTYPES[c.dtype]
    if c.num_experts:
      return self._experts(x)
    gate = _param(self, "gate", (c.d_model, c.mlp_dim), ("embed", "mlp"), c)
    up = _param(self, "up", (c.d_model, c.mlp_dim), ("embed", "mlp"), c)
    down = _param(self, "down", (c.mlp_dim, c.d_model), ("mlp", "embed"), c)
    h = ACTIVATIONS[c.hidden_act](dense(x, gate.astype(dt))) * dense(x, up.astype(dt))
    h = constrain(h, self.mesh if self.pin else None, "batch",
                  *_middle(h.ndim, self.split_sequence), "act_mlp")
    return dense(h, down.astype(dt))

  def _experts(self, x):
    c = self.cfg
    dt = DTYPES[c.dtype]
    e, f = c.num_experts, c.moe_mlp_dim
    router = _param(self, "router", (c.d_model, e), ("embed", None), c)
    gate = _param(self, "gate", (e, c.d_model, f), ("expert", "expert_embed", "mlp"), c)
    up = _param(self, "up", (e, c.d_model, f), ("expert", "expert_embed", "mlp"), c)
    down = _param(self, "down", (e, f, c.d_model), ("expert", "mlp", "expert_embed"), c)
    y, probs, chosen = experts_layer(x, router, gate.astype(dt), up.astype(dt),
                                     down.astype(dt), c, self.mesh, self.split_sequence)
    # For the router's load-balancing loss (moe.balance_loss); recorded only when the
    # caller makes "intermediates" mutable (grpo.router_aux_loss_coef > 0).
    self.sow("intermediates", "router", (probs, chosen))
    return y


def experts_layer(x, router, gate, up, down, cfg: ModelConfig, mesh=None,
                  split_sequence: bool = False):
  """moe.moe with the model's settings, expert-parallel on the program's `mesh` when there
  is one (the update's and every sampler's alike): the one call the training forward and
  the sampler's decode step share."""
  matmul = moe_lib.resolve_matmul(cfg.moe_matmul, platform_of(mesh))
  row_spec = None
  if mesh is not None:
    row_spec = nn.logical_to_mesh_axes(("batch", *_middle(x.ndim, split_sequence), None),
                                       axes_lib.RULES)
    ways = math.prod(mesh.shape[a] for a in jax.tree.leaves(tuple(row_spec)))
    if x.shape[0] % ways:  # rows that do not split (never in a step): GSPMD's placement
      mesh = row_spec = None
  router_dtype = None if cfg.router_dtype == "compute" else DTYPES[cfg.router_dtype]
  return moe_lib.moe(x, router, gate, up, down, k=cfg.num_experts_per_tok,
                     normalize=cfg.norm_topk_prob, matmul=matmul, router_dtype=router_dtype,
                     mesh=mesh, row_spec=row_spec)


class Block(nn.Module):
  """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x)). With cfg.post_norms
  (Gemma) each sublayer's output is normed too before it is added: x + norm(attn(norm(x)))."""

  cfg: ModelConfig
  attention: str = "xla"
  mesh: Any = None  # the program's (Decoder's docstring)
  pin: bool = False
  split_sequence: bool = False

  def setup(self):
    self.attn_norm = RMSNorm(self.cfg, self.cfg.d_model)
    self.attn = Attention(self.cfg, self.attention, self.mesh, self.split_sequence)
    self.mlp_norm = RMSNorm(self.cfg, self.cfg.d_model)
    self.mlp = MLP(self.cfg, self.mesh, self.pin, self.split_sequence)
    if self.cfg.post_norms:
      self.post_attn_norm = RMSNorm(self.cfg, self.cfg.d_model)
      self.post_mlp_norm = RMSNorm(self.cfg, self.cfg.d_model)

  def rows(self, x):
    """constrain_rows with this program's pinning (none unless `pin`)."""
    return constrain_rows(x, self.mesh if self.pin else None, self.split_sequence)

  def _mlp(self, x):
    h = self.mlp(self.rows(self.mlp_norm(x)))
    return x + (self.post_mlp_norm(h) if self.cfg.post_norms else h)

  def __call__(self, x, positions, mask, layer=0):
    h, kv = self.attn(self.rows(self.attn_norm(x)), positions, mask, layer)
    x = x + (self.post_attn_norm(h) if self.cfg.post_norms else h)
    return self._mlp(x), kv

  def extend(self, x, positions, prompt_k, prompt_v, prompt_mask, mask,
             return_kv: bool = False, layer=0, prompt_positions=None):
    h = self.attn.extend(self.rows(self.attn_norm(x)), positions, prompt_k, prompt_v,
                         prompt_mask, mask, return_kv, layer, prompt_positions)
    h, kv = h if return_kv else (h, None)
    x = x + (self.post_attn_norm(h) if self.cfg.post_norms else h)
    x = self._mlp(x)
    return (x, kv) if return_kv else x


def _prefill_layer(block, x, positions, mask, layer):
  """One layer of the full forward, as a scan body: (x, its (K, V) for the cache)."""
  return block(x, positions, mask, layer)


def _packed_layer(block, x, positions, segments, layer):
  """One layer over packed rows, as a scan body (no K/V kept: nothing reads them)."""
  return block.rows(block(x, positions, segments, layer)[0]), None


def _train_layer(block, carry, positions_p, mask_p, positions_c, mask_c, layer):
  """One layer of the training forward, as a scan body: the prompt rows, then the G
  completions of each prompt attending to that prompt's K/V."""
  x_p, x_c = carry
  x_next, (k, v) = block(x_p, positions_p, mask_p, layer)
  x_c = block.extend(x_c, positions_c, k, v, mask_p, mask_c, layer=layer,
                     prompt_positions=positions_p)
  return (block.rows(x_next), block.rows(x_c)), None


class Decoder(nn.Module):
  """The policy network: tokens -> next-token logits (float32).

  remat: a key of REMAT_POLICIES, for the training forward (`score_groups`): what each
  layer keeps for the backward pass. scan_layers: run the layers as a loop over one
  compiled body (True) or unrolled (False); see `layers.over_layers`. attention: a name of
  ATTENTION, or None for the platform's (`resolve_attention`). mesh: the program's, passed
  explicitly to the attention kernels (splash's shard_map) and a mixture's experts (expert
  parallelism), and deciding the platform of every None above (`platform_of`); None: one
  device. pin: activations pinned to rows over the data axes on `mesh` (the update step's
  forward; module docstring). split_sequence: packed rows' positions also split over the
  mesh's `context` axis (context parallelism: `score_packed` sets it).
  """

  cfg: ModelConfig
  remat: str = "none"
  scan_layers: bool | None = None  # None: by the platform (resolve_scan_layers)
  attention: str | None = None  # None: by the platform (resolve_attention)
  mesh: Any = None
  pin: bool = False
  split_sequence: bool = False

  def setup(self):
    c = self.cfg
    self.embedding = _param(self, "embedding", (c.vocab_size, c.d_model), ("vocab", "embed"), c)
    if not c.tie_embeddings:
      self.lm_head = _param(self, "lm_head", (c.d_model, c.vocab_size),
                            ("embed", "vocab"), c)
    # One block's parameters, stacked [num_layers, ...] by the scan.
    self.layers = Block(c, attention_lib.resolve_attention(
        self.attention, platform_of(self.mesh), c.dtype, windowed=bool(c.sliding_window)),
                        self.mesh, self.pin, self.split_sequence)
    self.final_norm = RMSNorm(c, c.d_model)

  def _embed(self, tokens):
    # Under FSDP the table's model dimension is split over `fsdp`, like the rows: the lookup
    # gathers the table (as a layer's weights are) rather than the rows' activations.
    table = constrain(self.embedding, self._pinned(), "vocab", None)
    return embed(table, tokens, self.cfg)

  def _logits(self, x):
    logits = dense(self.final_norm(x), self._head())
    logits = constrain(logits, self._pinned(), "batch", *([None] * (logits.ndim - 2)),
                       "act_vocab")
    return logits.astype(jnp.float32)

  def __call__(self, tokens_BxT, positions_BxT, mask_BxT, return_kv: bool | str = False):
    """Causal forward over left-padded rows; mask_BxT marks real tokens.

    Returns logits_BxTxV; with return_kv (prefill) only the last position's logits_BxV,
    which is all a sampler needs, and per-layer tuples (K, V) of [B, Hkv, T, D];
    return_kv="stacked": (K, V) as the scan makes them, [num_layers, B, Hkv, T, D] each.
    """
    x = self._embed(tokens_BxT)
    layers = over_layers(_prefill_layer, self.cfg.num_layers, self._scan(), 2)
    x, (k_L, v_L) = layers(self.layers, x, positions_BxT, mask_BxT, self._layer_ids())
    if return_kv == "stacked":
      return self._logits(x[:, -1]), (k_L, v_L)
    if return_kv:
      num = self.cfg.num_layers
      return self._logits(x[:, -1]), (tuple(k_L[i] for i in range(num)),
                                      tuple(v_L[i] for i in range(num)))
    return self._logits(x)

  def score_groups(self, prompt_tokens_BxL, prompt_mask_BxL, completion_BxGxT,
                   completion_mask_BxGxT):
    """Logits [B, G, T, V] predicting each of G completions' T tokens (teacher forcing).

    The prompt runs once per prompt and its K/V are shared by the G completions, so the
    training loss costs B*L + B*G*T token positions instead of B*G*(L+T). Completion token
    t sits at position prompt_length + t, exactly as in sampling.
    """
    first_BxD, rest_BxGxTxD = self._score_hidden(prompt_tokens_BxL, prompt_mask_BxL,
                                                 completion_BxGxT, completion_mask_BxGxT)
    first_BxV = self._logits(first_BxD)  # the prompt's last position predicts token 0
    rest = self._logits(rest_BxGxTxD[:, :, :-1])   # completion token t predicts token t + 1
    g = completion_BxGxT.shape[1]
    first = jnp.broadcast_to(first_BxV[:, None, None], (first_BxV.shape[0], g, 1,
                                                        first_BxV.shape[-1]))
    return jnp.concatenate([first, rest], axis=2)

  def score_hidden(self, prompt_tokens_BxL, prompt_mask_BxL, completion_BxGxT,
                   completion_mask_BxGxT):
    """The final-normed hidden states [B, G, T, D] that predict each completion token, and
    the head [D, V]: `score_groups` without the [B, G, T, V] logits, for a loss that
    projects a chunk of positions at a time (grpo.completion_logprobs)."""
    first_BxD, rest_BxGxTxD = self._score_hidden(prompt_tokens_BxL, prompt_mask_BxL,
                                                 completion_BxGxT, completion_mask_BxGxT)
    b, g = completion_BxGxT.shape[:2]
    first = jnp.broadcast_to(first_BxD[:, None, None], (b, g, 1, first_BxD.shape[-1]))
    hidden = jnp.concatenate([first, rest_BxGxTxD[:, :, :-1]], axis=2)
    return self.final_norm(hidden), self._head()

  def _score_hidden(self, prompt_tokens_BxL, prompt_mask_BxL, completion_BxGxT,
                    completion_mask_BxGxT):
    """The last layer's output at the prompt's last position [B, D] and at every completion
    position [B, G, T, D] (not normed)."""
    positions_BxL = positions_from_mask(prompt_mask_BxL)
    prompt_len_B = jnp.sum(prompt_mask_BxL, axis=-1).astype(jnp.int32)
    t = completion_BxGxT.shape[-1]
    positions_BxGxT = prompt_len_B[:, None, None] + jnp.arange(t, dtype=jnp.int32)
    x_p = self.layers.rows(self._embed(prompt_tokens_BxL))
    x_c = self.layers.rows(self._embed(completion_BxGxT))

    body = _train_layer
    if self.remat != "none":
      # Inside a scan the loop already keeps XLA from merging the recomputation with the
      # forward; unrolled, prevent_cse must (jax.checkpoint's documentation).
      body = nn.remat(body, policy=REMAT_POLICIES[self.remat], prevent_cse=not self._scan())
    layers = over_layers(body, self.cfg.num_layers, self._scan(), 4)
    (x_p, x_c), _ = layers(self.layers, (x_p, x_c), positions_BxL, prompt_mask_BxL,
                           positions_BxGxT, completion_mask_BxGxT, self._layer_ids())
    return x_p[:, -1], x_c

  def score_packed(self, tokens_RxS, positions_RxS, segments_RxS):
    """(final-normed hidden states [R, S, D], head [D, V]) of packed rows (algo/packing.py):
    several sequences end to end in each row, each attending causally to itself only
    (segment ids; 0 marks padding) with its own positions. Position s predicts the token
    at s + 1 of its sequence. The module function `score_packed` builds the Decoder with
    split_sequence, so the positions also split over `context` (a no-op where it is 1)."""
    x = self.layers.rows(self._embed(tokens_RxS))
    body = _packed_layer
    if self.remat != "none":  # as in _score_hidden
      body = nn.remat(body, policy=REMAT_POLICIES[self.remat], prevent_cse=not self._scan())
    layers = over_layers(body, self.cfg.num_layers, self._scan(), 2)
    x, _ = layers(self.layers, x, positions_RxS, segments_RxS, self._layer_ids())
    return self.layers.rows(self.final_norm(x)), self._head()

  def _pinned(self):
    """The mesh activations are pinned on: the program's when `pin`, else None."""
    return self.mesh if self.pin else None

  def _layer_ids(self):
    return jnp.arange(self.cfg.num_layers, dtype=jnp.int32)

  def _scan(self) -> bool:
    return resolve_scan_layers(self.scan_layers, platform_of(self.mesh))

  def _head(self):
    """The output projection [D, V] in the compute dtype (the tied embedding, transposed)."""
    dt = DTYPES[self.cfg.dtype]
    return self.embedding.astype(dt).T if self.cfg.tie_embeddings else self.lm_head.astype(dt)


def embed(table_VxD, tokens, cfg: ModelConfig):
  """Token embeddings in the compute dtype; Gemma's times sqrt(d_model), multiplied in the
  table's dtype as transformers does."""
  x = jnp.take(table_VxD, tokens, axis=0)
  if cfg.embed_scale:
    x = x * jnp.asarray(cfg.d_model ** 0.5, table_VxD.dtype)
  return x.astype(DTYPES[cfg.dtype])


def positions_from_mask(mask_BxT):
  """Position ids for left-padded rows: 0 at the first real token, pads clamp to 0."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def forward(params, cfg: ModelConfig, tokens_BxT, mask_BxT, scan_layers: bool | None = None,
            attention: str | None = None, mesh=None):
  """Teacher-forced logits of left-padded rows (the pure function the trainer calls)."""
  return Decoder(cfg, scan_layers=scan_layers, attention=attention, mesh=mesh).apply(
      {"params": params}, tokens_BxT, positions_from_mask(mask_BxT), mask_BxT)


def _apply(cfg, remat, scan_layers, attention, params, *args, method, masks=None, mesh=None,
           pin: bool = False, split_sequence: bool = False):
  """Decoder.apply; with `masks` (the real-token masks of the rows each layer's mixture
  routes, in the order it routes them) also the router's statistics (`router_stats`)."""
  model = Decoder(cfg, remat, scan_layers, attention, mesh, pin, split_sequence)
  if masks is None:
    return model.apply({"params": params}, *args, method=method)
  out, state = model.apply({"params": params}, *args, method=method, mutable=["intermediates"])
  return out, router_stats(state["intermediates"]["layers"]["mlp"]["router"], masks,
                           cfg.num_experts)


def router_stats(sown, masks, num_experts: int):
  """(f [E], P [E]) of moe.balance_loss from the sown (probabilities, experts) of every
  layer (stacked [L, rows..., E] and [L, rows..., K]), over the real tokens of `masks`:
  f_e = K x the share of (token, slot) assignments to e, P_e = the mean probability."""
  counts, probs, n = 0.0, 0.0, 0.0
  for (p_LxNxE, e_LxNxK), mask in zip(sown, masks):
    m = mask.astype(jnp.float32)[None, ..., None]  # [1, rows..., 1]
    chosen = jnp.sum(jax.nn.one_hot(e_LxNxK, num_experts, dtype=jnp.float32), axis=-2)
    lead = tuple(range(p_LxNxE.ndim - 1))
    counts = counts + jnp.sum(chosen * m, axis=lead)
    probs = probs + jnp.sum(p_LxNxE * m, axis=lead)
    n = n + jnp.sum(m) * p_LxNxE.shape[0]
  n = jnp.maximum(n, 1.0)
  return counts / n, probs / n


def score_groups(params, cfg: ModelConfig, prompt_tokens_BxL, prompt_mask_BxL,
                 completion_BxGxT, completion_mask_BxGxT, remat: str = "none",
                 scan_layers: bool | None = None, attention: str | None = None,
                 with_router_stats: bool = False, mesh=None, pin: bool = False):
  """Teacher-forced logits of G completions per prompt, the prompt computed once.
  with_router_stats: (logits, router_stats over the prompt and completion tokens). pin:
  activations pinned on `mesh` (the update's forward: Decoder)."""
  masks = (prompt_mask_BxL, completion_mask_BxGxT) if with_router_stats else None
  return _apply(cfg, remat, scan_layers, attention, params, prompt_tokens_BxL,
                prompt_mask_BxL, completion_BxGxT, completion_mask_BxGxT,
                method=Decoder.score_groups, masks=masks, mesh=mesh, pin=pin)


def score_hidden(params, cfg: ModelConfig, prompt_tokens_BxL, prompt_mask_BxL,
                 completion_BxGxT, completion_mask_BxGxT, remat: str = "none",
                 scan_layers: bool | None = None, attention: str | None = None,
                 with_router_stats: bool = False, mesh=None, pin: bool = False):
  """(hidden [B, G, T, D], head [D, V]): `score_groups` before the output projection."""
  masks = (prompt_mask_BxL, completion_mask_BxGxT) if with_router_stats else None
  return _apply(cfg, remat, scan_layers, attention, params, prompt_tokens_BxL,
                prompt_mask_BxL, completion_BxGxT, completion_mask_BxGxT,
                method=Decoder.score_hidden, masks=masks, mesh=mesh, pin=pin)


def score_packed(params, cfg: ModelConfig, tokens_RxS, positions_RxS, segments_RxS,
                 remat: str = "none", scan_layers: bool | None = None,
                 attention: str | None = None, with_router_stats: bool = False, mesh=None,
                 pin: bool = False):
  """(hidden [R, S, D], head [D, V]) of packed rows: Decoder.score_packed, the positions
  split over the mesh's `context` axis."""
  masks = (segments_RxS > 0,) if with_router_stats else None
  return _apply(cfg, remat, scan_layers, attention, params, tokens_RxS, positions_RxS,
                segments_RxS, method=Decoder.score_packed, masks=masks, mesh=mesh, pin=pin,
                split_sequence=True)


def init_params(cfg: ModelConfig, rng):
  """Boxed (logically partitioned) parameters; see sharding.init_sharded. Traced with the
  einsum attention and no mesh: the parameters do not depend on either, and a [1, 1] dummy
  through a kernel's shard_map (the update traces this under its mesh) cannot split."""
  dummy = jnp.zeros((1, 1), jnp.int32)
  return Decoder(cfg, attention="xla").init(rng, dummy, dummy, jnp.ones((1, 1), bool))["params"]


def param_structure(cfg: ModelConfig):
  """The boxed parameter tree's shapes, dtypes and logical axes, with nothing computed or
  compiled: the key is made inside the trace too (a concrete jax.random.key compiles its
  seeding, and start-up checks run before anything may compile)."""
  return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def count_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))

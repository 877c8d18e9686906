"""Attention maths for the training forward and the prefill: rotary embeddings, and
softmax(q k^T / sqrt(D), masked) v in one of three implementations (`model.attention`):

  * "xla": the scores as einsums and the softmax in float32, what XLA compiles on TPU and
    CPU. For the completions (`extend`) the prompt's K/V are shared by the G samples and the
    softmax runs over [prompt | own] score blocks without concatenating them.
  * "cudnn": `jax.nn.dot_product_attention`'s cuDNN flash attention (GPU, bfloat16), which
    never holds the [B, H, T, S] scores. Causality and left padding are one boolean mask
    (cuDNN's padding masks assume right padding), and a completion attends to [its prompt |
    itself] as one key sequence.
  * "splash": Pallas' splash attention (TPU; `jax.experimental.pallas.ops.tpu.
    splash_attention`, as MaxText and Tunix use it), a flash kernel that never holds the
    scores and skips the blocks its mask rules out. Its mask is causal (with an offset for
    a completion over [its prompt | itself]) and its segment ids say who may see whom: a
    real token is segment 1, a pad 0 (so a pad query attends only pads: finite, and
    never read), the keys padded up to the kernel's blocks -1 (seen by no one). No [B, T,
    S] mask is built. Kernels cannot be partitioned by XLA ("Mosaic kernels cannot be
    automatically partitioned"), so every program on a mesh passes it explicitly and the
    kernel runs inside `jax.shard_map`: rows over the data axes, heads over `tensor` when
    both head counts divide it. The mesh's devices decide whether the kernel is compiled
    for TPU or, elsewhere, run in Pallas' interpret mode (tests: equal to "xla"); never
    the default backend, so launch/compile_check.py compiles the TPU kernel from a CPU.

Grouped-query attention throughout: query head h reads KV head h // (H / H_kv). The decode
step's attention lives in decode.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxgrpo.runtime import config_checks

# A large finite negative instead of -inf: a fully masked row (a pad query) then gets a
# uniform softmax instead of NaN, and NaN never leaks into gradients.
_NEG = -1e30

ATTENTION = ("xla", "cudnn", "splash")
SPLASH_BLOCK = 128  # the kernel's smallest block: sequences are padded to a multiple


def resolve_attention(value: str | None, platform: str, dtype: str,
                      windowed: bool = False) -> str:
  """`model.attention`; None picks by platform: "splash" (Pallas' flash kernel) on TPU,
  "cudnn" (jax.nn.dot_product_attention's cuDNN flash attention) on GPU with bfloat16
  compute, "xla" (the einsum path) elsewhere: CPU keeps "xla". windowed: a model with
  sliding-window layers (Gemma 3), whose per-layer window the splash kernels here do not
  take: "xla" on TPU (a named "splash" is refused at startup; here it becomes "xla" too, so
  no window is ever dropped)."""
  if value is None:
    value = ("splash" if platform == "tpu" else
             "cudnn" if platform == "gpu" and dtype == "bfloat16" else "xla")
  return "xla" if windowed and value == "splash" else value


def packed_row_multiple(implementation: str, context: int) -> int:
  """What a packed row's length should be a multiple of so that nothing is padded or
  resharded: each of the `context` chips' shares a whole number of the kernel's blocks
  for splash (it pads each share to SPLASH_BLOCK, see `splash`), an equal share else."""
  return SPLASH_BLOCK * context if implementation == "splash" else context


def fused_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, allowed_BxTxS, implementation: str):
  """softmax(q k^T / sqrt(D), masked) v through jax.nn.dot_product_attention (grouped-query
  heads as the model groups them: query head h reads KV head h // (H / H_kv)). The mask is
  one [B, 1, T, S] boolean, which cuDNN takes as an additive bias in the compute dtype."""
  return jax.nn.dot_product_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD,
                                      mask=allowed_BxTxS[:, None], implementation=implementation)


def _pick_block(length: int) -> int:
  """The largest of 512, 256, 128 that divides `length` (a multiple of 128)."""
  return next(b for b in (512, 256, SPLASH_BLOCK) if length % b == 0)


def _splash_kernel(heads: int, t: int, s: int, offset: int, interpret: bool):
  """A splash kernel for `heads` query heads, t queries over s keys (multiples of the block),
  query i seeing keys <= i + offset; the dq and dkv backward kernels kept apart (the fused
  one holds an unreduced float32 dq: issue 51's probe measured 3.6 GiB at 16k)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  mask = masks.MultiHeadMask([masks.CausalMask((t, s), offset=offset)] * heads)
  bq, bkv = _pick_block(t), _pick_block(s)
  sizes = kernel.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                            block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                            block_kv_dq=bkv, use_fused_bwd_kernel=False)
  return kernel.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                interpret=interpret)


def splash(q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, q_segment_NxT, kv_segment_NxS, offset: int,
           mesh=None, split_queries: bool = False):
  """softmax(q k^T / sqrt(D)) v through splash attention: query i sees key j when j <= i +
  offset and their segment ids are equal (module doc). mesh: the program's mesh, whose
  data axes split the N rows (and `tensor` the heads, where both counts divide it); rows
  that do not divide over them (a batch of one) run whole on every chip. None: one device,
  the default one. out [N, T, H, D].

  split_queries (context parallelism, packed rows: self-attention, T == S): the queries
  are split over the mesh's `context` axis and every chip of a context group sees all the
  keys (shard_map gathers K and V: a GQA model's K/V are a fraction of its queries, and one
  gather a layer is simpler than a ring, at the cost of holding the whole row's K/V). Chip
  c's queries start at c * T / C, so its kernel's causal mask is offset by that: one kernel
  per chip position, picked by `lax.switch` on the axis index."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  n, t, h, d = q_NxTxHxD.shape
  s, hk = k_NxSxKxD.shape[1], k_NxSxKxD.shape[2]
  context = mesh.shape["context"] if mesh is not None and split_queries else 1
  # Each chip's queries a whole number of blocks (and the keys, which equal the queries
  # when split: then padded alike).
  tp = -(-t // (SPLASH_BLOCK * context)) * SPLASH_BLOCK * context
  sp = tp if context > 1 else -(-s // SPLASH_BLOCK) * SPLASH_BLOCK
  # The kernel does not scale: q is, in float32 then back to the compute dtype.
  q = (q_NxTxHxD.astype(jnp.float32) * d ** -0.5).astype(q_NxTxHxD.dtype)
  # [N, heads, length, D], padded to whole blocks: a padded query is a real one (it sees
  # real keys: finite, and cut off below), a padded key segment -1 (seen by no one).
  q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  k = jnp.pad(k_NxSxKxD, ((0, 0), (0, sp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  v = jnp.pad(v_NxSxKxD, ((0, 0), (0, sp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  q_seg = jnp.pad(q_segment_NxT.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=1)
  kv_seg = jnp.pad(kv_segment_NxS.astype(jnp.int32), ((0, 0), (0, sp - s)),
                   constant_values=-1)
  # The kernel compiles for TPU; elsewhere Pallas interprets it. The devices the program is
  # compiled for decide (the mesh's; without one, the default device, where it then runs).
  platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
  interpret = platform != "tpu"
  tensor = mesh.shape["tensor"] if mesh is not None else 1
  heads_split = tensor > 1 and h % tensor == 0 and hk % tensor == 0

  def one_kernel(chip):
    fn = _splash_kernel(q.shape[1] // (tensor if heads_split else 1), tp // context, sp,
                        offset + chip * (tp // context), interpret)
    return lambda q, k, v, q_seg, kv_seg: jax.vmap(
        lambda q, k, v, qs, ks: fn(q, k, v, segment_ids=kernel.SegmentIds(qs, ks)))(
            q, k, v, q_seg, kv_seg)

  def local(q, k, v, q_seg, kv_seg):
    if context == 1:
      return one_kernel(0)(q, k, v, q_seg, kv_seg)
    return jax.lax.switch(jax.lax.axis_index("context"),
                          [one_kernel(c) for c in range(context)], q, k, v, q_seg, kv_seg)

  if mesh is None:
    o = local(q, k, v, q_seg, kv_seg)
  else:
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    rows = ("data", "fsdp", "expert")  # sharding.BATCH_AXES (not imported: sharding imports us)
    if n % math.prod(mesh.shape[a] for a in rows):
      rows = None  # what GSPMD does with rows that do not split: every chip computes them
    heads = "tensor" if heads_split else None
    ctx = "context" if context > 1 else None
    o = jax.shard_map(local, mesh=mesh,
                      in_specs=(P(rows, heads, ctx), P(rows, heads), P(rows, heads),
                                P(rows, ctx), P(rows)),
                      out_specs=P(rows, heads, ctx), check_vma=False)(q, k, v, q_seg, kv_seg)
  return o.transpose(0, 2, 1, 3)[:, :t]


def causal(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxT, positions_BxT, window,
           implementation: str, mesh=None, split_queries: bool = False):
  """Causal self-attention of rows, by `implementation` (the one dispatch: decoder.Attention
  calls this). mask_BxT: a boolean padding mask (real tokens True), or for packed rows int
  segment ids (a token sees the earlier tokens of its own segment; 0: padding). window:
  the keys a query sees behind it (a local layer's), None for all. "splash": the kernel
  (causal, real tokens segment 1 and pads 0: no [B, T, S] mask; windows never reach it:
  resolve_attention); otherwise the [B, T, S] mask and `attend`."""
  if implementation == "splash":
    return splash(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxT, mask_BxT, 0, mesh,
                  split_queries=split_queries)
  t = q_BxTxHxD.shape[1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  if mask_BxT.dtype == jnp.bool_:
    allowed = causal_TxT[None] & mask_BxT[:, None, :]  # [B, T, S]
  else:
    allowed = causal_TxT[None] & (mask_BxT[:, :, None] == mask_BxT[:, None, :])
  if window is not None:  # a local layer sees the last `window` positions
    behind = positions_BxT[:, :, None] - positions_BxT[:, None, :]
    allowed = allowed & (behind < window)
  return attend(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, allowed, implementation)


def causal_extend(q, k, v, prompt_k, prompt_v, prompt_mask_BxL, mask_BxGxT, positions_BxGxT,
                  prompt_positions_BxL, window, implementation: str, mesh=None):
  """T new tokens per sample attending to their prompt's shared K/V and causally to
  themselves (`extend`), by `implementation`: "splash" (`extend_splash`), else the masks
  and `extend`. window: as in `causal` (then prompt_positions_BxL, the prompt keys'
  positions, is needed)."""
  if implementation == "splash":
    return extend_splash(q, k, v, prompt_k, prompt_v, prompt_mask_BxL, mask_BxGxT, mesh)
  t = q.shape[2]
  own_BxGxTxS = jnp.tril(jnp.ones((t, t), bool))[None, None] & mask_BxGxT[:, :, None, :]
  prompt_allowed = prompt_mask_BxL
  if window is not None:  # a local layer sees the last `window` positions
    own_BxGxTxS = own_BxGxTxS & (positions_BxGxT[..., :, None] - positions_BxGxT[..., None, :]
                                 < window)
    behind_BxGxTxL = (positions_BxGxT[..., None]
                      - prompt_positions_BxL[:, None, None, :])
    prompt_allowed = prompt_mask_BxL[:, None, None, :] & (behind_BxGxTxL < window)
  return extend(q, k, v, prompt_k, prompt_v, prompt_allowed, own_BxGxTxS, implementation)


def attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, allowed_BxTxS, implementation: str):
  """Masked attention of T queries over S keys; out [B, T, H, D]."""
  if implementation == "cudnn":
    return fused_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, allowed_BxTxS, "cudnn")
  b, t, h, d = q_BxTxHxD.shape
  hk = k_BxSxKxD.shape[2]
  q = q_BxTxHxD.reshape(b, t, hk, h // hk, d)
  scores = jnp.einsum("btgrd,bsgd->bgrts", q, k_BxSxKxD).astype(jnp.float32) * d ** -0.5
  scores = jnp.where(allowed_BxTxS[:, None, None], scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxD.dtype)
  return jnp.einsum("bgrts,bsgd->btgrd", probs, v_BxSxKxD).reshape(b, t, h, d)


def extend(q, k, v, prompt_k, prompt_v, prompt_mask_BxL, own_BxGxTxS, implementation: str):
  """G samples' T new tokens per prompt (q [B, G, T, H, D], k/v [B, G, T, H_kv, D]) over
  their prompt's K/V ([B, H_kv, L, D], the cache layout) and causally over themselves
  (own_BxGxTxS); out [B, G, T, H, D]. prompt_mask_BxL: the prompt keys every new token
  sees, or per token [B, G, T, L] (a sliding window).

  "xla": heads laid out [B, Hkv, G, R, T, D] so the prompt scores are one batched matmul
  per (prompt, kv head) with G*R*T rows, no prompt copied G times. Both score blocks are
  shifted by their joint row max (held constant for the gradient, exact because softmax is
  shift-invariant) and normalised by the summed exponentials. Measured on the small preset
  update: 1.07x faster than the concatenated softmax, same loss.
  """
  if implementation == "cudnn":
    return _extend_fused(q, k, v, prompt_k, prompt_v, prompt_mask_BxL, own_BxGxTxS,
                         implementation)
  b, g, t, h, d = q.shape
  hk = k.shape[3]
  r = h // hk
  q_BKGRTD = q.reshape(b, g, t, hk, r, d).transpose(0, 3, 1, 4, 2, 5)
  k_BKGSD = k.transpose(0, 3, 1, 2, 4)
  v_BKGSD = v.transpose(0, 3, 1, 2, 4)
  scale = d ** -0.5
  s_prompt = jnp.einsum("bkmd,bkpd->bkmp", q_BKGRTD.reshape(b, hk, g * r * t, d),
                        prompt_k).astype(jnp.float32) * scale
  s_prompt = s_prompt.reshape(b, hk, g, r, t, -1)
  seen = (prompt_mask_BxL[:, None, None, None, None, :] if prompt_mask_BxL.ndim == 2
          else prompt_mask_BxL[:, None, :, None])  # [B, 1, G, 1, T, L]
  s_prompt = jnp.where(seen, s_prompt, _NEG)
  s_own = jnp.einsum("bkgrtd,bkgsd->bkgrts", q_BKGRTD, k_BKGSD).astype(jnp.float32) * scale
  s_own = jnp.where(own_BxGxTxS[:, None, :, None], s_own, _NEG)
  row_max = jax.lax.stop_gradient(jnp.maximum(s_prompt.max(-1, keepdims=True),
                                              s_own.max(-1, keepdims=True)))
  e_prompt = jnp.exp(s_prompt - row_max)
  e_own = jnp.exp(s_own - row_max)
  denom = e_prompt.sum(-1, keepdims=True) + e_own.sum(-1, keepdims=True)
  o = (jnp.einsum("bkmp,bkpd->bkmd", (e_prompt / denom).astype(v.dtype).reshape(
      b, hk, g * r * t, -1), prompt_v).reshape(b, hk, g, r, t, d)
       + jnp.einsum("bkgrts,bkgsd->bkgrtd", (e_own / denom).astype(v.dtype), v_BKGSD))
  o = o.transpose(0, 2, 4, 1, 3, 5)  # [B,G,T,Hkv,R,D]
  return o.reshape(b, g, t, h, d)


def extend_splash(q, k, v, prompt_k, prompt_v, prompt_mask_BxL, mask_BxGxT, mesh=None):
  """`extend` through splash attention: each sample's T queries over [its prompt | itself]
  (L + T keys, each sample with its own copy of its prompt's K/V, as _extend_fused), query t
  seeing the prompt's real keys and its own real keys up to t (causal offset L); no [B, G,
  T, S] mask is built. q [B, G, T, H, D], k/v [B, G, T, H_kv, D], prompt_k/v [B, H_kv, L,
  D]; out [B, G, T, H, D]."""
  b, g, t, h, d = q.shape
  p = prompt_mask_BxL.shape[-1]
  keys = _with_prompt(prompt_k, k).reshape(b * g, p + t, -1, d)
  values = _with_prompt(prompt_v, v).reshape(b * g, p + t, -1, d)
  kv_segment = jnp.concatenate([jnp.broadcast_to(prompt_mask_BxL[:, None], (b, g, p)),
                                mask_BxGxT], axis=-1).reshape(b * g, p + t)
  o = splash(q.reshape(b * g, t, h, d), keys, values, jnp.ones((b * g, t), jnp.int32),
             kv_segment, p, mesh)
  return o.reshape(b, g, t, h, d)


def _with_prompt(prompt_BxKxLxD, own_BxGxTxKxD):
  """Each sample's key (or value) sequence [its prompt | its own], [B, G, L + T, H_kv, D]:
  the prompt's copy per sample that a fused kernel's one key sequence needs."""
  prompt_BxLxKxD = prompt_BxKxLxD.transpose(0, 2, 1, 3)
  prompt = jnp.broadcast_to(prompt_BxLxKxD[:, None],
                            own_BxGxTxKxD.shape[:2] + prompt_BxLxKxD.shape[1:])
  return jnp.concatenate([prompt.astype(own_BxGxTxKxD.dtype), own_BxGxTxKxD], axis=2)


def _extend_fused(q, k, v, prompt_k, prompt_v, prompt_mask_BxL, own_BxGxTxS,
                  implementation: str):
  """`extend` through one fused attention per sample over [prompt | own] keys. The fused
  kernel takes one key sequence, so each sample gets its own copy of its prompt's K/V
  (B*G*L*H_kv*D values per layer, small beside the [B, H, T, L + T] scores it saves)."""
  b, g, t, h, d = q.shape
  p = prompt_mask_BxL.shape[-1]
  keys, values = _with_prompt(prompt_k, k), _with_prompt(prompt_v, v)
  seen = prompt_mask_BxL[:, None, None] if prompt_mask_BxL.ndim == 2 else prompt_mask_BxL
  allowed = jnp.concatenate([jnp.broadcast_to(seen, (b, g, t, p)), own_BxGxTxS], axis=-1)
  o = fused_attention(q.reshape(b * g, t, h, d), keys.reshape(b * g, p + t, -1, d),
                      values.reshape(b * g, p + t, -1, d), allowed.reshape(b * g, t, p + t),
                      implementation)
  return o.reshape(b, g, t, h, d)


def rope_frequencies(cfg, d: int, local: bool = False):
  """inv_freq_i = theta^(-2i/d), then the scaling when rope_scaling_factor > 0 (cfg: a
  model.ModelConfig): Llama 3's, or linear (inv_freq / factor, Gemma 3's global layers).
  local: a sliding-window layer's (base rope_local_theta, never scaled).

  The scaling is transformers' `_compute_llama3_parameters`: wavelengths longer than
  original_max / low_freq_factor are divided by the factor, shorter than original_max /
  high_freq_factor are kept, and the band between is interpolated.
  """
  theta = (cfg.rope_local_theta or cfg.rope_theta) if local else cfg.rope_theta
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  factor = cfg.rope_scaling_factor
  if local or not factor:
    return inv_freq
  if cfg.rope_scaling_type == "linear":
    return inv_freq / factor
  low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old_len = cfg.rope_original_max_positions
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
  return jnp.where(medium, smoothed, scaled)


def rope(x, positions, inv_freq):
  """Rotary embedding, Hugging Face "rotate_half" convention (first half / second half).

  x: [..., T, H, D] (or [..., H, D] with positions [...]); positions broadcast over heads.
  """
  d = x.shape[-1]
  angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [..., 1, D/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


@config_checks.register(order=33)
def _check_config(c, num_devices: int) -> None:
  """cuDNN's fused attention: a GPU and half-precision compute (else jax fails deep inside
  the first compilation); splash: not on a GPU."""
  del num_devices
  m = c.model
  if m.attention == "splash" and jax.default_backend() == "gpu":
    config_checks.fail("model.attention", m.attention, "None, 'cudnn' or 'xla' on gpu (splash "
                       "is a TPU kernel; on CPU it runs in Pallas' interpret mode, for tests)")
  if m.attention != "cudnn":
    return
  if jax.default_backend() != "gpu":
    config_checks.fail("model.attention", m.attention, f"None or 'xla' on {jax.default_backend()} "
          "(cuDNN's fused attention needs a GPU)")
  if m.dtype != "bfloat16":
    config_checks.fail("model.attention", m.attention, f"None or 'xla' with model.dtype={m.dtype!r} "
          "(cuDNN's flash attention takes bfloat16)")


@config_checks.register_model(order=10)
def _check_window(c, model_cfg) -> None:
  """Splash takes no sliding window: a model with windowed layers (Gemma 3) is refused it."""
  if model_cfg.sliding_window and c.model.attention == "splash":
    config_checks.fail("model.attention", "splash", "None (xla on TPU for such a model), "
                       "'xla', or 'cudnn' on a GPU", reason=(
                           f"the model has sliding-window layers (window "
                           f"{model_cfg.sliding_window}), which the splash kernels here do "
                           "not take"))

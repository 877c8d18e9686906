"""The sampler's decode step: one new token for each of G samples of B prompts, in few ops.

`decoder.Decoder` is the reference implementation of the network; this module computes the
same function of the same parameters for the one place where speed is everything, the
token-by-token loop of the sampler. On CPU every op inside that loop costs a few
microseconds of dispatch on top of its work, and the matmuls are tiny (B*G rows), so the
number of ops per token decides the speed (BENCHMARKS.md has the figures). Here:

  * the weights are rearranged once per sampler call (`prepare`), outside the loop: q, k
    and v are one matmul ([d_model, H_kv, r + 2, head_dim]: each KV head's r query heads,
    its key and its value side by side, which keeps a KV-head sharding intact), and a tied
    output head is the embedding array itself, cast once. Gate and up are two matmuls,
    not one stacked [2 * mlp, d_model] one: at 32 rows YNNPACK splits the stacked one over
    both threads, and waking and joining the second thread cost more than it saves (tiny
    preset: 158 us against 2 x 47 us on one thread; the sampler 1.08-1.13x slower per call;
    small: the same either way; BENCHMARKS.md);
  * QK-norm and RoPE run on q and k together; the rotation angles are computed once per
    token for all layers, and the rotation pairs the two halves of each head by reversing a
    size-2 axis, not by slicing and concatenating (a concatenation per layer);
  * the embedding is used as stored, [V, d_model] (a row gather per token, no transposed
    copy per call), and the output projection is one 2-D matmul over [H_kv * r * D] inputs
    (as an einsum over [H_kv, r, D], XLA copied its weight into a new layout every token);
  * the caches are laid out so each attention contraction is a plain batched matmul with no
    transpose: prompt keys [B, H_kv, D, L] (stored transposed), prompt values
    [B, H_kv, L, D], and the samples' own keys [B, H_kv, G, D, T] and values
    [B, H_kv, G, T, D]. The prompt's keys and values are held once per prompt and read by
    all G samples: a prompt is never copied G times;
  * the softmax over [prompt | generated] keys is taken without concatenating them;
  * with `block` > 0 the generated keys are read a block of `block` slots at a time, only
    up to the block holding the current token, with an online softmax (Milakov and
    Gimelshein 2018; FlashAttention's rescaling): a step early in a long completion reads
    a few blocks, not all max_new_tokens slots. The program keeps static shapes (a loop
    with a dynamic trip count) and compiles once. 0 reads the whole cache and masks the
    unfilled slots.

A mixture of experts' MLP is the training forward's own call (`decoder.experts_layer` on the
rows, [N, d_model]: one routing for the sampler and the update); Gemma 3's local layers take
their window as data (the prompt's keys and the generated slots more than window - 1
positions behind the token are masked) and their own RoPE angles, chosen per layer.

tests/test_decode.py pins every variant (GQA, QK-norm, biases, untied head, Llama 3 RoPE,
Gemma 3's window and norms, bfloat16) to `model.forward`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxgrpo.model import attention as attention_lib
from jaxgrpo.model import decoder as model_lib

_NEG = -1e30  # as in attention.py: finite, so a fully masked row cannot produce NaN


class Layer(NamedTuple):
  """One block's weights, transposed for feature-major activations (compute dtype)."""

  attn_norm: jax.Array   # [d_model, 1]
  qkv: jax.Array         # [H_kv, r + 2, D, d_model]: r query heads, then key, then value
  qkv_bias: jax.Array | None  # [H_kv, r + 2, D, 1, 1] (Qwen2) or None
  qk_norm: jax.Array | None   # [r + 1, D, 1, 1]: q_norm for the r query rows, k_norm for the key
  out: jax.Array         # [d_model, H_kv * r * D]
  mlp_norm: jax.Array    # [d_model, 1]
  gate: jax.Array        # [mlp, d_model]; a mixture's: [E, d_model, F] as stored
  up: jax.Array          # [mlp, d_model]; a mixture's: [E, d_model, F]
  down: jax.Array        # [d_model, mlp]; a mixture's: [E, F, d_model]
  router: jax.Array | None = None  # a mixture's router [d_model, E] (moe.py), else None
  post_attn_norm: jax.Array | None = None  # [d_model, 1]: Gemma's norms of the sublayers'
  post_mlp_norm: jax.Array | None = None   # outputs (decoder.Block), else None


class Weights(NamedTuple):
  embedding: jax.Array   # [V, d_model]
  layers: tuple          # of Layer
  final_norm: jax.Array  # [d_model, 1]
  head: jax.Array        # [V, d_model]
  inv_freq: jax.Array    # [D / 2, 1, 1] RoPE frequencies
  inv_freq_local: jax.Array | None = None  # a sliding-window layer's, where the model has them


class Cache(NamedTuple):
  """Per-layer tuples of keys and values; see the module docstring for the layouts."""

  prompt_k: tuple        # [B, H_kv, D, L]
  prompt_v: tuple        # [B, H_kv, L, D]
  prompt_bias: jax.Array  # [B, 1, 1, L]: 0 on real prompt tokens, -1e30 on left padding
  gen_k: tuple           # [B, H_kv, G, D, T]
  gen_v: tuple           # [B, H_kv, G, T, D]


def _prepare_layer(p, cfg: model_lib.ModelConfig) -> Layer:
  """One block's parameters rearranged for `step`."""
  dt = model_lib.DTYPES[cfg.dtype]
  hk, r, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
  col = lambda v: v[:, None]
  a, m = p["attn"], p["mlp"]
  q = a["q"].reshape(cfg.d_model, hk, r, d)
  qkv = jnp.concatenate([q, a["k"][:, :, None], a["v"][:, :, None]], axis=2)
  bias = None
  if cfg.qkv_bias:
    bias = jnp.concatenate([a["q_bias"].reshape(hk, r, d), a["k_bias"][:, None],
                            a["v_bias"][:, None]], axis=1).astype(dt)[..., None, None]
  norm = None
  if cfg.qk_norm:
    norm = jnp.concatenate([jnp.broadcast_to(a["q_norm"]["scale"], (r, d)),
                            a["k_norm"]["scale"][None]], axis=0)[..., None, None]
  if cfg.num_experts:  # the experts as the training forward holds them (moe.py)
    mlp = dict(gate=m["gate"].astype(dt), up=m["up"].astype(dt), down=m["down"].astype(dt),
               router=m["router"])
  else:
    mlp = dict(gate=m["gate"].T.astype(dt), up=m["up"].T.astype(dt), down=m["down"].T.astype(dt))
  if cfg.post_norms:
    mlp.update(post_attn_norm=col(p["post_attn_norm"]["scale"]),
               post_mlp_norm=col(p["post_mlp_norm"]["scale"]))
  return Layer(
      attn_norm=col(p["attn_norm"]["scale"]), qkv=qkv.transpose(1, 2, 3, 0).astype(dt),
      qkv_bias=bias, qk_norm=norm, out=a["o"].reshape(hk * r * d, cfg.d_model).T.astype(dt),
      mlp_norm=col(p["mlp_norm"]["scale"]), **mlp)


def prepare(params, cfg: model_lib.ModelConfig, stacked: bool = False, mesh=None) -> Weights:
  """Rearranges Decoder parameters for `step` (once per sampler call, outside the loop).

  stacked=False: `layers` is a tuple of Layer (the step unrolls the layers); True: one
  Layer whose arrays carry a leading [num_layers] axis (the step scans over them).

  mesh: the sampler's. On a mesh that splits only rows (data, fsdp: no tensor or expert
  axis) the arranged weights are made whole on every chip here, once per call: every chip
  decodes its own rows with every weight, and weights left split by fsdp were all-gathered
  layer by layer in every token-step instead (Qwen2.5-7B on v5p:2x2x2: 46 ms of a 67 ms
  predicted token-step, and the gathered copies' HBM traffic; issue 62). The cost is the
  weights in the compute dtype resident on each chip while sampling, which the compile
  check's sampler totals include. Tensor- or expert-split weights keep their split.
  """
  dt = model_lib.DTYPES[cfg.dtype]
  if stacked:
    layers = jax.vmap(lambda p: _prepare_layer(p, cfg))(params["layers"])
  else:  # the stacked layers, sliced (static indices: no copy)
    layers = tuple(_prepare_layer(jax.tree.map(lambda a, i=i: a[i], params["layers"]), cfg)
                   for i in range(cfg.num_layers))
  # Tied: one cast array serves as both the embedding and the head (both [V, d_model]).
  embedding = params["embedding"].astype(dt)
  head = embedding if cfg.tie_embeddings else params["lm_head"].T.astype(dt)
  local = None
  if cfg.sliding_window:
    local = attention_lib.rope_frequencies(cfg, cfg.head_dim, local=True)[:, None, None]
  w = Weights(embedding=embedding, layers=layers,
              final_norm=params["final_norm"]["scale"][:, None], head=head,
              inv_freq=attention_lib.rope_frequencies(cfg, cfg.head_dim)[:, None, None],
              inv_freq_local=local)
  if mesh is not None and mesh.shape["tensor"] == 1 and mesh.shape["expert"] == 1:
    w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, PartitionSpec()))
  return w


def init_cache(prompt_k, prompt_v, prompt_mask_BxL, cfg: model_lib.ModelConfig,
               num_samples: int, max_new_tokens: int, stacked: bool = False,
               block: int = 0) -> Cache:
  """The cache after prefill: prefill's per-layer K/V, tuples of [B, H_kv, L, D].

  stacked: the prefill's K/V stacked, [num_layers, B, H_kv, L, D] (sampling.prefill with
  stacked_kv), and each field one array with a leading [num_layers] axis instead of a
  tuple (for `prepare(stacked=True)`). block: `step`'s key block; the generated slots are
  rounded up to whole blocks (the extra slots are never written, never attended)."""
  dt = model_lib.DTYPES[cfg.dtype]
  b, hk, d = prompt_mask_BxL.shape[0], cfg.num_kv_heads, cfg.head_dim
  g, t = num_samples, gen_slots(max_new_tokens, block)
  bias = jnp.where(prompt_mask_BxL, 0.0, _NEG).astype(jnp.float32)[:, None, None]
  if stacked:
    num = cfg.num_layers
    return Cache(prompt_k=jnp.swapaxes(prompt_k, 3, 4).astype(dt), prompt_v=prompt_v.astype(dt),
                 prompt_bias=bias, gen_k=jnp.zeros((num, b, hk, g, d, t), dt),
                 gen_v=jnp.zeros((num, b, hk, g, t, d), dt))
  return Cache(
      prompt_k=tuple(k.transpose(0, 1, 3, 2).astype(dt) for k in prompt_k),
      prompt_v=tuple(v.astype(dt) for v in prompt_v), prompt_bias=bias,
      gen_k=tuple(jnp.zeros((b, hk, g, d, t), dt) for _ in prompt_k),
      gen_v=tuple(jnp.zeros((b, hk, g, t, d), dt) for _ in prompt_v))


def gen_slots(max_new_tokens: int, block: int = 0) -> int:
  """Generated-token slots in the cache: max_new_tokens, rounded up to whole key blocks."""
  return -(-max_new_tokens // block) * block if block else max_new_tokens


def blocks_read(i, block: int):
  """Key blocks of generated slots a step at slot i reads: those up to the one holding i."""
  return i // block + 1


def _norm(x, scale, cfg: model_lib.ModelConfig, axis: int = 0):
  """model.rms_norm over `axis` (features run down the columns here)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + cfg.norm_eps)
  return (x32 * model_lib.norm_scale(scale, cfg)).astype(model_lib.DTYPES[cfg.dtype])


def _rope(x, cos2, sin2):
  """Hugging Face's rotate-half RoPE (attention.rope) along axis 2 of [H_kv, r+1, D, B, G]."""
  hk, r1, d, b, g = x.shape
  x6 = x.astype(jnp.float32).reshape(hk, r1, 2, d // 2, b, g)
  return (x6 * cos2 + jnp.flip(x6, axis=2) * sin2).reshape(x.shape).astype(x.dtype)


def _at_slot(i, shape, axis: int):
  """Where generated-token slot `i` sits in an array of `shape` whose `axis` runs over the
  slots: i is one step for every row (the sampler), or one per row [B] (JetStream's
  continuous batching, where each slot is at its own step). Returns (slots [T] broadcast
  along `axis`, i broadcast to match)."""
  view = [1] * len(shape)
  view[axis] = shape[axis]
  slots = jnp.arange(shape[axis]).reshape(view)
  if jnp.ndim(i) == 0:
    return slots, i
  return slots, jnp.reshape(i, (-1,) + (1,) * (len(shape) - 1))


def _write(buffer, new, i, axis: int, layer=None):
  """buffer with `new` (size 1 along `axis`) written at slot i (scalar, or one per row).
  layer: the buffer carries a leading [num_layers] axis and `new` is that layer's (the
  stacked decode step); `axis` then counts from after it."""
  lead = () if layer is None else (layer,)
  if jnp.ndim(i) == 0:  # one dynamic slice: the sampler's hot loop
    if layer is None:
      return jax.lax.dynamic_update_slice_in_dim(buffer, new, i, axis=axis)
    start = [layer] + [0] * new.ndim
    start[1 + axis] = i
    return jax.lax.dynamic_update_slice(buffer, new[None], start)
  # One slot per row: a scatter, in place, of the rows' own slots; a slot past the end is
  # dropped (an episode's turn may sample past its room: episodes.py cuts those tokens).
  index = [slice(None)] * new.ndim
  index[0], index[axis] = jnp.arange(new.shape[0]), i
  return buffer.at[lead + tuple(index)].set(jnp.squeeze(new, axis), mode="drop")


def _attend(q_BxKxGxRxD, layer_k, layer_v, prompt_k, prompt_v, prompt_bias, i,
            block: int = 0, window=None, layer=None):
  """Softmax over the prompt's and the samples' own keys, without concatenating them.
  window: a sliding-window layer's (the prompt's keys beyond it already in prompt_bias):
  the generated slots more than window - 1 behind slot i are not seen either. layer: the
  layer whose keys and values layer_k and layer_v hold when they are the stacked caches
  [num_layers, ...] (read where they lie, never copied out first); None: one layer's."""
  b, hk, g, r, d = q_BxKxGxRxD.shape
  f32 = jnp.float32
  s_prompt = jnp.einsum("bkmd,bkdp->bkmp", q_BxKxGxRxD.reshape(b, hk, g * r, d),
                        prompt_k, preferred_element_type=f32) + prompt_bias
  s_prompt = s_prompt.reshape(b, hk, g, r, -1)
  if block:
    return _attend_blocks(q_BxKxGxRxD, layer_k, layer_v, prompt_v, s_prompt, i, block,
                          window, layer)
  if layer is not None:
    layer_k, layer_v = layer_k[layer], layer_v[layer]
  s_gen = jnp.einsum("bkgrd,bkgdt->bkgrt", q_BxKxGxRxD, layer_k, preferred_element_type=f32)
  slots, at = _at_slot(i, s_gen.shape, s_gen.ndim - 1)
  seen = slots <= at
  if window is not None:
    seen = seen & (at - slots < window)
  s_gen = jnp.where(seen, s_gen, _NEG)
  top = jnp.maximum(jnp.max(s_prompt, axis=-1, keepdims=True),
                    jnp.max(s_gen, axis=-1, keepdims=True))
  e_prompt, e_gen = jnp.exp(s_prompt - top), jnp.exp(s_gen - top)
  total = jnp.sum(e_prompt, axis=-1, keepdims=True) + jnp.sum(e_gen, axis=-1, keepdims=True)
  dt = layer_v.dtype
  o = (jnp.einsum("bkmp,bkpd->bkmd", e_prompt.reshape(b, hk, g * r, -1).astype(dt),
                  prompt_v, preferred_element_type=f32).reshape(b, hk, g, r, d)
       + jnp.einsum("bkgrt,bkgtd->bkgrd", e_gen.astype(dt), layer_v,
                    preferred_element_type=f32))
  return (o / total).astype(dt)


def _attend_blocks(q_BxKxGxRxD, layer_k, layer_v, prompt_v, s_prompt, i, block: int,
                   window=None, layer=None):
  """_attend with the generated keys read block by block up to slot i (online softmax):
  the running max m, sum l and output acc start from the prompt's keys, and each block
  rescales them by exp(m_old - m_new). i: one slot for every row, or one per row [B]
  (partial rollouts' rows, each at its own step): the blocks up to the furthest row's are
  read, and each row sees its own slots only. Each block is sliced from the stacked caches
  directly when `layer` is given: slicing the layer out first materialised a copy of it
  every token-step (the 16k preset's step read 3x its floor; issue 62)."""
  b, hk, g, r, d = q_BxKxGxRxD.shape
  f32, dt = jnp.float32, layer_v.dtype
  m = jnp.max(s_prompt, axis=-1, keepdims=True)
  e = jnp.exp(s_prompt - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  acc = jnp.einsum("bkmp,bkpd->bkmd", e.reshape(b, hk, g * r, -1).astype(dt), prompt_v,
                   preferred_element_type=f32).reshape(b, hk, g, r, d)

  def one_block(j, carry):
    m, l, acc = carry
    start = j * block
    k_blk = _slots(layer_k, layer, start, block, axis=4)  # [b,hk,g,d,blk]
    v_blk = _slots(layer_v, layer, start, block, axis=3)  # [b,hk,g,blk,d]
    s = jnp.einsum("bkgrd,bkgdt->bkgrt", q_BxKxGxRxD, k_blk, preferred_element_type=f32)
    slots, at = _at_slot(i, s.shape, s.ndim - 1)
    slots = start + slots
    seen = slots <= at
    if window is not None:
      seen = seen & (at - slots < window)
    s = jnp.where(seen, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    scale, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
    l = l * scale + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * scale + jnp.einsum("bkgrt,bkgtd->bkgrd", p.astype(dt), v_blk,
                                   preferred_element_type=f32)
    return m_new, l, acc

  # As a fori_loop to blocks_read(i, block), with the cache's block count in the condition
  # too (never the smaller): the compiled loop then carries its bound (runtime/tpu_cost).
  n, total = blocks_read(jnp.max(i), block), layer_v.shape[-2] // block
  _, (m, l, acc) = jax.lax.while_loop(lambda c: (c[0] < n) & (c[0] < total),
                                      lambda c: (c[0] + 1, one_block(c[0], c[1])),
                                      (jnp.int32(0), (m, l, acc)))
  return (acc / l).astype(dt)


def _slots(cache, layer, start, size: int, axis: int):
  """Generated slots start .. start + size along `axis` (a layer's: 4 for the keys
  [B, H_kv, G, D, T], 3 for the values [B, H_kv, G, T, D]) of one layer's cache, or of
  layer `layer` of the stacked caches [num_layers, ...], as one slice."""
  if layer is None:
    return jax.lax.dynamic_slice_in_dim(cache, start, size, axis=axis)
  starts, sizes = [layer] + [0] * (cache.ndim - 1), [1, *cache.shape[1:]]
  starts[1 + axis], sizes[1 + axis] = start, size
  return jax.lax.dynamic_slice(cache, starts, sizes)[0]


def step(w: Weights, cfg: model_lib.ModelConfig, tokens_BxG, positions_B, i, cache: Cache,
         block: int = 0, mesh=None):
  """Logits [B, G, V] (float32) for the tokens fed at decode step i, and the cache with
  their keys and values written at slot i. All G samples of prompt b sit at
  positions_B[b] (prompt length + i - 1). i is a scalar (every row at the same step, the
  sampler) or one step per row, i_B (the JetStream adapter's slots, partial rollouts'
  rows). block > 0 (the cache made with the same block): read the generated keys a block
  at a time, up to slot i's block, the furthest row's for i_B (see the module docstring). mesh: the sampler's, on which a mixture's
  experts run expert-parallel (decoder.experts_layer).

  Activations are feature-major, x [d_model, N] with N = B*G rows as columns, so every
  projection is weight @ activations: XLA's CPU matmul measured up to 3x faster with the
  large weight on the left than `x @ W` for 32 rows (BENCHMARKS.md).
  """
  # Named so the compiled program's ops say which belong to a token-step (runtime/tpu_cost:
  # the compile check's bytes and time per decode step).
  with jax.named_scope("decode_step"):
    return _step(w, cfg, tokens_BxG, positions_B, i, cache, block, mesh)


def _step(w: Weights, cfg: model_lib.ModelConfig, tokens_BxG, positions_B, i, cache: Cache,
          block: int, mesh):
  b, g = tokens_BxG.shape
  hk, r, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
  f32 = jnp.float32
  x = model_lib.embed(w.embedding, tokens_BxG.reshape(-1), cfg).T  # [d_model, N]

  def rotation(inv_freq):
    angles = inv_freq * positions_B.astype(f32)[None, :, None]  # [D/2, B, 1]
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # shared by all layers
    # [2, D/2, B, 1]: both halves' factors, so `_rope` needs no concatenation. Built by
    # stacking, which materialises them once per token: as broadcasts XLA fused cos and
    # sin into every layer's RoPE and recomputed them per element (tiny sampler 1.13x
    # slower).
    return jnp.stack([cos, cos]), jnp.stack([-sin, sin])

  cos2, sin2 = rotation(w.inv_freq)
  q_scale = d ** -0.5 * model_lib.query_factor(cfg)
  if cfg.sliding_window:  # the local layers' rotation, and what their window hides
    cos2_local, sin2_local = rotation(w.inv_freq_local)
    prompt_mask_BxL = cache.prompt_bias[:, 0, 0] == 0.0
    behind_BxL = positions_B[:, None] - model_lib.positions_from_mask(prompt_mask_BxL)
    prompt_bias_local = cache.prompt_bias + jnp.where(
        behind_BxL < cfg.sliding_window, 0.0, _NEG)[:, None, None]

  def layer_step(l, layer: Layer, x, prompt_k, prompt_v, write):
    """One block (layer l): x [d_model, N] -> x, and the caches `write(k, v)` carries on
    after it stored this token's key [B, H_kv, G, D] and value; write also says what to
    attend over: (keys, values, the layer index into them when they are the stacked
    caches, else None)."""
    h = jnp.einsum("ksem,mn->ksen", layer.qkv, _norm(x, layer.attn_norm, cfg))
    h = h.reshape(hk, r + 2, d, b, g)
    if layer.qkv_bias is not None:
      h = h + layer.qkv_bias
    qk, v = h[:, : r + 1], h[:, r + 1]
    if layer.qk_norm is not None:  # Qwen3 normalises each head before the rotation
      qk = _norm(qk, layer.qk_norm, cfg, axis=2)
    rot, bias, window = (cos2, sin2), cache.prompt_bias, None
    if cfg.sliding_window:
      local = model_lib.is_local(l, cfg)
      rot = tuple(jnp.where(local, a, b) for a, b in zip((cos2_local, sin2_local), rot))
      bias = jnp.where(local, prompt_bias_local, bias)
      window = model_lib.layer_window(l, cfg)
    qk = _rope(qk, *rot)
    q = (qk[:, :r] * q_scale).transpose(3, 0, 4, 1, 2)   # [B, H_kv, G, r, D]
    k = qk[:, r].transpose(2, 0, 3, 1)                     # [B, H_kv, G, D]
    v = v.transpose(2, 0, 3, 1)
    caches, (layer_k, layer_v, index) = write(k, v)
    o = _attend(q, layer_k, layer_v, prompt_k, prompt_v, bias, i, block, window, index)
    h = layer.out @ o.transpose(1, 3, 4, 0, 2).reshape(hk * r * d, b * g)
    x = x + (h if layer.post_attn_norm is None else _norm(h, layer.post_attn_norm, cfg))
    xn = _norm(x, layer.mlp_norm, cfg)
    if layer.router is not None:  # the training forward's own mixture call, rows [N, d]
      h = model_lib.experts_layer(xn.T, layer.router, layer.gate, layer.up, layer.down,
                                  cfg, mesh)[0].T
    else:
      h = layer.down @ (model_lib.ACTIVATIONS[cfg.hidden_act](layer.gate @ xn) * (layer.up @ xn))
    x = x + (h if layer.post_mlp_norm is None else _norm(h, layer.post_mlp_norm, cfg))
    return x, caches

  if isinstance(w.layers, Layer):  # stacked (prepare(stacked=True)): one compiled block
    def body(carry, xs):
      x, gen_k, gen_v = carry
      l, layer, prompt_k, prompt_v = xs

      def write(k, v):
        # This token's slot written into the carried caches first (in place), and layer l
        # read from the written ones: nothing reads the caches from before the write, so
        # XLA updates them in place and reads the layer where it lies. Reading gen_k[l]
        # before writing kept the old buffer alive: the compiled TPU program copied the
        # whole stacked cache twice per layer per token (issue 62).
        new_k = _write(gen_k, k[..., None], i, axis=4, layer=l)
        new_v = _write(gen_v, v[:, :, :, None], i, axis=3, layer=l)
        return (new_k, new_v), (new_k, new_v, l)

      x, (gen_k, gen_v) = layer_step(l, layer, x, prompt_k, prompt_v, write)
      return (x, gen_k, gen_v), None

    (x, gen_k, gen_v), _ = jax.lax.scan(
        body, (x, cache.gen_k, cache.gen_v),
        (jnp.arange(cfg.num_layers), w.layers, cache.prompt_k, cache.prompt_v))
    cache = cache._replace(gen_k=gen_k, gen_v=gen_v)
  else:
    gen_k, gen_v = [], []
    for l, layer in enumerate(w.layers):
      def write(k, v, l=l):
        layer_k = _write(cache.gen_k[l], k[..., None], i, axis=4)
        layer_v = _write(cache.gen_v[l], v[:, :, :, None], i, axis=3)
        return (layer_k, layer_v), (layer_k, layer_v, None)

      x, (layer_k, layer_v) = layer_step(l, layer, x, cache.prompt_k[l], cache.prompt_v[l],
                                         write)
      gen_k.append(layer_k)
      gen_v.append(layer_v)
    cache = cache._replace(gen_k=tuple(gen_k), gen_v=tuple(gen_v))
  # [V, N], then a transpose behind a barrier: when XLA folds the transpose into the matmul
  # it picks a slower CPU matmul kernel (0.8 ms instead of ~0.3 per token on the small preset).
  logits_VxN = jax.lax.optimization_barrier(w.head @ _norm(x, w.final_norm, cfg))
  logits = logits_VxN.astype(f32).T
  return logits.reshape(b, g, -1), cache


def extend(params, cfg: model_lib.ModelConfig, tokens_NxE, new_len_N, slot_N, cache: Cache,
           stacked: bool = False, attention: str = "xla", mesh=None):
  """Appends new tokens to a cache of one sample per row (G = 1), one prefill of them at each
  row's own place: row n's first new_len_N[n] tokens of tokens_NxE go to its generated slots
  slot_N[n], slot_N[n] + 1, ... at positions prompt length + slot, each attending to the
  row's prompt, its generated slots before slot_N[n] and, causally, the new tokens before
  it (decoder.Block.extend: the training forward's layers, on raw parameters). Returns the
  logits [N, V] (float32) after each row's last new token (a row with none gets those of
  its pad) and the cache with the new tokens' keys and values written (slots past the end
  are dropped).

  Multi-turn episodes (episodes.py) append each observation this way, with the turn's last
  sampled token (the decode loop never feeds it), instead of prefilling the whole context
  again. params: the Decoder's; stacked: the cache's fields carry a leading layer axis;
  mesh: the program's (a splash kernel's shard_map).
  """
  n, e = tokens_NxE.shape
  dt = model_lib.DTYPES[cfg.dtype]
  prompt_mask_NxL = cache.prompt_bias[:, 0, 0] == 0.0
  slots = (cache.gen_k if stacked else cache.gen_k[0]).shape[-1]
  j_E = jnp.arange(e, dtype=jnp.int32)
  positions_NxE = (jnp.sum(prompt_mask_NxL, -1).astype(jnp.int32) + slot_N)[:, None] + j_E
  new_NxE = j_E < new_len_N[:, None]
  # What the new tokens see besides themselves: [prompt | generated slots before slot_N].
  seen_NxS = jnp.concatenate([prompt_mask_NxL, jnp.arange(slots) < slot_N[:, None]], axis=1)
  # Where each new token's K/V go; a pad's slot is out of range, so the scatter drops it.
  write_NxE = jnp.where(new_NxE, slot_N[:, None] + j_E, slots)
  rows_Nx1 = jnp.arange(n)[:, None]
  block = model_lib.Block(cfg, attention, mesh)
  x = model_lib.embed(params["embedding"], tokens_NxE, cfg)[:, None]  # [N, 1, E, d]
  # The seen keys' positions: the prompt's from its mask, slot s at prompt length + s (a
  # local layer's window).
  seen_pos_NxS = jnp.concatenate([
      model_lib.positions_from_mask(prompt_mask_NxL),
      jnp.sum(prompt_mask_NxL, -1).astype(jnp.int32)[:, None] + jnp.arange(slots)], axis=1)

  def layer(l, x, p, prompt_k, prompt_v, gen_k, gen_v):
    """One block over the new tokens: x, and their keys and values [N, E, H_kv, D]."""
    seen_k = jnp.concatenate([jnp.swapaxes(prompt_k, 2, 3), jnp.swapaxes(gen_k[:, :, 0], 2, 3)],
                             axis=2)  # [N, H_kv, S, D]
    seen_v = jnp.concatenate([prompt_v, gen_v[:, :, 0]], axis=2)
    x, (k, v) = block.apply({"params": p}, x, positions_NxE[:, None], seen_k, seen_v, seen_NxS,
                            new_NxE[:, None], True, l, seen_pos_NxS,
                            method=model_lib.Block.extend)
    return x, k[:, 0].astype(gen_k.dtype), v[:, 0].astype(gen_v.dtype)

  if stacked:
    def body(carry, xs):
      x, gen_k, gen_v = carry
      l, p, prompt_k, prompt_v = xs
      x, k, v = layer(l, x, p, prompt_k, prompt_v, gen_k[l], gen_v[l])
      gen_k = gen_k.at[l, rows_Nx1, :, 0, :, write_NxE].set(k, mode="drop")
      gen_v = gen_v.at[l, rows_Nx1, :, 0, write_NxE, :].set(v, mode="drop")
      return (x, gen_k, gen_v), None

    (x, gen_k, gen_v), _ = jax.lax.scan(
        body, (x, cache.gen_k, cache.gen_v),
        (jnp.arange(cfg.num_layers), params["layers"], cache.prompt_k, cache.prompt_v))
  else:
    gen_k, gen_v = [], []
    for l in range(cfg.num_layers):
      p = jax.tree.map(lambda a, l=l: a[l], params["layers"])
      x, k, v = layer(l, x, p, cache.prompt_k[l], cache.prompt_v[l], cache.gen_k[l],
                      cache.gen_v[l])
      gen_k.append(cache.gen_k[l].at[rows_Nx1, :, 0, :, write_NxE].set(k, mode="drop"))
      gen_v.append(cache.gen_v[l].at[rows_Nx1, :, 0, write_NxE, :].set(v, mode="drop"))
    gen_k, gen_v = tuple(gen_k), tuple(gen_v)
  last_NxD = jnp.take_along_axis(x[:, 0], jnp.maximum(new_len_N - 1, 0)[:, None, None],
                                 axis=1)[:, 0]
  head = (params["embedding"].T if cfg.tie_embeddings else params["lm_head"]).astype(dt)
  logits = model_lib.rms_norm(last_NxD, params["final_norm"]["scale"], cfg) @ head
  return logits.astype(jnp.float32), cache._replace(gen_k=gen_k, gen_v=gen_v)

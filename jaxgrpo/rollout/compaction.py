"""Compaction: finished rows stop costing the sampler.

`sampling.sample` decodes all N = B * G rows in one loop that runs until the longest row
ends, and computes every row at every step. With real completion lengths (long-tailed: most
rows end early, a few reach max_new_tokens) most of that work is on rows that already ended.
Compaction moves the live rows into a batch half as large whenever they fit in one, up to
`stages` times: bucket sizes N, N/2, N/4, ... (rounded up). Every stage is its own
`lax.while_loop` with static shapes, one after another inside the one compiled sampler, so
each profile still compiles once (a program with stages + 1 decode loops).

Layout. The first stage is the sampler's own: B prompts x G samples, each prompt's K/V held
once and read by its G samples (decode.Cache). A compacted stage holds M rows, each a prompt
with one sample (G = 1): its prompt's K/V, its generated K/V and its prompt length are
gathered from the previous stage when it starts, so `decode.step` runs unchanged. A row's
prompt K/V is then read once per row, not once per prompt: the bandwidth floor of
`python -m jaxgrpo.bench rollout` counts it that way too. Memory: the first copy is alive
beside the full cache while it is made; measured by the compiler, the sampler's temporaries
grow 1-6% with scanned layers and 6-20% unrolled on CPU, and 3.2 -> 3.5 GiB per chip for
configs/gsm8k.py's Qwen2.5-1.5B train sampler on v5e:2x4 (BENCHMARKS.md).

Rows stay on their device. The rows are split over the data-parallel devices in D
contiguous groups (D = mesh data x fsdp; 1 without a mesh), and compaction picks, in each
group, that group's live rows (a batched gather along the group's own axis): nothing moves
between devices. A stage ends when every group's live rows fit in the next bucket.

Reproducibility. A row's draws come from (key, row id, token index) alone (the uniforms are
drawn up front for every original row and step, and a compacted row reads its own), so its
tokens and log-probs do not depend on the slot it ran in or when it moved: compaction on and
off give the same rollout (tests/test_compaction.py).

Continuous batching (refilling finished slots with queued rows) was not chosen: a refilled
slot decodes at its own step, so every slot's cache write and attention mask is per row
(decode.step with i_B: a masked rewrite of the whole cache per token), which is what makes
the JetStream adapter 3.6x slower than this sampler on CPU (BENCHMARKS.md); compaction keeps
one step index for all rows (one dynamic-slice write, and `decode_block_size` still reads
only the filled blocks).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxgrpo.model import decode
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib


def bucket_sizes(rows_per_group: int, stages: int) -> tuple[int, ...]:
  """Rows per group in each stage: n, ceil(n / 2), ... (stages halvings, never below 1)."""
  sizes = [rows_per_group]
  while len(sizes) <= stages and sizes[-1] > 1:
    sizes.append(-(-sizes[-1] // 2))
  return tuple(sizes)


def max_live(done_N, groups: int):
  """The most live rows any group holds (rows in `groups` contiguous groups)."""
  return jnp.max(jnp.sum(~done_N.reshape(groups, -1), axis=1))


class Context(NamedTuple):
  """What every stage needs and never changes (closed over; arrays are traced values)."""

  weights: decode.Weights
  cfg: model_lib.ModelConfig
  draw: Callable        # (logits [D, M, V], u [D, M] or None, done [D, M]) -> (token,
                        # logp, raw), pad and zeros where done
  is_stop: Callable | None
  samples: int          # G of the first stage's layout
  groups: int           # D
  sizes: tuple          # bucket_sizes(...)
  max_new_tokens: int
  block: int
  stacked: bool
  mesh: object
  u_TxDxn: jax.Array | None  # every original row's uniforms, grouped
  prompt_len_Dxn: jax.Array  # every original row's prompt length, grouped
  # Multi-turn episodes (rollout/turns.py, G = 1): every original row's first generated
  # slot of this call, grouped (None: slot i - 1 for every row at step i); and whether the
  # full cache comes back with every stage's K/V written to their rows.
  offset_Dxn: jax.Array | None = None
  keep_cache: bool = False


class Stage(NamedTuple):
  """A compacted stage's loop state: M slots per group, each an original row."""

  i: jax.Array          # the step: the token written next sits at slot i
  token_DxM: jax.Array  # the token each slot feeds at step i
  done_DxM: jax.Array
  rows_DxM: jax.Array   # the slot's original row, its index within the group (0..n-1)
  prompt_len_DxM: jax.Array
  offset_DxM: jax.Array  # the row's first generated slot of the call (0 single-turn)
  cache: decode.Cache   # M * D rows, G = 1


def _take(x, idx_DxM, groups: int):
  """x's rows (axis 0, in `groups` contiguous groups) at idx_DxM, each group gathering its
  own: [groups * n, ..] -> [groups * M, ..]."""
  grouped = x.reshape(groups, -1, *x.shape[1:])
  out = jax.vmap(lambda xg, ig: jnp.take(xg, ig, axis=0))(grouped, idx_DxM)
  return out.reshape(-1, *x.shape[1:])


def _take_samples(x, prompt_DxM, sample_DxM, groups: int):
  """The generated K/V [B, H_kv, G, ..] of sample (prompt, sample) per slot, as
  [groups * M, H_kv, 1, ..]: one gather indexing both axes, never a transposed copy."""
  grouped = x.reshape(groups, -1, *x.shape[1:])
  out = jax.vmap(lambda xg, b, g: xg[b, :, g])(grouped, prompt_DxM, sample_DxM)
  return jnp.expand_dims(out.reshape(-1, *out.shape[2:]), 2)


def _per_layer(fn, field, stacked: bool):
  """fn on each layer's array: a tuple's entries, or a stacked array's leading axis (a vmap,
  so the layer axis stays in front without a transposed copy)."""
  return jax.vmap(fn)(field) if stacked else tuple(fn(x) for x in field)


def _compact_cache(cache: decode.Cache, idx_DxM, ctx: Context, first: bool) -> decode.Cache:
  """The cache of the slots idx_DxM picks. first: from the first stage's [B, .., G, ..]
  layout (slot row r is sample r % G of prompt r // G); else from a compacted stage (G = 1)."""
  d = ctx.groups
  prompt_idx, sample_idx = ((idx_DxM // ctx.samples, idx_DxM % ctx.samples) if first
                            else (idx_DxM, jnp.zeros_like(idx_DxM)))
  prompt = lambda x: _take(x, prompt_idx, d)
  generated = lambda x: _take_samples(x, prompt_idx, sample_idx, d)
  out = decode.Cache(
      prompt_k=_per_layer(prompt, cache.prompt_k, ctx.stacked),
      prompt_v=_per_layer(prompt, cache.prompt_v, ctx.stacked),
      prompt_bias=_take(cache.prompt_bias, prompt_idx, d),
      gen_k=_per_layer(generated, cache.gen_k, ctx.stacked),
      gen_v=_per_layer(generated, cache.gen_v, ctx.stacked))
  if ctx.mesh is not None:
    out = jax.lax.with_sharding_constraint(out, sharding_lib.cache_shardings(ctx.mesh,
                                                                             ctx.stacked))
  return out


def _compact(stage: Stage, size: int, ctx: Context, first: bool) -> Stage:
  """The live slots first (in their order), then finished ones, `size` per group."""
  idx = jnp.argsort(stage.done_DxM, axis=1, stable=True)[:, :size]
  pick = lambda x: jnp.take_along_axis(x, idx, axis=1)
  return Stage(stage.i, pick(stage.token_DxM), pick(stage.done_DxM), pick(stage.rows_DxM),
               pick(stage.prompt_len_DxM), pick(stage.offset_DxM),
               _compact_cache(stage.cache, idx, ctx, first))


def _write_back(full: decode.Cache, stage: Stage, ctx: Context) -> decode.Cache:
  """The full cache (G = 1, rows in order) with a compacted stage's generated K/V written
  back to the rows they came from, each group its own (rows stay on their device)."""
  d = ctx.groups

  def put(full_x, stage_x):
    grouped = full_x.reshape(d, -1, *full_x.shape[1:])
    out = jax.vmap(lambda f, r, x: f.at[r].set(x))(
        grouped, stage.rows_DxM, stage_x.reshape(d, -1, *stage_x.shape[1:]))
    return out.reshape(full_x.shape)

  if ctx.stacked:
    gen_k, gen_v = jax.vmap(put)(full.gen_k, stage.cache.gen_k), jax.vmap(put)(
        full.gen_v, stage.cache.gen_v)
  else:
    gen_k = tuple(put(f, x) for f, x in zip(full.gen_k, stage.cache.gen_k))
    gen_v = tuple(put(f, x) for f, x in zip(full.gen_v, stage.cache.gen_v))
  return full._replace(gen_k=gen_k, gen_v=gen_v)


def _scatter(buffers, rows_DxM, i, values):
  """Each slot's values written at its original row, step i ([D, n, T] buffers)."""
  def one(buf, val):
    return jax.vmap(lambda b, r, v: b.at[r, i].set(v))(buf, rows_DxM, val)
  return tuple(one(b, v) for b, v in zip(buffers, values))


def _loop(stage: Stage, buffers, ctx: Context, next_size: int | None):
  """Decodes a compacted stage until every row ended, max_new_tokens, or the live rows fit
  in next_size per group."""
  t, d = ctx.max_new_tokens, ctx.groups

  def cond(carry):
    s, _ = carry
    go = (s.i < t) & ~jnp.all(s.done_DxM)
    return go if next_size is None else go & (max_live(s.done_DxM, d) > next_size)

  def body(carry):
    s, buffers = carry
    m = s.token_DxM.shape[1]
    # The token fed at step i sits at generated slot i - 1 (single-turn: one slot for every
    # row) or after the row's earlier turns (episodes: one slot per row).
    slot = s.i - 1 if ctx.offset_Dxn is None else s.offset_DxM.reshape(-1) + s.i - 1
    logits, cache = decode.step(ctx.weights, ctx.cfg, s.token_DxM.reshape(d * m, 1),
                                s.prompt_len_DxM.reshape(-1) + slot, slot, s.cache, ctx.block,
                                ctx.mesh)
    u = None
    if ctx.u_TxDxn is not None:
      u_Dxn = jax.lax.dynamic_index_in_dim(ctx.u_TxDxn, s.i, keepdims=False)
      u = jnp.take_along_axis(u_Dxn, s.rows_DxM, axis=1)
    token, logp, raw = ctx.draw(logits.reshape(d, m, -1), u, s.done_DxM)
    buffers = _scatter(buffers, s.rows_DxM, s.i, (token, logp, raw, ~s.done_DxM))
    done = s.done_DxM | ctx.is_stop(token) if ctx.is_stop is not None else s.done_DxM
    return s._replace(i=s.i + 1, token_DxM=token, done_DxM=done, cache=cache), buffers

  return jax.lax.while_loop(cond, body, (stage, buffers))


def finish(i, token_BxG, done_BxG, cache: decode.Cache, buffers_BxGxT, ctx: Context):
  """Continues the sampler's first stage (stopped when the live rows fit in sizes[1]) in
  the compacted stages. Returns the buffers (tokens, logps, raws, masks) as [N, T], and with
  ctx.keep_cache the full cache (every stage's generated K/V back in their rows), else None."""
  d, t = ctx.groups, ctx.max_new_tokens
  n = token_BxG.size // d
  grouped = lambda x: x.reshape(d, n)
  offsets = (jnp.zeros((d, n), jnp.int32) if ctx.offset_Dxn is None else ctx.offset_Dxn)
  full = cache if ctx.keep_cache else None
  stage = Stage(i, grouped(token_BxG), grouped(done_BxG),
                jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (d, n)), ctx.prompt_len_Dxn,
                offsets, cache)
  buffers = tuple(x.reshape(d, n, t) for x in buffers_BxGxT)
  # Every stage compacts, even after the last row ended (its loop then runs no step): under
  # a lax.cond that skips it, XLA kept the branches' caches apart (CPU: 1.8x the sampler's
  # temporary memory; without: 1.06x), and a compaction copies at most half the cache once,
  # about what one decode step reads.
  for k in range(1, len(ctx.sizes)):
    stage = _compact(stage, ctx.sizes[k], ctx, first=k == 1)
    last = k + 1 == len(ctx.sizes)
    stage, buffers = _loop(stage, buffers, ctx, None if last else ctx.sizes[k + 1])
    if full is not None:  # before the next stage gathers from this one and drops it
      full = _write_back(full, stage, ctx)
  return tuple(x.reshape(d * n, t) for x in buffers), full

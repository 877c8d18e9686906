"""Sampling profiles and the rollout engine.

A profile's settings (temperature, top-p, top-k, samples per prompt, new tokens) are static
arguments of its compiled sampler, so each profile compiles exactly once. The engine knows
exactly two profiles, `train` and `val`: the trainer can only roll out with the training
distribution (the on-policy guard), and validation gets its own, typically near-greedy one.

One call: prefill the B distinct prompts once ([B, L], never [B*G, L]), then decode G samples
per prompt in a `lax.while_loop` that stops when every row has emitted EOS or after
`max_new_tokens` (with `compact_stages`, the live rows move into smaller batches on the way:
compaction.py). Rows come out prompt-major (row b*G + g), so `rewards.reshape(B, G)` groups
them. Per token it returns the log-probability under the profile's distribution (after
temperature and truncation; 0 for greedy), which is π_old of the trainer's importance ratios
(the distribution the token was drawn from), and under the raw model (temperature 1, no
truncation), a diagnostic the trainer does not use.

Tokens are drawn by distribution.py (truncation, the inverse-CDF pick, greedy).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.runtime import compile_options
from jaxgrpo.model import attention as attention_lib
from jaxgrpo.model import decode, distribution
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import compaction

PROFILE_NAMES = ("train", "val")
# The profile's draw settings live with the distribution they define; re-exported here,
# where profiles are made.
SamplingParams = distribution.SamplingParams


@dataclasses.dataclass(frozen=True)
class Profile:
  """A compiled sampler's static settings: how to draw, how many samples, how long."""

  sampling: SamplingParams
  num_samples: int
  max_new_tokens: int

  def __post_init__(self):
    if not isinstance(self.sampling, SamplingParams):
      raise ValueError(f"sampling={self.sampling!r}: must be a SamplingParams")
    if not isinstance(self.num_samples, int) or self.num_samples < 1:
      raise ValueError(f"num_samples={self.num_samples!r}: must be an integer >= 1")
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")


class Rollout(NamedTuple):
  """Sampled completions, N = B * G rows, prompt-major."""

  tokens_NxT: jax.Array     # completion tokens; pad after the end
  logp_NxT: jax.Array       # log p of each token under the profile's distribution
  raw_logp_NxT: jax.Array   # log p under the raw model (temperature 1, no truncation)
  mask_NxT: jax.Array       # True on generated tokens, EOS included
  lengths_N: jax.Array      # number of generated tokens, EOS included
  truncated_N: jax.Array    # True when the row hit max_new_tokens without EOS


def prefill(params, cfg: model_lib.ModelConfig, prompt_tokens_BxL, prompt_mask_BxL,
            scan_layers: bool | None = None, attention: str | None = None,
            stacked_kv: bool = False, mesh=None):
  """Runs the prompts once: the last position's logits and each layer's K/V (tuples of
  [B, H_kv, L, D]; stacked_kv: two [num_layers, B, H_kv, L, D] arrays). mesh: the
  program's (model.Decoder's: splash's kernel runs under shard_map on it).

  A module-level function so tests can watch the shapes it is traced with.
  """
  positions = model_lib.positions_from_mask(prompt_mask_BxL)
  return model_lib.Decoder(cfg, scan_layers=scan_layers, attention=attention, mesh=mesh).apply(
      {"params": params}, prompt_tokens_BxL, positions, prompt_mask_BxL,
      return_kv="stacked" if stacked_kv else True)


def row_uniforms(key, row_ids_B, step, num_samples: int):
  """u_BxG in [0, 1): prompt b's draws depend only on (key, row_ids_B[b], step).

  So a prompt's samples do not depend on which batch, position or device it landed in:
  validation keys its prompts by their index in the validation set, and the same
  parameters give the same samples whatever the batch size or mesh.
  """
  return jax.vmap(lambda row_id: row_uniform(key, row_id, step, num_samples))(row_ids_B)


def row_uniform(key, row_id, step, num_samples: int):
  """The uniforms [num_samples] of one prompt (row id) at one step: the single definition of
  the samplers' random streams (the JetStream adapter draws each slot's from it too)."""
  return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, row_id), step),
                            (num_samples,))


def sample(params, prompt_tokens_BxL, prompt_mask_BxL, key, row_ids_B=None, *,
           cfg: model_lib.ModelConfig, profile: Profile, eos_id, pad_id: int,
           mesh=None, share_prefix: bool = True,
           scan_layers: bool | None = None, attention: str | None = None,
           decode_block: int = 0, compact_stages: int = 0,
           gather_weights: bool = True) -> Rollout:
  """The pure sampler (jit it with `profile` static).

  eos_id: the id (or a tuple of ids: instruct models end a turn with any of several) that
  ends a row; None: always max_new_tokens.

  Prompt b's random draws come from (key, row_ids_B[b]) alone (default: its row number).

  share_prefix=False prefills every one of the B*G rows separately (each sample then holds
  its own copy of the prompt's keys and values), as samplers without prefix sharing do. It
  exists to measure what sharing buys (`python -m jaxgrpo.bench prefill`); the random draws
  are the same, so the samples are too, up to float rounding.

  scan_layers: the layers as one compiled loop body, in the prefill (model.Decoder) and the
  decode step (decode.step), or unrolled (fewest ops per token: CPU's default);
  attention: the prefill's (model.Decoder). decode_block: > 0 reads the samples' own keys
  a block of that many slots at a time, up to the current token's (decode.step); 0 reads
  every slot and masks the unfilled ones. compact_stages: > 0 moves the live rows into a batch
  half as large whenever they fit, up to that many times (compaction.py: the same rollout,
  without computing rows that ended); 0 computes every row until the longest ends.
  gather_weights: the decode step's weights whole on every chip once per call, where the
  mesh splits only rows (decode.prepare); False leaves them split (fsdp) as the parameters
  are, gathered layer by layer every token-step.
  """
  g, t = profile.num_samples, profile.max_new_tokens
  b = prompt_tokens_BxL.shape[0]
  if row_ids_B is None:
    row_ids_B = jnp.arange(b, dtype=jnp.int32)
  # The decode loop's view: pb prompts with pg samples each (pb * pg = b * g rows).
  pb, pg = (b, g) if share_prefix else (b * g, 1)
  if not share_prefix:
    prompt_tokens_BxL = jnp.repeat(prompt_tokens_BxL, g, axis=0)
    prompt_mask_BxL = jnp.repeat(prompt_mask_BxL, g, axis=0)
  # Scanned layers: the decode step loops over one compiled block too (decode.step), over
  # the caches as the prefill's scan stacked them.
  stacked = model_lib.resolve_scan_layers(scan_layers, model_lib.platform_of(mesh))
  logits_BxV, (ks, vs) = prefill(params, cfg, prompt_tokens_BxL, prompt_mask_BxL,
                                 scan_layers, attention, stacked_kv=stacked, mesh=mesh)
  prompt_len_B = jnp.sum(prompt_mask_BxL, axis=-1).astype(jnp.int32)
  cache = decode.init_cache(ks, vs, prompt_mask_BxL, cfg, pg, t, stacked, decode_block)
  rollout, _ = decode_loop(decode.prepare(params, cfg, stacked, mesh if gather_weights else None),
                           cache, logits_BxV,
                           prompt_len_B, key, row_ids_B, cfg=cfg, profile=profile,
                           eos_id=eos_id, pad_id=pad_id, mesh=mesh, stacked=stacked,
                           decode_block=decode_block, compact_stages=compact_stages,
                           shape=(pb, pg))
  return rollout


def decode_loop(weights, cache, logits_BxV, prompt_len_B, key, row_ids_B, *, cfg, profile,
                eos_id, pad_id, mesh, stacked, decode_block=0, compact_stages=0, shape,
                done_B=None, start_B=None):
  """The decode loop after a prefill: G samples of B prompts (`shape`: the loop's (pb, pg)
  view of them) drawn from logits_BxV and then token by token with `decode.step`.
  Returns the Rollout and, for episodes (start_B), the cache with the fed tokens' K/V in
  their rows' slots (compaction writes each stage's back: compaction.finish), else None.

  Multi-turn episodes (G = 1): done_B rows start done (sample nothing); start_B: the
  generated slot each row's first fed token goes to (its slots before hold its earlier
  turns), so each row writes and attends at its own slot (decode.step with one i per row).
  """
  sp, g, t = profile.sampling, profile.num_samples, profile.max_new_tokens
  b = len(row_ids_B)
  pb, pg = shape
  if mesh is not None:  # keep caches split by rows (and KV heads) through the loop
    # One sharding per field is a tree prefix: it applies to every layer's array.
    cache = jax.lax.with_sharding_constraint(cache, sharding_lib.cache_shardings(mesh, stacked))

  # Every step's draws up front, in one vectorised computation: threefry inside the loop
  # ran as nested loops of tiny ops, about 1 ms per token on CPU (a third of a tiny-preset
  # call). The values are the same as drawing at each step.
  u_TxBxG = None if sp.greedy else jax.vmap(
      lambda i: row_uniforms(key, row_ids_B, i, g))(jnp.arange(t, dtype=jnp.int32))

  def draw_live(logits, u, done):
    """The draw, with pad and zero log-probs for rows that already ended (also used by the
    compacted stages, over their slots)."""
    token, logp, raw = distribution.draw(logits, u, sp)
    zero = jnp.zeros_like(logp)
    return (jnp.where(done, pad_id, token), jnp.where(done, zero, logp),
            jnp.where(done, zero, raw))

  def pick(logits_BxGxV, i, done_BxG):
    u = None if u_TxBxG is None else jax.lax.dynamic_index_in_dim(u_TxBxG, i, keepdims=False)
    return draw_live(logits_BxGxV.reshape(b, g, -1), u, done_BxG)

  def record(state, i, token, logp, raw, done_BxG):
    tokens, logps, raws, masks = state
    return (tokens.at[:, :, i].set(token), logps.at[:, :, i].set(logp),
            raws.at[:, :, i].set(raw), masks.at[:, :, i].set(~done_BxG))

  done0 = jnp.zeros((b, g), bool)
  if done_B is not None:
    done0 = jnp.broadcast_to(done_B[:, None], (b, g))
  buffers = (jnp.full((b, g, t), pad_id, jnp.int32), jnp.zeros((b, g, t), jnp.float32),
             jnp.zeros((b, g, t), jnp.float32), jnp.zeros((b, g, t), bool))
  # Token 0 of every sample comes from the (shared) prefill logits.
  token, logp, raw = pick(jnp.broadcast_to(logits_BxV[:, None], (pb, pg, cfg.vocab_size)), 0,
                          done0)
  buffers = record(buffers, 0, token, logp, raw, done0)
  stops = None if eos_id is None else jnp.asarray(np.atleast_1d(eos_id), jnp.int32)
  is_stop = lambda t: jnp.any(t[..., None] == stops, axis=-1)
  done = done0 | is_stop(token) if stops is not None else done0

  groups = 1 if mesh is None else sharding_lib.batch_size_multiple(mesh)
  sizes = compaction.bucket_sizes(b * g // groups, compact_stages)
  # The generated slot of the token fed at step i: i - 1, or per row after its earlier turns.
  offset_B = jnp.int32(0) if start_B is None else start_B

  def cond(carry):
    i, _, done, _, _ = carry
    go = (i < t) & ~jnp.all(done)
    # Compacting: the first stage ends once the live rows fit in the next bucket.
    return go if len(sizes) == 1 else go & (compaction.max_live(done, groups) > sizes[1])

  def body(carry):
    i, token, done, cache, buffers = carry
    # The token fed at step i sits at position prompt_length + slot.
    slot = offset_B + i - 1
    logits, cache = decode.step(weights, cfg, token.reshape(pb, pg), prompt_len_B + slot, slot,
                                cache, decode_block, mesh)
    new, logp, raw = pick(logits, i, done)
    buffers = record(buffers, i, new, logp, raw, done)
    if stops is not None:
      done = done | is_stop(new)
    return i + 1, new, done, cache, buffers

  i, token, done, cache, buffers = jax.lax.while_loop(
      cond, body, (jnp.int32(1), token, done, cache, buffers))
  if len(sizes) == 1:
    tokens, logps, raws, masks = (x.reshape(b * g, t) for x in buffers)
  else:
    ctx = compaction.Context(
        weights=weights, cfg=cfg, draw=draw_live,
        is_stop=None if stops is None else is_stop, samples=pg, groups=groups,
        sizes=sizes, max_new_tokens=t, block=decode_block, stacked=stacked, mesh=mesh,
        u_TxDxn=None if u_TxBxG is None else u_TxBxG.reshape(t, groups, -1),
        prompt_len_Dxn=jnp.repeat(prompt_len_B, pg).reshape(groups, -1),
        offset_Dxn=None if start_B is None else start_B.reshape(groups, -1),
        keep_cache=start_B is not None)
    (tokens, logps, raws, masks), cache = compaction.finish(i, token, done, cache, buffers,
                                                            ctx)
  # Truncated: rows that ran through the last step without ending there. Read off the buffers,
  # which hold every row whatever stage it ended in (a compacted run's final `done` covers
  # only the last stage's slots).
  truncated = masks[:, -1] & ~is_stop(tokens[:, -1]) if stops is not None else masks[:, -1]
  lengths = jnp.sum(masks, axis=-1).astype(jnp.int32)
  return Rollout(tokens, logps, raws, masks, lengths, truncated), cache


def left_pad(prompt_tokens_BxL, prompt_mask_BxL, width: int, pad_id: int):
  """Host-side: left-pads prompts to `width` so every call has the same compiled shape."""
  tokens = np.asarray(prompt_tokens_BxL)
  mask = np.asarray(prompt_mask_BxL, bool)
  extra = width - tokens.shape[1]
  if extra > 0:
    tokens = np.pad(tokens, ((0, 0), (extra, 0)), constant_values=pad_id)
    mask = np.pad(mask, ((0, 0), (extra, 0)), constant_values=False)
  return tokens.astype(np.int32), mask


def compile_sampler(cfg: model_lib.ModelConfig, profile: Profile, *, eos_id, pad_id, mesh,
                    on_trace=None, share_prefix: bool = True,
                    scan_layers: bool | None = None, attention: str | None = None,
                    decode_block: int = 0, compact_stages: int = 0,
                    gather_weights: bool = True):
  """jit(sample) for one profile with explicit shardings: rows over the data axes."""

  def traced(params, tokens, mask, key, row_ids):
    if on_trace is not None:
      on_trace()  # runs once per trace, i.e. once per compilation
    return sample(params, tokens, mask, key, row_ids, cfg=cfg, profile=profile,
                  eos_id=eos_id, pad_id=pad_id, mesh=mesh, share_prefix=share_prefix,
                  scan_layers=scan_layers, attention=attention, decode_block=decode_block,
                  compact_stages=compact_stages, gather_weights=gather_weights)

  rows2, rows1 = sharding_lib.batch_sharding(mesh, 2), sharding_lib.batch_sharding(mesh, 1)
  return jax.jit(
      traced,
      in_shardings=(sharding_lib.param_shardings(cfg, mesh), rows2, rows2,
                    sharding_lib.replicated(mesh), rows1),
      out_shardings=Rollout(rows2, rows2, rows2, rows2, rows1, rows1),
      compiler_options=compile_options.compiler_options(mesh))


class RolloutEngine:
  """Exactly two compiled samplers, `train` and `val`; keys folded from seed and step."""

  def __init__(self, cfg: model_lib.ModelConfig, mesh, profiles: Mapping[str, Profile], *,
               max_prompt_length: int, eos_id, pad_id: int, seed: int,
               share_prefix: bool = True, scan_layers: bool | None = None,
               attention: str | None = None, decode_block: int = 0,
               compact_stages: int = 0, gather_weights: bool = True):
    """share_prefix=False prefills every sample's copy of its prompt (see `sample`); only
    for measuring what prefix sharing buys. scan_layers, attention: the prefill's;
    decode_block: the decode step's key block; compact_stages: how many times the live rows
    may move into a batch half as large; gather_weights: the decode's weights whole on
    each chip once per call (`sample`)."""
    names = tuple(profiles)
    if sorted(names) != sorted(PROFILE_NAMES):
      raise ValueError(f"rollout profiles {list(names)}: the engine takes exactly "
                       f"{list(PROFILE_NAMES)} (training may only sample with 'train')")
    self.cfg, self.mesh, self.profiles = cfg, mesh, dict(profiles)
    self.max_prompt_length, self.pad_id, self.eos_id = max_prompt_length, pad_id, eos_id
    self.compilations = {name: 0 for name in PROFILE_NAMES}
    self._calls = {name: 0 for name in PROFILE_NAMES}
    self._base_key = jax.random.key(seed)
    # Resolved once for the engine (model x platform x request; a run passes build.attention's
    # name already), so every program it compiles gets the same concrete name.
    self.attention = attention_lib.resolve_attention(
        attention, model_lib.platform_of(mesh), cfg.dtype, bool(cfg.sliding_window))
    self.scan_layers, self.decode_block = scan_layers, decode_block
    self.compact_stages, self.gather_weights = compact_stages, gather_weights
    self._samplers = self._build(eos_id=eos_id, share_prefix=share_prefix)

  def _build(self, *, eos_id, share_prefix: bool):
    """One compiled sampler per profile (a backend adapter replaces this and `_roll`)."""
    return {name: compile_sampler(self.cfg, self.profiles[name], eos_id=eos_id,
                                  pad_id=self.pad_id, mesh=self.mesh,
                                  on_trace=functools.partial(self._count, name),
                                  share_prefix=share_prefix, scan_layers=self.scan_layers,
                                  attention=self.attention, decode_block=self.decode_block,
                                  compact_stages=self.compact_stages,
                                  gather_weights=self.gather_weights)
            for name in PROFILE_NAMES}

  def _count(self, name):
    self.compilations[name] += 1

  def programs(self, name: str, params, prompts: int, key, samples: int) -> list:
    """[(label, jax Lowered)]: what profile `name` runs for `prompts` prompts of `samples`
    samples each, lowered from abstract inputs (`params`: ShapeDtypeStructs with their
    shardings), so sizing and the compile check measure the engine's own programs instead
    of rebuilding them by kind. Here one sampler call (the profile holds its samples);
    other engines describe theirs (partial rounds, episode turns)."""
    del samples
    sds = jax.ShapeDtypeStruct
    p = self.max_prompt_length
    sampler = compile_sampler(self.cfg, self.profile(name), eos_id=self.eos_id,
                              pad_id=self.pad_id, mesh=self.mesh, scan_layers=self.scan_layers,
                              attention=self.attention, decode_block=self.decode_block,
                              compact_stages=self.compact_stages,
                              gather_weights=self.gather_weights)
    return [(f"{name} sampler", sampler.lower(params, sds((prompts, p), jnp.int32),
                                               sds((prompts, p), bool), key,
                                               sds((prompts,), jnp.int32)))]

  def key(self, name: str, step: int):
    """The key of call `step` of profile `name`: distinct per (profile, step)."""
    return jax.random.fold_in(jax.random.fold_in(self._base_key, PROFILE_NAMES.index(name)),
                              step)

  def profile(self, name: str) -> Profile:
    if name not in self.profiles:
      raise ValueError(f"unknown rollout profile {name!r}; allowed {list(PROFILE_NAMES)}")
    return self.profiles[name]

  def sample(self, name: str, params, prompt_tokens_BxL, prompt_mask_BxL, *,
             step: int | None = None, key=None, row_ids_B=None) -> Rollout:
    """Samples with profile `name`. Without `step` or `key` each call draws a fresh key
    (a per-profile counter); pass `key` to reuse one on purpose (fixed validation key).

    row_ids_B: an id per prompt (default 0..B-1); prompt b's draws depend only on the key
    and its id, so validation passes each prompt's index in the validation set.
    """
    self.profile(name)
    if key is not None and step is not None:
      raise ValueError("pass either step= (a key folded from the run seed) or key=, not both")
    width = np.shape(prompt_tokens_BxL)[1]
    if width > self.max_prompt_length:
      raise ValueError(f"prompt length {width} exceeds max_prompt_length="
                       f"{self.max_prompt_length}")
    rows = self._check_rows(np.shape(prompt_tokens_BxL)[0])
    if key is None:
      step = self._calls[name] if step is None else step
      key = self.key(name, step)
      self._calls[name] = step + 1
    tokens, mask = left_pad(prompt_tokens_BxL, prompt_mask_BxL, self.max_prompt_length,
                            self.pad_id)
    return self._roll(name, params, tokens, mask, key, self._row_ids(row_ids_B, rows))

  def _check_rows(self, rows: int) -> int:
    """rows (this process's prompts), checked to divide over the data-parallel devices."""
    multiple = sharding_lib.batch_size_multiple(self.mesh)
    if (rows * jax.process_count()) % multiple:
      raise ValueError(f"{rows * jax.process_count()} prompts do not divide over the "
                       f"{multiple} data-parallel devices (mesh data x fsdp x expert)")
    return rows

  @staticmethod
  def _row_ids(row_ids_B, rows: int):
    """row_ids_B as int32, by default the global batch's row numbers (each process holds a
    slice)."""
    if row_ids_B is None:
      row_ids_B = np.arange(rows, dtype=np.int32) + jax.process_index() * rows
    row_ids_B = np.asarray(row_ids_B, np.int32)
    if row_ids_B.shape != (rows,):
      raise ValueError(f"row_ids_B has shape {row_ids_B.shape}; expected ({rows},)")
    return row_ids_B

  def _roll(self, name: str, params, tokens_BxL, mask_BxL, key, row_ids_B) -> Rollout:
    """The rollout itself, from this process's left-padded prompts (numpy)."""
    tokens, mask, row_ids_B = sharding_lib.to_global(self.mesh, (tokens_BxL, mask_BxL,
                                                                 row_ids_B))
    return self._samplers[name](params, tokens, mask, sharding_lib.replicate_key(self.mesh, key),
                                row_ids_B)

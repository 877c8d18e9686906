"""Multi-turn episodes on device: a KV cache kept between an episode's turns.

episodes.py runs N = B * G episodes (G per prompt, prompt-major) as a loop of turns on the
host; this module is the device side, two programs per profile:

  start  prefills each of the B prompts once, all but its last token, and repeats its keys
         and values for its G episodes: the cache (decode.Cache with G = 1: one row per
         episode) of [prompt | R generated slots], R = max_episode_tokens -
         max_prompt_length + 1 (the completion region and the prompt's last token);
  turn   appends each row's new tokens to its cache (decode.extend: one prefill of them at
         the row's own slot, attending to everything before; in chunks of APPEND_CHUNK, as
         many as the call's longest append needs) and decodes the turn from the
         logits after them (sampling.decode_loop, each row at its own slot), with the profile's
         draws. The cache goes in and comes back (donated: updated in place).

The new tokens of turn 0 are the prompt's last token; of a later turn, the previous turn's
last sampled token (the decode loop writes the K/V of the tokens it feeds, and it never
feeds the last one) and the observation: at most max_observation_tokens + 1 (E). So a
turn costs one prefill of E tokens per episode, not of its whole context, and the G
episodes of a prompt share its prefill.

Rows whose episode ended are inactive (done from the start: they sample nothing, and their
append is empty), and with `compact_stages` the decode drops them and the rows that end, as
the single-turn sampler does (compaction.py), writing each compacted stage's keys and values
back to their rows for the next turn. The decode's key blocks (`decode_block_size`) are not
used: each row writes and reads at its own slot.

Both programs of a profile draw with that profile alone: training episodes can only sample
with `train`, validation episodes with `val` (the on-policy guard is kept).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.model import decode
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.runtime import compile_options


def slots(max_prompt_length: int, max_episode_tokens: int) -> int:
  """R: an episode's generated slots, its completion region and its prompt's last token."""
  return max_episode_tokens - max_prompt_length + 1


def start(params, prompt_tokens_BxL, prompt_mask_BxL, *, cfg: model_lib.ModelConfig,
          samples: int, num_slots: int, mesh=None, scan_layers: bool | None = None,
          attention: str | None = None) -> decode.Cache:
  """The cache of B * samples episodes (row b * samples + g): prompt b's K/V but for its
  last token (left-padded prompts: the last column), prefilled once and repeated for its
  episodes, and num_slots empty generated slots per episode."""
  stacked = model_lib.resolve_scan_layers(scan_layers, model_lib.platform_of(mesh))
  tokens_BxL, mask_BxL = prompt_tokens_BxL[:, :-1], prompt_mask_BxL[:, :-1]
  _, (ks, vs) = sampling.prefill(params, cfg, tokens_BxL, mask_BxL, scan_layers, attention,
                                 stacked_kv=stacked, mesh=mesh)
  axis = 1 if stacked else 0  # the rows' axis, after a stacked cache's layer axis
  if stacked:
    ks, vs = jnp.repeat(ks, samples, axis), jnp.repeat(vs, samples, axis)
  else:
    ks = tuple(jnp.repeat(k, samples, axis) for k in ks)
    vs = tuple(jnp.repeat(v, samples, axis) for v in vs)
  cache = decode.init_cache(ks, vs, jnp.repeat(mask_BxL, samples, 0), cfg, 1, num_slots,
                            stacked)
  if mesh is not None:
    cache = jax.lax.with_sharding_constraint(cache, sharding_lib.cache_shardings(mesh, stacked))
  return cache


def turn(params, cache: decode.Cache, slot_N, new_tokens_NxE, new_len_N, key, row_ids_N,
         active_N, *, cfg: model_lib.ModelConfig, profile: sampling.Profile, eos_id,
         pad_id: int, attention: str, mesh=None, scan_layers: bool | None = None,
         compact_stages: int = 0, gather_weights: bool = True):
  """One turn of N episodes: appends row n's first new_len_N[n] tokens at its generated slot
  slot_N[n] and samples the turn after them with `profile` (one sample per row; row n's
  draws from (key, row_ids_N[n]) alone). compact_stages: the decode's (compaction.py; each
  stage's K/V are written back to their rows); gather_weights: sampling.sample's. Returns (sampling.Rollout, the cache)."""
  stacked = model_lib.resolve_scan_layers(scan_layers, model_lib.platform_of(mesh))
  logits_NxV, cache = append(params, cfg, new_tokens_NxE, new_len_N, slot_N, cache, stacked,
                             attention, mesh)
  prompt_len_N = jnp.sum(cache.prompt_bias[:, 0, 0] == 0.0, axis=-1).astype(jnp.int32)
  return sampling.decode_loop(
      decode.prepare(params, cfg, stacked, mesh if gather_weights else None), cache, logits_NxV, prompt_len_N, key, row_ids_N,
      cfg=cfg, profile=profile, eos_id=eos_id, pad_id=pad_id, mesh=mesh, stacked=stacked,
      shape=(len(row_ids_N), 1), done_B=~active_N, start_B=slot_N + new_len_N,
      compact_stages=compact_stages)


# The append runs in chunks of this many tokens, as many as the longest append of the call
# needs: most turns append a handful (turn 0 one token, a tool result a few), while the
# program's static width is max_observation_tokens + 1. On the calculator task (width 49,
# results of 7 tokens) one 49-wide append was 68% of a turn on CPU (BENCHMARKS.md).
APPEND_CHUNK = 16


def append(params, cfg: model_lib.ModelConfig, tokens_NxE, new_len_N, slot_N,
           cache: decode.Cache, stacked: bool, attention: str, mesh=None):
  """decode.extend of each row's new tokens, APPEND_CHUNK at a time (a loop of as many chunks
  as the longest row needs; chunk c attends to the ones before it through the cache).
  Returns the logits after each row's last new token and the cache."""
  n, e = tokens_NxE.shape
  chunk = min(APPEND_CHUNK, e)
  chunks = -(-e // chunk)
  tokens_NxE = jnp.pad(tokens_NxE, ((0, 0), (0, chunks * chunk - e)))

  def body(c, carry):
    logits_NxV, cache = carry
    start = c * chunk
    len_N = jnp.clip(new_len_N - start, 0, chunk)
    logits, cache = decode.extend(
        params, cfg, jax.lax.dynamic_slice_in_dim(tokens_NxE, start, chunk, axis=1), len_N,
        slot_N + start, cache, stacked, attention, mesh)
    # A row's logits are those after its last new token: from its last chunk with tokens.
    return jnp.where((len_N > 0)[:, None], logits, logits_NxV), cache

  used = -(-jnp.max(new_len_N) // chunk)
  logits0 = jnp.zeros((n, cfg.vocab_size), jnp.float32)
  return jax.lax.fori_loop(0, used, body, (logits0, cache))


def compile_start(cfg: model_lib.ModelConfig, samples: int, num_slots: int, *, mesh,
                  on_trace=None, scan_layers: bool | None = None,
                  attention: str | None = None):
  """jit(start) for `samples` episodes per prompt, with explicit shardings."""
  stacked = model_lib.resolve_scan_layers(scan_layers, model_lib.platform_of(mesh))

  def traced(params, tokens, mask):
    if on_trace is not None:
      on_trace()
    return start(params, tokens, mask, cfg=cfg, samples=samples, num_slots=num_slots,
                 mesh=mesh, scan_layers=scan_layers, attention=attention)

  rows2 = sharding_lib.batch_sharding(mesh, 2)
  return jax.jit(traced,
                 in_shardings=(sharding_lib.param_shardings(cfg, mesh), rows2, rows2),
                 out_shardings=sharding_lib.cache_shardings(mesh, stacked),
                 compiler_options=compile_options.compiler_options(mesh))


def compile_turn(cfg: model_lib.ModelConfig, profile: sampling.Profile, *, eos_id,
                 pad_id: int, mesh, attention: str, on_trace=None,
                 scan_layers: bool | None = None, compact_stages: int = 0,
                 gather_weights: bool = True):
  """jit(turn) for one profile with explicit shardings; the cache is donated. attention:
  a concrete name (the engine's, resolved once when it was made)."""
  stacked = model_lib.resolve_scan_layers(scan_layers, model_lib.platform_of(mesh))

  def traced(params, cache, slot_N, new_tokens, new_len_N, key, row_ids, active_N):
    if on_trace is not None:
      on_trace()  # runs once per trace, i.e. once per compilation
    return turn(params, cache, slot_N, new_tokens, new_len_N, key, row_ids, active_N,
                cfg=cfg, profile=profile, eos_id=eos_id, pad_id=pad_id, mesh=mesh,
                scan_layers=scan_layers, attention=attention, compact_stages=compact_stages,
                gather_weights=gather_weights)

  rows2, rows1 = sharding_lib.batch_sharding(mesh, 2), sharding_lib.batch_sharding(mesh, 1)
  caches = sharding_lib.cache_shardings(mesh, stacked)
  return jax.jit(
      traced,
      in_shardings=(sharding_lib.param_shardings(cfg, mesh), caches, rows1, rows2, rows1,
                    sharding_lib.replicated(mesh), rows1, rows1),
      out_shardings=(sampling.Rollout(rows2, rows2, rows2, rows2, rows1, rows1), caches),
      donate_argnums=(1,), compiler_options=compile_options.compiler_options(mesh))


class EpisodeEngine(sampling.RolloutEngine):
  """The rollout engine of multi-turn episodes: per profile (`train`, `val`, exactly as the
  single-turn engine) a start program and a turn program; `sample` is not available.

  max_prompt_length: data.max_prompt_length (prompts are left-padded to it);
  max_episode_tokens: generation.max_episode_tokens (the prompt and everything after it);
  max_append_tokens: E, the most new tokens a turn appends (max_observation_tokens + 1).
  The profiles' num_samples must be 1: the G episodes of a prompt are rows of their own.
  """

  def __init__(self, cfg: model_lib.ModelConfig, mesh, profiles, *, max_prompt_length: int,
               max_episode_tokens: int, max_append_tokens: int, eos_id, pad_id: int,
               seed: int, scan_layers: bool | None = None, attention: str | None = None,
               compact_stages: int = 0, gather_weights: bool = True):
    if max_episode_tokens <= max_prompt_length or max_prompt_length < 2:
      raise ValueError(f"max_episode_tokens={max_episode_tokens} must exceed "
                       f"max_prompt_length={max_prompt_length} (at least 2)")
    if any(p.num_samples != 1 for p in profiles.values()):
      raise ValueError("an episode engine's profiles sample once per row (num_samples=1)")
    self.max_episode_tokens, self.max_append_tokens = max_episode_tokens, max_append_tokens
    self.num_slots = slots(max_prompt_length, max_episode_tokens)
    self.start_compilations = {name: 0 for name in sampling.PROFILE_NAMES}
    super().__init__(cfg, mesh, profiles, max_prompt_length=max_prompt_length, eos_id=eos_id,
                     pad_id=pad_id, seed=seed, scan_layers=scan_layers, attention=attention,
                     compact_stages=compact_stages, gather_weights=gather_weights)

  def _build(self, *, eos_id, share_prefix: bool):
    del share_prefix
    self._starts = {}  # (profile, samples) -> compiled start, made at its first call
    self._turns = {name: compile_turn(self.cfg, self.profiles[name], eos_id=eos_id,
                                      pad_id=self.pad_id, mesh=self.mesh,
                                      on_trace=functools.partial(self._count, name),
                                      scan_layers=self.scan_layers, attention=self.attention,
                                      compact_stages=self.compact_stages,
                                      gather_weights=self.gather_weights)
                   for name in sampling.PROFILE_NAMES}
    return {}

  def sample(self, *args, **kwargs):
    raise ValueError("an episode engine runs turns (start, turn: episodes.py), not sample")

  def programs(self, name: str, params, prompts: int, key, samples: int) -> list:
    """sampling.RolloutEngine.programs: the turn program of `prompts` prompts' `samples`
    episodes each (its arguments hold the episodes' KV cache, kept on the chips between
    turns) and the start that makes it (the prompts' prefill, the cache its output)."""
    n, width = prompts * samples, self.max_prompt_length
    sds = jax.ShapeDtypeStruct
    start = compile_start(self.cfg, samples, self.num_slots, mesh=self.mesh,
                          scan_layers=self.scan_layers, attention=self.attention)
    prompt_args = (params, sds((prompts, width), jnp.int32), sds((prompts, width), bool))
    cache = jax.eval_shape(start, *prompt_args)
    turn_program = compile_turn(self.cfg, self.profile(name), eos_id=self.eos_id,
                                pad_id=self.pad_id, mesh=self.mesh,
                                scan_layers=self.scan_layers, attention=self.attention,
                                compact_stages=self.compact_stages,
                                gather_weights=self.gather_weights)
    rows1 = lambda dtype: sds((n,), dtype)
    return [(f"{name} sampler", turn_program.lower(
                params, cache, rows1(jnp.int32), sds((n, self.max_append_tokens), jnp.int32),
                rows1(jnp.int32), key, rows1(jnp.int32), rows1(bool))),
            (f"{name} episode start", start.lower(*prompt_args))]

  def start(self, name: str, params, prompt_tokens_BxL, prompt_mask_BxL,
            samples: int) -> decode.Cache:
    """The cache of this process's B prompts' B * samples episodes (`start`)."""
    self.profile(name)
    self._check_rows(np.shape(prompt_tokens_BxL)[0])
    if np.shape(prompt_tokens_BxL)[1] > self.max_prompt_length:
      raise ValueError(f"prompt length {np.shape(prompt_tokens_BxL)[1]} exceeds "
                       f"max_prompt_length={self.max_prompt_length}")
    tokens, mask = sampling.left_pad(prompt_tokens_BxL, prompt_mask_BxL,
                                     self.max_prompt_length, self.pad_id)
    if (name, samples) not in self._starts:
      def counted(name=name):
        self.start_compilations[name] += 1
      self._starts[(name, samples)] = compile_start(
          self.cfg, samples, self.num_slots, mesh=self.mesh, on_trace=counted,
          scan_layers=self.scan_layers, attention=self.attention)
    tokens, mask = sharding_lib.to_global(self.mesh, (tokens, mask))
    return self._starts[(name, samples)](params, tokens, mask)

  def turn(self, name: str, params, cache: decode.Cache, slot_N, new_tokens, *,
           key, row_ids_B, active_B):
    """One turn (`turn`) of this process's N episodes: new_tokens, a list of each row's
    tokens to append (at most max_append_tokens), at its slot slot_N. The cache passed in
    is consumed (donated); use the one returned. Returns (Rollout, cache)."""
    self.profile(name)
    n = self._check_rows(len(new_tokens))
    e = self.max_append_tokens
    tokens_NxE = np.full((n, e), self.pad_id, np.int32)
    len_N = np.zeros(n, np.int32)
    for i, ids in enumerate(new_tokens):
      if len(ids) > e:
        raise ValueError(f"episode row {i} appends {len(ids)} tokens; at most {e}")
      tokens_NxE[i, :len(ids)], len_N[i] = ids, len(ids)
    row_ids = self._row_ids(row_ids_B, n)
    slot_N, tokens_NxE, len_N, row_ids, active = sharding_lib.to_global(
        self.mesh, (np.asarray(slot_N, np.int32), tokens_NxE, len_N, row_ids,
                    np.asarray(active_B, bool)))
    return self._turns[name](params, cache, slot_N, tokens_NxE, len_N,
                             sharding_lib.replicate_key(self.mesh, key), row_ids, active)

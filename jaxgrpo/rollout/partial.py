"""Partial rollouts on device: N sampler rows that decode in bounded rounds, keep their KV
cache between rounds, and take a new rollout the moment they free up.

One program per run, `round`, compiled once (the training profile's; validation keeps the
synchronous sampler of sampling.py). Each row holds one rollout (G = 1 per row: the G
completions of a prompt are rows of their own, as in episodes) and its State on device:
its cache ([prompt | T generated slots]), the tokens and sampler log-probs drawn so far
([N, T]) and how many (count_N). A round

  1. refills the rows the host marks (`refill_N`): prefills their prompts (every row's in
     one [N, L] prefill, skipped when no row refills), writes the prompt's K/V into those
     rows only, resets their tokens, and draws each one's first token from the prefill;
  2. decodes every live row token by token (decode.step, each row at its own slot), each
     row drawing at most `budget` tokens this round (a traced scalar: any budget runs the
     same program) and stopping at an end token or after T.

Why the cache is kept on device rather than re-prefilled from the tokens at the next round:
a re-prefill of a carried row costs a forward pass over its prompt and every token it has
written (measured on CPU at 1,040 tokens: 4.9x a round of 128 decode steps, `python -m
jaxgrpo.bench long-tail --reprefill`), and it computes the K/V of the
written tokens by a different program than the decode step did, so the row would not
continue exactly as it would have uninterrupted. Kept, a row carried over any number of
rounds draws exactly the tokens and log-probs of one uninterrupted round with the same
parameters: the token fed at slot s is fed by the same decode step either way, and its
draws are keyed by (rollout id, token index), never by the round or the sampler row
(`uniforms`). The cost: the cache of the carried rows stays resident (it is already sized
for the full length), and checkpoints hold it (run/partial_rollouts.py).

Arrays end in their shape: N sampler rows, T = max_new_tokens, L = max_prompt_length.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.model import decode, distribution
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.runtime import compile_options


class State(NamedTuple):
  """The sampler rows between rounds (device arrays, rows over the data axes)."""

  cache: decode.Cache
  tokens_NxT: jax.Array   # int32: the completion so far; pad after count_N
  logp_NxT: jax.Array     # float32: each token's log-prob under the training profile
  count_N: jax.Array      # int32: tokens drawn so far
  u_NxT: jax.Array        # float32: the row's uniforms, drawn once at its refill


class Round(NamedTuple):
  """What a round tells the host (besides the new State)."""

  ended_N: jax.Array       # the row's rollout is complete (an end token, or T tokens)
  stopped_N: jax.Array     # it ended with an end token (else: truncated at T, or not ended)
  drawn_N: jax.Array       # tokens this round drew per row
  live_sum: jax.Array      # sum over decode steps of the rows live at that step
  steps: jax.Array         # decode steps the round ran (its first draw, from the prefill, is 0)


def uniforms(key, rollout_ids_N, num_tokens: int):
  """u_NxT: token j of rollout i draws with sampling.row_uniform(key, i, j): keyed by the
  rollout and the token index alone, so a row continues the same stream whatever round,
  step, sampler row or process it lands in."""
  steps = jnp.arange(num_tokens, dtype=jnp.int32)
  return jax.vmap(lambda i: jax.vmap(
      lambda j: sampling.row_uniform(key, i, j, 1)[0])(steps))(rollout_ids_N)


def _rows_where(refill_N, new, old, row_axis: int):
  view = [1] * old.ndim
  view[row_axis] = -1
  return jnp.where(refill_N.reshape(view), new, old)


def init_state(cfg: model_lib.ModelConfig, rows: int, max_prompt_length: int,
               max_new_tokens: int, stacked: bool, block: int = 0) -> State:
  """Every row free: an empty cache (its generated slots whole key blocks of `block`, the
  decode step's), no tokens."""
  dt = model_lib.DTYPES[cfg.dtype]
  shape = (rows, cfg.num_kv_heads, max_prompt_length, cfg.head_dim)
  if stacked:
    ks = vs = jnp.zeros((cfg.num_layers,) + shape, dt)
  else:
    ks = vs = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
  cache = decode.init_cache(ks, vs, jnp.zeros((rows, max_prompt_length), bool), cfg, 1,
                            max_new_tokens, stacked, block)
  return State(cache, jnp.zeros((rows, max_new_tokens), jnp.int32),
               jnp.zeros((rows, max_new_tokens), jnp.float32),
               jnp.zeros((rows,), jnp.int32), jnp.zeros((rows, max_new_tokens), jnp.float32))


def round_(params, state: State, refill_N, prompt_tokens_NxL, prompt_mask_NxL, rollout_ids_N,
           active_N, limit_N, budget, key, *, cfg: model_lib.ModelConfig, profile: sampling.Profile,
           eos_id, pad_id: int, mesh=None, scan_layers: bool | None = None,
           attention: str | None = None, gather_weights: bool = True,
           block: int = 0) -> tuple[State, Round]:
  """One round (module docstring). refill_N: rows that start the rollout rollout_ids_N[n]
  from prompt n; active_N: rows that hold a rollout (a refilled one, or one carried on);
  limit_N: the most tokens row n's rollout may have (max_new_tokens; a benchmark's scripted
  policy ends each row at a drawn length); budget: the most tokens a row draws this round;
  gather_weights: sampling.sample's; block: the decode step's key block (each row reads
  its own slots, the blocks up to the furthest row's: decode.step with a slot per row)."""
  sp, t = profile.sampling, profile.max_new_tokens
  n = refill_N.shape[0]
  stacked = model_lib.resolve_scan_layers(scan_layers, model_lib.platform_of(mesh))
  row_axis = 1 if stacked else 0

  def refill(state):
    logits_NxV, (ks, vs) = sampling.prefill(params, cfg, prompt_tokens_NxL, prompt_mask_NxL,
                                            scan_layers, attention, stacked_kv=stacked,
                                            mesh=mesh)
    fresh = decode.init_cache(ks, vs, prompt_mask_NxL, cfg, 1, 1, stacked)
    c = state.cache
    pick = lambda new, old: _rows_where(refill_N, new, old, row_axis)
    cache = c._replace(prompt_k=jax.tree.map(pick, fresh.prompt_k, c.prompt_k),
                       prompt_v=jax.tree.map(pick, fresh.prompt_v, c.prompt_v),
                       prompt_bias=_rows_where(refill_N, fresh.prompt_bias, c.prompt_bias, 0))
    u_NxT = state.u_NxT if sp.greedy else jnp.where(
        refill_N[:, None], uniforms(key, rollout_ids_N, t), state.u_NxT)
    token, logp, _ = distribution.draw(logits_NxV, u_NxT[:, 0], sp)
    tokens = jnp.where(refill_N[:, None], pad_id, state.tokens_NxT)
    logps = jnp.where(refill_N[:, None], 0.0, state.logp_NxT)
    tokens = tokens.at[:, 0].set(jnp.where(refill_N, token, tokens[:, 0]))
    logps = logps.at[:, 0].set(jnp.where(refill_N, logp, logps[:, 0]))
    count = jnp.where(refill_N, 1, state.count_N)
    return State(cache, tokens, logps, count, u_NxT)

  state = jax.lax.cond(jnp.any(refill_N), refill, lambda s: s, state)
  if mesh is not None:
    state = state._replace(cache=jax.lax.with_sharding_constraint(
        state.cache, sharding_lib.cache_shardings(mesh, stacked)))
  stops = None if eos_id is None else jnp.asarray(np.atleast_1d(eos_id), jnp.int32)
  rows = jnp.arange(n)

  def ended(tokens, count):
    last = tokens[rows, jnp.maximum(count - 1, 0)]
    stopped = (count > 0) & (jnp.any(last[:, None] == stops, axis=-1) if stops is not None
                             else False)
    return stopped | (count >= limit_N), stopped

  drawn0 = refill_N.astype(jnp.int32)
  weights = decode.prepare(params, cfg, stacked, mesh if gather_weights else None)
  prompt_len_N = jnp.sum(state.cache.prompt_bias[:, 0, 0] == 0.0, axis=-1).astype(jnp.int32)

  def live(carry):
    _, tokens, count, drawn, _ = carry[1]
    return active_N & ~ended(tokens, count)[0] & (drawn < budget)

  def cond(carry):
    return jnp.any(live(carry))

  def body(carry):
    cache, (logps, tokens, count, drawn, u), (live_sum, steps) = carry
    go = live(carry)
    # The row's last token is fed at its own slot (count - 1); a row that is not live
    # feeds its last token too (rewriting that slot's K/V with the same values) or, free,
    # writes slot 0, which its next refill never reads before writing.
    slot = jnp.maximum(count - 1, 0)
    fed = tokens[rows, slot]
    logits, cache = decode.step(weights, cfg, fed.reshape(n, 1), prompt_len_N + slot, slot,
                                cache, block, mesh=mesh)
    at = jnp.minimum(count, t - 1)
    u_N = None if sp.greedy else u[rows, at]
    new, logp, _ = distribution.draw(logits[:, 0], u_N, sp)
    tokens = tokens.at[rows, at].set(jnp.where(go, new, tokens[rows, at]))
    logps = logps.at[rows, at].set(jnp.where(go, logp, logps[rows, at]))
    count, drawn = count + go, drawn + go
    stats = (live_sum + jnp.sum(go), steps + 1)
    return cache, (logps, tokens, count, drawn, u), stats

  carry0 = (state.cache, (state.logp_NxT, state.tokens_NxT, state.count_N, drawn0, state.u_NxT),
            (jnp.int32(0), jnp.int32(0)))
  # (cond and body see the same carry layout: live() reads its middle part.)
  cache, (logps, tokens, count, drawn, u), (live_sum, steps) = jax.lax.while_loop(
      cond, body, carry0)
  done, stopped = ended(tokens, count)
  return (State(cache, tokens, logps, count, u),
          Round(done & active_N, stopped & active_N, drawn * active_N, live_sum, steps))


def state_shardings(mesh, stacked: bool) -> State:
  rows2, rows1 = sharding_lib.batch_sharding(mesh, 2), sharding_lib.batch_sharding(mesh, 1)
  return State(sharding_lib.cache_shardings(mesh, stacked), rows2, rows2, rows1, rows2)


def compile_round(cfg: model_lib.ModelConfig, profile: sampling.Profile, *, eos_id,
                  pad_id: int, mesh, on_trace=None, scan_layers: bool | None = None,
                  attention: str | None = None, gather_weights: bool = True,
                  block: int = 0):
  """jit(round_) with explicit shardings; the state is donated (updated in place)."""
  stacked = model_lib.resolve_scan_layers(scan_layers, model_lib.platform_of(mesh))

  def traced(params, state, refill, tokens, mask, ids, active, limit, budget, key):
    if on_trace is not None:
      on_trace()  # once per trace, i.e. once per compilation
    return round_(params, state, refill, tokens, mask, ids, active, limit, budget, key,
                  cfg=cfg, profile=profile, eos_id=eos_id, pad_id=pad_id, mesh=mesh,
                  scan_layers=scan_layers, attention=attention,
                  gather_weights=gather_weights, block=block)

  rows2, rows1 = sharding_lib.batch_sharding(mesh, 2), sharding_lib.batch_sharding(mesh, 1)
  rep = sharding_lib.replicated(mesh)
  states = state_shardings(mesh, stacked)
  return jax.jit(
      traced,
      in_shardings=(sharding_lib.param_shardings(cfg, mesh), states, rows1, rows2, rows2,
                    rows1, rows1, rows1, rep, rep),
      out_shardings=(states, Round(rows1, rows1, rows1, rep, rep)),
      donate_argnums=(1,), compiler_options=compile_options.compiler_options(mesh))


class PartialEngine(sampling.RolloutEngine):
  """The rollout engine of partial rollouts: `val` samples synchronously (sampling.sample,
  as every run validates); `train` runs only in rounds (`round`), over `rows` sampler rows
  (this process's: rows_local). The on-policy guard holds: the round program draws with the
  training profile alone, and it is the training profile's one compiled program.

  The training profile's num_samples must be 1 here (each row one rollout)."""

  def __init__(self, cfg: model_lib.ModelConfig, mesh, profiles, *, rows: int, **kwargs):
    if profiles["train"].num_samples != 1:
      raise ValueError("a partial engine's training profile samples once per row")
    self.rows = rows
    super().__init__(cfg, mesh, profiles, **kwargs)

  def _build(self, *, eos_id, share_prefix: bool):
    samplers = super()._build(eos_id=eos_id, share_prefix=share_prefix)
    self._round = compile_round(self.cfg, self.profiles["train"], eos_id=eos_id,
                                pad_id=self.pad_id, mesh=self.mesh,
                                on_trace=functools.partial(self._count, "train"),
                                scan_layers=self.scan_layers, attention=self.attention,
                                gather_weights=self.gather_weights, block=self.decode_block)
    return {"val": samplers["val"]}

  @property
  def stacked(self) -> bool:
    return model_lib.resolve_scan_layers(self.scan_layers, model_lib.platform_of(self.mesh))

  def sample(self, name: str, *args, **kwargs):
    if name == "train":
      raise ValueError("partial rollouts sample training rows in rounds (run/partial_rollouts.py)")
    return super().sample(name, *args, **kwargs)

  def programs(self, name: str, params, prompts: int, key, samples: int) -> list:
    """sampling.RolloutEngine.programs: `train` is the round program over the engine's
    sampler rows (its state, the rows' KV caches kept on the chips between rounds, an
    argument, donated); `val` the synchronous sampler."""
    if name != "train":
      return super().programs(name, params, prompts, key, samples)
    sds = jax.ShapeDtypeStruct
    n, width = self.rows * jax.process_count(), self.max_prompt_length
    program = compile_round(self.cfg, self.profile("train"), eos_id=self.eos_id,
                            pad_id=self.pad_id, mesh=self.mesh, scan_layers=self.scan_layers,
                            attention=self.attention, gather_weights=self.gather_weights,
                            block=self.decode_block)
    rows1 = lambda dtype: sds((n,), dtype)
    return [("train sampler", program.lower(
        params, self.state_like(), rows1(bool), sds((n, width), jnp.int32),
        sds((n, width), bool), rows1(jnp.int32), rows1(bool), rows1(jnp.int32),
        sds((), jnp.int32), key))]

  def round_key(self):
    """The key every training rollout's draws fold their rollout id into (`uniforms`)."""
    return self.key("train", 0)

  def init_state(self) -> State:
    """Every sampler row free (global arrays, rows over the data axes)."""
    self._check_rows(self.rows)
    rows = self.rows * jax.process_count()
    make = jax.jit(functools.partial(init_state, self.cfg, rows, self.max_prompt_length,
                                     self.profiles["train"].max_new_tokens, self.stacked,
                                     self.decode_block),
                   out_shardings=state_shardings(self.mesh, self.stacked))
    return make()

  def state_like(self) -> State:
    """The State's shapes and shardings, for restoring one from a checkpoint."""
    rows = self.rows * jax.process_count()
    shapes = jax.eval_shape(functools.partial(
        init_state, self.cfg, rows, self.max_prompt_length,
        self.profiles["train"].max_new_tokens, self.stacked, self.decode_block))
    # The shardings are a tree prefix (one per cache field: every layer's array).
    return jax.tree.map(lambda sh, sub: jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), sub),
        state_shardings(self.mesh, self.stacked), shapes)

  def round(self, params, state: State, refill_N, prompt_tokens_NxL, prompt_mask_NxL,
            rollout_ids_N, active_N, budget: int, limit_N=None):
    """One round over this process's rows (numpy inputs); the state passed in is consumed.
    limit_N: each row's most tokens (default max_new_tokens). Returns (State, Round)."""
    tokens, mask = sampling.left_pad(prompt_tokens_NxL, prompt_mask_NxL,
                                     self.max_prompt_length, self.pad_id)
    t = self.profiles["train"].max_new_tokens
    limit_N = np.full(len(refill_N), t, np.int32) if limit_N is None else np.minimum(limit_N, t)
    args = sharding_lib.to_global(self.mesh, (
        np.asarray(refill_N, bool), tokens, mask, np.asarray(rollout_ids_N, np.int32),
        np.asarray(active_N, bool), np.asarray(limit_N, np.int32)))
    return self._round(params, state, *args, np.int32(budget),
                       sharding_lib.replicate_key(self.mesh, self.round_key()))

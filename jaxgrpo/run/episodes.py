"""Multi-turn episodes: the policy samples a turn, its environment answers, and so on.

One call runs N = B * G episodes (G per prompt, prompt-major as single-turn rollouts) and
returns them as one token sequence each after the prompt:

    assistant tokens (sampled, trained) | observation tokens (appended, never trained) | ...

with the sampler's log-probs on the assistant tokens. Nothing is re-tokenized: each turn's
tokens are the sampled ids, each observation becomes ids on its own (text tokenized alone,
or chat messages rendered by the model's chat template: observations.py) and is appended,
so what the update trains is exactly what was sampled.

Per turn (turns.py, the device side): each prompt is prefilled once for its G episodes,
and the episodes' KV cache is kept on device between turns: a turn appends each live
episode's new tokens (the previous turn's last sampled token and the observation) at its
own place, one prefill of those tokens only, and decodes the turn with the engine's profile
(`train` for training, `val` for validation: every turn of an episode draws with its
profile, and no other distribution exists). A turn ends at an end token, at a stop string's
token (`env.stop_strings` and the environment's own), or after `generation.max_new_tokens`.
The host then steps the environments of the episodes whose turn ended (in worker
processes, each call limited to `env.timeout_s`: envs.py), appends their observations (at
most `env.max_observation_tokens` each, the template's framing included; longer text is cut
before templating, and counted) and starts the next turn. Episodes that ended are inactive
rows: they append and sample nothing, and with `generation.compact_stages` the turn's
decode drops them (compaction.py).

An episode ends when its environment says done, or it is truncated (the loss may mask it:
`grpo.mask_truncated_completions`) when it runs out of tokens (the completion region of
max_episode_tokens - data.max_prompt_length), out of turns (`env.max_turns`), or a turn
runs past max_new_tokens without ending. An environment that fails ends its episode with
reward None (the row leaves the loss and its group's statistics).

Random draws: turn t of episode (row r, sample g) draws from (the call's key folded with
t, the episode's global id r*G + g), and its environment's seed comes from (seed, step, r,
g): a deterministic environment gives a bitwise-exact resume, on any number of devices.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import time

import jax
import numpy as np

from jaxgrpo import data, envs, plugins
from jaxgrpo import observations as observations_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.runtime import distributed
from jaxgrpo.runtime import workers as workers_lib


@dataclasses.dataclass
class Episodes:
  """N episodes, the tokens after each prompt. Host arrays."""

  tokens_NxT: np.ndarray      # int32: assistant and observation tokens, pad after the end
  mask_NxT: np.ndarray        # bool: real tokens (both kinds)
  trained_NxT: np.ndarray     # bool: sampled tokens, the ones the loss counts
  logp_NxT: np.ndarray        # float32: the sampler's log-probs on trained tokens, else 0
  lengths_N: np.ndarray       # int32: real tokens
  truncated_N: np.ndarray     # bool: out of tokens or turns, or a turn cut at max_new_tokens
  env_reward_N: np.ndarray    # float32: the sum of the steps' rewards (0 where none)
  env_rewarded_N: np.ndarray  # bool: some step returned a reward
  # Each step's reward, kept per episode in turn order (None: that step returned none);
  # env_reward_N is their sum, the environment's part of the episode's return.
  turn_rewards: list[list[float | None]]
  failed_N: np.ndarray        # bool: the environment raised, hung or returned garbage
  # float32: the environment's own verdict, info["correct"] of the last step that gave one
  # (1/0), NaN where none did: accuracy when no configured reward is a correctness reward
  correct_N: np.ndarray
  turns_N: np.ndarray         # int32: assistant turns
  tool_calls_N: np.ndarray    # int32: info["tool_calls"] summed
  tool_errors_N: np.ndarray   # int32: info["tool_errors"] summed
  observation_tokens_N: np.ndarray  # int32
  observations: int           # observations appended
  observations_cut: int       # of which cut at max_observation_tokens
  observations_unencodable: int  # of which had text the tokenizer turned into its <unk>
  prompts: list[list[int]] | None  # per prompt: the environment's own first prompt, if any
  info: dict[str, np.ndarray]  # env/<key>: per-episode sums of numeric info values (NaN: none)
  rollout_s: float            # the sampler calls
  env_s: float                # host time in environments (resets and steps)

  @property
  def rewarded_steps_N(self) -> np.ndarray:
    """int32: the steps of each episode that returned a reward."""
    return np.array([sum(r is not None for r in t) for t in self.turn_rewards], np.int32)


def stop_ids(tokenizer, strings) -> tuple[int, ...]:
  """The token id of each stop string; ValueError naming one that is not a single token."""
  out = []
  for text in strings:
    ids = tokenizer.encode(text, add_bos=False)
    if len(ids) != 1:
      raise ValueError(f"stop string {text!r} encodes to {len(ids)} tokens {ids}; a turn can "
                       "end only at one token (a special token of the tokenizer, such as "
                       "Qwen's </tool_call>)")
    out.append(ids[0])
  return tuple(out)


def episode_seed(seed: int, step: int, row_id: int, sample: int) -> int:
  """The environment's seed of one episode: a function of these four numbers alone."""
  return int(np.random.SeedSequence([seed, step, row_id, sample]).generate_state(1)[0])


class Runner:
  """Runs episodes on a rollout engine whose profiles take one sample per context."""

  def __init__(self, engine, tokenizer, *, env_name: str, env_kwargs: str = "",
               max_turns: int, max_episode_tokens: int, max_prompt_length: int,
               max_observation_tokens: int, workers: int = 0, timeout_s: float = 60.0,
               user_modules: str = "", seed: int = 0, add_bos: bool = True, chat=None,
               tools: list[dict] | None = None, truncation_side: str = "right", log=None):
    """chat, tools: the chat template the prompts were rendered with and the tools they
    show (None: plain-text prompts), which render observations that are chat messages;
    truncation_side: where an observation's text is cut (observations.py)."""
    self.engine, self.tokenizer = engine, tokenizer
    self.env_name, self.env_kwargs = env_name, env_kwargs
    self.max_turns = max_turns
    self.renderer = observations_lib.Renderer(tokenizer, chat, tools,
                                              max_tokens=max_observation_tokens,
                                              side=truncation_side)
    self.max_prompt_length = max_prompt_length
    self.room = max_episode_tokens - max_prompt_length  # the completion region, T
    self.seed, self.add_bos = seed, add_bos
    self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    self._pool = (workers_lib.WorkerPool(workers, timeout_s,
                                         (plugins.import_modules, (user_modules,)),
                                         timeout_key="env.timeout_s", what="environment")
                  if workers > 0 else None)
    self._reported = False
    self._unencodable_reported = False  # the once-per-run warning (_check_encodable)

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None

  def rewards(self, scores, ep: "Episodes", correctness: str | None):
    """with_env_rewards: the transcripts' scores with the episodes' own rewards."""
    return with_env_rewards(scores, ep, correctness)

  def metrics(self, parts) -> dict[str, float]:
    """`metrics` over every process's episodes; parts: [(rows to count (bool [N]),
    Episodes)], one per call of `run` (validation pads its last batch)."""
    fields = [np.concatenate([getattr(ep, f)[keep] for keep, ep in parts])
              for f in METRIC_FIELDS]
    keys = distributed.union_keys(sorted({k for _, ep in parts for k in ep.info}))
    info = [np.concatenate([ep.info.get(k, np.full(len(keep), np.nan))[keep]
                            for keep, ep in parts]) for k in keys]
    gathered = distributed.gather_rows(*fields, *info)
    counts = distributed.gather_rows(np.array(
        [sum(ep.observations for _, ep in parts), sum(ep.observations_cut for _, ep in parts),
         sum(ep.observations_unencodable for _, ep in parts)]))[0].reshape(-1, 3).sum(0)
    return metrics(self.env_name, *gathered[:len(fields)], int(counts[0]), int(counts[1]),
                   dict(zip(keys, gathered[len(fields):])), int(counts[2]))

  # -------------------------------------------------------------- environment calls

  def _calls(self, tasks: list[tuple]) -> list[tuple]:
    """Runs (fn, args) tasks in the pool (or here): ("ok", value) / ("error" | "timeout", why)."""
    tasks = [(fn, args, {}) for fn, args in tasks]
    if self._pool is None:
      return [workers_lib.call(t) for t in tasks]
    return self._pool.run([pickle.dumps(t) for t in tasks])

  def _failure(self, label: str, why: str, ends: bool = True) -> None:
    """Prints the first failure's traceback in full, later ones one line each. ends: the
    failure ends its episode unscored (a reset or a step; a close changes nothing)."""
    if not self._reported:
      self._reported = True
      what = (f"its episode ends with no reward (env_errors/{self.env_name} counts them)"
              if ends else "the episode had ended; its reward stands")
      self._log(f"warning: environment {self.env_name!r} failed ({label}); {what}:\n"
                f"{why.rstrip()}")
    else:
      self._log(f"warning: environment {self.env_name!r} failed ({label}): "
                f"{why.strip().splitlines()[-1]}")

  # -------------------------------------------------------------- the episodes

  def run(self, name: str, params, prompt_tokens_BxL, prompt_mask_BxL, rows: list[dict],
          num_samples: int, *, key, step: int, row_ids_B=None, label: str = "") -> Episodes:
    """G = num_samples episodes per prompt with profile `name`; rows: the prompts' data rows;
    key: the call's key (each turn folds its index in); row_ids_B: global prompt ids (this
    process's slice of the batch), for the draws and the environments' seeds."""
    g = num_samples
    tokens_BxL, mask_BxL = np.asarray(prompt_tokens_BxL), np.asarray(prompt_mask_BxL, bool)
    b = len(tokens_BxL)
    if row_ids_B is None:
      row_ids_B = np.arange(b, dtype=np.int32) + jax.process_index() * b
    row_ids_B = np.asarray(row_ids_B, np.int64)
    episode_ids = (row_ids_B[:, None] * g + np.arange(g)[None]).reshape(-1).astype(np.int32)
    call = _Call.empty(b * g)
    new_prompts = self._reset(call, rows, g, step, row_ids_B, label)
    if new_prompts is not None:
      tokens_BxL, mask_BxL = data.pad_left(new_prompts, self.engine.pad_id,
                                           self.max_prompt_length)
    # The episodes' KV cache (turns.py): each prompt prefilled once for its G episodes, but
    # for its last token, which turn 0 appends. Each turn then appends a row's new tokens
    # (`new`: the last turn's last sampled token and the observation) at its slot (`slot`:
    # its tokens after the prompt's last already in the cache) and samples the turn.
    t0 = time.perf_counter()
    cache = self.engine.start(name, params, tokens_BxL, mask_BxL, g)
    call.t_rollout += time.perf_counter() - t0
    last_B = [int(np.asarray(tokens_BxL)[r][np.asarray(mask_BxL, bool)[r]][-1]) for r in range(b)]
    call.new = [[last_B[i // g]] for i in range(b * g)]
    for turn in range(self.max_turns):
      if not distributed.any_process(bool((~call.done).any())):
        break
      cache, out_tokens, out_len, pending = self._turn(call, name, params, cache,
                                                       jax.random.fold_in(key, turn),
                                                       episode_ids)
      self._step(call, pending, out_tokens, out_len, turn, label)
      call.t_env += self._close(call.states, call.done & call.has_state & ~call.closed,
                                call.closed, label)
    # Episodes still going after the last turn: truncated.
    call.t_env += self._close(call.states, call.has_state & ~call.closed, call.closed, label)
    return self._episodes(call, new_prompts)

  def _reset(self, call: "_Call", rows, g: int, step: int, row_ids_B, label: str):
    """One reset per episode, seeded from (seed, step, row, sample); the prompts the
    environments returned (`_own_prompts`), or None."""
    n = len(call.done)
    t0 = time.perf_counter()
    results = self._calls([
        (envs.call_reset, (self.env_name, self.env_kwargs, rows[i // g],
                           episode_seed(self.seed, step, int(row_ids_B[i // g]), i % g)))
        for i in range(n)])
    call.t_env += time.perf_counter() - t0
    own_prompts: list[list[int] | None] = [None] * n
    for i, (status, value) in enumerate(results):
      if status != "ok":
        self._failure(f"{label} reset of episode {i}", value)
        call.failed[i] = call.done[i] = True
        continue
      call.states[i], prompt = value
      call.has_state[i] = True
      if prompt is not None:
        own_prompts[i] = self.tokenizer.encode(prompt, add_bos=self.add_bos)
    new_prompts = self._own_prompts(own_prompts, g, call.failed, call.done, label)
    call.t_env += self._close(call.states, call.done & call.has_state & ~call.closed,
                              call.closed, label)
    return new_prompts

  def _turn(self, call: "_Call", name: str, params, cache, key, episode_ids):
    """One turn on the device for every live episode: its tokens kept up to the room left
    (an episode out of tokens, or whose turn did not end, is truncated). Returns (cache,
    the turn's tokens and lengths, the episodes whose environments step now)."""
    done, new = call.done, call.new
    t0 = time.perf_counter()
    rollout, cache = self.engine.turn(
        name, params, cache, call.slot, [[] if done[i] else new[i] for i in range(len(done))],
        key=key, row_ids_B=episode_ids, active_B=~done)
    out_tokens, out_logp, out_len, out_trunc = (np.asarray(x) for x in sharding_lib.to_local(
        (rollout.tokens_NxT, rollout.logp_NxT, rollout.lengths_N, rollout.truncated_N)))
    call.t_rollout += time.perf_counter() - t0
    pending = []
    for i in np.flatnonzero(~done):
      k, room = int(out_len[i]), self.room - len(call.comp[i])
      take = min(k, room)
      call.comp[i] += out_tokens[i, :take].tolist()
      call.trained[i] += [True] * take
      call.logps[i] += out_logp[i, :take].tolist()
      call.turns[i] += 1
      # The turn's tokens but its last are in the cache now (the decode loop fed them).
      call.slot[i] += len(new[i]) + k - 1
      new[i] = [int(out_tokens[i, k - 1])]
      if take < k or bool(out_trunc[i]):  # out of tokens, or the turn did not end
        call.truncated[i] = done[i] = True
      else:
        pending.append(i)
    return cache, out_tokens, out_len, pending

  def _step(self, call: "_Call", pending, out_tokens, out_len, turn: int, label: str):
    """The environments of the episodes whose turn ended read it: their rewards, counts and
    info are kept, and each observation is appended for the next turn."""
    t0 = time.perf_counter()
    results = self._calls([
        (envs.call_step, (self.env_name, self.env_kwargs, call.states[i],
                          self.tokenizer.decode(out_tokens[i, :out_len[i]],
                                                skip_special=False)))
        for i in pending])
    call.t_env += time.perf_counter() - t0
    for i, (status, value) in zip(pending, results):
      if status != "ok":
        self._failure(f"{label} turn {turn} of episode {i}", value)
        call.failed[i] = call.done[i] = True
        continue
      call.states[i], (observation, reward, finished, step_info) = value
      call.record(i, reward, step_info)
      if finished:
        call.done[i] = True
        continue
      if turn == self.max_turns - 1:  # out of turns, not finished: no turn would read
        call.truncated[i] = call.done[i] = True  # an observation, so none is appended
        continue
      if observation:
        self._append(call, i, observation, out_tokens[i, :out_len[i]].tolist(),
                     f"{label} turn {turn} of episode {i}", label)

  def _append(self, call: "_Call", i: int, observation, turn_ids, where: str, label: str):
    """Episode i's observation as tokens (observations.py), appended up to the room left
    (none left: the episode is truncated); one that cannot be rendered fails it."""
    try:
      rendered = self.renderer.render(observation, turn_ids)
    except observations_lib.ObservationError as e:
      self._failure(where, f"ObservationError: {e}\n")
      call.failed[i] = call.done[i] = True
      return
    ids = rendered.ids
    call.observations += 1
    call.cut += rendered.cut
    call.unencodable += self._check_encodable(rendered.text, label)
    room = self.room - len(call.comp[i])
    call.comp[i] += ids[:room]
    call.new[i] += ids[:room]
    call.trained[i] += [False] * min(len(ids), room)
    call.logps[i] += [0.0] * min(len(ids), room)
    call.obs_tokens[i] += min(len(ids), room)
    if len(ids) >= room:  # no room left for the next turn
      call.truncated[i] = call.done[i] = True

  def _episodes(self, call: "_Call", new_prompts) -> Episodes:
    """The call's episodes as arrays of the completion region's width."""
    n, t = len(call.done), self.room
    tokens = np.full((n, t), self.engine.pad_id, np.int32)
    mask, trained_mask = np.zeros((n, t), bool), np.zeros((n, t), bool)
    logp = np.zeros((n, t), np.float32)
    for i in range(n):
      k = len(call.comp[i])
      tokens[i, :k], mask[i, :k] = call.comp[i], True
      trained_mask[i, :k], logp[i, :k] = call.trained[i], call.logps[i]
    return Episodes(
        tokens_NxT=tokens, mask_NxT=mask, trained_NxT=trained_mask, logp_NxT=logp,
        lengths_N=mask.sum(1).astype(np.int32), truncated_N=call.truncated & ~call.failed,
        env_reward_N=call.env_reward, env_rewarded_N=call.rewarded,
        turn_rewards=call.turn_rewards, failed_N=call.failed, correct_N=call.correct,
        turns_N=call.turns, tool_calls_N=call.calls, tool_errors_N=call.tool_errors,
        observation_tokens_N=call.obs_tokens, observations=call.observations,
        observations_cut=call.cut, observations_unencodable=call.unencodable,
        prompts=new_prompts, info=call.info, rollout_s=call.t_rollout, env_s=call.t_env)

  def _close(self, states, which, closed, label: str) -> float:
    """close(state) of the episodes `which` marks (their environments' optional hook), once:
    `closed` records it. A close that fails is reported, and changes no reward. Returns the
    seconds it took (host time in environments)."""
    indices = np.flatnonzero(which)
    if not len(indices):
      return 0.0
    t0 = time.perf_counter()
    results = self._calls([(envs.call_close, (self.env_name, self.env_kwargs, states[i]))
                           for i in indices])
    closed[indices] = True
    for i, (status, value) in zip(indices, results):
      if status != "ok":
        self._failure(f"{label} close of episode {i}", value, ends=False)
    return time.perf_counter() - t0

  def _check_encodable(self, observation: str, label: str) -> int:
    """1 when the observation has text the tokenizer cannot encode (it becomes <unk>, and
    the model reads something else than the environment wrote), else 0; the first such
    observation of the run is named in one warning (observation_unencodable_count counts
    them per step)."""
    pieces = self.tokenizer.unknown_pieces([observation])[0]
    if not pieces:
      return 0
    if not self._unencodable_reported:
      self._unencodable_reported = True
      shown = ", ".join(repr(p) for p in list(dict.fromkeys(pieces))[:8])
      self._log(f"warning: environment {self.env_name!r} wrote an observation ({label}) with "
                f"text the tokenizer cannot encode: {shown}; the model reads "
                f"{self.tokenizer.hf.id_to_token(self.tokenizer.unk_id)} there instead "
                f"(first: {observation[:80]!r}); observation_unencodable_count counts such "
                "observations per step (said once per run)")
    return 1

  def _own_prompts(self, own, g: int, failed, done, label: str):
    """The prompts environments returned, one per prompt (GRPO compares the G episodes of
    one prompt, so they must agree); None when none returned one. A row whose episodes
    disagree, or whose prompt is too long, fails. An episode whose reset failed is already
    failed alone: the others of its row are compared without it."""
    if not distributed.any_process(any(p is not None for p in own)):
      return None
    out = []
    for r in range(len(own) // g):
      group = [p for i, p in enumerate(own[r * g:(r + 1) * g]) if not failed[r * g + i]]
      first = group[0] if group else None
      why = None
      if any(p != first for p in group):
        why = "reset returned different prompts for the samples of one row (GRPO compares "
        why += "the samples of one prompt: return the same Start.prompt for every seed)\n"
      elif first is not None and len(first) > self.max_prompt_length:
        why = (f"reset's prompt has {len(first)} tokens; data.max_prompt_length="
               f"{self.max_prompt_length}\n")
      if why:
        self._failure(f"{label} reset of row {r}", why)
        failed[r * g:(r + 1) * g] = done[r * g:(r + 1) * g] = True  # every episode of it
        first = None
      out.append(first if first is not None else [self.engine.pad_id])
    return out


@dataclasses.dataclass
class _Call:
  """What one `Runner.run` accumulates for its N episodes, on the host, until `_episodes`
  makes them arrays: each episode's tokens, trained flags and log-probs so far, its
  environment's state, and the counts the metrics read."""

  comp: list                  # per episode: tokens after the prompt (turns and observations)
  trained: list               # per episode: whether each of them was sampled
  logps: list                 # per episode: each token's sampler log-prob (0: observation)
  new: list                   # per episode: tokens the next turn appends to the cache
  slot: np.ndarray            # int32: tokens after the prompt's last already in the cache
  states: list                # per episode: its environment's state
  has_state: np.ndarray       # reset returned a state: close(state) is owed
  closed: np.ndarray          # close(state) was called
  env_reward: np.ndarray
  rewarded: np.ndarray
  turn_rewards: list
  failed: np.ndarray
  truncated: np.ndarray
  done: np.ndarray
  turns: np.ndarray
  calls: np.ndarray
  tool_errors: np.ndarray
  correct: np.ndarray
  obs_tokens: np.ndarray
  info: dict
  observations: int = 0
  cut: int = 0
  unencodable: int = 0
  t_env: float = 0.0
  t_rollout: float = 0.0

  @classmethod
  def empty(cls, n: int) -> "_Call":
    lists = lambda: [[] for _ in range(n)]
    flags = lambda: np.zeros(n, bool)
    counts = lambda: np.zeros(n, np.int32)
    return cls(comp=lists(), trained=lists(), logps=lists(), new=lists(),
               slot=counts(), states=[None] * n, has_state=flags(), closed=flags(),
               env_reward=np.zeros(n, np.float32), rewarded=flags(), turn_rewards=lists(),
               failed=flags(), truncated=flags(), done=flags(), turns=counts(),
               calls=counts(), tool_errors=counts(), correct=np.full(n, np.nan, np.float32),
               obs_tokens=counts(), info={})

  def record(self, i: int, reward, step_info: dict) -> None:
    """Episode i's step: its reward (None: this step gave none) and what its info counts."""
    self.turn_rewards[i].append(reward)
    if reward is not None:
      self.env_reward[i] += reward
      self.rewarded[i] = True
    self.calls[i] += int(_number(step_info.get("tool_calls", 0)))
    self.tool_errors[i] += int(_number(step_info.get("tool_errors", 0)))
    correct = step_info.get("correct")
    if _is_number(correct) or isinstance(correct, bool):
      self.correct[i] = float(correct)
    n = len(self.done)
    for k, v in step_info.items():
      if k not in ("tool_calls", "tool_errors", "correct") and _is_number(v):
        self.info.setdefault(f"env/{k}", np.full(n, np.nan))
        self.info[f"env/{k}"][i] = np.nan_to_num(self.info[f"env/{k}"][i]) + float(v)


def _is_number(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _number(v) -> float:
  return float(v) if _is_number(v) else 0.0


def with_env_rewards(scores, ep: Episodes, correctness: str | None):
  """A scorer.Scores of the transcripts with the episodes' own rewards: each episode's reward
  is its steps' rewards plus the configured rewards' total; it is scored when either scored
  it and its environment did not fail (a failed episode leaves the loss, as an unscored row
  does). `env_N` keeps the environment's part.

  Correctness (training's accuracy, validation's pass): the configured correctness reward
  when there is one; else the environment's own `info["correct"]` where it gave one; else,
  with configured rewards, total > 0 (validation: the total); with none configured (every
  weight 0: the environment's rewards alone) there is no verdict: NaN, so training's
  accuracy is left out rather than a made-up 0, and validation scores the total."""
  scored = (scores.scored_N | ep.env_rewarded_N) & ~ep.failed_N
  total = np.where(scored, scores.total_N + ep.env_reward_N, 0.0).astype(np.float32)
  env_N = np.where(ep.env_rewarded_N & ~ep.failed_N, ep.env_reward_N, np.nan)
  if correctness is not None:
    correct = np.where(ep.failed_N, np.nan, scores.correct_N).astype(np.float32)
    validation = np.nan_to_num(correct, nan=0.0).astype(np.float32)
  else:
    flag = np.where(ep.failed_N, np.nan, ep.correct_N)
    has_flag = ~np.isnan(flag)
    fallback = (np.where(scored, (total > 0).astype(np.float32), np.nan) if scores.breakdown
                else np.full(len(total), np.nan))
    correct = np.where(has_flag, flag, fallback).astype(np.float32)
    validation = np.where(has_flag, flag, np.where(scored, total, 0.0)).astype(np.float32)
  return dataclasses.replace(scores, total_N=total, scored_N=scored, validation_N=validation,
                             correct_N=correct, env_N=env_N.astype(np.float32))


# The per-episode arrays the metrics read, gathered over processes by the caller.
METRIC_FIELDS = ("turns_N", "tool_calls_N", "tool_errors_N", "observation_tokens_N",
                 "lengths_N", "failed_N", "env_reward_N", "rewarded_steps_N")


def metrics(env_name: str, turns_N, tool_calls_N, tool_errors_N, observation_tokens_N,
            lengths_N, failed_N, env_reward_N, rewarded_steps_N, observations: int,
            observations_cut: int, info: dict[str, np.ndarray],
            observations_unencodable: int = 0) -> dict[str, float]:
  """What a step (or a validation) logs of its episodes. tool_errors_fraction: of the tool
  calls, the ones that failed; episode_tokens_mean: tokens after the prompt (turns and
  observations); env_errors/<name>: the fraction of episodes whose environment failed;
  observation_unencodable_count: observations with text the tokenizer turned into <unk>;
  env/turn_reward_mean: the mean reward of a step, over every step that returned one (an
  episode's environment part is the sum of its steps': env_reward_N)."""
  calls = float(np.sum(tool_calls_N))
  out = {"turns_mean": float(np.mean(turns_N)), "turns_max": int(np.max(turns_N)),
         "tool_calls_mean": float(np.mean(tool_calls_N)),
         "tool_errors_fraction": float(np.sum(tool_errors_N) / calls) if calls else 0.0,
         "observation_tokens_mean": float(np.mean(observation_tokens_N)),
         "episode_tokens_mean": float(np.mean(lengths_N)),
         "observation_truncated_fraction": observations_cut / max(observations, 1),
         "observation_unencodable_count": observations_unencodable,
         f"env_errors/{env_name}": float(np.mean(failed_N))}
  if np.sum(rewarded_steps_N):  # left out when no step returned a reward
    out["env/turn_reward_mean"] = float(np.sum(env_reward_N) / np.sum(rewarded_steps_N))
  for key, values in sorted(info.items()):
    seen = values[~np.isnan(values)]
    if len(seen):  # a key no counted episode returned is left out, not logged as NaN
      out[key] = float(seen.mean())
  return out

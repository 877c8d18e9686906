"""The scoring seam: a rollout's tokens and its batch's rows -> rewards, for training and
validation alike.

`Scorer(...)(tokens_NxT, lengths_N, batch, repeats)` decodes the N completions and calls every
active reward with them, the reference answers and every column of the batch's rows
(`batch["rows"]`, each repeated for its `repeats` consecutive completions), the rendered
`prompts` and the `completion_ids` (rewards.py's docstring has the signature).

What a reward may return, per row:
  * a number: its score;
  * a dict with a `score` key (a number or None): its other numeric keys are logged as
    `reward/<name>/<key>` (train and val), and `pred` is the answer maj@k votes on when the
    reward is the correctness reward (registered with `pred=True`);
  * None: this reward could not score the row.
A row's total is the weighted sum of the rewards that scored it. A row that no reward scored
has `scored_N` False: GRPO leaves it out of the loss and out of its group's mean and std
(algo/grpo.py), as a masked truncated row leaves the loss. In validation such a row does not pass.

A reward's failure never stops a run. Each reward call runs in a worker process
(`reward_workers`) with a time limit (`reward_timeout_s`); the rows are split into one call
per worker, so the rewards run side by side. A call that raises or times out (its worker
is killed and replaced) is retried row by row: each worker runs its share of those rows
side by side, each row in a process of its own with the same time limit
(workers.fan_out, up to workers.FAN_OUT at once), so exactly the rows that raise or are
slow lose their score, however many they are. With R rewards, N rows and W workers a
step's scoring takes at most R x (1 + ceil(N / (W x FAN_OUT))) x reward_timeout_s, plus
the start-up of replaced workers: 2 R x reward_timeout_s while N <= 16 W. A call that returns the
wrong number of values, or a value that is not a number, a dict with a score or None: those
rows score None for that reward, an error. `errors[name]` flags
them (the trainer logs `reward_errors/<name>`, the fraction of rows), the first traceback
of each reward is printed once in full and later failures one line each.

Workers are fresh Python processes (runtime/workers.py says why) that import `config.user_modules`
before their first call; a reward goes to them as a reference to its function (module and
name), so it must be a module-level function of an importable module or of a user module.
Any other (a lambda, a closure, a function of the main script) runs in the main process, as
every reward does with `reward_workers=0`: without a time limit, its exceptions still
caught.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import sys
from typing import Any, Mapping

import numpy as np

from jaxgrpo import plugins, rewards
from jaxgrpo.runtime import workers as workers_lib


@dataclasses.dataclass(frozen=True)
class Scores:
  """A rollout's N rows scored: what training's metrics and the update, and validation,
  read."""

  completions: list[str]
  total_N: np.ndarray        # float32, weighted sum of the rewards that scored the row, else 0
  scored_N: np.ndarray       # bool, some reward scored the row (the others leave the loss)
  breakdown: dict[str, np.ndarray]  # float32 per active reward, unweighted, NaN: not scored
  extras: dict[str, np.ndarray]     # "<reward>/<key>" from dict returns, NaN where absent
  errors: dict[str, np.ndarray]     # bool per active reward: the row was lost to an error
  # Validation passes a row above val_pass_threshold: the correctness reward's values (else
  # the total), 0 where unscored. correct_N: the same values (else total > 0 as 0/1), NaN
  # where unscored, for training's accuracy.
  validation_N: np.ndarray
  correct_N: np.ndarray
  answers: list[Any] | None  # the voting reward's answers per row, when asked for
  # Multi-turn episodes: the environment's part of total_N (its steps' rewards summed),
  # NaN where it gave none (episodes.with_env_rewards); None for single-turn rollouts.
  env_N: np.ndarray | None = None


# A warning names at most this many of the rows a reward lost, then counts the rest.
MAX_NAMED_ROWS = 16


def resolve_workers(workers: int) -> int:
  """config.reward_workers: -1 is one per core, at most 8."""
  return min(8, os.cpu_count() or 1) if workers < 0 else workers


def from_config(config, tokenizer) -> "Scorer":
  """The scorer of a validated run config."""
  return Scorer(config.rewards.to_dict(), tokenizer,
                workers=resolve_workers(config.reward_workers),
                timeout_s=config.reward_timeout_s, user_modules=config.user_modules)


def _normalize(item) -> tuple[float | None, dict[str, float], Any]:
  """One row's return -> (score or None, numeric extras, pred). Raises ValueError on a value
  that is none of the allowed forms."""
  extras, pred = {}, None
  if isinstance(item, dict):
    if "score" not in item:
      raise ValueError(f"returned a dict without a 'score' key ({', '.join(map(str, item))})")
    pred = item.get("pred")
    for key, value in item.items():
      if key not in ("score", "pred") and _is_number(value) and math.isfinite(value):
        extras[str(key)] = float(value)
    item = item["score"]
  if item is None:
    return None, extras, pred
  if not _is_number(item):
    raise ValueError(f"returned {type(item).__name__} {item!r:.40}; allowed: a number, None or "
                     "a dict with a 'score' key")
  if not math.isfinite(item):
    raise ValueError(f"returned {float(item)}")
  return float(item), extras, pred


def _is_number(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, str)


def reward_call(fn, completions, answers, columns):
  """One reward call as a worker runs it (workers.call): the reward's values as a list."""
  out = fn(completions, answers, **columns)
  return None if out is None else list(out)


class Scorer:
  """The one seam from a rollout to rewards (module docstring)."""

  def __init__(self, weights: Mapping[str, float], tokenizer, *, workers: int = 0,
               timeout_s: float = 60.0, user_modules: str = "", log=None):
    self.weights = {n: float(w) for n, w in weights.items() if w != 0}
    rewards.combine(self.weights)  # checks the names and weights
    self.tokenizer = tokenizer
    self.correctness = rewards.correctness_reward(self.weights)
    self.majority = rewards.majority_reward(self.weights)
    self.workers = workers
    self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    self.timeout_s = timeout_s
    self._pool = workers_lib.WorkerPool(
        workers, timeout_s, (plugins.import_modules, (user_modules,))) if workers > 0 else None
    self._reported: set[str] = set()
    # A function goes to the workers by reference; what cannot be pickled runs here.
    self._inline = set()
    for name in self.weights:
      fn = rewards.get(name)
      try:
        pickle.dumps(fn)  # by reference: its module and name
      except Exception:  # pylint: disable=broad-except
        self._inline.add(name)
      if getattr(fn, "__module__", None) == "__main__":  # a worker has another __main__
        self._inline.add(name)
    if self._pool is not None and self._inline:
      self._log(f"warning: reward{'s' * (len(self._inline) > 1)} "
                f"{', '.join(sorted(self._inline))} cannot be sent to a worker process (not a "
                "module-level function); it runs in the main process, without reward_timeout_s")

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None

  def columns(self, batch: Mapping[str, Any], repeats: int) -> dict[str, list[Any]]:
    """Every row field but `answer`, and `prompts`, one entry per completion."""
    rows = batch["rows"]
    names = sorted({k for row in rows for k in row} - {"answer"})
    clash = sorted(set(names) & set(rewards.RESERVED_COLUMNS))
    if clash:
      raise ValueError(f"data column {clash[0]!r} is a name the scorer passes itself; "
                       f"rename it (reserved: {', '.join(rewards.RESERVED_COLUMNS)})")
    out = {k: [row.get(k) for row in rows for _ in range(repeats)] for k in names}
    out["prompts"] = [p for p in batch["prompts"] for _ in range(repeats)]
    return out

  def _run(self, calls: list[tuple[str, int, int]], completions, answers, columns,
           alone: bool = False):
    """The results of reward calls (name, first row, end row), in order. alone: the calls
    are single rows retried; the workers run them side by side, a process each
    (workers.fan_out), each worker its contiguous share."""
    results, tasks, remote = [None] * len(calls), [], []
    for i, (name, a, b) in enumerate(calls):
      task = (reward_call, (rewards.get(name), completions[a:b], answers[a:b],
                            {k: v[a:b] for k, v in columns.items()}), {})
      if self._pool is None or name in self._inline:
        results[i] = workers_lib.call(task)
      else:
        tasks.append(task)
        remote.append(i)
    if not tasks:
      return results
    if not alone:
      for i, result in zip(remote, self._pool.run([pickle.dumps(t) for t in tasks])):
        results[i] = result
      return results
    shares = min(self.workers, len(tasks))
    bounds = [(len(tasks) * c // shares, len(tasks) * (c + 1) // shares) for c in range(shares)]
    # A worker's own limit covers its share's waves and one more for forking and collecting.
    limits = [(workers_lib.fan_out_waves(b - a) + 1) * self.timeout_s for a, b in bounds]
    payloads = [pickle.dumps((workers_lib.fan_out, (tasks[a:b], self.timeout_s,
                                                    "reward_timeout_s"), {})) for a, b in bounds]
    for (a, b), (status, out) in zip(bounds, self._pool.run(payloads, limits)):
      for j in range(a, b):  # a share that failed as a whole (its worker died) fails each row
        results[remote[j]] = out[j - a] if status == "ok" else (status, out)
    return results

  def __call__(self, tokens_NxT, lengths_N, batch: Mapping[str, Any], repeats: int,
               extract: bool = False, label: str = "", trained_NxT=None) -> Scores:
    """label: where the failures printed happened (e.g. "step 12").
    trained_NxT: a multi-turn episode's sampled tokens (episodes.py): the rewards'
    `completions` are then what the policy wrote (every sampled turn, in order, without
    the observations), beside `transcripts` (every token) and `turns` (its parts)."""
    tokens_NxT, lengths_N = np.asarray(tokens_NxT), np.asarray(lengths_N)
    extra_columns = {}
    if trained_NxT is not None:
      trained_NxT = np.asarray(trained_NxT, bool)
      completions = [self.tokenizer.decode(t[:k][m[:k]], until_end=False)
                     for t, k, m in zip(tokens_NxT, lengths_N, trained_NxT)]
      extra_columns["transcripts"] = [self.tokenizer.decode(t[:k], until_end=False)
                                      for t, k in zip(tokens_NxT, lengths_N)]
      extra_columns["turns"] = [self._turns(t[:k], m[:k])
                                for t, k, m in zip(tokens_NxT, lengths_N, trained_NxT)]
    else:
      completions = self.tokenizer.decode_batch(tokens_NxT)
    n = len(completions)
    answers = [row["answer"] for row in batch["rows"] for _ in range(repeats)]
    columns = self.columns(batch, repeats)
    columns["completion_ids"] = [t[:k] for t, k in zip(tokens_NxT, lengths_N)]
    columns.update(extra_columns)
    chunks = max(1, min(self.workers, n))
    bounds = [(n * c // chunks, n * (c + 1) // chunks) for c in range(chunks)]
    calls = [(name, a, b) for name in self.weights for a, b in bounds if b > a]
    # float64 as the rewards return them: the total is rounded to float32 once, at the end.
    values = {name: np.full(n, np.nan) for name in self.weights}
    errors = {name: np.zeros(n, bool) for name in self.weights}
    extras, preds, first_error = {}, [None] * n, {}

    def take(name, a, b, result):
      """Writes one call's result; returns the rows to retry one by one, if any."""
      status, out = result
      if status == "ok" and (out is None or len(out) != b - a):
        status, out = "error", (f"returned {'None' if out is None else len(out)} values for "
                                f"{b - a} completions\n")
        errors[name][a:b] = True
        first_error.setdefault(name, out)
        return []
      if status != "ok":
        if b - a > 1:  # each row alone: only its culprits are lost
          return [(name, r, r + 1) for r in range(a, b)]
        errors[name][a:b] = True
        first_error.setdefault(name, out)
        return []
      for r, item in zip(range(a, b), out):
        try:
          score, more, pred = _normalize(item)
        except ValueError as e:
          errors[name][r] = True
          first_error.setdefault(name, f"row {r}: {e}\n")
          continue
        values[name][r] = np.nan if score is None else score
        for key, value in more.items():
          extras.setdefault(f"{name}/{key}", np.full(n, np.nan, np.float32))[r] = value
        if name == self.majority and pred is not None:
          preds[r] = pred
      return []

    retry = []
    for call, result in zip(calls, self._run(calls, completions, answers, columns)):
      retry += take(*call, result)
    if retry:
      for call, result in zip(retry, self._run(retry, completions, answers, columns, True)):
        take(*call, result)
    self._report(errors, first_error, n, label)
    scored_N, total = np.zeros(n, bool), np.zeros(n)
    for name, weight in self.weights.items():  # in the config's order, in float64
      ok = ~np.isnan(values[name])
      scored_N |= ok
      total = np.where(ok, total + weight * values[name], total)
    total_N = total.astype(np.float32)
    values = {name: v.astype(np.float32) for name, v in values.items()}
    if self.correctness is not None:
      correct_N = values[self.correctness]
      validation_N = np.nan_to_num(correct_N, nan=0.0)
    else:
      correct_N = np.where(scored_N, (total_N > 0).astype(np.float32), np.nan)
      validation_N = np.where(scored_N, total_N, 0.0).astype(np.float32)
    answers_out = None
    if extract and self.majority is not None:
      if self.majority in rewards.EXTRACTORS:
        answers_out = [rewards.EXTRACTORS[self.majority](c) for c in completions]
      else:
        answers_out = preds
    return Scores(completions, total_N, scored_N, values, extras, errors,
                  validation_N.astype(np.float32), correct_N.astype(np.float32), answers_out)

  def _turns(self, tokens, trained) -> list[dict[str, str]]:
    """An episode's parts in order: each run of sampled tokens an assistant part, each run
    of appended ones the environment's (two turns with no observation between are one)."""
    out, start = [], 0
    for i in range(1, len(tokens) + 1):
      if i == len(tokens) or trained[i] != trained[start]:
        role = "assistant" if trained[start] else "environment"
        out.append({"role": role,
                    "text": self.tokenizer.decode(tokens[start:i], until_end=False)})
        start = i
    return out

  def _report(self, errors, first_error, n: int, label: str) -> None:
    for name, rows in errors.items():
      if not rows.any():
        continue
      lost = np.flatnonzero(rows)
      named = ", ".join(map(str, lost[:MAX_NAMED_ROWS])) + (
          f" and {len(lost) - MAX_NAMED_ROWS} more" if len(lost) > MAX_NAMED_ROWS else "")
      head = (f"warning: reward {name!r} failed on {len(lost)} of {n} rows "
              f"(row{'s' * (len(lost) > 1)} {named}){f' at {label}' if label else ''}")
      text = first_error.get(name, "")
      if name not in self._reported:
        self._reported.add(name)
        self._log(f"{head}; they score None for it (its first error, in full; later ones in "
                  f"one line):\n{text.rstrip()}")
      else:
        last = [line for line in text.strip().splitlines() if line.strip()][-1:] or [""]
        self._log(f"{head}: {last[0].strip()}")

  def answers_equal(self, a: Any, b: Any) -> bool:
    """Whether two of the voting reward's answers are the same answer (None equals
    nothing): its registered equality, else ==."""
    if self.majority in rewards.EXTRACTORS:
      return rewards.answers_equal(self.majority, a, b)
    return a is not None and b is not None and bool(a == b)

"""The rollout seam: a training step, or a validation, asks one object for its batch of
sequences, scored, and does not know how they were made.

    made = build.rollouts(config, model_cfg, tokenizer, mesh, scorer=..., train_batches=...)
    got = made.source.collect("train", params, batch, samples=G, step=step)   # a Collected

Every source is a `Source`: `collect`, and what only some kinds do, with defaults (its own
step metrics, prompts it pulls itself, rollouts a checkpoint carries), so a step and the
trainer never ask which kind they run; run/build.py's `rollouts` is the one place that
chooses it (build.kind_of reads the config) and builds the engine with it. Four sources, one per way a run samples; each is
selectable and testable alone:

  SingleTurn       one sampler call: G completions per prompt (the default).
  DynamicSampling  generation batches until B informative groups are kept
                   (grpo.dynamic_sampling='filter'; run/dynamic.py holds the rule).
  EpisodeRollouts  G multi-turn episodes per prompt against the run's environment
                   (env.name; episodes.py runs the turns).
  PartialRollouts  rows decoded a budget of tokens a round, carried between steps
                   (generation.max_tokens_per_step; run/partial_rollouts.py).

Validation uses the same seam with the `val` profile (`Rollouts.val_source`: single turn
or episodes; dynamic sampling is a training rule). Its `start` dispatches the sampler and
`finish` scores, so a validation samples batch i+1 on the device while the host scores
batch i; `collect` is the two in one.

Array names end in their shape (N = B x G rows, prompt-major); everything in a Collected is
this process's rows.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from jaxgrpo import data as data_lib
from jaxgrpo import scorer as scorer_lib
from jaxgrpo.algo import dynamic
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.runtime import distributed


@dataclasses.dataclass
class Collected:
  """A batch of sequences and their scores: what an update trains on, or a validation
  measures."""

  prompt_tokens_BxL: Any  # the prompts the rows continue (episodes: the environment's own)
  prompt_mask_BxL: Any
  # The update's completion arrays, as the update takes them (device arrays for one sampler
  # call, host arrays otherwise): tokens, real-token mask, sampler log-probs, truncated.
  completion: tuple
  lengths_N: np.ndarray     # host: tokens after the prompt
  truncated_N: np.ndarray   # host: ran out of tokens (or turns) without ending
  scores: scorer_lib.Scores
  batches: list[dict]       # the prompt batches sampled (dynamic sampling: several)
  rollout_s: float          # the sampler (and, for episodes, the environments)
  reward_s: float
  generated: int | None = None  # tokens generated in all processes; None: the rows' own
  trained_NxT: np.ndarray | None = None  # episodes: the sampled tokens (observations not)
  episodes: Any = None      # episodes.Episodes, for their metrics
  metrics: dict = dataclasses.field(default_factory=dict)  # the source's own step metrics


@dataclasses.dataclass
class _Pending:
  """A dispatched sampler call, not yet scored."""
  batch: dict
  samples: int
  rollout: Any
  t0: float
  label: str


class Source:
  """What a training step collects its scored batch from. `collect` is each kind's own; the
  rest are defaults that the kinds which need them override."""

  # True: the source reads its own prompts (partial rollouts refill freed rows), and the
  # trainer hands it no batch.
  pulls_batches = False

  def collect(self, name: str, params, batch: dict | None, *, samples: int,
              step: int | None = None, label: str = "", **kwargs) -> Collected:
    raise NotImplementedError

  def step_metrics(self, got: Collected) -> dict:
    """The source's own numbers for a step's metrics row beyond `got.metrics` (episodes:
    turns, tool calls, ...); over every process's rows."""
    return {}

  def carry(self):
    """What a checkpoint holds of rollouts in flight (None: nothing; partial rollouts)."""
    return None

  def carry_like(self):
    """The abstract shapes of `carry`, for a restore (None when it carries nothing)."""
    return None

  def restore(self, carry) -> None:
    """Takes back what a checkpoint carried (`carry`)."""
    del carry


class SingleTurn(Source):
  """One sampler call per batch: `samples` completions per prompt (the profile's own)."""

  def __init__(self, engine, scorer):
    self.engine, self.scorer = engine, scorer

  def start(self, name: str, params, batch: dict, *, samples: int, step: int | None = None,
            key=None, row_ids_B=None, label: str = "", env_step=None) -> _Pending:
    """Dispatches the sampler (jax returns at once); `finish` waits and scores. step: the
    run's step (its key is folded from it); key: a fixed key instead (validation)."""
    del env_step  # episodes only
    t0 = time.perf_counter()
    rollout = self.engine.sample(name, params, batch["prompt_tokens_BxL"],
                                 batch["prompt_mask_BxL"],
                                 **({"key": key} if key is not None else {"step": step}),
                                 **({"row_ids_B": row_ids_B} if row_ids_B is not None else {}))
    return _Pending(batch, samples, rollout, t0, label)

  def finish(self, pending: _Pending, *, extract: bool = False) -> Collected:
    r = pending.rollout
    tokens_NxT, lengths_N, truncated_N = sharding_lib.to_local(
        (r.tokens_NxT, r.lengths_N, r.truncated_N))
    t_rollout = time.perf_counter() - pending.t0
    t0 = time.perf_counter()
    scores = self.scorer(tokens_NxT, lengths_N, pending.batch, pending.samples,
                         extract=extract, label=pending.label)
    return Collected(
        pending.batch["prompt_tokens_BxL"], pending.batch["prompt_mask_BxL"],
        (r.tokens_NxT, r.mask_NxT, r.logp_NxT, r.truncated_N), np.asarray(lengths_N),
        np.asarray(truncated_N), scores, [pending.batch], t_rollout,
        time.perf_counter() - t0)

  def collect(self, name: str, params, batch: dict, *, extract: bool = False,
              **kwargs) -> Collected:
    return self.finish(self.start(name, params, batch, **kwargs), extract=extract)


class EpisodeRollouts(Source):
  """`samples` multi-turn episodes per prompt (episodes.Runner), scored on their
  transcripts together with the environment's own rewards."""

  def __init__(self, engine, scorer, runner):
    self.engine, self.scorer, self.runner = engine, scorer, runner

  def step_metrics(self, got: Collected) -> dict:
    """The episodes' metrics (turns, tool calls, environment errors, ...), every process's."""
    return self.runner.metrics([(np.ones(len(got.lengths_N), bool), got.episodes)])

  def start(self, name: str, params, batch: dict, **kwargs):
    """Episodes run turn by turn with the host in between: nothing to dispatch ahead."""
    return (name, params, batch, kwargs)

  def finish(self, pending, *, extract: bool = False) -> Collected:
    name, params, batch, kwargs = pending
    return self.collect(name, params, batch, extract=extract, **kwargs)

  def collect(self, name: str, params, batch: dict, *, samples: int, step: int | None = None,
              key=None, row_ids_B=None, label: str = "", env_step: int | None = None,
              extract: bool = False) -> Collected:
    """key: the call's (default: the engine's for `step`); env_step: the step the
    environments are seeded for (default `step`; validation: 0, the same episodes at every
    validation)."""
    key = self.engine.key(name, step) if key is None else key
    ep = self.runner.run(name, params, batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"],
                         batch["rows"], samples, key=key,
                         step=step if env_step is None else env_step, row_ids_B=row_ids_B,
                         label=label)
    t0 = time.perf_counter()
    scores = self.runner.rewards(
        self.scorer(ep.tokens_NxT, ep.lengths_N, batch, samples, extract=extract, label=label,
                    trained_NxT=ep.trained_NxT),
        ep, self.scorer.correctness)
    t_reward = time.perf_counter() - t0
    # Sampled tokens only: observations are appended, not generated (every process's).
    generated = int(distributed.gather_rows(ep.trained_NxT.sum(axis=1))[0].sum())
    prompt = ((batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"]) if ep.prompts is None
              else data_lib.pad_left(ep.prompts, self.engine.pad_id,
                                     self.runner.max_prompt_length))
    return Collected(
        *prompt, (ep.tokens_NxT, ep.mask_NxT, ep.logp_NxT, ep.truncated_N), ep.lengths_N,
        ep.truncated_N, scores, [batch], ep.rollout_s + ep.env_s, t_reward,
        generated=generated, trained_NxT=ep.trained_NxT, episodes=ep,
        metrics={"env_s": ep.env_s, "sampler_s": ep.rollout_s})


class DynamicSampling(Source):
  """Generation batches of the training profile until B informative groups are kept
  (algo/dynamic.py: the rule, the bound, the fill; its docstring cites DAPO).

  Every process's rows are gathered, so every host chooses the same groups; each then keeps
  its own slice of them (rows p*B/P.. of the global batch)."""

  def __init__(self, config, engine, scorer, next_batch: Callable[[], dict]):
    self.config, self.engine, self.scorer, self.next_batch = config, engine, scorer, next_batch

  def collect(self, name: str, params, batch: dict, *, samples: int, step: int,
              label: str = "", **unused) -> Collected:
    del unused  # a fixed key or row ids: validation's, which never samples dynamically
    if name != "train":
      raise ValueError("dynamic sampling draws training batches only")
    gc, g = self.config.grpo, samples
    num, metric = gc.num_prompts_per_step, gc.dynamic_sampling_metric
    parts, flags, t_rollout, t_reward, generated = [], [], 0.0, 0.0, 0
    for j in range(gc.max_generation_batches):
      if j:
        batch = self.next_batch()
      t0 = time.perf_counter()
      # One key per (step, generation batch), folded from the step's own.
      r = self.engine.sample(name, params, batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"],
                             key=jax.random.fold_in(self.engine.key(name, step), j))
      local = sharding_lib.to_local((r.tokens_NxT, r.mask_NxT, r.logp_NxT, r.lengths_N,
                                     r.truncated_N))
      t_rollout += time.perf_counter() - t0
      t1 = time.perf_counter()
      scores = self.scorer(local[0], local[3], batch, g, label=label)
      t_reward += time.perf_counter() - t1
      values = scores.total_N if metric is None else scores.breakdown[metric]
      judged = scores.scored_N if metric is None else ~np.isnan(values)
      values_all, judged_all, lengths_all = distributed.gather_rows(values, judged, local[3])
      generated += int(lengths_all.sum())
      flags.append(dynamic.informative(values_all, judged_all, g))
      parts.append((batch, local, scores))
      if sum(int(f.sum()) for f in flags) >= num:
        break
    chosen, filled = dynamic.choose(flags, num)
    sampled = sum(len(f) for f in flags)
    metrics = {"dynamic_sampling/generation_batches": len(parts),
               "dynamic_sampling/kept_groups_fraction": float(
                   sum(f.sum() for f in flags) / sampled),
               "dynamic_sampling/filled_flat_groups": int(filled)}
    return _chosen_rows(parts, chosen, g, num, t_rollout, t_reward, generated, metrics)


def _chosen_rows(parts, chosen, g: int, num: int, t_rollout, t_reward, generated,
                 metrics) -> Collected:
  """This process's rows of the chosen groups, out of every process's rows of every
  generation batch (gathered: the global batch order)."""
  names = sorted(parts[0][2].breakdown)
  extras = distributed.union_keys({k for _, _, s in parts for k in s.extras})

  def rows(get):
    return np.concatenate([distributed.gather_rows(np.asarray(get(p)))[0] for p in parts])

  nan = lambda s: np.full(len(s.total_N), np.nan, np.float32)
  group_rows = (chosen[:, None] * g + np.arange(g)).reshape(-1)
  mine = slice(jax.process_index() * num // jax.process_count() * g,
               (jax.process_index() + 1) * num // jax.process_count() * g)
  pick = lambda get: rows(get)[group_rows][mine]  # completion rows (N = B x G)
  mine_prompts = slice(mine.start // g, mine.stop // g)
  prompt = tuple(rows(lambda p, k=k: p[0][k])[chosen][mine_prompts]
                 for k in ("prompt_tokens_BxL", "prompt_mask_BxL"))
  completion = tuple(pick(lambda p, i=i: p[1][i]) for i in (0, 1, 2, 4))
  scores = scorer_lib.Scores(
      completions=[], total_N=pick(lambda p: p[2].total_N),
      scored_N=pick(lambda p: p[2].scored_N),
      breakdown={k: pick(lambda p, k=k: p[2].breakdown[k]) for k in names},
      extras={k: pick(lambda p, k=k: p[2].extras.get(k, nan(p[2]))) for k in extras},
      errors={k: pick(lambda p, k=k: p[2].errors[k]) for k in names},
      validation_N=pick(lambda p: p[2].validation_N), correct_N=pick(lambda p: p[2].correct_N),
      answers=None)
  return Collected(*prompt, completion, pick(lambda p: p[1][3]), completion[3], scores,
                   [b for b, _, _ in parts], t_rollout, t_reward, generated=generated,
                   metrics=metrics)

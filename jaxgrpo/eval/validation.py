"""Grouped validation: k samples per prompt with the `val` profile, metrics reshaped on device.

Each of the P validation prompts is sampled k times (rows p*k .. p*k+k-1 belong to prompt p:
the sampler shares each prompt's prefill across its k samples), the completions are scored
on the host, and the scores go back to the device, where one jitted function reshapes them to
(P, k) and computes every metric; one transfer brings the metrics back.

Keys: prompt p's draws depend only on `val_seed` and p's index in the validation set, so the
same parameters give the same metrics at every step, on every rerun, and whatever the batch
size or mesh: two validations differ only because the policy did.

The validation reward of a rollout is the active correctness reward's value when there is
one (`math`, `exact_match` or a reward registered with correctness=True, unweighted; see
scorer.py), else the total weighted reward; a row that reward could not score is 0. A
rollout passes when its validation reward is > `val_pass_threshold`. With n = k samples of a prompt,
c of them passing (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):

    accuracy   mean validation reward over all P*k rollouts (its meaning does not change with k)
    pass@j     mean over prompts of 1 - C(n-c, j) / C(n, j), the unbiased estimator, for
               j = 1, 2, 4, ... < k and j = k; pass@k is the share of prompts with c > 0
    pass_k     that share, under a k-free name (only when k > 1)
    *_stderr   standard error across prompts (sample std with ddof 1 over sqrt(P))

    maj@k      share of prompts whose most frequent answer among the k samples is right
               (k > 1, and the correctness reward has an answer extractor or `pred`s: see
               voting.py)

Deviation from the paper: it estimates pass@j from n >> j samples; here n = k, so pass@k is
the plain empirical rate and the smaller j reuse the same k samples.

Sources: when the validation rows name a `source` (a column, or one per validation file),
every metric is also reported per source as `<metric>/<source>` (e.g. `pass@4/gsm8k`),
weighted by that source's prompts only, so the prompt-weighted average of the per-source
values is the overall value.

Confidence (`stop_at_validation_confidence` = c): the stop metric's one-sided lower bound at
level c is logged as `<metric>_lcb`, and the run stops only when the bound reaches the
threshold. Accuracy, a mean of per-prompt rates that is close to normal at a few hundred
prompts, uses mean - z_c * stderr; pass@j, pass_k, maj@k and reward_mean, whose per-prompt
values are 0/1 or lumpy, use a bootstrap over prompts (never over one prompt's k samples,
which are not independent draws of the prompt population), seeded by val_seed, with the
prompts' values sorted first so the bound does not depend on how prompts were split over
hosts.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.runtime import distributed
from jaxgrpo.runtime import metrics as metrics_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.eval import voting
from jaxgrpo.runtime import config_checks
from jaxgrpo import rewards


def pass_js(k: int) -> tuple[int, ...]:
  """The j of the reported pass@j: powers of two below k, and k itself."""
  js, j = [], 1
  while j < k:
    js.append(j)
    j *= 2
  return tuple(js) + (k,)


def per_prompt_metrics(k: int, majority: bool) -> list[str]:
  """The metrics with a value per prompt (those a paired comparison can difference)."""
  return ["accuracy", "reward_mean"] + [f"pass@{j}" for j in pass_js(k)] + (
      [f"maj@{k}"] if majority else []) + (["pass_k"] if k > 1 else []) + [
          "avg_length", "truncated_fraction"]


def stop_metric_names(k: int, majority: bool = False) -> list[str]:
  """The validation metrics a run may stop on, for k samples per prompt (each may also be
  named per source, `<metric>/<source>`)."""
  names = ["accuracy", "reward_mean"] + [f"pass@{j}" for j in pass_js(k)]
  names += ["pass_k"] if k > 1 else []
  return names + ([f"maj@{k}"] if majority and k > 1 else [])


def _source_metric_names(k: int, majority: bool) -> list[str]:
  names = ["accuracy", "accuracy_stderr", "reward_mean"]
  for j in pass_js(k):
    names += [f"pass@{j}", f"pass@{j}_stderr"]
  names += [f"maj@{k}", f"maj@{k}_stderr"] if majority and k > 1 else []
  names += ["pass_k"] if k > 1 else []
  return names + ["avg_length", "truncated_fraction", "num_prompts"]


def metric_names(k: int, majority: bool = False, sources: Sequence[str] = (),
                 stop_metric: str | None = None, confidence: float | None = None) -> list[str]:
  """Every metric one validation logs, in order: the overall ones, then each source's, then
  the stop metric's lower bound when the confidence rule is on."""
  per_source = _source_metric_names(k, majority)
  names = per_source + ["num_rollouts", "wall_time_s"]
  names += [f"{m}/{s}" for s in sources for m in per_source]
  if confidence is not None and stop_metric is not None:
    names.append(f"{stop_metric}_lcb")
  return names


def split_metric(name: str) -> tuple[str, str | None]:
  """'pass@4/gsm8k' -> ('pass@4', 'gsm8k'); 'accuracy' -> ('accuracy', None)."""
  base, _, source = name.partition("/")
  return base, (source or None)


def pass_at_j(c_P, n: int, j: int):
  """1 - C(n-c, j) / C(n, j) per prompt, as prod_{i<j} (n-c-i) / (n-i), exact for j <= n.

  A factor n-c-i <= 0 means fewer than j failures exist, so every j-subset holds a pass.
  """
  i = jnp.arange(j, dtype=jnp.float32)
  fail = jnp.maximum(n - c_P.astype(jnp.float32)[:, None] - i, 0.0) / (n - i)
  return 1.0 - jnp.prod(fail, axis=-1)


def grouped_metrics(scores_N, rewards_N, lengths_N, truncated_N, valid_P, source_P=None,
                    maj_P=None, *, k: int, threshold: float,
                    sources: Sequence[str] = ()) -> dict:
  """Every validation metric from N = P*k rows (prompt-major); padding prompts masked out.

  source_P: each prompt's index into `sources` (metrics are also computed per source, keyed
  `<metric>/<source>`); maj_P: 1 where the prompt's majority answer is right (maj@k is
  reported when given). Each metric's per-prompt values come back too, under '_values'
  (a dict of [P] arrays, padding included): the stop metric's lower bound and the paired
  comparison of two checkpoints (jaxgrpo/eval/paired.py) are computed from them on the host.
  """
  scores_PxK = scores_N.reshape(-1, k).astype(jnp.float32)
  c_P = jnp.sum(scores_PxK > threshold, axis=1)
  values = {"accuracy": scores_PxK.mean(axis=1),
            "reward_mean": rewards_N.reshape(-1, k).astype(jnp.float32).mean(axis=1)}
  for j in pass_js(k):
    values[f"pass@{j}"] = pass_at_j(c_P, k, j)
  if maj_P is not None:
    values[f"maj@{k}"] = maj_P.astype(jnp.float32)
  if k > 1:
    values["pass_k"] = (c_P > 0).astype(jnp.float32)
  values["avg_length"] = lengths_N.reshape(-1, k).astype(jnp.float32).mean(axis=1)
  values["truncated_fraction"] = truncated_N.reshape(-1, k).astype(jnp.float32).mean(axis=1)
  with_stderr = ("accuracy",) + tuple(f"pass@{j}" for j in pass_js(k)) + (f"maj@{k}",)

  def block(w_P, suffix):  # every metric over the prompts weighted by w_P
    p = jnp.maximum(w_P.sum(), 1.0)
    out = {}
    for name, x_P in values.items():
      mean = jnp.sum(w_P * x_P) / p
      out[name + suffix] = mean
      if name in with_stderr:
        var = jnp.sum(w_P * (x_P - mean) ** 2) / jnp.maximum(p - 1.0, 1.0)
        out[f"{name}_stderr{suffix}"] = jnp.where(p > 1, jnp.sqrt(var / p), jnp.nan)
    out["num_prompts" + suffix] = w_P.sum().astype(jnp.int32)
    return out

  w_P = valid_P.astype(jnp.float32)
  out = block(w_P, "")
  out["num_rollouts"] = out["num_prompts"] * k
  for s, name in enumerate(sources):
    out.update(block(w_P * (source_P == s), f"/{name}"))
  out["_values"] = values
  return out


def compile_metrics(mesh, k: int, threshold: float, sources: Sequence[str] = ()):
  """grouped_metrics jitted once: rows split over the data axes, scalars and the per-prompt
  values replicated (P numbers per metric: small beside one rollout)."""
  rows = sharding_lib.batch_sharding(mesh, 1)
  sources = tuple(sources)
  return jax.jit(lambda *a: grouped_metrics(*a, k=k, threshold=threshold, sources=sources),
                 in_shardings=(rows,) * 7, out_shardings=sharding_lib.replicated(mesh))


# Bootstrap resamples for the lower bound: the 5% quantile of 2000 means moves by ~0.1 of a
# stderr between seeds, small next to the bound's own distance below the mean.
BOOTSTRAP_SAMPLES = 2000
NORMAL_BOUND_METRICS = ("accuracy",)


def lower_bound(values_P, weights_P, metric: str, confidence: float, seed: int,
                mean: float | None = None, stderr: float | None = None) -> float:
  """One-sided lower confidence bound at `confidence` of the prompt mean of `metric`.

  accuracy: mean - z * stderr (z the normal quantile), as reported. Others (reward_mean,
  pass@j, pass_k, maj@k): the (1 - confidence) quantile of BOOTSTRAP_SAMPLES means of
  prompts resampled with replacement (a seeded, percentile bootstrap over prompts).
  """
  base, _ = split_metric(metric)
  if base in NORMAL_BOUND_METRICS and mean is not None:
    if stderr is None or not np.isfinite(stderr):
      return float("nan")
    return float(mean - statistics.NormalDist().inv_cdf(confidence) * stderr)
  x_P = np.sort(np.asarray(values_P, np.float64)[np.asarray(weights_P) > 0])
  if x_P.size < 2:
    return float("nan")  # one prompt says nothing about the spread
  rng = np.random.default_rng(seed)
  means = x_P[rng.integers(0, x_P.size, size=(BOOTSTRAP_SAMPLES, x_P.size))].mean(axis=1)
  return float(np.quantile(means, 1.0 - confidence))


def stop_message(metrics: Mapping[str, float], metric: str | None,
                 threshold: float | None, step: int,
                 confidence: float | None = None) -> str | None:
  """The early-stop line when `metric` >= `threshold` (with `confidence`: when its lower
  bound `<metric>_lcb` is), else None. A stop metric that this validation did not report is
  a bug, not a reason to keep training: it raises."""
  if metric is None:
    return None
  key = metric if confidence is None else f"{metric}_lcb"
  if key not in metrics:
    raise KeyError(f"stop_at_validation_metric={metric!r}: {key!r} is not among the "
                   f"validation metrics reported at step {step}: "
                   f"{', '.join(sorted(metrics))}")
  value = float(metrics[key])
  if not value >= threshold:  # NaN never stops a run
    return None
  if confidence is None:
    return (f"early stop at step {step}: val {metric}={value:.4g} reached "
            f"stop_at_validation_threshold={threshold:g}")
  return (f"early stop at step {step}: val {metric}={float(metrics[metric]):.4g}, its "
          f"{confidence:g} lower bound {value:.4g} reached "
          f"stop_at_validation_threshold={threshold:g}")


class Validator:
  """Runs one grouped validation of `params`: samples, scores, metrics, sample log.

  sources: every source name in the validation set (all hosts' rows: known at startup), in
  the order their metrics are logged; rows name theirs in batch["sources"]. stop_metric and
  confidence: the stop rule's metric gets its lower bound `<metric>_lcb` when confidence is
  set (seeded by `seed`, like the samples).

  After a call, `per_prompt` holds every metric's per-prompt values over the valid prompts
  of all hosts, sorted by prompt index, beside `prompt_index` and `source` (names, or None
  without sources); `records` holds the samples log's rows (process 0: every host's).
  """

  def __init__(self, source, batches: Sequence[dict], *, threshold: float, seed: int, mesh,
               samples_dir: str | None = None, sources: Sequence[str] = (),
               stop_metric: str | None = None, confidence: float | None = None,
               collect: bool = False, k: int | None = None):
    """source: the run's rollout seam for validation (run/build.py's Rollouts.val_source: one
    sampler call per batch, or multi-turn episodes), with its `engine`, its `scorer` (the
    seam training scores through too) and, for episodes, its `runner`. k: samples per
    prompt (default: the val profile's; episodes: their number, the profile sampling one
    turn per episode). collect: keep `records` without writing them (the evaluation command
    writes its own samples.jsonl)."""
    self.source, self.batches = source, list(batches)
    self.engine, self.scorer = source.engine, source.scorer
    self.threshold, self.seed = threshold, seed
    self.runner = getattr(source, "runner", None)
    self.k = k if k is not None else self.engine.profile("val").num_samples
    self.key = jax.random.key(seed)  # with the prompt index, the only source of randomness
    self.samples_dir, self.mesh = samples_dir, mesh
    self.sources = list(sources)
    # The correctness reward's answers, logged per sample; one sample per prompt has no
    # vote to take (maj@1 would repeat accuracy).
    self.extractor = self.scorer.majority
    self.majority = self.extractor if self.k > 1 else None
    self.stop_metric = stop_metric if confidence is not None else None
    self.confidence = confidence
    self.names = metric_names(self.k, self.majority is not None, self.sources,
                              self.stop_metric, confidence)
    self._metrics = compile_metrics(mesh, self.k, threshold, self.sources)
    # Process 0 writes every host's samples, so on a pod every host collects its own.
    self.collect = collect or samples_dir is not None or jax.process_count() > 1
    self.per_prompt, self.records = {}, []

  def __call__(self, params, step: int, progress=None) -> dict:
    """progress: called as progress(prompts_done, prompts_total, tokens, seconds) after each
    batch is scored (this process's prompts, padding excluded)."""
    t0 = time.perf_counter()
    # Dispatch every batch first: the device samples batch i+1 while the host scores batch i
    # (episodes run turn by turn with the host in between, one batch after another). The
    # same draws and episodes at every validation: a fixed key, and the environments seeded
    # as at step 0 (envs.py).
    label = f"validation at step {step}"
    extract = self.extractor is not None and bool(self.majority or self.collect)
    pending = [self.source.start("val", params, b, samples=self.k, key=self.key,
                                 row_ids_B=b["row_ids_B"], label=label, env_step=0)
               for b in self.batches]
    scores, totals, lengths, truncated, majs, records = [], [], [], [], [], []
    episode_rows = []  # per batch: (valid rows, Episodes)
    reward_rows = []  # per batch: its valid rows' Scores (for reward_errors/, reward/<key>)
    total_prompts = int(sum(b["valid_B"].sum() for b in self.batches))
    done = tokens_done = 0
    for batch, started in zip(self.batches, pending):
      got = self.source.finish(started, extract=extract)
      scored, lens, trunc = got.scores, got.lengths_N, got.truncated_N
      if got.episodes is not None:
        episode_rows.append((np.repeat(batch["valid_B"], self.k), got.episodes))
      reward_rows.append((np.repeat(batch["valid_B"], self.k), scored))
      score = scored.validation_N
      scores.append(score)
      totals.append(scored.total_N)
      lengths.append(lens)
      truncated.append(trunc)
      extracted = voting.group(scored.answers, self.k) if extract else None
      if self.majority is not None:
        majs.append(voting.maj_correct(extracted, scored.correct_N.reshape(-1, self.k),
                                       self.scorer.answers_equal))
      if self.collect:
        records += self._records(batch, scored, lens, trunc, extracted, got.episodes)
      if progress is not None:
        valid_rows = np.repeat(batch["valid_B"], self.k)
        done += int(batch["valid_B"].sum())
        tokens_done += int(np.asarray(lens)[valid_rows].sum())
        progress(done, total_prompts, tokens_done, time.perf_counter() - t0)
    valid_P = np.concatenate([b["valid_B"] for b in self.batches])
    source_P = np.asarray(
        [self.sources.index("other" if s is None else s) if self.sources else 0
         for b in self.batches for s in b["sources"]], np.int32)
    maj_P = np.concatenate(majs) if majs else np.zeros_like(valid_P, np.float32)
    # This process's rows, whole prompts each: the metrics are sums over prompts, so the
    # global array's row order (process by process) does not change them.
    metrics = jax.device_get(self._metrics(*sharding_lib.to_global(self.mesh, (
        np.concatenate(scores), np.concatenate(totals), np.concatenate(lengths),
        np.concatenate(truncated), valid_P, source_P, maj_P))))
    # The per-prompt values are in that global order too: so are the gathered rows.
    ids_P, valid_P, source_P = distributed.gather_rows(
        np.concatenate([b["row_ids_B"] for b in self.batches]), valid_P, source_P)
    values = metrics.pop("_values")  # global order, padding included
    self.per_prompt = self._per_prompt(values, ids_P, valid_P, source_P)
    if self.stop_metric is not None:
      base, source = split_metric(self.stop_metric)
      stderr_key = self.stop_metric.replace(base, f"{base}_stderr", 1)
      in_source = (np.ones_like(valid_P) if source is None
                   else source_P == self.sources.index(source))
      metrics[f"{self.stop_metric}_lcb"] = lower_bound(
          values[base], valid_P & in_source, self.stop_metric, self.confidence, self.seed,
          mean=float(metrics[self.stop_metric]),
          stderr=float(metrics[stderr_key]) if stderr_key in metrics else None)
    if jax.process_count() > 1:  # into process 0's file (the others pass samples_dir=None)
      records = sorted((r for part in distributed.gather_objects(records) for r in part),
                       key=lambda r: r["prompt_index"])
    self.records = records
    metrics["wall_time_s"] = time.perf_counter() - t0
    # In metric_names order (device_get sorts dict keys): accuracy first on every console line.
    out = {name: (int(metrics[name]) if name.split("/")[0].startswith("num_")
                  else float(metrics[name])) for name in self.names}
    # The rewards' own figures before the stop metric's bound, which stays last.
    lcb = {k: out.pop(k) for k in list(out) if k.endswith("_lcb")}
    out.update(reward_metrics(reward_rows))
    if episode_rows:
      out.update(self.runner.metrics(episode_rows))
    out.update(lcb)
    if self.samples_dir is not None:
      metrics_lib.write_jsonl(os.path.join(self.samples_dir, f"step_{step}.jsonl"), records)
    return out

  def _per_prompt(self, values, ids_P, valid_P, source_P) -> dict:
    """Every metric's per-prompt values over the valid prompts, sorted by prompt index."""
    keep = np.flatnonzero(valid_P)
    keep = keep[np.argsort(ids_P[keep], kind="stable")]
    out = {"prompt_index": ids_P[keep].astype(np.int64),
           "source": [self.sources[s] if self.sources else None for s in source_P[keep]]}
    out.update({name: np.asarray(v, np.float64)[keep] for name, v in values.items()})
    return out

  def _records(self, batch, scored, lens, trunc, extracted, episodes=None) -> list[dict]:
    """The samples log's rows: per prompt its k completions; `rewards`, each one's total
    reward (what reward_mean averages); `reward_parts`, each reward's own value, unweighted
    (what reward/<name> averages; None: it did not score the row), and with an environment
    its part under `env` (its steps' rewards summed), and `turn_rewards`, each step's reward
    in turn order (None: that step gave none); `passed`, its validation score above
    val_pass_threshold (what accuracy and pass@j count)."""
    k, out = self.k, []
    parts = dict(scored.breakdown)
    if scored.env_N is not None:
      parts["env"] = scored.env_N
    for b, valid in enumerate(batch["valid_B"]):
      if not valid:
        continue
      rows = slice(b * k, (b + 1) * k)
      record = {"prompt_index": int(batch["row_ids_B"][b]), "prompt": batch["prompts"][b],
                "answer": batch["answers"][b], "completions": scored.completions[rows],
                "rewards": [float(x) for x in scored.total_N[rows]],
                "reward_parts": {name: [None if np.isnan(x) else float(x) for x in v[rows]]
                                 for name, v in parts.items()},
                "passed": [bool(x > self.threshold) for x in scored.validation_N[rows]],
                "lengths": [int(x) for x in lens[rows]],
                "truncated": [bool(x) for x in trunc[rows]]}
      if episodes is not None:
        record["turn_rewards"] = [episodes.turn_rewards[i] for i in range(b * k, (b + 1) * k)]
      if extracted is not None:  # what the correctness reward read as each sample's answer
        record["extracted"] = [None if a is None else str(a) for a in extracted[b]]
      if self.sources:
        record["source"] = batch["sources"][b] or "other"
      out.append(record)
    return out


def reward_metrics(batches) -> dict[str, float]:
  """`reward_unscored_fraction`, `reward_errors/<name>` and the rewards' own dict keys
  `reward/<name>/<key>` over the valid rows of (valid_N, scorer.Scores) batches, every
  process's rows together (a collective: every process calls it)."""
  names = sorted(batches[0][1].breakdown) if batches else []
  extras = distributed.union_keys({k for _, s in batches for k in s.extras})

  def rows(get):
    return np.concatenate([np.asarray(get(s), np.float32)[valid] for valid, s in batches])

  nan = lambda s: np.full(len(s.total_N), np.nan, np.float32)
  unscored, *parts = distributed.gather_rows(
      rows(lambda s: ~s.scored_N), *(rows(lambda s, k=k: s.errors[k]) for k in names),
      *(rows(lambda s, k=k: s.extras.get(k, nan(s))) for k in extras))
  out = {"reward_unscored_fraction": float(unscored.mean())}
  out.update({f"reward_errors/{k}": float(v.mean()) for k, v in zip(names, parts)})
  for k, v in zip(extras, parts[len(names):]):
    v = v[~np.isnan(v)]
    out[f"reward/{k}"] = float(v.mean()) if len(v) else float("nan")
  return out


def unbiased_pass_at_j(n: int, c: int, j: int) -> float:
  """Host reference, exact in rationals: 1 - C(n-c, j) / C(n, j) (tests and tools)."""
  return 1.0 - math.comb(n - c, j) / math.comb(n, j)


def _check_stop_rule(g, weights):
  """The stop metric must be one validation reports with this k (or such a metric of one
  source, `pass@4/gsm8k`: the source is checked against the data at startup), and come
  with a threshold."""
  metric, threshold = g.stop_at_validation_metric, g.stop_at_validation_threshold
  k = g.val_num_generations_per_prompt
  names = stop_metric_names(k, rewards.majority_reward(weights) is not None)
  if g.stop_at_validation_confidence is not None and metric is None:
    config_checks.fail("grpo.stop_at_validation_confidence", g.stop_at_validation_confidence,
          "None while grpo.stop_at_validation_metric is None (it qualifies that rule)")
  if metric is None:
    if threshold is not None:
      raise config_checks.ConfigError(
          f"config.grpo.stop_at_validation_metric=None: stop_at_validation_threshold="
          f"{threshold} is set but names no metric; allowed: {', '.join(names)} (or unset "
          "the threshold)")
    return
  base, _, source = metric.partition("/")
  if "/" in metric and not source:
    config_checks.fail("grpo.stop_at_validation_metric", metric, "a metric, or a metric/source")
  if base not in names:
    j = base[len("pass@"):] if base.startswith("pass@") else ""
    if base.startswith("maj@") and rewards.majority_reward(weights) is None:
      why = ("needs a correctness reward with an answer extractor (math or exact_match) "
             "to vote on")
    elif base == "pass_k":
      why = f"reported only when val_num_generations_per_prompt > 1 (it is {k})"
    elif j.isdigit() and int(j) > k:
      why = f"needs {j} samples per prompt but val_num_generations_per_prompt={k}"
    else:
      why = "validation does not report this metric"
    raise config_checks.ConfigError(f"config.grpo.stop_at_validation_metric={metric!r}: {why}; allowed: "
                      f"{', '.join(names)} (with val_num_generations_per_prompt={k})")
  if threshold is None:
    raise config_checks.ConfigError(
        f"config.grpo.stop_at_validation_threshold=None: stop_at_validation_metric={metric!r} "
        f"needs a threshold; allowed: a number, the value of {metric} at which the run stops")


def _check_best_metric(ck, g, weights):
  """checkpoint.best_metric: a metric validation reports, at validations that run."""
  names = stop_metric_names(g.val_num_generations_per_prompt,
                                       rewards.majority_reward(weights) is not None)
  if ck.best_metric is not None and ck.best_metric.partition("/")[0] not in names:
    raise config_checks.ConfigError(
        f"config.checkpoint.best_metric={ck.best_metric!r}: validation does not report it "
        f"with val_num_generations_per_prompt={g.val_num_generations_per_prompt}; allowed: "
        f"{', '.join(names)}")
  if ck.best_metric is not None and not g.val_period:
    config_checks.fail("checkpoint.best_metric", ck.best_metric,
          "None while grpo.val_period=0 (best checkpoints are saved at validations)")


@config_checks.register(order=37)
def _check_config(c, num_devices: int) -> None:
  """The stop rule and the best checkpoint's metric: metrics this validation reports."""
  del num_devices
  _check_stop_rule(c.grpo, c.rewards)
  _check_best_metric(c.checkpoint, c.grpo, c.rewards)

"""Grouped validation: k samples per prompt with the `val` profile, metrics reshaped on device.

Each of the P validation prompts is sampled k times (rows p*k .. p*k+k-1 belong to prompt p:
the sampler shares each prompt's prefill across its k samples), the completions are scored
on the host, and the scores go back to the device, where one jitted function reshapes them to
(P, k) and computes every metric; one transfer brings the metrics back.

Keys: prompt p's draws depend only on `val_seed` and p's index in the validation set, so the
same parameters give the same metrics at every step, on every rerun, and whatever the batch
size or mesh: two validations differ only because the policy did.

The validation reward of a rollout is the task's correctness reward when one is configured
(`math` or `exact_match`, unweighted, 0 or 1), else the total weighted reward. A rollout
passes when its validation reward is > `val_pass_threshold`. With n = k samples of a prompt,
c of them passing (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):

    accuracy   mean validation reward over all P*k rollouts (its meaning does not change with k)
    pass@j     mean over prompts of 1 - C(n-c, j) / C(n, j), the unbiased estimator, for
               j = 1, 2, 4, ... < k and j = k; pass@k is the share of prompts with c > 0
    pass_k     that share, under a k-free name (only when k > 1)
    *_stderr   standard error across prompts (sample std with ddof 1 over sqrt(P))

Deviation from the paper: it estimates pass@j from n >> j samples; here n = k, so pass@k is
the plain empirical rate and the smaller j reuse the same k samples.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import distributed
from jaxgrpo import rewards as rewards_lib
from jaxgrpo import sharding as sharding_lib

# Which reward says "the answer is right", in order of preference.
CORRECTNESS_REWARDS = ("math", "exact_match")


def _correctness_reward(weights: Mapping[str, float], breakdown):
  """The first active correctness reward's per-row values, or None when none is active."""
  for name in CORRECTNESS_REWARDS:
    if weights.get(name, 0) > 0:
      return np.asarray(breakdown[name], np.float32)
  return None


def correctness(weights: Mapping[str, float], total: Sequence[float],
                breakdown: Mapping[str, Sequence[float]]) -> np.ndarray:
  """Per-row 0/1 correctness: the first active correctness reward, else total reward > 0."""
  found = _correctness_reward(weights, breakdown)
  return found if found is not None else (np.asarray(total) > 0).astype(np.float32)


def validation_rewards(weights: Mapping[str, float], total: Sequence[float],
                       breakdown: Mapping[str, Sequence[float]]) -> np.ndarray:
  """The reward validation measures: the correctness reward if any, else the total."""
  found = _correctness_reward(weights, breakdown)
  return found if found is not None else np.asarray(total, np.float32)


def pass_js(k: int) -> tuple[int, ...]:
  """The j of the reported pass@j: powers of two below k, and k itself."""
  js, j = [], 1
  while j < k:
    js.append(j)
    j *= 2
  return tuple(js) + (k,)


def stop_metric_names(k: int) -> list[str]:
  """The validation metrics a run may stop on, for k samples per prompt."""
  names = ["accuracy", "reward_mean"] + [f"pass@{j}" for j in pass_js(k)]
  return names + (["pass_k"] if k > 1 else [])


def metric_names(k: int) -> list[str]:
  """Every metric one validation logs, for k samples per prompt."""
  names = ["accuracy", "accuracy_stderr", "reward_mean"]
  for j in pass_js(k):
    names += [f"pass@{j}", f"pass@{j}_stderr"]
  names += ["pass_k"] if k > 1 else []
  return names + ["avg_length", "truncated_fraction", "num_prompts", "num_rollouts",
                  "wall_time_s"]


def pass_at_j(c_P, n: int, j: int):
  """1 - C(n-c, j) / C(n, j) per prompt, as prod_{i<j} (n-c-i) / (n-i), exact for j <= n.

  A factor n-c-i <= 0 means fewer than j failures exist, so every j-subset holds a pass.
  """
  i = jnp.arange(j, dtype=jnp.float32)
  fail = jnp.maximum(n - c_P.astype(jnp.float32)[:, None] - i, 0.0) / (n - i)
  return 1.0 - jnp.prod(fail, axis=-1)


def grouped_metrics(scores_N, rewards_N, lengths_N, truncated_N, valid_P, *, k: int,
                    threshold: float) -> dict:
  """Every validation metric from N = P*k rows (prompt-major); padding prompts masked out."""
  w_P = valid_P.astype(jnp.float32)
  p = jnp.maximum(w_P.sum(), 1.0)

  def mean_se(x_P):  # prompt-weighted mean and its standard error across prompts
    mean = jnp.sum(w_P * x_P) / p
    var = jnp.sum(w_P * (x_P - mean) ** 2) / jnp.maximum(p - 1.0, 1.0)
    return mean, jnp.where(p > 1, jnp.sqrt(var / p), jnp.nan)

  scores_PxK = scores_N.reshape(-1, k).astype(jnp.float32)
  out = {}
  out["accuracy"], out["accuracy_stderr"] = mean_se(scores_PxK.mean(axis=1))
  out["reward_mean"], _ = mean_se(rewards_N.reshape(-1, k).astype(jnp.float32).mean(axis=1))
  c_P = jnp.sum(scores_PxK > threshold, axis=1)
  for j in pass_js(k):
    out[f"pass@{j}"], out[f"pass@{j}_stderr"] = mean_se(pass_at_j(c_P, k, j))
  if k > 1:
    out["pass_k"], _ = mean_se((c_P > 0).astype(jnp.float32))
  out["avg_length"], _ = mean_se(lengths_N.reshape(-1, k).astype(jnp.float32).mean(axis=1))
  out["truncated_fraction"], _ = mean_se(
      truncated_N.reshape(-1, k).astype(jnp.float32).mean(axis=1))
  out["num_prompts"] = w_P.sum().astype(jnp.int32)
  out["num_rollouts"] = out["num_prompts"] * k
  return out


def compile_metrics(mesh, k: int, threshold: float):
  """grouped_metrics jitted once: rows split over the data axes, scalars replicated."""
  rows = sharding_lib.batch_sharding(mesh, 1)
  return jax.jit(lambda *a: grouped_metrics(*a, k=k, threshold=threshold),
                 in_shardings=(rows,) * 5, out_shardings=sharding_lib.replicated(mesh))


def stop_message(metrics: Mapping[str, float], metric: str | None,
                 threshold: float | None, step: int) -> str | None:
  """The early-stop line when `metric` >= `threshold`, else None. A stop metric that this
  validation did not report is a bug, not a reason to keep training: it raises."""
  if metric is None:
    return None
  if metric not in metrics:
    raise KeyError(f"stop_at_validation_metric={metric!r} is not among the validation "
                   f"metrics reported at step {step}: {', '.join(sorted(metrics))}")
  value = float(metrics[metric])
  if not value >= threshold:  # NaN never stops a run
    return None
  return (f"early stop at step {step}: val {metric}={value:.4g} reached "
          f"stop_at_validation_threshold={threshold:g}")


class Validator:
  """Runs one grouped validation of `params`: samples, scores, metrics, sample log."""

  def __init__(self, engine, batches: Sequence[dict], tokenizer, weights: Mapping[str, float],
               *, threshold: float, seed: int, mesh, samples_dir: str | None = None):
    self.engine, self.batches, self.tokenizer = engine, list(batches), tokenizer
    self.weights, self.threshold = dict(weights), threshold
    self.k = engine.profile("val").num_samples
    self.key = jax.random.key(seed)  # with the prompt index, the only source of randomness
    self.samples_dir, self.mesh = samples_dir, mesh
    self._metrics = compile_metrics(mesh, self.k, threshold)

  def __call__(self, params, step: int) -> dict:
    t0 = time.perf_counter()
    # Dispatch every batch first: the device samples batch i+1 while the host scores batch i.
    rollouts = [self.engine.sample("val", params, b["prompt_tokens_BxL"], b["prompt_mask_BxL"],
                                   key=self.key, row_ids_B=b["row_ids_B"])
                for b in self.batches]
    scores, totals, lengths, truncated, records = [], [], [], [], []
    for batch, rollout in zip(self.batches, rollouts):
      tokens, lens, trunc = sharding_lib.to_local((rollout.tokens_NxT, rollout.lengths_N,
                                                   rollout.truncated_N))
      completions = self.tokenizer.decode_batch(tokens)
      answers = [a for a in batch["answers"] for _ in range(self.k)]
      total, breakdown = rewards_lib.compute(self.weights, completions, answers)
      score = validation_rewards(self.weights, total, breakdown)
      scores.append(score)
      totals.append(np.asarray(total, np.float32))
      lengths.append(lens)
      truncated.append(trunc)
      records += self._records(batch, completions, score, lens, trunc)
    valid_P = np.concatenate([b["valid_B"] for b in self.batches])
    # This process's rows, whole prompts each: the metrics are sums over prompts, so the
    # global array's row order (process by process) does not change them.
    metrics = jax.device_get(self._metrics(*sharding_lib.to_global(self.mesh, (
        np.concatenate(scores), np.concatenate(totals), np.concatenate(lengths),
        np.concatenate(truncated), valid_P))))
    # Every host's samples go to process 0's file (the others pass samples_dir=None).
    records = sorted((r for part in distributed.gather_objects(records) for r in part),
                     key=lambda r: r["prompt_index"])
    metrics["wall_time_s"] = time.perf_counter() - t0
    # In metric_names order (device_get sorts dict keys): accuracy first on every console line.
    out = {name: (int(metrics[name]) if name.startswith("num_") else float(metrics[name]))
           for name in metric_names(self.k)}
    if self.samples_dir is not None:
      self._write_samples(step, records)
    return out

  def _records(self, batch, completions, score, lens, trunc) -> list[dict]:
    k, out = self.k, []
    for b, valid in enumerate(batch["valid_B"]):
      if not valid:
        continue
      rows = slice(b * k, (b + 1) * k)
      out.append({"prompt_index": int(batch["row_ids_B"][b]), "prompt": batch["prompts"][b],
                  "answer": batch["answers"][b], "completions": completions[rows],
                  "rewards": [float(x) for x in score[rows]],
                  "passed": [bool(x > self.threshold) for x in score[rows]],
                  "lengths": [int(x) for x in lens[rows]],
                  "truncated": [bool(x) for x in trunc[rows]]})
    return out

  def _write_samples(self, step: int, records: list[dict]) -> None:
    os.makedirs(self.samples_dir, exist_ok=True)
    path = os.path.join(self.samples_dir, f"step_{step}.jsonl")
    with open(path + ".tmp", "w") as f:
      for record in records:
        f.write(json.dumps(record) + "\n")
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def unbiased_pass_at_j(n: int, c: int, j: int) -> float:
  """Host reference, exact in rationals: 1 - C(n-c, j) / C(n, j) (tests and tools)."""
  return 1.0 - math.comb(n - c, j) / math.comb(n, j)

"""Validation: sample the held-out prompts with the engine's `val` profile and score them.

For now each validation prompt is sampled once, with a fixed key (a validation number must
move only when the policy moves: at temperature 1 two keys differ by about ±0.035 on 200
prompts), and `accuracy` is the mean correctness over the real (unpadded) rows. Grouped
validation (k samples per prompt, pass@k) builds on this.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np

from jaxgrpo import rewards as rewards_lib

# Which reward says "the answer is right", in order of preference; `accuracy` is its mean.
CORRECTNESS_REWARDS = ("math", "exact_match")


def correctness(weights: Mapping[str, float], total: Sequence[float],
                breakdown: Mapping[str, Sequence[float]]) -> np.ndarray:
  """Per-row 0/1 correctness: the first active correctness reward, else total reward > 0."""
  for name in CORRECTNESS_REWARDS:
    if weights.get(name, 0) > 0:
      return np.asarray(breakdown[name], np.float32)
  return (np.asarray(total) > 0).astype(np.float32)


def run(engine, params, batches, tokenizer, weights: Mapping[str, float], key) -> dict:
  """Scores every validation batch with the `val` profile and a fixed key."""
  k = engine.profile("val").num_samples
  correct, reward_sum, rows, tokens = 0.0, 0.0, 0, 0
  for i, batch in enumerate(batches):
    rollout = engine.sample("val", params, batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"],
                            key=jax.random.fold_in(key, i))
    completions = tokenizer.decode_batch(jax.device_get(rollout.tokens_NxT))
    answers = [a for a in batch["answers"] for _ in range(k)]
    total, breakdown = rewards_lib.compute(weights, completions, answers)
    valid = np.repeat(np.asarray(batch["valid_B"], bool), k)
    correct += float(correctness(weights, total, breakdown)[valid].sum())
    reward_sum += float(np.asarray(total)[valid].sum())
    rows += int(valid.sum())
    tokens += int(np.asarray(rollout.lengths_N)[valid].sum())
  return {"accuracy": correct / max(rows, 1), "reward_mean": reward_sum / max(rows, 1),
          "completion_length_mean": tokens / max(rows, 1), "num_samples": rows}

"""The paired comparison of two evaluations (jaxgrpo/eval/paired.py), on hand-computed numbers."""

import math

import jax
import numpy as np
import pytest

from jaxgrpo.run import evaluator
from jaxgrpo.model import sharding
from jaxgrpo.eval import paired, validation


def per_prompt(scores, k):
  """Per-prompt metric values from rewards, through the Validator's own jitted metrics."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  scores = np.asarray(scores, np.float32)
  p = len(scores) // k
  out = jax.device_get(validation.compile_metrics(mesh, k, 0.0)(
      scores, scores, np.ones(len(scores), np.int32), np.zeros(len(scores), bool),
      np.ones(p, bool), np.zeros(p, np.int32), np.zeros(p, np.float32)))
  values = {name: np.asarray(v, np.float64) for name, v in out["_values"].items()}
  return {"prompt_index": np.arange(p), "source": [None] * p, **values}


# Three prompts, k = 2 samples each (rewards 0 or 1):
#   prompt        A's rewards  B's rewards  accuracy A, B  difference d
#   0             1 0          1 1          0.5, 1.0       +0.5
#   1             0 0          1 0          0.0, 0.5       +0.5
#   2             1 1          1 1          1.0, 1.0        0
A = [1, 0, 0, 0, 1, 1]
B = [1, 1, 1, 0, 1, 1]


def test_hand_example_paired_excludes_zero_where_the_error_bars_overlap():
  result = paired.compare(per_prompt(A, 2), per_prompt(B, 2), ["accuracy", "pass@2"])
  acc = result["accuracy"]["all"]
  # mean d = 1/3. d - mean = (1/6, 1/6, -1/3): squares sum to 1/36 + 1/36 + 4/36 = 1/6,
  # over P - 1 = 2 gives 1/12, so the paired stderr is sqrt(1/12) / sqrt(3) = 1/6.
  assert acc["difference"] == pytest.approx(1 / 3)
  assert acc["stderr"] == pytest.approx(1 / 6)
  z = 1.959963984540054  # the 97.5% normal quantile
  assert acc["ci95"] == pytest.approx([1 / 3 - z / 6, 1 / 3 + z / 6])  # [0.0067, 0.660]
  assert acc["ci95"][0] > 0 and acc["verdict"] == "B > A"
  # Unpaired: A = (0.5, 0, 1) has stderr 0.5 / sqrt(3), B = (1, 0.5, 1) has sqrt(1/12) /
  # sqrt(3) = 1/6; together sqrt(1/12 + 1/36) = 1/3, twice the paired stderr.
  assert acc["a"] == pytest.approx(0.5) and acc["b"] == pytest.approx(5 / 6)
  assert acc["a_stderr"] == pytest.approx(0.5 / math.sqrt(3))
  assert acc["b_stderr"] == pytest.approx(1 / 6)
  assert acc["unpaired_stderr"] == pytest.approx(1 / 3)
  assert acc["unpaired_ci95"][0] < 0  # the unpaired interval holds 0 ...
  a_high = acc["a"] + z * acc["a_stderr"]
  b_low = acc["b"] - z * acc["b_stderr"]
  assert a_high > b_low  # ... and A's and B's own 95% intervals overlap
  # P * (unpaired / paired)^2 = 3 * 4: the unpaired comparison needs 12 prompts.
  assert acc["prompts_unpaired"] == pytest.approx(12)
  # pass@2 per prompt is "some sample passed": A (1, 0, 1), B (1, 1, 1); d = (0, 1, 0),
  # mean 1/3, deviations (-1/3, 2/3, -1/3): squares 6/9 over 2 = 1/3, stderr 1/3.
  p2 = result["pass@2"]["all"]
  assert p2["difference"] == pytest.approx(1 / 3) and p2["stderr"] == pytest.approx(1 / 3)
  assert p2["verdict"] == paired.NO_DIFFERENCE
  assert paired.verdict_line("accuracy", "all", acc).startswith(
      "accuracy: B > A: +0.3333 [+0.0067, +0.6600] (paired stderr 0.1667, unpaired 0.3333")


def test_a_policy_against_itself_is_exactly_zero():
  rng = np.random.default_rng(0)
  same = per_prompt(rng.integers(0, 2, 40), 4)
  for metric, groups in paired.compare(same, same, ["accuracy", "pass@4"]).items():
    d = groups["all"]
    assert d["difference"] == 0.0 and d["stderr"] == 0.0 and d["ci95"] == [0.0, 0.0], metric
    assert d["ci95_bootstrap"] == [0.0, 0.0]
    assert d["verdict"] == "no significant difference at 95%"


def test_verdicts_by_the_intervals_side_of_zero():
  assert paired.verdict(0.01, 0.2) == "B > A"
  assert paired.verdict(-0.2, -0.01) == "B < A"
  assert paired.verdict(-0.01, 0.2) == paired.NO_DIFFERENCE
  assert paired.verdict(float("nan"), float("nan")) == paired.NO_DIFFERENCE  # one prompt
  worse = paired.compare(per_prompt(B, 2), per_prompt(A, 2), ["accuracy"])
  assert worse["accuracy"]["all"]["verdict"] == "B < A"


def test_per_source_groups_and_unpaired_sets_are_refused():
  a, b = per_prompt(A + A, 2), per_prompt(B + A, 2)
  for side in (a, b):
    side["source"] = ["x", "x", "x", "y", "y", "y"]
  result = paired.compare(a, b, ["accuracy"], sources=["x", "y"])["accuracy"]
  assert result["x"]["difference"] == pytest.approx(1 / 3)  # the hand example
  assert result["y"]["difference"] == 0.0 and result["y"]["num_prompts"] == 3
  assert result["all"]["difference"] == pytest.approx(1 / 6)
  lines = evaluator.verdict_lines({"accuracy": result}, ["accuracy", "accuracy/y"], ["x", "y"])
  assert [line.split(":")[0] for line in lines] == [
      "accuracy", "accuracy/x", "accuracy/y", "accuracy/y"]
  short = dict(b, prompt_index=np.arange(1, 7))
  with pytest.raises(ValueError, match="different prompts"):
    paired.compare(a, short, ["accuracy"])


def test_bootstrap_interval_is_seeded_and_close_to_the_normal_one():
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, 2, 400).astype(float), rng.integers(0, 2, 400).astype(float)
  first, again = paired.paired_difference(a, b, seed=3), paired.paired_difference(a, b, seed=3)
  assert first["ci95_bootstrap"] == again["ci95_bootstrap"]
  width = first["ci95"][1] - first["ci95"][0]
  boot = first["ci95_bootstrap"][1] - first["ci95_bootstrap"][0]
  assert abs(boot / width - 1) < 0.1

"""Grouped validation: metric numbers by hand, row layout, keys, the stop rule."""

import fractions
import json
import math

import jax
import numpy as np
import pytest

from jaxgrpo import data, rewards, scorer
from jaxgrpo.model import sharding
from jaxgrpo.run import rollouts
from jaxgrpo.model import decoder as model
from jaxgrpo.model.tokenizer import Tokenizer
from jaxgrpo.rollout import sampling
from jaxgrpo.eval import validation

from numpy_params import random_params  # tests/numpy_params.py


def metrics_of(scores, k, valid=None, threshold=0.0, devices=1, source=None, sources=(),
               maj=None):
  """grouped_metrics through its jitted, sharded call site, as the Validator calls it."""
  scores = np.asarray(scores, np.float32)
  p = len(scores) // k
  valid = np.ones(p, bool) if valid is None else np.asarray(valid, bool)
  source = np.zeros(p, np.int32) if source is None else np.asarray(source, np.int32)
  maj = np.zeros(p, np.float32) if maj is None else np.asarray(maj, np.float32)
  mesh = sharding.make_mesh({"data": devices, "fsdp": 1, "tensor": 1},
                            devices=jax.devices()[:devices])
  fn = validation.compile_metrics(mesh, k, threshold, sources)
  out = jax.device_get(fn(scores, scores, np.full(len(scores), 3, np.int32),
                          np.zeros(len(scores), bool), valid, source, maj))
  out.pop("_values")  # the per-prompt values: tested through the Validator's per_prompt
  return {name: float(v) for name, v in out.items()}


def test_two_prompts_k4_by_hand():
  # Prompt 0: n=4, c=1. pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2;
  # pass@4 = 1 - C(3,4)/C(4,4) = 1 - 0 = 1. Prompt 1: c=0, every pass@j is 0.
  # Averages over the 2 prompts: 0.125, 0.25, 0.5; accuracy = 1/8 rollouts = 0.125.
  m = metrics_of([1, 0, 0, 0, 0, 0, 0, 0], k=4)
  assert m["accuracy"] == pytest.approx(0.125)
  assert m["pass_k"] == pytest.approx(0.5)
  assert m["pass@1"] == pytest.approx(0.125)
  assert m["pass@2"] == pytest.approx(0.25)
  assert m["pass@4"] == pytest.approx(0.5)
  assert set(k for k in m if k.startswith("pass@") and "_" not in k) == {"pass@1", "pass@2",
                                                                         "pass@4"}
  # Per-prompt means 0.25 and 0: sample std (ddof 1) = sqrt(2 * 0.125^2 / 1) = 0.1768,
  # over sqrt(2) prompts = 0.125.
  assert m["accuracy_stderr"] == pytest.approx(0.125)
  assert m["num_prompts"] == 2 and m["num_rollouts"] == 8
  assert m["avg_length"] == 3 and m["truncated_fraction"] == 0


def test_rows_are_prompt_major_and_padding_is_left_out():
  # The same rewards laid out the other way round (sample-major) would give prompt rows
  # [1,0,0,0] and [0,0,0,0] too, so use a layout where the two readings differ: with
  # prompt-major rows [1,1,0,0 | 0,0,0,0], prompt 0 has c=2 -> pass_k 0.5; read
  # sample-major, each prompt would hold one pass -> pass_k 1.0.
  m = metrics_of([1, 1, 0, 0, 0, 0, 0, 0], k=4)
  assert m["pass_k"] == pytest.approx(0.5)
  # A third, padding prompt with all passes changes nothing.
  padded = metrics_of([1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], k=4, valid=[1, 1, 0])
  assert padded == pytest.approx(m)


def test_threshold_is_strict():
  # Rewards equal to the threshold do not pass; accuracy is the plain mean either way.
  m = metrics_of([0.5, 0.5, 1.0, 0.0], k=2, threshold=0.5)
  assert m["pass@2"] == pytest.approx(0.5) and m["accuracy"] == pytest.approx(0.5)


def test_sharded_metrics_match_one_device():
  rng = np.random.default_rng(0)
  scores = (rng.random(16 * 4) < 0.3).astype(np.float32)
  assert metrics_of(scores, 4, devices=8) == pytest.approx(metrics_of(scores, 4))


def test_pass_at_j_matches_exact_combinatorics():
  # Random sample counts n, every c in 0..n at once, and random j <= n (each (n, j) compiles,
  # so a few of each): against 1 - C(n-c, j) / C(n, j) in exact rationals.
  rng = np.random.default_rng(1)
  pass_at_j = jax.jit(validation.pass_at_j, static_argnums=(1, 2))  # one compile per (n, j)
  for n in sorted(set(rng.integers(1, 33, size=6).tolist())):
    c = np.arange(n + 1)
    for j in sorted({1, n, *rng.integers(1, n + 1, size=2).tolist()}):
      got = np.asarray(pass_at_j(c, n, j))
      exact = [1 - fractions.Fraction(math.comb(n - ci, j), math.comb(n, j)) for ci in c]
      np.testing.assert_allclose(got, np.array(exact, float), atol=1e-6, err_msg=f"{n=} {j=}")


def test_per_source_metrics_weighted_by_their_prompts():
  # k=2, 4 prompts: source 0 holds prompts 0, 1 (scores [1,1], [0,1]); source 1 holds
  # prompts 2, 3 ([0,0], [1,0]). Source 0: accuracy (1 + 0.5) / 2 = 0.75, pass_k 1.0;
  # source 1: accuracy (0 + 0.5) / 2 = 0.25, pass_k 0.5. Overall accuracy 4/8 = 0.5, and
  # the prompt-weighted average of the sources, (2 * 0.75 + 2 * 0.25) / 4, is 0.5 too.
  # maj: prompts 0 and 3 voted right -> maj@2 overall 0.5, source 0: 0.5, source 1: 0.5.
  m = metrics_of([1, 1, 0, 1, 0, 0, 1, 0], k=2, source=[0, 0, 1, 1], sources=("0", "1"),
                 maj=[1, 0, 0, 1])
  assert (m["accuracy/0"], m["accuracy/1"], m["accuracy"]) == pytest.approx((0.75, 0.25, 0.5))
  assert (m["pass_k/0"], m["pass_k/1"]) == pytest.approx((1.0, 0.5))
  assert (m["num_prompts/0"], m["num_prompts/1"]) == (2, 2)
  assert (m["maj@2"], m["maj@2/0"], m["maj@2/1"]) == pytest.approx((0.5, 0.5, 0.5))
  for name in ("accuracy", "pass@1", "pass@2", "pass_k", "reward_mean", "maj@2"):
    weighted = sum(m[f"num_prompts/{s}"] * m[f"{name}/{s}"] for s in (0, 1)) / 4
    assert weighted == pytest.approx(m[name]), name
  # A padding prompt of source 1 counts nowhere.
  padded = metrics_of([1, 1, 0, 1, 0, 0, 1, 0, 1, 1], k=2, source=[0, 0, 1, 1, 1],
                      valid=[1, 1, 1, 1, 0], sources=("0", "1"), maj=[1, 0, 0, 1, 1])
  assert padded["accuracy/1"] == pytest.approx(0.25) and padded["num_prompts/1"] == 2


def test_lower_bounds():
  # Accuracy: mean - z_0.95 * stderr with z_0.95 = 1.6449 (normal quantile): 0.5 - 1.6449
  # * 0.1 = 0.3355.
  assert validation.lower_bound([], [], "accuracy", 0.95, 0, mean=0.5,
                                stderr=0.1) == pytest.approx(0.33551, abs=1e-4)
  # Bootstrap: 0/1 per prompt, 60 of 100 prompts pass. The percentile bound sits near
  # 0.6 - 1.645 * sqrt(0.6 * 0.4 / 100) = 0.519; it is seeded, ignores padding (weight 0),
  # and depends on the multiset of values, not their order (hosts split prompts
  # differently).
  x = np.array([1.0] * 60 + [0.0] * 40)
  w = np.ones(100)
  bound = validation.lower_bound(x, w, "pass_k", 0.95, seed=3)
  assert 0.50 < bound < 0.54
  assert validation.lower_bound(x[::-1], w, "pass_k", 0.95, seed=3) == bound
  padded = validation.lower_bound(np.r_[x, 1.0], np.r_[w, 0.0], "pass_k", 0.95, seed=3)
  assert padded == bound
  assert validation.lower_bound(x, w, "pass_k", 0.99, seed=3) < bound  # more confidence
  # No spread, no doubt: every prompt passes.
  assert validation.lower_bound(np.ones(50), np.ones(50), "maj@4/gsm8k", 0.95, 0) == 1.0


def test_the_validator_logs_the_stop_metrics_lower_bound_per_source(tmp_path):
  # Two sources on a real tiny model; the per-prompt values that feed the bound are the
  # stop metric's over that source's prompts only.
  rows = [dict(r, source="even" if i % 2 == 0 else "odd") for i, r in enumerate(ROWS)]
  validator, params = make_validator(sampling.SamplingParams(1.0, 1.0, 0), 2, 4, rows=rows,
                                     sources=["even", "odd"], stop_metric="pass@2/odd",
                                     confidence=0.9)
  m = validator(params, 0)
  assert list(m)[-1] == "pass@2/odd_lcb" and m["num_prompts/odd"] == 6
  assert m["pass@2/odd_lcb"] <= m["pass@2/odd"] or math.isnan(m["pass@2/odd_lcb"])
  weighted = (6 * m["accuracy/even"] + 6 * m["accuracy/odd"]) / 12
  assert weighted == pytest.approx(m["accuracy"])
  assert "maj@2/odd" in m  # exact_match has an answer extractor


def test_reported_names():
  assert validation.pass_js(1) == (1,) and validation.pass_js(8) == (1, 2, 4, 8)
  assert validation.pass_js(6) == (1, 2, 4, 6)
  assert "pass_k" not in validation.stop_metric_names(1)
  assert validation.stop_metric_names(4) == ["accuracy", "reward_mean", "pass@1", "pass@2",
                                             "pass@4", "pass_k"]
  assert "maj@4" in validation.stop_metric_names(4, majority=True)
  names = validation.metric_names(2, True, ["a", "b"], "pass@2/b", 0.9)
  assert names[:3] == ["accuracy", "accuracy_stderr", "reward_mean"]
  assert "maj@2" in names and "pass@2/a" in names and names[-1] == "pass@2/b_lcb"


def test_stop_message():
  m = {"accuracy": 0.4, "pass_k": 0.8, "pass@2": float("nan")}
  assert validation.stop_message(m, None, None, 3) is None
  assert validation.stop_message(m, "accuracy", 0.5, 3) is None
  line = validation.stop_message(m, "pass_k", 0.5, 3)  # accuracy is below, pass_k is not
  assert "step 3" in line and "pass_k=0.8" in line and "0.5" in line
  assert validation.stop_message(m, "pass@2", 0.0, 3) is None  # NaN never stops a run
  with pytest.raises(KeyError, match="pass@4.*accuracy, pass@2, pass_k"):
    validation.stop_message(m, "pass@4", 0.5, 3)
  # The confidence rule reads the bound, not the mean.
  m = {"accuracy": 0.6, "accuracy_lcb": 0.45}
  assert validation.stop_message(m, "accuracy", 0.5, 3) is not None
  assert validation.stop_message(m, "accuracy", 0.5, 3, confidence=0.95) is None
  line = validation.stop_message({"accuracy": 0.6, "accuracy_lcb": 0.55}, "accuracy", 0.5, 4,
                                 confidence=0.95)
  assert "0.95 lower bound 0.55" in line and "accuracy=0.6" in line


# --- The Validator on a real (tiny, random) model. -------------------------------------------

TOK = Tokenizer.char_level("0123456789+=")
CFG = model.ModelConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2,
                        head_dim=16, mlp_dim=64)
ROWS = data.arithmetic_examples(12, num_digits=3, seed=5)


def make_validator(val_sp, k, batch_size, tmp_path=None, devices=1, seed=0, rows=ROWS,
                   weights=None, **validator_kwargs):
  mesh = sharding.make_mesh({"data": devices, "fsdp": 1, "tensor": 1},
                            devices=jax.devices()[:devices])
  train = sampling.Profile(sampling.SamplingParams(1.0, 1.0, 0), 2, 5)
  engine = sampling.RolloutEngine(
      CFG, mesh, {"train": train, "val": sampling.Profile(val_sp, k, 5)},
      max_prompt_length=9, eos_id=TOK.eos_id, pad_id=TOK.pad_id, seed=123)
  batches = data.validation_batches(rows, TOK, batch_size, 9, process_index=0, process_count=1)
  validator = validation.Validator(
      rollouts.SingleTurn(engine, scorer.Scorer(weights or {"exact_match": 1.0}, TOK)), batches,
      threshold=0.0, seed=seed, mesh=mesh,
      samples_dir=None if tmp_path is None else str(tmp_path / "val_samples"),
      **validator_kwargs)
  params = sharding.shard_params(random_params(CFG, 0), CFG, mesh)
  return validator, params


def samples_of(tmp_path, step=0):
  with open(tmp_path / "val_samples" / f"step_{step}.jsonl") as f:
    return [json.loads(line) for line in f]


def test_val_profile_reaches_the_sampler(tmp_path, registry):
  # A reward that scores 0 and keeps what it was given: the rows' columns, as in training.
  seen = []
  rewards.register("_test_seen")(lambda c, a, **columns: seen.append(columns) or [0.0] * len(c))
  greedy, params = make_validator(sampling.SamplingParams(0.0, 1.0, 0), 4, 4, tmp_path,
                                  weights={"exact_match": 1.0, "_test_seen": 1.0})
  metrics = greedy(params, step=0)
  # 3 batches of 4 prompts x 4 samples (no workers here: one call per batch).
  assert [len(s["question"]) for s in seen] == [16, 16, 16]
  assert seen[0]["question"][:5] == [ROWS[0]["question"]] * 4 + [ROWS[1]["question"]]
  records = samples_of(tmp_path)
  assert [r["prompt_index"] for r in records] == list(range(12))  # padding rows left out
  assert metrics["num_prompts"] == 12 and metrics["num_rollouts"] == 48
  # Temperature 0: the k samples of each prompt are one and the same completion.
  assert all(len(set(r["completions"])) == 1 for r in records)
  hot, params = make_validator(sampling.SamplingParams(1.0, 1.0, 0), 4, 4, tmp_path / "hot")
  hot(params, step=0)
  # Temperature 1 on a random 16-token model: the samples of a prompt differ.
  assert sum(len(set(r["completions"])) > 1 for r in samples_of(tmp_path / "hot")) >= 10


def test_same_params_same_seed_same_metrics_whatever_the_batching(tmp_path):
  sp = sampling.SamplingParams(1.0, 1.0, 0)
  validator, params = make_validator(sp, 3, 4, tmp_path)
  first = validator(params, step=0)
  second = validator(params, step=5)
  strip = lambda m: {k: v for k, v in m.items() if k != "wall_time_s"}
  assert strip(first) == strip(second)
  assert samples_of(tmp_path, 0) == samples_of(tmp_path, 5)
  # Keys come from (val_seed, prompt index): other batch sizes and 8 devices draw the same
  # samples for every prompt.
  other, params8 = make_validator(sp, 3, 8, tmp_path / "b8", devices=8)
  assert strip(other(params8, step=0)) == pytest.approx(strip(first))
  assert samples_of(tmp_path / "b8") == samples_of(tmp_path)
  # Another val_seed draws other samples.
  reseeded, params = make_validator(sp, 3, 4, tmp_path / "s1", seed=1)
  reseeded(params, step=0)
  assert samples_of(tmp_path / "s1") != samples_of(tmp_path)


def test_each_prompts_rollouts_land_in_its_row(tmp_path):
  # Greedy, k=3: each prompt's three rows must hold what the sampler gives that prompt
  # alone (k=1), so rows were neither interleaved nor shifted between prompts.
  greedy = sampling.SamplingParams(0.0, 1.0, 0)
  grouped, params = make_validator(greedy, 3, 4, tmp_path / "k3")
  grouped(params, step=0)
  single, params = make_validator(greedy, 1, 4, tmp_path / "k1")
  single(params, step=0)
  alone = {r["prompt_index"]: r["completions"][0] for r in samples_of(tmp_path / "k1")}
  assert len(set(alone.values())) > 1  # the prompts do get different completions
  for r in samples_of(tmp_path / "k3"):
    assert r["completions"] == [alone[r["prompt_index"]]] * 3


def test_per_prompt_values_follow_the_prompt_index_on_any_mesh(tmp_path):
  # What the paired comparison (jaxgrpo/eval/paired.py) differences: every metric's value per
  # valid prompt, sorted by prompt index, whatever the batching and mesh (batch size 8 on
  # 8 devices pads 12 prompts to 16; the padding must not appear).
  rows = [dict(r, source="even" if i % 2 == 0 else "odd") for i, r in enumerate(ROWS)]
  sp = sampling.SamplingParams(1.0, 1.0, 0)
  one, params = make_validator(sp, 3, 4, rows=rows, sources=["even", "odd"], collect=True)
  m = one(params, 0)
  per = one.per_prompt
  assert list(per["prompt_index"]) == list(range(12))
  assert per["source"] == ["even", "odd"] * 6
  # The prompt means of the per-prompt values are the reported metrics.
  for name in ("accuracy", "pass@1", "pass@2", "pass@3", "maj@3", "pass_k", "avg_length"):
    assert per[name].mean() == pytest.approx(m[name], abs=1e-6), name
    assert per[name][1::2].mean() == pytest.approx(m[f"{name}/odd"], abs=1e-6), name
  # A prompt's accuracy is the mean of its samples' rewards in the records, and each
  # record names its source and the answers exact_match read (the first word).
  assert len(one.records) == 12
  for record, accuracy in zip(one.records, per["accuracy"]):
    assert np.mean(record["rewards"]) == pytest.approx(accuracy)
    assert record["extracted"] == [(c.split() or [None])[0] for c in record["completions"]]
    assert record["source"] == per["source"][record["prompt_index"]]
  eight, params8 = make_validator(sp, 3, 8, devices=8, rows=rows, sources=["even", "odd"])
  eight(params8, 0)
  for name, values in per.items():
    np.testing.assert_array_equal(eight.per_prompt[name], values)


def test_maj_at_k_votes_on_a_user_rewards_pred(tmp_path, registry):
  # A correctness reward registered with pred=True: its dicts' `pred` is what maj@k votes
  # on. Here the pred is the completion's first character, right when it is 0-4.

  @rewards.register("_test_vote", correctness=True, pred=True)
  def vote(completions, answers, **columns):
    return [{"score": float(c[:1] in tuple("01234")) if c else 0.0, "pred": c[:1] or None}
            for c in completions]

  validator, params = make_validator(sampling.SamplingParams(1.0, 1.0, 0), 4, 4, tmp_path,
                                     weights={"_test_vote": 1.0})
  metrics = validator(params, step=0)
  records = samples_of(tmp_path)
  right = []
  for r in records:  # the vote by hand: most frequent pred, first occurrence on ties
    preds = [p for p in r["extracted"] if p is not None]
    if not preds:
      right.append(0.0)
      continue
    counts = {p: preds.count(p) for p in preds}
    top = max(counts.values())
    winner = next(p for p in r["extracted"] if p is not None and counts[p] == top)
    right.append(r["rewards"][r["extracted"].index(winner)])
  assert metrics["maj@4"] == pytest.approx(sum(right) / len(right))
  # accuracy and pass@j read the user's reward too.
  scores = [x for r in records for x in r["rewards"]]
  assert metrics["accuracy"] == pytest.approx(sum(scores) / len(scores))
  assert 0 < metrics["accuracy"] < 1 and metrics["reward_errors/_test_vote"] == 0.0


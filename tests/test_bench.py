"""Tests for jaxgrpo.bench: the sampler and validation benches' JSON lines (no timing checks)."""

import json
import subprocess
import sys

import numpy as np
import pytest

import cli  # tests/cli.py
from jaxgrpo import bench
from jaxgrpo.bench import common, prefill, roofline, sampler, validation
from jaxgrpo.bench import step as bench_step

KEYS = {"bench", "preset", "mode", "n_params", "tokens_per_s", "first_call_s", "median_s",
        "all_s", "generated_tokens", "rows", "decode_steps_per_s", "jax", "device",
        "cpu_count", "loadavg_start", "loadavg_end", "workload", "sampling"}


def test_prompt_batch_matches_the_peer_workload():
  tokens, mask = common.prompt_batch()
  assert tokens.shape == mask.shape == (8, 64)  # the 33-token prompt rounds up to 64
  assert max(mask.sum(axis=1)) == 33
  # Left-padded, bos first, bytes shifted by 3.
  row = tokens[2][mask[2]].tolist()
  assert row == [1] + [b + 3 for b in b"Natalia sold 48 clips. How many?"]
  assert not mask[0, 0] and mask[:, -1].all()
  assert common.decode(row) == "Natalia sold 48 clips. How many?"


def test_presets_have_the_peer_sizes():
  # The peer reports 557,824 parameters for its tiny Qwen3 (tied embeddings, QK-norm).
  cfg = common.preset_config("tiny")
  assert (cfg.num_layers, cfg.d_model, cfg.mlp_dim, cfg.vocab_size) == (2, 128, 512, 512)
  assert cfg.qk_norm and cfg.tie_embeddings and cfg.rope_theta == 1e4


@pytest.mark.slow
def test_sampler_bench_prints_and_appends_one_json_line(tmp_path, capsys):
  out = tmp_path / "bench.jsonl"
  results = bench.main(["sampler", "--preset", "tiny", "--reps", "1", "--new_tokens", "4",
                        "--out", str(out)])
  printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  appended = [json.loads(line) for line in out.read_text().splitlines()]
  assert printed == appended == results and len(results) == 1
  r = results[0]
  assert KEYS <= set(r)
  assert (r["bench"], r["preset"], r["mode"]) == ("sampler", "tiny", "pure")
  assert r["n_params"] == 557_824
  assert r["rows"] == 32
  assert r["generated_tokens"] == 32 * 4
  assert len(r["all_s"]) == 1
  assert r["workload"]["prompt_len"] == 64 and r["workload"]["new_tokens"] == 4


@pytest.mark.parametrize("argv", [["sampler", "--reps", "0"], ["sampler", "--preset", "huge"],
                                  ["sampler", "--mode", "beam"]])
def test_bad_arguments_exit(argv):
  with pytest.raises(SystemExit):
    bench.main(argv)


@pytest.mark.slow
def test_validation_bench_reports_each_k_and_the_summary(tmp_path, capsys):
  # 64 prompts fit the config's one validation batch of 128; 3 seeds give a nonzero spread.
  out = tmp_path / "bench.jsonl"
  results = bench.main(["validation", "--ks", "2,1", "--seeds", "3", "--max_val_samples", "64",
                        "--out", str(out)])
  printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  appended = [json.loads(line) for line in out.read_text().splitlines()]
  assert printed == appended == results and len(results) == 3
  *per_k, summary = results
  assert [r["k"] for r in per_k] == [1, 2]  # sorted
  for r in per_k:
    assert {"jax", "device", "platform", "cpu_count", "loadavg_start", "loadavg_end"} <= set(r)
    assert (r["bench"], r["preset"], r["checkpoint"]) == (
        "validation", "embedded-default", "@embedded/arith3")
    assert r["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 5}
    assert r["workload"]["prompts"] == 64 and r["workload"]["rollouts"] == 64 * r["k"]
    assert r["val_seeds"] == [0, 1, 2] and len(r["accuracy"]) == len(r["all_wall_s"]) == 3
    assert all(0 <= a <= 1 for a in r["accuracy"]) and 0 <= r["pass_k_mean"] <= 1
    assert r["accuracy_mean"] == pytest.approx(sum(r["accuracy"]) / 3)
    assert r["ddof"] == 1 and r["accuracy_std_across_seeds"] > 0
    assert 0 < r["accuracy_stderr_mean"] < 1
    assert r["median_wall_s"] > 0 and r["first_call_s"] > 0
    assert r["sampler_compilations"] == 1  # seeds change the key, not the compiled shapes
  # The seeds really differ: one shared key would give one accuracy.
  assert len(set(per_k[0]["accuracy"])) > 1
  assert summary["summary"] and summary["ks"] == [1, 2] and "loadavg_end" in summary
  assert summary["std_ratio"] == pytest.approx(
      per_k[0]["accuracy_std_across_seeds"] / per_k[1]["accuracy_std_across_seeds"])
  assert summary["wall_ratio"] == pytest.approx(
      per_k[1]["median_wall_s"] / (2 * per_k[0]["median_wall_s"]))
  assert summary["std_ratio"] > 0 and summary["wall_ratio"] > 0


@pytest.mark.parametrize("argv", [["validation", "--ks", "8"], ["validation", "--ks", "0,8"],
                                  ["validation", "--ks", "1,x"], ["validation", "--seeds", "1"],
                                  ["validation", "--max_val_samples", "0"]])
def test_bad_validation_arguments_exit(argv):
  with pytest.raises(SystemExit):
    bench.main(argv)


def test_validation_bench_without_the_repository_config_fails_in_one_line(tmp_path, monkeypatch):
  # Installed without the checkout: configs/math.py is not next to the package.
  monkeypatch.setattr(common, "__file__", str(tmp_path / "jaxgrpo" / "bench" / "common.py"))
  with pytest.raises(SystemExit, match="configs/math.py not found") as e:
    common.default_config()
  assert "\n" not in str(e.value)


def test_sampler_flops_by_hand():
  # tiny: per token 2 * 557,056 matmul weights (per layer q 128x128, k and v 128x64, o
  # 128x128, MLP 3 x 128x512 = 245,760, two layers, plus the 128x512 head) = 1,114,112 FLOPs,
  # plus attention 2 layers x 2 x 2 x 4 heads x 32 = 1,024 FLOPs per key attended.
  # One call of 8 prompts x 4 samples, L = 64, T = 4: 8 x 64 prefill tokens over 64 keys,
  # then 3 decode steps of 32 rows over the 68-slot cache.
  expected = 8 * 64 * (1_114_112 + 1_024 * 64) + 32 * 3 * (1_114_112 + 1_024 * 68)
  assert sampler.sampler_flops(common.preset_config("tiny"), 8, 4, 64, 4) == expected


def test_sampler_bench_reports_its_roofline_fraction(monkeypatch):
  monkeypatch.setattr(roofline, "matmul_rate", lambda: {"flops_per_s": 1e11})
  r = bench.main(["sampler", "--preset", "tiny", "--reps", "1", "--new_tokens", "4"])[0]
  assert r["flops_per_call"] == sampler.sampler_flops(common.preset_config("tiny"), 8, 4, 64, 4)
  # median_s is printed to 0.1 ms, a few percent of this 4-token call; the rate is not rounded.
  assert r["flops_per_s"] == pytest.approx(r["flops_per_call"] / r["median_s"], rel=0.05)
  assert r["matmul_flops_per_s"] == 1e11
  assert r["roofline_fraction"] == pytest.approx(r["flops_per_s"] / 1e11, abs=1e-3)


@pytest.mark.slow
def test_prefill_bench_times_shared_and_unshared_rollouts(monkeypatch, capsys):
  monkeypatch.setattr(roofline, "matmul_rate", lambda: {"flops_per_s": 1e11})
  # Every call still runs; the clock is replaced so the figures are known. In call order:
  # the prefill (first + 2 reps), the first shared and unshared rollouts, then 2 rounds of
  # shared 1.25 ms / unshared 8.75 ms. Rounded to 0.1 ms those medians would be
  # 0.0012 / 0.0088 = 0.136, 5% off their true ratio 1.25 / 8.75 = 0.142857.
  durations = iter([(0.5, [0.01, 0.01]), (1.0, []), (1.0, []),
                    (0.0, [0.00125]), (0.0, [0.00875]), (0.0, [0.00125]), (0.0, [0.00875])])
  real_timed = common.timed

  def timed(fn, reps):
    real_timed(fn, reps)
    return next(durations)

  monkeypatch.setattr(common, "timed", timed)
  results = bench.main(["prefill", "--preset", "tiny", "--prompts", "2", "--prompt_len", "16",
                        "--samples", "2", "--new_tokens", "3", "--reps", "2"])
  assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == results
  pre, share = results
  assert (pre["kind"], share["kind"]) == ("prefill", "prefix_sharing")
  assert pre["workload"] == share["workload"] == dict(prompts=2, prompt_len=16, samples=2,
                                                      new_tokens=3, eos=None, dtype="float32")
  # XLA's count of the prefill: at least the matmul FLOPs of its 2 x 16 tokens through the
  # layers (2 x 491,520 weights each) plus the 128x512 head at each prompt's last position
  # only (a prefill returns no other logits): 2 * 16 * 983,040 + 2 * 131,072.
  assert pre["flops"] >= 2 * 16 * 983_040 + 2 * 131_072
  assert pre["roofline_fraction"] == pytest.approx(pre["flops_per_s"] / 1e11, abs=1e-3)
  assert len(share["shared_all_s"]) == len(share["unshared_all_s"]) == 2
  assert (share["shared_median_s"], share["unshared_median_s"]) == (0.00125, 0.00875)
  assert share["cost_ratio"] == 0.1429
  assert share["cost_ratio"] == pytest.approx(
      share["shared_median_s"] / share["unshared_median_s"], rel=0.001)


def test_all_runs_each_bench_for_the_preset(monkeypatch):
  seen = []

  def fake(name):
    return lambda args: seen.append((name, getattr(args, "preset", None))) or [{"bench": name}]

  monkeypatch.setattr(sampler, "run_sampler", fake("sampler"))
  monkeypatch.setattr(prefill, "run_prefill", fake("prefill"))
  monkeypatch.setattr(validation, "run_validation", fake("validation"))
  monkeypatch.setattr(bench_step, "run_step", fake("step"))
  results = bench.main(["all", "--preset", "small"])
  assert seen == [("sampler", "small"), ("step", "small"), ("prefill", "small"),
                  ("validation", None)]
  assert [r["bench"] for r in results] == ["sampler", "step", "prefill", "validation"]


@pytest.mark.parametrize("argv", [["prefill", "--prompt_len", "0"], ["prefill", "--samples", "0"],
                                  ["all", "--preset", "huge"]])
def test_bad_prefill_and_all_arguments_exit(argv):
  with pytest.raises(SystemExit):
    bench.main(argv)


@pytest.mark.slow
def test_early_stop_bench_reads_both_rules_off_one_trajectory(capsys):
  # Two tiny runs of 2 steps, validated after each: a threshold of 0 is reached by every
  # accuracy and every lower bound at the first validation (the bound of 100 prompts at
  # temperature 1 is > 0), so both rules stop at step 1 and nothing is early (accuracy >= 0).
  results = bench.main(["early-stop", "--runs", "2", "--max_steps", "2", "--val_period", "1",
                        "--threshold", "0", "--big_k", "1"])
  runs, summary = results[:-1], results[-1]
  assert [r["seed"] for r in runs] == [0, 1]
  for r in runs:
    point = r["trajectory"][0]
    assert point["step"] == 1 and point["lcb"] < point["accuracy"]
    assert 0 < point["large_sample_accuracy"] < 1
    assert r["stops"]["plain"]["step"] == r["stops"]["confidence"]["step"] == 1
  for rule in ("plain", "confidence"):
    assert summary[rule]["stopped"] == 2 and summary[rule]["early_stops"] == 0
    assert summary[rule]["mean_stop_step"] == 1
  assert summary["large_sample"] == {"prompts": 500, "k": 1}
  assert len(capsys.readouterr().out.strip().splitlines()) == 2 + 3  # progress + JSON


@pytest.mark.slow
def test_memory_bench_prints_one_line_per_point_of_the_grid(tmp_path, capsys):
  # 2 prompts x 2 rollouts: micro-batch 2 is valid, 4 is not (it is the whole batch) and is
  # skipped; each valid one with and without chunks. Compiler facts only: nothing runs.
  out = tmp_path / "memory.jsonl"
  results = bench.main(["memory", "--preset", "tiny", "--vocab", "512", "--batch_prompts", "2",
                        "--generations", "2", "--prompt_len", "8", "--new_tokens", "8",
                        "--micro_batch_sizes", "2,4", "--remat", "none", "--chunks", "0,4",
                        "--out", str(out)])
  assert [(r["micro_batch_size"], r["logprob_chunk_size"]) for r in results] == [
      (2, None), (2, 4)]
  for r in results:
    assert r["bench"] == "memory" and r["temp_bytes"] > 0 and r["argument_bytes"] > 0
  assert len(capsys.readouterr().out.strip().splitlines()) == 2
  assert [json.loads(line) for line in out.read_text().splitlines()] == results


def test_rollout_floor_and_end_ids_by_hand():
  from jaxgrpo.bench import rollout  # pylint: disable=g-import-not-at-top
  # Uniform policy over V = 1000: m ids end a row with probability m / V per token; half the
  # rows end within 100 tokens when (1 - m/V)^100 = 1/2, m = 1000 (1 - 2^-0.01) = 6.9 -> 7.
  assert rollout.end_ids(1000, 100) == tuple(range(993, 1000))
  cfg = common.preset_config("tiny")  # 2 layers, 2 KV heads x 32, float32
  kv = 2 * 2 * 2 * 32 * 4  # K and V, per layer, per head, per dim, 4 bytes
  # Rows of 2 and 3 tokens after a 4-token prompt: (4 + 5) + (4 + 5 + 6) = 24 positions;
  # the weights are read once per step of the longest row (3).
  total, parts = rollout.floor_bytes(cfg, 1000, 4, [2, 3])
  assert parts == dict(weight_bytes=1000, kv_bytes_per_position=kv, kv_positions_read=24.0)
  assert total == 3 * 1000 + 24 * kv


@pytest.mark.slow
def test_rollout_bench_eos_off_and_long_tailed(capsys):
  # With one compaction stage (generation.compact_stages; tests/test_compaction.py shows the
  # rollout is the same): the lengths below are the uncompacted sampler's too.
  results = bench.main(["rollout", "--preset", "tiny", "--reps", "1", "--modes", "pure",
                        "--new_tokens", "16", "--median_length", "4", "--bandwidth_gbs", "10",
                        "--compact_stages", "1"])
  assert [(r["mode"], r["eos"]) for r in results] == [("pure", "off"), ("pure", "longtail")]
  off, tail = results
  assert off["lengths"] == dict(min=16, median=16.0, mean=16.0, max=16)
  assert off["generated_tokens"] == 8 * 4 * 16 and off["workload"]["end_ids"] == 0
  # Long-tailed: rows end early (median near 4), the longest can reach the cap.
  assert tail["lengths"]["min"] < tail["lengths"]["median"] < 16
  assert tail["workload"]["end_ids"] == rollout_end_ids(512, 4)
  for r in results:
    assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["median_s"], rel=0.01)
    assert r["floor_s"] == pytest.approx(r["floor_bytes"] / 10e9, rel=0.01)
    assert r["floor_fraction"] == pytest.approx(r["floor_s"] / r["median_s"], rel=0.02)
    assert r["bandwidth_is"] == "given (--bandwidth_gbs)" and r["compilations"] == 1
    assert r["compact_stages"] == 1
  assert tail["floor_bytes"] < off["floor_bytes"]  # finished rows need no reads
  assert len(capsys.readouterr().out.strip().splitlines()) == 2


@pytest.mark.slow
def test_truncation_bench_times_each_mode_against_pure():
  # 4 rows of 2048 tokens, one near-flat: its top-p 0.95 nucleus is most of the vocabulary
  # (more than the 1024 candidates), the peaked rows' a few tokens.
  results = bench.main(["truncation", "--rows", "4", "--vocab", "2048", "--flat_rows", "1",
                        "--reps", "2"])
  assert [r["mode"] for r in results] == ["pure", "topk50_topp095", "topk50", "topp095"]
  for r in results:
    assert len(r["all_ms"]) == 2 and r["median_ms"] > 0 and r["first_call_s"] > 0
    assert r["vs_pure"] == pytest.approx(r["median_ms"] / results[0]["median_ms"], rel=0.01)
  nucleus = results[0]["nucleus_095_tokens"]
  assert nucleus["min"] < 100 and nucleus["max"] > 1024


def rollout_end_ids(vocab, median):
  from jaxgrpo.bench import rollout  # pylint: disable=g-import-not-at-top
  return len(rollout.end_ids(vocab, median))


@pytest.mark.slow
def test_rewards_bench_times_the_reward_step_three_ways():
  # Its own process: it sets a run up as python -m jaxgrpo.train does (absl flags parse
  # once per process).
  proc = subprocess.run([sys.executable, "-m", "jaxgrpo.bench", "rewards", "--reps", "2", "--",
                         f"--config={cli.MATH}:smoke", "--config.reward_workers=2"],
                        capture_output=True, text=True, env=cli.env(), cwd=cli.ROOT,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["bench"] == "rewards" and r["reward_workers"] == 2 and r["reps"] == 2
  assert r["rows_per_step"] == 8 * 4  # the smoke preset's B x G
  for way in ("compute", "inline", "pool"):
    assert r[f"{way}_s"] > 0 and 0 < r[f"{way}_share"] < 1
  assert r["rollout_s"] > 0 and r["update_s"] > 0


@pytest.mark.slow
def test_lora_bench_times_merge_rollout_and_update_beside_full():
  proc = subprocess.run([sys.executable, "-m", "jaxgrpo.bench", "lora", "--reps", "1", "--",
                         f"--config={cli.MATH}:smoke", "--config.model.lora_rank=4",
                         "--config.logging.trackers="],
                        capture_output=True, text=True, env=cli.env(), cwd=cli.ROOT,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["bench"] == "lora" and r["lora_rank"] == 4 and r["reps"] == 1
  assert r["lora_policy_s"] > 0 and r["full_policy_s"] >= 0
  assert r["lora_rollout_tokens_per_s"] > 0 and r["update_ratio"] > 0


def test_lora_decode_bench_weighs_merge_per_step_against_the_adapter_path():
  # The tiny shape, 2 layers x 7 targets at rank 4: A and B hold
  # 2 x 4 x (128+128 q, 128+64 k, 128+64 v, 128+128 o, 128+512 gate, 128+512 up, 512+128 down)
  # = 2 x 4 x 2816 = 22,528 adapter parameters.
  r = bench.main(["lora-decode", "--shape", "tiny", "--rank", "4", "--rows", "4",
                  "--new_tokens", "4", "--reps", "1"])[0]
  assert (r["bench"], r["shape"], r["rank"], r["new_tokens"]) == ("lora-decode", "tiny", 4, 4)
  assert r["adapter_params"] == 22_528
  for key in ("merge_s", "step_merged_s", "step_adapter_s", "rollout_s"):
    assert r[key] > 0, key
  assert r["merge_per_step_s"] == pytest.approx(r["merge_s"] + r["rollout_s"], abs=2e-4)
  assert r["adapter_path_s"] == pytest.approx(
      r["rollout_s"] + 4 * r["adapter_extra_per_token_s"], abs=2e-4)
  assert r["faster"] in ("merge per step", "adapter path")


def test_packing_bench_runs_padded_and_packed_side_by_side(tmp_path):
  # Issue 51: 2 prompts x 4 rollouts whose completion lengths come from a file (3, 30, 5,
  # 1, cycled) of up to 32 new tokens after 8-token prompts: the padded whole batch and
  # packed rows of one longest sequence (40 tokens) report the same loss, less padding
  # packed, and the layout each ran.
  lengths = tmp_path / "lengths.txt"
  lengths.write_text("3\n30\n5\n1\n")
  results = bench.main(["packing", "--prompts", "2", "--generations", "4", "--prompt_len",
                        "8", "--new_tokens", "32", "--lengths", str(lengths), "--budgets", "1",
                        "--reps", "1"])
  padded, packed = results
  assert (padded["layout"], packed["layout"], packed["micro_batch_tokens"]) == (
      "padded", "packed", 40)
  assert (padded["completion_max"], padded["completion_median"]) == (30, 4.0)
  assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-7)
  assert packed["padding_fraction"] < padded["padding_fraction"]
  assert packed["micro_batches"] >= 1 and padded["ratio_to_padded_whole"] == 1.0


def test_at_the_staleness_bound_no_group_is_lost_and_long_answers_train_as_often(tmp_path):
  """Issue 63: groups past max_staleness were dropped after drawing, and never re-queued,
  so the prompts that draw long answers were under-trained. Lengths by rollout id 2 (six
  times) then 30 twice, cycled: one group in four is all long, taking R = 8 rounds of 4 of
  32 tokens, while the short ones end a step in a round. Below the bound (max_staleness
  1 < R - 1 = 7) long groups are dropped: the trained answers are half the synchronous
  mode's length (measured 0.55). At the bound none is dropped, and over 24 steps the
  trained length is the synchronous one's but for the long groups still in flight at the
  end (measured 0.94; it tends to 1 with the steps)."""
  lengths = tmp_path / "lengths.txt"
  lengths.write_text("2\n" * 6 + "30\n" * 2)
  args = ["long-tail", "--prompts", "2", "--generations", "2", "--prompt_len", "4",
          "--new_tokens", "32", "--lengths", str(lengths), "--max_tokens_per_step", "4",
          "--steps", "24"]
  _, below = bench.main([*args, "--max_staleness", "1"])
  assert below["dropped_groups"] > 0 and below["trained_length_ratio"] < 0.7
  sync, part = bench.main([*args, "--max_staleness", "7"])
  assert sync["trained_length_mean"] == 9  # (3 x 2 + 30) / 4: the drawn mix, all trained
  assert part["dropped_groups"] == 0 and part["trained_length_ratio"] >= 0.9


def test_context_imbalance_counts_each_chips_causal_pairs_by_hand():
  # Issue 63's figure, the contiguous split: one sequence of 2 prompt + 6 completion
  # tokens fills a packed row of 8 split over 2 context chips. Position j attends to j + 1
  # keys: chip 0 (positions 0-3) 1 + 2 + 3 + 4 = 10 pairs, chip 1 (4-7) 5 + 6 + 7 + 8 = 26;
  # max / mean = 26 / 18. Two sequences of 4 instead: 10 and 10, even.
  from jaxgrpo.bench import packing as bench_packing  # pylint: disable=g-import-not-at-top
  batch = {"prompt_mask_BxL": np.array([[True, True]])}
  assert bench_packing.context_spread(batch, np.array([6]), 2, 8) == pytest.approx(26 / 18)
  two = {"prompt_mask_BxL": np.array([[True, True], [True, True]])}
  assert bench_packing.context_spread(two, np.array([2, 2]), 2, 8) == pytest.approx(1.0)


def test_long_tail_bench_runs_synchronous_and_partial_side_by_side(tmp_path):
  # Issue 52: lengths from a file (2, 30, cycled by rollout id), so each group of G = 2 has
  # one row of 2 tokens and one of 30. Synchronous: a step of 2 groups decodes 29 steps
  # after the prefill's first token, for 2 x (2 + 30) = 64 trained tokens: 29/64 decode
  # steps a token; live rows 2 x 1 + 2 x 29 of 4 x 29 slots = 0.517. Partial rounds of 4
  # tokens refill the short rows at once: fewer decode steps a trained token.
  lengths = tmp_path / "lengths.txt"
  lengths.write_text("2\n30\n")
  sync, part, reprefill = bench.main([
      "long-tail", "--prompts", "2", "--generations", "2", "--prompt_len", "4", "--new_tokens",
      "32", "--lengths", str(lengths), "--max_tokens_per_step", "4", "--steps", "2",
      "--reprefill", "8"])
  assert (sync["mode"], part["mode"], part["max_tokens_per_step"]) == ("synchronous", "partial", 4)
  assert sync["decode_steps"] == 58 and sync["trained_tokens"] == 128
  assert sync["live_fraction"] == pytest.approx(60 / 116)
  assert sync["staleness_mean"] == 0 and sync["rounds"] == 2
  assert part["decode_steps_per_trained_token"] < sync["decode_steps_per_trained_token"]
  assert part["live_fraction"] > sync["live_fraction"]
  assert part["decode_steps_ratio_to_synchronous"] < 1
  assert sync["compilations"] == part["compilations"] == 1
  # What re-prefilling the carried rows would cost: 4 rows of 4 + 8 tokens, timed.
  assert (reprefill["mode"], reprefill["rows"], reprefill["tokens"]) == ("re-prefill", 4, 12)
  assert reprefill["prefill_s"] > 0 and reprefill["partial_round_s"] > 0


def test_every_subcommands_help_names_each_flags_default():
  """Issue 60: `bench long-tail --help` showed no defaults (flags without help text)."""
  import argparse  # pylint: disable=g-import-not-at-top
  from jaxgrpo.bench import cli as bench_cli  # pylint: disable=g-import-not-at-top
  parser = bench_cli.build_parser()
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  assert "long-tail" in sub.choices
  for name, subparser in sub.choices.items():
    text = subparser.format_help()
    for action in subparser._actions:  # pylint: disable=protected-access
      if action.option_strings and action.default not in (None, argparse.SUPPRESS) and \
          not isinstance(action, argparse._HelpAction):  # pylint: disable=protected-access
        assert action.help and "default" in action.help, (name, action.dest)
    if name == "long-tail":
      assert "--prompts PROMPTS     default: 8" in text

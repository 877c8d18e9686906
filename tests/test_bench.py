"""Tests for jaxgrpo.bench: the sampler bench's workload and its JSON line (no timing checks)."""

import json

import pytest

from jaxgrpo import bench

KEYS = {"bench", "preset", "mode", "n_params", "tokens_per_s", "first_call_s", "median_s",
        "all_s", "generated_tokens", "rows", "decode_steps_per_s", "jax", "device",
        "cpu_count", "loadavg_start", "loadavg_end", "workload", "sampling"}


def test_prompt_batch_matches_the_peer_workload():
  tokens, mask = bench.prompt_batch()
  assert tokens.shape == mask.shape == (8, 64)  # the 33-token prompt rounds up to 64
  assert max(mask.sum(axis=1)) == 33
  # Left-padded, bos first, bytes shifted by 3.
  row = tokens[2][mask[2]].tolist()
  assert row == [1] + [b + 3 for b in b"Natalia sold 48 clips. How many?"]
  assert not mask[0, 0] and mask[:, -1].all()
  assert bench.decode(row) == "Natalia sold 48 clips. How many?"


def test_presets_have_the_peer_sizes():
  # The peer reports 557,824 parameters for its tiny Qwen3 (tied embeddings, QK-norm).
  cfg = bench.preset_config("tiny")
  assert (cfg.num_layers, cfg.d_model, cfg.mlp_dim, cfg.vocab_size) == (2, 128, 512, 512)
  assert cfg.qk_norm and cfg.tie_embeddings and cfg.rope_theta == 1e4


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

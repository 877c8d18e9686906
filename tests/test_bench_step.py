"""Tests for jaxgrpo.bench.roofline, the `step` bench (jaxgrpo.bench.step) and bench/compare_tunix.py.

No timing is ever asserted: the machine is shared and noisy. The step bench runs once on the
tiny preset with 2 steps of 4 new tokens; the Tunix peer is never started (its JSON is faked).
"""

import argparse
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import pytest

from jaxgrpo.bench import common, roofline
from jaxgrpo.bench import step as bench_step

STEP_KEYS = {
    "bench", "preset", "n_params", "workload", "kind", "steps", "first_step_s",
    "steady_step_median_s", "rollout_median_s", "update_median_s", "step_s", "rollout_s",
    "update_s", "update_compilations", "sampler_compilations", "update_flops",
    "update_flops_per_s", "matmul_flops_per_s", "update_roofline_fraction", "forward_median_s",
    "forward_flops", "rollout_flops_analytic", "rollout_flops_per_s",
    "rollout_roofline_fraction", "peak_rss_mib", "last_update", "jax", "device", "cpu_count",
    "loadavg_start", "loadavg_end"}


def test_model_flops_per_token_by_hand():
  # tiny: d_model 128, 2 layers, 4 query heads and 2 KV heads of 32, mlp 512, vocab 512.
  # Per layer q 128*128 + k, v 2 * 128*64 + o 128*128 = 49,152 and the MLP 3 * 128*512 =
  # 196,608: 245,760; two layers 491,520, plus the tied head 512*128 = 65,536: 557,056
  # weights, 2 FLOPs each = 1,114,112. (557,056 is the peer's 557,824 parameters less the
  # 768 norm scales.) Attention at 100 keys: 2 layers * 2 * 2 * 4 heads * 32 * 100 = 102,400.
  cfg = common.preset_config("tiny")
  assert roofline.model_flops_per_token(cfg, 100) == 1_114_112 + 102_400
  assert roofline.model_flops_per_token(cfg, 0) == 1_114_112


def test_compiled_flops_counts_a_matmul():
  m, k, n = 64, 32, 48
  compiled = jax.jit(jnp.matmul).lower(jnp.ones((m, k)), jnp.ones((k, n))).compile()
  assert roofline.compiled_flops(compiled) == 2 * m * n * k


def test_compiled_flops_handles_missing_counts():
  class NoCost:
    def cost_analysis(self):
      raise NotImplementedError

  class ListCost:
    def cost_analysis(self):
      return [{"flops": 10.0}, {"flops": 5.0}]

  assert roofline.compiled_flops(NoCost()) is None
  assert roofline.compiled_flops(ListCost()) == 15.0


def test_matmul_rate_reports_a_rate():
  r = roofline.matmul_rate(n=(128, 256), reps=2)
  assert r["n"] in (128, 256) and r["flops_per_s"] > 0 and r["ms"] > 0


def test_medium_preset_shape():
  cfg = bench_step.preset_config("medium")
  assert (cfg.num_layers, cfg.d_model, cfg.mlp_dim, cfg.vocab_size) == (8, 512, 2048, 1024)
  assert cfg.num_heads * cfg.head_dim == cfg.d_model and cfg.qk_norm
  assert bench_step.DEFAULT_NEW_TOKENS["medium"] + 64 == 256  # the prompt width is 64


def _parse(argv):
  parser = argparse.ArgumentParser()
  bench_step.add_parsers(parser.add_subparsers(dest="bench", required=True))
  return parser.parse_args(argv)


@pytest.mark.parametrize("argv", [["step", "--steps", "1"], ["step", "--preset", "huge"],
                                  ["step", "--new_tokens", "0"]])
def test_bad_step_arguments_exit(argv):
  with pytest.raises(SystemExit):
    _parse(argv)


@pytest.mark.slow
def test_step_bench_tiny(monkeypatch):
  real = roofline.matmul_rate
  monkeypatch.setattr(roofline, "matmul_rate", lambda: real(n=256, reps=1))  # speed only
  # Hidden flags: 2 prompts of 4 new tokens, no forward figure (one compilation less).
  args = _parse(["step", "--preset", "tiny", "--steps", "2", "--new_tokens", "4", "--prompts",
                 "2", "--forward_reps", "0"])
  (r,) = args.run(args)
  json.dumps(r)  # JSON-able
  assert STEP_KEYS <= set(r)
  assert (r["bench"], r["preset"], r["kind"], r["n_params"]) == ("step", "tiny", "full_step",
                                                                   557_824)
  assert r["workload"]["prompts"] == 2 and r["workload"]["new_tokens"] == 4
  assert r["workload"]["prompt_len"] == 64 and r["workload"]["beta"] == 0.04
  assert len(r["step_s"]) == len(r["rollout_s"]) == len(r["update_s"]) == 2
  # One trace of the update over both steps; the val profile is never compiled.
  assert r["update_compilations"] == 1
  assert r["sampler_compilations"] == {"train": 1, "val": 0}
  assert r["update_flops"] > 0 and r["rollout_flops_analytic"] > 0
  assert r["forward_flops"] is None and r["forward_median_s"] is None
  assert r["last_update"]["learning_rate"] == pytest.approx(1e-5)


def _compare_module():
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                      "compare_tunix.py")
  spec = importlib.util.spec_from_file_location("compare_tunix", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _fake_round(scale):
  ours = [dict(bench="sampler", preset="tiny", mode=m, tokens_per_s=t * scale,
               first_call_s=1.0, median_s=0.1) for m, t in
          (("pure", 8000.0), ("topk50_topp095", 6000.0), ("greedy", 9000.0))]
  ours.append(dict(bench="step", preset="tiny", steady_step_median_s=0.5, first_step_s=20.0))
  peer = {"sampler_pure": dict(tokens_per_s=4000.0, steady_median_s=0.5, first_call_s=4.0),
          "sampler_topk50_topp095": dict(tokens_per_s=3000.0, steady_median_s=0.7,
                                         first_call_s=8.0),
          "sampler_greedy": dict(tokens_per_s=3000.0, steady_median_s=0.6, first_call_s=5.0),
          "grpo": dict(steady_step_median_s=2.0, per_step_s=[40.0, 2.0, 2.0])}
  return ours, peer


def test_compare_ratios_and_table():
  compare = _compare_module()
  rows = []
  for rnd, scale in enumerate((1.0, 0.5, 1.5)):
    ours, peer = _fake_round(scale)
    got = compare.ratio_rows("tiny", ours, peer)
    assert len(got) == 4
    rows += [dict(r, round=rnd) for r in got]
  pure = [r for r in rows if r["mode"] == "pure"]
  assert [r["ratio"] for r in pure] == [2.0, 1.0, 3.0]
  step = [r for r in rows if r["what"] == "step"][0]
  assert step["ratio"] == 0.25 and step["first_ratio"] == 0.5
  assert step["peer_first_step_s"] == 40.0
  summary = compare.summarize(rows)
  assert summary["tiny/sampler/pure"]["median"] == 2.0
  assert summary["tiny/sampler/greedy"]["ratios"] == [3.0, 1.5, 4.5]
  assert summary["tiny/sampler/greedy"]["first_median"] == 0.2
  assert summary["tiny/step/grpo"]["median"] == 0.25
  table = compare.format_table(summary)
  assert "tiny/sampler/topk50_topp095" in table and "tiny/step/grpo" in table


def test_compare_skips_missing_sides():
  compare = _compare_module()
  ours, peer = _fake_round(1.0)
  assert compare.ratio_rows("tiny", ours, None) == []
  del peer["grpo"]  # the peer ran with --skip_grpo
  assert {r["what"] for r in compare.ratio_rows("tiny", ours, peer)} == {"sampler"}
  lines = compare.parse_json_lines('params 5\n{"bench": "step"}\nwrote x\n{bad\n')
  assert lines == [{"bench": "step"}]


def test_compare_reports_a_failing_run(tmp_path):
  compare = _compare_module()
  with pytest.raises(compare.RunFailed, match="exit status 3"):
    compare._run(["python3", "-c", "import sys; sys.exit(3)"], timeout=60)  # pylint: disable=W0212


def test_compare_main_alternates_and_survives_a_failure(tmp_path, monkeypatch, capsys):
  compare = _compare_module()
  calls = []

  def fake_ours(what, preset, timeout):
    calls.append(("ours", what))
    if what == "step":
      raise compare.RunFailed("exit status 2: no step bench")
    return [r for r in _fake_round(1.0)[0] if r["bench"] == what]

  def fake_peer(tunix_python, peer, preset, tag, with_step, out_dir, timeout):
    calls.append(("peer", tag, with_step))
    return _fake_round(1.0)[1]

  monkeypatch.setattr(compare, "run_ours", fake_ours)
  monkeypatch.setattr(compare, "run_peer", fake_peer)
  out = tmp_path / "cmp.jsonl"
  rc = compare.main(["--tunix_python", "python", "--peer", __file__, "--presets", "tiny",
                     "--rounds", "2", "--out", str(out)])
  assert rc == 1
  # Round 1: ours first; round 2: the peer first.
  assert calls == [("ours", "sampler"), ("ours", "step"), ("peer", "_r0", True),
                   ("peer", "_r1", True), ("ours", "sampler"), ("ours", "step")]
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  final = lines[-1]
  assert final["summary"] and final["failures"] == 2
  assert final["ratios"]["tiny/sampler/pure"]["ratios"] == [2.0, 2.0]
  assert "tiny/step/grpo" not in final["ratios"]
  assert json.loads(capsys.readouterr().out.splitlines()[-1]) == final

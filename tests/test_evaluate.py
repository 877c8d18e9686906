"""`python -m jaxgrpo.evaluate` as a user runs it: a run's checkpoint gives the run's own
validation row, a comparison of a policy with itself is exactly 0, and bad input is one line.

The end-to-end tests read conftest.py's straight run (tests/cli.py's ARGS: the smoke preset,
k=2, validation and a checkpoint every 2 steps) and evaluate with the same ARGS.
"""

import json
import os
import re
import subprocess
import sys

import pytest

import cli  # tests/cli.py
from jaxgrpo.run import checkpoint


def run_evaluate(*args):
  return subprocess.run([sys.executable, "-m", "jaxgrpo.evaluate", *args], capture_output=True,
                        text=True, env=cli.env(), cwd=cli.ROOT, timeout=600)


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def val_rows(workdir):
  return {r["step"]: r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if r["split"] == "val"}


def assert_row_equals(metrics, row):
  """Every logged validation metric, bit for bit (JSON floats round-trip exactly)."""
  logged = {k: v for k, v in row.items() if k not in ("step", "split", "time", "wall_time_s")}
  assert {k: v for k, v in metrics.items() if k != "wall_time_s"} == logged


@pytest.mark.slow
def test_a_runs_checkpoint_evaluates_to_the_runs_validation_row(straight_run, tmp_path):
  workdir, run = straight_run
  assert run.returncode == 0, run.stderr[-2000:]
  steps = checkpoint.step_dirs(os.path.join(workdir, "checkpoints"))
  step = steps[-2]  # not the newest: --step must pick it
  out = tmp_path / "eval"
  # val_batch_size 'auto' (CPU: the whole validation set, 32 prompts in one batch where the
  # run validated 16 at a time): the same row, bit for bit, and no note about it.
  proc = run_evaluate(*cli.ARGS, f"--workdir={workdir}", f"--step={step}", f"--out={out}",
                      "--config.grpo.val_batch_size=auto")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "val_batch_size=auto -> 32 (the whole validation set" in proc.stderr
  doc = json.loads((out / "eval.json").read_text())
  assert doc["config"]["grpo"]["val_batch_size"] == 32
  assert_row_equals(doc["metrics"], val_rows(workdir)[step])
  assert doc["checkpoint"]["step"] == step and doc["sampling"]["k"] == 2
  assert doc["sampling"]["temperature"] == 0.9  # the val profile follows the override
  # The same samples as the run logged (which now name each sample's extracted answer).
  samples = read_jsonl(out / "samples.jsonl")
  assert samples == read_jsonl(os.path.join(workdir, "val_samples", f"step_{step}.jsonl"))
  assert len(samples) == doc["num_prompts"] and all(len(s["extracted"]) == 2 for s in samples)
  assert (out / "pass_at_k.png").stat().st_size > 0
  # The table, and the training-only overrides named once.
  assert "accuracy" in proc.stdout and "maj@2" in proc.stdout
  ignored = [l for l in proc.stderr.splitlines() if "ignored" in l]
  assert len(ignored) == 1 and "--config.grpo.max_num_steps" in ignored[0]
  assert "--config.generation.temperature" not in ignored[0]
  assert f"/{doc['num_prompts']} prompts" in proc.stderr  # the progress line
  assert "differs from the run's" not in proc.stderr  # the run's own validation settings


@pytest.mark.slow
def test_compare_the_base_model_with_a_checkpoint(straight_run, tmp_path):
  # A = the config's own starting checkpoint (what the run validated at step 0), B = the
  # newest checkpoint of the run: each side's eval.json is the run's row at that step.
  workdir, _ = straight_run
  step = checkpoint.step_dirs(os.path.join(workdir, "checkpoints"))[-1]
  out = tmp_path / "cmp"
  proc = run_evaluate(*cli.ARGS, f"--compare=@embedded/arith3,{workdir}:{step}",
                      f"--out={out}", "--trackers=wandb")
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = val_rows(workdir)
  a = json.loads((out / "A" / "eval.json").read_text())
  b = json.loads((out / "B" / "eval.json").read_text())
  assert_row_equals(a["metrics"], rows[0])
  assert_row_equals(b["metrics"], rows[step])
  doc = json.loads((out / "compare.json").read_text())
  acc = doc["metrics"]["accuracy"]["all"]
  assert acc["difference"] == pytest.approx(rows[step]["accuracy"] - rows[0]["accuracy"],
                                            abs=1e-6)
  assert acc["a_stderr"] == pytest.approx(rows[0]["accuracy_stderr"], rel=1e-5)
  assert len(doc["verdicts"]) == 4  # accuracy, pass@1, pass@2, maj@2 (no sources)
  assert (out / "compare.png").stat().st_size > 0
  # --trackers=wandb (offline): both sides' metrics, the differences, tables and plots, in
  # the run's project, at the checkpoint's step.
  (run,) = cli.wandb_runs(str(out))
  logged = {k: v for h in run["history"] for k, v in h.items()}
  assert logged["eval/A/accuracy"] == a["metrics"]["accuracy"]
  assert logged["eval/B/pass@2"] == b["metrics"]["pass@2"]
  assert logged["compare/accuracy"] == acc["difference"]
  assert {h["step"] for h in run["history"] if "eval/B/accuracy" in h} == {step}
  for key in ("eval/A/pass_at_k", "eval/B/table", "compare/difference", "compare/verdicts"):
    assert logged[key]["_type"] in ("image-file", "table-file"), key
  assert run["summary"]["compare/maj@2"] == doc["metrics"]["maj@2"]["all"]["difference"]


@pytest.mark.slow
def test_a_checkpoint_compared_with_itself_differs_by_exactly_zero(straight_run, tmp_path):
  workdir, _ = straight_run
  step = checkpoint.step_dirs(os.path.join(workdir, "checkpoints"))[-1]
  out = tmp_path / "self"
  # Another val_seed than the run's: both sides still draw alike, and the difference from
  # what the run validated with is named once (not once per side).
  proc = run_evaluate(*cli.ARGS, f"--compare={workdir}:{step},{workdir}/checkpoints/{step}",
                      "--config.grpo.val_seed=1", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  notes = [l for l in proc.stderr.splitlines() if "differs from the run's" in l]
  assert notes == ["note: this evaluation's validation differs from the run's: "
                   "grpo.val_seed=1 (the run validated with 0)"]
  doc = json.loads((out / "compare.json").read_text())
  for metric, groups in doc["metrics"].items():
    d = groups["all"]
    assert d["difference"] == 0.0 and d["ci95"] == [0.0, 0.0], metric
    assert d["verdict"] == "no significant difference at 95%"
  verdicts = [l for l in proc.stdout.splitlines() if l.startswith("  ")]
  assert len(verdicts) == 4
  assert all("no significant difference at 95%" in l for l in verdicts), verdicts
  assert (out / "A" / "samples.jsonl").read_text() == (out / "B" / "samples.jsonl").read_text()
  # One engine for both sides: the val sampler (jit(traced)) compiled once, not per side.
  assert sum("Compiling jit(traced)" in l for l in proc.stderr.splitlines()) == 1


def fake_run(tmp_path):
  """A run folder that holds config.json and an (empty) checkpoint folder for step 2."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "2").mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps({"model": {"checkpoint": "@embedded/arith3"}}))
  return workdir


@pytest.mark.parametrize("args,fragments", [
    (["--workdir=/no/such/run"], ["/no/such/run/config.json", "missing"]),
    (["--workdir={run}", "--step=5"], ["--step=5", "no such checkpoint", "[2]"]),
    (["--compare={run}"], ["--compare=", "two policies A,B"]),
    (["--compare=/no/such/dir,@embedded/arith3"], ["/no/such/dir", "no checkpoint there"]),
    (["--config.model.checkpoint=/no/such/ckpt"], ["/no/such/ckpt", "no such checkpoint"]),
    (["--metrics=pass@4"], ["--metrics", "'pass@4'", "allowed: accuracy"]),
    (["--metrics=accuracy/gsm8k"], ["no validation source 'gsm8k'"]),
    (["--trackers=wandb,mlflow"], ["--trackers='wandb,mlflow'", "unknown tracker 'mlflow'"]),
    (["--config.grpo.val_sampless=4"], ["config.grpo.val_sampless", "unknown key"]),
    (["--step=2"], ["--step=2", "only with --workdir"]),
    (["--out={out}"], ["already holds eval.json"]),
])
def test_bad_input_is_one_line_and_exit_2_before_compiling(tmp_path, args, fragments):
  run = fake_run(tmp_path)
  out = tmp_path / "out"
  out.mkdir()
  (out / "eval.json").write_text("{}")  # an earlier evaluation's results: never overwritten
  args = [a.format(run=run, out=out) for a in args]
  proc = run_evaluate(f"--config={cli.MATH}:smoke", *args)
  cli.assert_clean_error(proc, *fragments)
  assert (out / "eval.json").read_text() == "{}"


@pytest.mark.slow
def test_several_validation_sources_each_get_their_metrics_and_verdicts(tmp_path):
  # data.val_path with two named files: every metric per source in eval.json, a column
  # per source in the table, and the paired comparison (of the shipped checkpoint with
  # itself) per source, with one verdict line per metric and source.
  def write(name, pairs):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"question": f"{a}+{b}=", "answer": f"{a + b:04d}"})
                            + "\n" for a, b in pairs))
    return path
  train = write("train.jsonl", [(100 + i, 200 + i) for i in range(16)])
  easy = write("easy.jsonl", [(100 + i, 100) for i in range(8)])
  hard = write("hard.jsonl", [(900 - 7 * i, 800 + 3 * i) for i in range(8)])
  out = tmp_path / "cmp"
  proc = run_evaluate(f"--config={cli.MATH}:smoke", "--config.data.source=jsonl",
                      f"--config.data.train_path={train}",
                      f"--config.data.val_path=easy={easy},hard={hard}",
                      "--compare=@embedded/arith3,@embedded/arith3",
                      "--metrics=accuracy,pass@2/hard", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  doc = json.loads((out / "A" / "eval.json").read_text())
  assert doc["sources"] == ["easy", "hard"]
  m = doc["metrics"]
  assert m["num_prompts/easy"] == 8 and m["num_prompts/hard"] == 8
  assert m["accuracy"] == pytest.approx((m["accuracy/easy"] + m["accuracy/hard"]) / 2)
  header = next(l for l in proc.stdout.splitlines() if l.startswith("metric"))
  assert header.split() == ["metric", "all", "easy", "hard"]
  samples = read_jsonl(out / "A" / "samples.jsonl")
  assert [s["source"] for s in samples] == ["easy"] * 8 + ["hard"] * 8
  compare = json.loads((out / "compare.json").read_text())
  assert set(compare["metrics"]["accuracy"]) == {"all", "easy", "hard"}
  assert [v.split(":")[0] for v in compare["verdicts"]] == [
      "accuracy", "accuracy/easy", "accuracy/hard", "pass@2/hard"]


def test_a_checkpoint_of_per_layer_parameters_is_refused_in_one_line(tmp_path):
  # As for a resume (test_checkpoint.py): a run checkpointed before the layers were
  # stacked is named with the way out, before anything compiles.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxgrpo.algo import grpo  # pylint: disable=g-import-not-at-top
  run = fake_run(tmp_path)
  (run / "checkpoints" / "2").rmdir()
  ckpts = checkpoint.Checkpoints(str(run / "checkpoints"))
  old = {"layer_0": {"w": jnp.ones(2)}, "layer_1": {"w": jnp.ones(2)}}
  ckpts.save(3, grpo.TrainState(jnp.int32(3), old, ()), {"step": 3, "model": {}})
  ckpts.close()
  proc = run_evaluate(f"--config={cli.MATH}:smoke", f"--workdir={run}")
  cli.assert_clean_error(proc, f"{run}/checkpoints/3", "per-layer parameters",
                         "python -m jaxgrpo.export")


def test_results_go_beside_what_was_evaluated_not_into_the_current_folder(tmp_path):
  # `--compare` used to write ./eval/ into the current folder (the repository's root).
  import types  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import evaluator  # pylint: disable=g-import-not-at-top
  run = lambda w, step: types.SimpleNamespace(restore=(f"{w}/checkpoints", step),
                                              checkpoint={"workdir": str(w)})
  base = types.SimpleNamespace(restore=None, checkpoint={})
  a, b = tmp_path / "a", tmp_path / "b"
  assert re.fullmatch(rf"{a}/eval/step_300-\d{{8}}-\d{{6}}",
                      evaluator._out_dir(None, [run(a, 300)], comparing=False))
  assert re.fullmatch(rf"{b}/eval/compare-\d{{8}}-\d{{6}}",
                      evaluator._out_dir(None, [run(a, 300), run(b, 400)], comparing=True))
  assert re.fullmatch(rf"{a}/eval/compare-\d{{8}}-\d{{6}}",
                      evaluator._out_dir(None, [run(a, 300), base], comparing=True))
  assert re.fullmatch(r"runs/eval/compare-\d{8}-\d{6}",
                      evaluator._out_dir(None, [base, base], comparing=True))


def test_the_readmes_evaluate_examples_name_checkpoints_a_default_run_keeps():
  # The README's `--step=200` named a checkpoint that a default run does not keep.
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("math_config", cli.MATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  saved = range(c.checkpoint.save_period, c.grpo.max_num_steps + 1, c.checkpoint.save_period)
  kept = set(list(saved)[-c.checkpoint.max_to_keep:]) | {c.grpo.max_num_steps}
  readme = open(os.path.join(cli.ROOT, "README.md")).read()
  named = [int(n) for n in re.findall(r"runs/arith(?::|\S* --step=)(\d+)", readme)]
  assert named and set(named) <= kept, (named, sorted(kept))


def test_only_keys_that_move_validation_are_said_to_differ():
  """Issue 60: evaluate said validation differed because the run had
  generation.max_tokens_per_step=512 (training rollouts' budget; validation never reads it,
  and the numbers were identical). Only a key that moves validation's numbers is named."""
  import types  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import evaluator  # pylint: disable=g-import-not-at-top
  here = {"data": {"val_path": "v.jsonl"}, "rewards": {"math": 1.0},
          "generation": {"temperature": 1.0, "max_tokens_per_step": 0, "decode_block_size": 0,
                         "compact_stages": 0, "val_temperature": 0.6},
          "grpo": {"val_num_generations_per_prompt": 4}}
  run = json.loads(json.dumps(here))
  run["generation"].update(temperature=0.8, max_tokens_per_step=512, decode_block_size=256,
                           compact_stages=2)
  side = types.SimpleNamespace(run_config=run, config=ml_collections.ConfigDict(here))
  assert evaluator._differences(side) == []  # pylint: disable=protected-access
  run["generation"]["val_temperature"] = 0.3
  assert evaluator._differences(side) == [  # pylint: disable=protected-access
      "generation.val_temperature=0.6 (the run validated with 0.3)"]

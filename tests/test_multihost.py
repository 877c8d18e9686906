"""A pod rehearsed on one machine: two processes x 2 CPU devices (gloo collectives) against
one process with 4 devices, through the CLI as a user runs it.

What must hold (the pod-scale issue): the same losses and validation metrics for the same
global batch, and checkpoints that restore across process counts in both directions. The
runs share the session's compilation cache (conftest.py), so each compiles little.
"""

import json
import os
import subprocess
import sys

import pytest

import cli  # tests/cli.py

pytestmark = pytest.mark.slow

# Dynamic sampling on: the groups kept are chosen from every process's rows, so 2 processes
# must keep what 1 does (12-prompt generation batches, 6 per process).
ARGS = (f"--config={cli.MATH}:smoke", "--config.grpo.max_num_steps=2", *cli.USER,
        "--config.grpo.dynamic_sampling=filter", "--config.grpo.oversample_factor=1.5",
        "--config.grpo.max_generation_batches=2")
# Computed on device from the global batch, so they must agree; the host-side numbers
# (reward_mean, accuracy, lengths) are gathered over processes and must agree too.
TRAIN_KEYS = ("loss", "grad_norm", "clip_fraction", "reward_mean", "reward_std", "accuracy",
              "zero_std_group_fraction", "completion_length_mean", "learning_rate",
              "reward/fixture_columns/aligned", "reward_errors/fixture_columns",
              "dynamic_sampling/generation_batches", "dynamic_sampling/kept_groups_fraction",
              "dynamic_sampling/filled_flat_groups")
VAL_KEYS = ("accuracy", "accuracy_stderr", "pass@1", "pass@2", "pass_k", "avg_length",
            "num_prompts", "reward/fixture_columns/aligned", "reward_errors/fixture_columns")


_free_port = cli.free_port  # (test_episodes.py imports it from here)


def _one_process(workdir, *args):
  proc = cli.run_train(*ARGS, *args, workdir=workdir,
                       XLA_FLAGS=cli.xla_flags(4))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _two_processes(workdir, *args):
  """Both processes of a 2 x 2-device run, started together; returns process 0's output."""
  return cli.run_two_processes(*ARGS, *args, workdir=workdir, devices=2)[0]


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {(r["split"], r["step"]): r for r in rows}


def _assert_same(rows_a, rows_b):
  assert rows_a.keys() == rows_b.keys()
  for (split, step), a in rows_a.items():
    b = rows_b[(split, step)]
    for key in TRAIN_KEYS if split == "train" else VAL_KEYS:
      # Only the order of float sums differs (gloo vs in-process all-reduce); the GRPO
      # loss of a first iteration is ~1e-8 (ratio 1), so it gets an absolute tolerance.
      assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (split, step, key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One 2-step run each way, then each resumed from the other's checkpoint to step 3."""
  root = tmp_path_factory.mktemp("multihost")
  two, one = root / "two", root / "one"
  _two_processes(two)
  _one_process(one)
  # Cross restores: the 2-process checkpoint continues in 1 process, and the reverse.
  one_from_two, two_from_one = root / "one_from_two", root / "two_from_one"
  resume = "--config.grpo.max_num_steps=3"
  _one_process(one_from_two, resume, f"--config.checkpoint.resume={two}/checkpoints")
  _two_processes(two_from_one, resume, f"--config.checkpoint.resume={one}/checkpoints")
  return {name: root / name for name in ("two", "one", "one_from_two", "two_from_one")}


def test_two_processes_match_one_process_with_the_same_global_batch(runs):
  two, one = _rows(runs["two"]), _rows(runs["one"])
  assert set(two) == {("val", 0), ("train", 1), ("train", 2), ("val", 2)}
  _assert_same(two, one)
  # The user's reward (cli.USER) got each row's own columns on both processes.
  assert all(row["reward/fixture_columns/aligned"] == 1.0 for row in two.values())
  # The same prompts in the same order, gathered from both processes.
  with open(runs["two"] / "train_prompts.jsonl") as f2, open(runs["one"] /
                                                             "train_prompts.jsonl") as f1:
    assert f2.read() == f1.read()
  # Process 0 wrote every prompt's validation samples, not only its own half.
  with open(runs["two"] / "val_samples" / "step_2.jsonl") as f:
    samples = [json.loads(line) for line in f]
  assert [s["prompt_index"] for s in samples] == list(range(32))


def test_checkpoints_restore_across_process_counts(runs):
  # Each resumed run restored step 2 written by the other process count (its step 3 is the
  # only step it trained) and both continue identically.
  one_from_two, two_from_one = _rows(runs["one_from_two"]), _rows(runs["two_from_one"])
  assert ("train", 3) in one_from_two and ("train", 2) not in one_from_two
  _assert_same(one_from_two, two_from_one)
  for workdir in ("one_from_two", "two_from_one"):
    with open(runs[workdir] / "summary.json") as f:
      summary = json.load(f)
    assert summary["steps"] == 3 and summary["resumed_from"].endswith("checkpoints/2")


def test_evaluate_on_two_processes_gives_the_runs_validation(runs, tmp_path):
  # `python -m jaxgrpo.evaluate` on the same 2 x 2-device rehearsal: the 2-process run's
  # step-2 checkpoint gives its step-2 validation row, every prompt's samples, and only
  # process 0 writes and prints.
  port, out = _free_port(), tmp_path / "eval"
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jaxgrpo.evaluate", *ARGS, f"--workdir={runs['two']}",
       "--step=2", f"--out={out}", f"--coordinator_address=127.0.0.1:{port}",
       "--num_processes=2", f"--process_id={i}"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cli.ROOT,
      env=cli.env(XLA_FLAGS=cli.xla_flags(2))) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  # Only process 0 prints the table and where the results are (gloo's own connection lines
  # reach both processes' stdout, sometimes split mid-line, so they are not compared).
  assert any(l.startswith("accuracy") for l in outs[0][0].splitlines())
  assert "results in" in outs[0][0]
  assert not any(l.startswith(("accuracy", "metric")) for l in outs[1][0].splitlines())
  assert "results in" not in outs[1][0]
  with open(out / "eval.json") as f:
    metrics = json.load(f)["metrics"]
  logged = _rows(runs["two"])[("val", 2)]
  for key in VAL_KEYS:
    assert metrics[key] == pytest.approx(logged[key], rel=1e-5, abs=1e-6), key
  with open(out / "samples.jsonl") as f, open(runs["two"] / "val_samples" / "step_2.jsonl") as g:
    assert f.read() == g.read()

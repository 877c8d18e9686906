"""Killed, preempted and poisoned runs: resume is exact, nothing good is lost.

End to end through the CLI on the smoke preset for 8 steps (validation and a checkpoint every
2 steps; tests/cli.py's ARGS). One uninterrupted run (conftest.py) is the reference; each interrupted run must end with the same
parameters (bitwise), the same metrics rows and the same prompt batches.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from cli import ARGS, STRAIGHT, run_train, start_train  # tests/cli.py
from jaxgrpo.run import checkpoint
from jaxgrpo.runtime import faults
from jaxgrpo.runtime import metrics as metrics_lib

# (env_s, sampler_s: multi-turn episodes' timing, tests/test_episodes.py)
TIMING = ("time", "rollout_tokens_per_s", "rollout_s", "reward_s", "update_s", "wall_time_s",
          "env_s", "sampler_s")


def rows(workdir):
  """(split, step) -> metrics row without wall-clock fields; a repeated key fails."""
  out = {}
  for r in metrics_lib.read_metrics(str(workdir)):
    key = (r["split"], r["step"])
    assert key not in out, f"{key} logged twice"
    out[key] = {k: v for k, v in r.items() if k not in TIMING}
  return out


def prompt_ids(workdir):
  with open(os.path.join(workdir, "train_prompts.jsonl")) as f:
    return [json.loads(line) for line in f]


def final_params(workdir, step=None):
  ckpts = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True)
  state, _ = ckpts.restore(max(ckpts.steps()) if step is None else step)
  ckpts.close()
  return state


def assert_same_run(workdir, reference):
  got, want = rows(workdir), rows(reference)
  assert sorted(got) == sorted(want)  # no step missing or repeated, train and val
  for key in want:
    assert got[key] == want[key], key
  assert prompt_ids(workdir) == prompt_ids(reference)  # no batch skipped or repeated
  for a, b in zip(jax.tree.leaves(final_params(workdir)),
                  jax.tree.leaves(final_params(reference))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def wait_for_checkpoint(proc, workdir, step, timeout=300):
  """Polls until checkpoint `step` is complete (orbax renames it into place when done)."""
  path = os.path.join(workdir, "checkpoints", str(step))
  deadline = time.time() + timeout
  while not os.path.isdir(path):
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert time.time() < deadline, "no checkpoint in time"
    time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(straight_run):
  workdir, proc = straight_run  # conftest.py
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert [s for split, s in rows(workdir) if split == "train"] == list(range(1, 9))
  summary = json.load(open(workdir / "summary.json"))
  best = summary["best_checkpoint"]
  assert best["metric"] == "accuracy" and best["step"] in (2, 4, 6, 8)
  return workdir


@pytest.mark.slow
def test_sigkill_then_resume_is_exact(reference, tmp_path):
  proc = start_train(*ARGS, workdir=tmp_path)
  wait_for_checkpoint(proc, tmp_path, 4)
  proc.kill()  # SIGKILL: no handler runs, whatever was in flight is lost
  proc.wait()
  done = max(s for split, s in rows(tmp_path) if split == "train")
  resumed = run_train(*ARGS, workdir=tmp_path)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  start = int(resumed.stdout.split("at step ")[1].split()[0])
  assert 4 <= start <= done, (start, done)  # the newest complete checkpoint, >= the one seen
  assert_same_run(tmp_path, reference)
  # The killed process wrote no summary: the history says who trained its steps.
  history = json.load(open(tmp_path / "summary.json"))["history"]
  assert [(h["first_step"], h["last_step"]) for h in history] == [(1, start), (start + 1, 8)]
  assert "left no summary" in history[0]["note"]


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resumes_exactly(reference, tmp_path):
  # The run sends itself SIGTERM during step 3 (faults.py's hook): a known step between two
  # periodic checkpoints, so the test always exercises the preemption save and a resume (a
  # signal sent from here raced the 8-step run, which sometimes finished first).
  proc = run_train(*ARGS, workdir=tmp_path, **{faults.SIGTERM_STEP_ENV: "3"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "received SIGTERM" in proc.stderr
  line = proc.stdout.strip().splitlines()[-1]
  assert line.startswith("preempted (SIGTERM) after 3 steps"), line
  assert os.path.join("checkpoints", "3") in line  # names the checkpoint it wrote
  assert checkpoint.step_dirs(str(tmp_path / "checkpoints")) == [2, 3]
  assert json.load(open(tmp_path / "summary.json"))["preempted"] == "SIGTERM"
  resumed = run_train(*ARGS, workdir=tmp_path)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resuming from {tmp_path}/checkpoints/3 at step 3" in resumed.stdout
  assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_a_start_interrupted_before_its_first_checkpoint_reruns_without_duplicate_rows(
    reference, tmp_path):
  # A signal during start-up (the hook at step 0: after the step-0 validation, before step
  # 1) ends the run with no checkpoint but a logged step-0 validation. The same command
  # again starts afresh; it used to log step 0's validation a second time.
  proc = run_train(*ARGS, workdir=tmp_path, **{faults.SIGTERM_STEP_ENV: "0"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert checkpoint.step_dirs(str(tmp_path / "checkpoints")) == []
  assert [k for k in rows(tmp_path)] == [("val", 0)]
  rerun = run_train(*ARGS, workdir=tmp_path)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert_same_run(tmp_path, reference)  # rows() fails on a (split, step) logged twice


@pytest.mark.slow
def test_a_second_signal_while_saving_waits_for_the_save_then_exits_130(reference, tmp_path):
  # SIGTERM during step 3 (the first signal), then SIGINT as the preemption save starts
  # (faults.py's busy hook; a Ctrl-C sent from here would race the save). It used to exit at
  # once, or with a KeyboardInterrupt traceback once the handlers were gone.
  proc = run_train(*ARGS, workdir=tmp_path, **{faults.SIGTERM_STEP_ENV: "3",
                                               faults.SIGINT_BUSY_ENV: "1"})
  assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
  assert "received SIGINT again: saving checkpoint 3, please wait" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert checkpoint.step_dirs(str(tmp_path / "checkpoints")) == [2, 3]
  summary = json.load(open(tmp_path / "summary.json"))  # written in full before the exit
  assert (summary["steps"], summary["preempted"]) == (3, "SIGTERM")
  resumed = run_train(*ARGS, workdir=tmp_path)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_truncated_latest_checkpoint_is_skipped(reference, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  shutil.rmtree(workdir / "checkpoints" / "8" / "state")  # as if killed mid-write
  proc = run_train(*STRAIGHT, "--config.grpo.max_num_steps=10", workdir=workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  warning = [l for l in proc.stderr.splitlines() if "is unreadable" in l]
  assert warning and f"{workdir}/checkpoints/8" in warning[0]
  # One line of ours: no Python warning header, no source line, no orbax item list.
  assert warning[0].startswith(f"warning: checkpoint {workdir}/checkpoints/8 is unreadable "
                               "(a missing or damaged file: "), warning[0]
  assert "UserWarning" not in proc.stderr and "Available items" not in proc.stderr
  assert f"resuming from {workdir}/checkpoints/6" in warning[0]
  assert "at step 6" in proc.stdout
  # The broken checkpoint was moved aside, not deleted, and steps 7.. were redone once.
  assert os.path.isdir(f"{workdir}/checkpoints.set_aside/8-0")
  train = [s for split, s in rows(workdir) if split == "train"]
  assert train == list(range(1, 11))
  assert [r["step"] for r in prompt_ids(workdir)] == list(range(1, 11))
  # Steps 7 and 8, redone after the resume from 6, sampled the straight run's prompts: the
  # data iterator's position came back with the checkpoint.
  assert prompt_ids(workdir)[:8] == prompt_ids(reference)


@pytest.mark.slow
def test_nan_stops_before_saving_and_last_good_checkpoint_restores(tmp_path):
  proc = run_train(*ARGS, workdir=tmp_path, **{faults.NAN_STEP_ENV: "5"})
  assert proc.returncode == 1, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: non-finite loss=nan") and "at step 5" in last, last
  assert last.endswith(os.path.join(str(tmp_path), "checkpoints", "4")), last
  assert checkpoint.step_dirs(str(tmp_path / "checkpoints")) == [2, 4]
  state = final_params(tmp_path, step=4)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  assert json.load(open(tmp_path / "summary.json"))["fault"].startswith("non-finite loss")


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_leaves_checkpoints_intact(tmp_path):
  proc = start_train(*ARGS, workdir=tmp_path)
  wait_for_checkpoint(proc, tmp_path, 2)
  # Two different signals: Python would coalesce a repeat of one still pending (and runs
  # pending handlers in signal-number order, so either may come second).
  proc.send_signal(signal.SIGTERM)
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), stderr[-3000:]
  assert "a second signal: exiting now" in stderr
  ckpts = checkpoint.Checkpoints(str(tmp_path / "checkpoints"), read_only=True)
  step, state, meta = ckpts.restore_latest(None)
  ckpts.close()
  assert step >= 2 and meta["step"] == step and int(state["step"]) == step


def test_check_finite_names_the_quantity_and_step():
  faults.check_finite({"loss": 0.5, "grad_norm": 2.0, "kl": float("nan")}, 3)  # kl not watched
  with pytest.raises(faults.NumericalFault, match=r"non-finite grad_norm=inf at step 7"):
    faults.check_finite({"loss": 0.5, "grad_norm": float("inf")}, 7)


def test_preemption_flag_then_immediate_exit():
  # In a child process: the first SIGTERM only sets the flag; the second exits with 143.
  script = textwrap.dedent("""
      import os, signal
      from jaxgrpo.runtime import faults
      with faults.Preemption() as p:
        os.kill(os.getpid(), signal.SIGTERM)
        print("flag", p.requested, p.name, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached", flush=True)
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=60)
  assert proc.stdout.split() == ["flag", "True", "SIGTERM"]
  assert proc.returncode == 128 + signal.SIGTERM
  assert "finishing this step" in proc.stderr and "second signal: exiting now" in proc.stderr
  # Leaving the block restores the previous handlers.
  before = signal.getsignal(signal.SIGINT)
  with faults.Preemption():
    assert signal.getsignal(signal.SIGINT) != before
  assert signal.getsignal(signal.SIGINT) == before


def test_a_second_signal_in_a_busy_section_waits_for_it():
  # In a child process: SIGTERM sets the flag; SIGINT inside busy() says what it waits for
  # and is remembered (exit status 130 for the caller); outside busy() one exits at once.
  script = textwrap.dedent("""
      import os, signal
      from jaxgrpo.runtime import faults
      with faults.Preemption() as p:
        os.kill(os.getpid(), signal.SIGTERM)
        with p.busy("saving checkpoint 7"):
          os.kill(os.getpid(), signal.SIGINT)
          print("saved", p.exit_status, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        print("not reached", flush=True)
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=60)
  assert proc.stdout.split() == ["saved", str(128 + signal.SIGINT)]
  assert "received SIGINT again: saving checkpoint 7, please wait" in proc.stderr
  assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_micro_batched_run_resumes_exactly(tmp_path):
  # micro_batch_size 16 (2 micro-batches of the smoke preset's 8 x 4 rollouts), chunked
  # log-probs and remat: the preempted-and-resumed run ends bitwise where its uninterrupted
  # twin does (4 steps, checkpoints every 2, SIGTERM during step 3).
  args = (*ARGS, "--config.grpo.max_num_steps=4", "--config.grpo.micro_batch_size=16",
          "--config.grpo.logprob_chunk_size=2", "--config.model.remat=full")
  straight = run_train(*args, workdir=tmp_path / "straight")
  assert straight.returncode == 0, straight.stderr[-3000:]
  stopped = run_train(*args, workdir=tmp_path / "run", **{faults.SIGTERM_STEP_ENV: "3"})
  assert stopped.returncode == 0, stopped.stderr[-3000:]
  assert stopped.stdout.strip().splitlines()[-1].startswith("preempted (SIGTERM) after 3")
  resumed = run_train(*args, workdir=tmp_path / "run")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "at step 3" in resumed.stdout
  assert rows(tmp_path / "run") == rows(tmp_path / "straight")
  assert prompt_ids(tmp_path / "run") == prompt_ids(tmp_path / "straight")
  for a, b in zip(jax.tree.leaves(final_params(tmp_path / "run", 4)),
                  jax.tree.leaves(final_params(tmp_path / "straight", 4))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Dynamic sampling draws a varying number of generation batches per step: the data
# iterator's position in the checkpoint must still give exactly the same prompts.
DYNAMIC = (*ARGS, "--config.grpo.dynamic_sampling=filter", "--config.grpo.oversample_factor=1",
           "--config.grpo.max_generation_batches=3")


@pytest.mark.slow
def test_dynamic_sampling_resumes_exactly_after_sigkill(tmp_path):
  straight = run_train(*DYNAMIC, workdir=tmp_path / "straight")
  assert straight.returncode == 0, straight.stderr[-3000:]
  train = [r for (split, _), r in sorted(rows(tmp_path / "straight").items()) if split == "train"]
  # Some steps needed more than one generation batch (else this would test nothing).
  assert any(r["dynamic_sampling/generation_batches"] > 1 for r in train)
  steps = prompt_ids(tmp_path / "straight")
  assert any(len(s["row_ids"]) > 8 for s in steps)  # several batches' prompts, logged
  proc = start_train(*DYNAMIC, workdir=tmp_path / "killed")
  wait_for_checkpoint(proc, tmp_path / "killed", 4)
  proc.kill()
  proc.wait()
  resumed = run_train(*DYNAMIC, workdir=tmp_path / "killed")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert_same_run(tmp_path / "killed", tmp_path / "straight")

"""The command line: bad input gets one line and exit status 2; the smoke run writes its files.

The CLI runs in subprocesses (as a user runs it). JAX_LOG_COMPILES makes jax log every
compilation, so "no compilation before the error" is checked, not assumed.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = os.path.join(ROOT, "configs", "math.py")


def run_train(*args, workdir):
  env = dict(os.environ, JAX_LOG_COMPILES="1", JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  return subprocess.run(
      [sys.executable, "-m", "jaxgrpo.train", f"--workdir={workdir}", *args],
      capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def assert_clean_error(proc, *fragments):
  err = proc.stderr.strip()
  assert proc.returncode == 2, (proc.returncode, err[-2000:])
  assert "Traceback" not in err, err
  lines = [l for l in err.splitlines() if l.strip()]
  # JAX_LOG_COMPILES also logs tracing (shape checks use jax.eval_shape, which compiles
  # nothing); what must never appear before the error is a compilation.
  assert not any("Compiling" in l or "compil" in l.lower() for l in lines), lines
  lines = [l for l in lines if "Finished tracing" not in l]
  assert len(lines) == 1, lines
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


def write(path, text):
  with open(path, "w") as f:
    f.write(text)
  return str(path)


def test_unknown_config_key(tmp_path):
  proc = run_train(f"--config={MATH}:smoke", "--config.grpo.num_genrations=4",
                   workdir=tmp_path / "w")
  assert_clean_error(proc, "config.grpo.num_genrations")


def test_group_of_one_is_refused(tmp_path):
  proc = run_train(f"--config={MATH}:smoke", "--config.grpo.num_generations_per_prompt=1",
                   workdir=tmp_path / "w")
  assert_clean_error(proc, "config.grpo.num_generations_per_prompt=1", "integer >= 2")


def test_missing_data_file(tmp_path):
  proc = run_train(f"--config={MATH}:smoke", "--config.data.source=jsonl",
                   f"--config.data.train_path={tmp_path}/nope.jsonl", workdir=tmp_path / "w")
  assert_clean_error(proc, "nope.jsonl", "no such file")


def test_bad_jsonl_line_names_file_and_line(tmp_path):
  path = write(tmp_path / "train.jsonl",
               '{"question": "1+1=", "answer": "2"}\n{"question": oops}\n')
  proc = run_train(f"--config={MATH}:smoke", "--config.data.source=jsonl",
                   f"--config.data.train_path={path}", workdir=tmp_path / "w")
  assert_clean_error(proc, "train.jsonl:2")


def test_empty_dataset(tmp_path):
  path = write(tmp_path / "empty.jsonl", "\n\n")
  proc = run_train(f"--config={MATH}:smoke", "--config.data.source=jsonl",
                   f"--config.data.train_path={path}", workdir=tmp_path / "w")
  assert_clean_error(proc, "empty.jsonl", "empty")


def test_missing_config_file_and_checkpoint(tmp_path):
  proc = run_train(f"--config={tmp_path}/nope.py", workdir=tmp_path / "w")
  assert_clean_error(proc, "nope.py")
  proc = run_train(f"--config={MATH}:smoke", f"--config.model.checkpoint={tmp_path}/ckpt",
                   workdir=tmp_path / "w")
  assert_clean_error(proc, "ckpt", "no such checkpoint folder")


def test_architecture_must_match_checkpoint(tmp_path):
  proc = run_train(f"--config={MATH}:smoke", "--config.model.d_model=64",
                   workdir=tmp_path / "w")
  assert_clean_error(proc, "config.model.d_model=64", "has 128")


@pytest.mark.slow
def test_smoke_run_writes_results(tmp_path):
  workdir = tmp_path / "run"
  proc = run_train(f"--config={MATH}:smoke", workdir=workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "finished 3 steps" in proc.stdout
  records = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  train = [r for r in records if r["split"] == "train"]
  val = [r for r in records if r["split"] == "val"]
  assert [r["step"] for r in train] == [1, 2, 3]
  assert [r["step"] for r in val] == [0, 2, 3]  # at start, every val_period=2, at end
  for key in ("reward_mean", "reward_std", "accuracy", "zero_std_group_fraction",
              "completion_length_mean", "completion_length_max", "truncated_fraction",
              "loss", "kl", "clip_fraction", "grad_norm", "learning_rate",
              "rollout_tokens_per_s", "reward/exact_match"):
    assert key in train[0], key
  assert 0 <= val[0]["accuracy"] <= 1 and val[0]["num_samples"] == 32
  config = json.load(open(workdir / "config.json"))
  assert config["grpo"]["max_num_steps"] == 3 and config["mesh"]["data"] == 1
  summary = json.load(open(workdir / "summary.json"))
  # Each profile compiled exactly once over the whole run.
  assert summary["sampler_compilations"] == {"train": 1, "val": 1}
  assert "final_val_accuracy" in summary
  assert os.listdir(workdir / "tb" / "train")


def test_help_exits_zero(tmp_path):
  proc = run_train("--help", workdir=tmp_path / "w")
  assert proc.returncode == 0 and "--config=FILE" in proc.stdout

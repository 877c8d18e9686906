"""The command line: bad input gets one line and exit status 2; the smoke run writes its files.

The CLI runs in subprocesses (as a user runs it), through tests/cli.py.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
import pytest

import cli
from cli import (MATH, ROOT, STRAIGHT, assert_clean_error,  # tests/cli.py
                 assert_smoke_run_imports_nothing_heavy, env, run_train)
from jaxgrpo import data as data_lib
from jaxgrpo.run import loading
from jaxgrpo.model import hf


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


@pytest.mark.parametrize("case", ["missing", "raises", "twice", "unregistered", "parquet"])
def test_a_bad_user_module_or_data_file_is_one_line_before_compiling(tmp_path, case):
  # config.user_modules and Parquet data: each problem is one line, exit 2, before any
  # compilation, naming the file (and line) at fault.
  module = write(tmp_path / "my_rewards.py", {
      "raises": "import json\nraise ImportError('needs a GPU')\n",
      "twice": "import jaxgrpo.rewards\n@jaxgrpo.rewards.register('exact_match')\n"
               "def again(c, a, **k):\n  return [0.0] * len(c)\n"}.get(case, "x = 1\n"))
  args = [f"--config={MATH}:smoke", f"--config.user_modules={module}"]
  if case == "missing":
    args[1] = f"--config.user_modules={tmp_path}/nope.py"
    expect = (f"{tmp_path}/nope.py: no such file",)
  elif case == "raises":
    expect = (f"{module}:2: ImportError: needs a GPU",)
  elif case == "twice":
    expect = (f"{module}:2: ValueError: reward 'exact_match' is already registered",)
  elif case == "unregistered":
    args.append("--config.rewards.unit_tests=1.0")
    expect = ("config.rewards.unit_tests", "registered rewards: exact_match, format, math")
  else:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([{"problem": "1+1=", "answer": "0002"}]),
                   tmp_path / "train.parquet")
    args += ["--config.data.source=jsonl", f"--config.data.train_path={tmp_path}/train.parquet"]
    expect = (f"{tmp_path}/train.parquet: no column 'question' (columns: problem, answer)",)
  proc = run_train(*args, workdir=tmp_path / "w")
  assert_clean_error(proc, *expect)
  assert "Compiling" not in proc.stderr and not os.path.exists(tmp_path / "w")


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


# Each validation setting the validator refuses, with the fragments its one line must hold.
REFUSED = [
    # An override that would do nothing (issue 48; every such key: tests/test_config.py).
    (["--config.data.val_path=my_val.parquet"],
     ["config.data.val_path: ignored while data.source='arithmetic'; add "
      "--config.data.source=jsonl"]),
    # LoRA's rank above a target's smaller side, found once the checkpoint's architecture
    # is known (the embedded model: d_model 128 = 4 heads x 32, so q is 128 in, 128 out).
    (["--config.model.lora_rank=129"],
     ["config.model.lora_rank=129: rank 129 exceeds the smaller side of target 'q' (128: "
      "128 in, 128 out); allowed: a smaller rank"]),
    (["--config.grpo.val_num_generations_per_prompt=0"],
     ["config.grpo.val_num_generations_per_prompt=0", "integer >= 1"]),
    (["--config.grpo.stop_at_validation_metric=pass_k",
      "--config.grpo.stop_at_validation_threshold=0.5",
      "--config.grpo.val_num_generations_per_prompt=1"],
     ["stop_at_validation_metric='pass_k'", "val_num_generations_per_prompt > 1",
      "allowed: accuracy, reward_mean, pass@1"]),
    (["--config.grpo.stop_at_validation_metric=pass@4",
      "--config.grpo.stop_at_validation_threshold=0.5"],  # smoke: k=2
     ["stop_at_validation_metric='pass@4'", "needs 4 samples per prompt",
      "allowed: accuracy, reward_mean, pass@1, pass@2, pass_k"]),
    (["--config.grpo.stop_at_validation_metric=acuracy",
      "--config.grpo.stop_at_validation_threshold=0.5"],
     ["stop_at_validation_metric='acuracy'", "does not report", "allowed: accuracy"]),
    (["--config.grpo.stop_at_validation_metric=accuracy"],
     ["config.grpo.stop_at_validation_threshold=None", "needs a threshold"]),
    (["--config.grpo.stop_at_validation_threshold=0.8"],
     ["config.grpo.stop_at_validation_metric=None", "names no metric", "allowed: accuracy"]),
    (["--config.generation.val_temperature=-0.1"],
     ["config.generation.val_temperature=-0.1", "a number >= 0"]),
    (["--config.generation.val_top_p=1.5"], ["config.generation.val_top_p=1.5", "<= 1"]),
    (["--config.generation.val_top_p=0"], ["config.generation.val_top_p=0", "> 0"]),
    (["--config.generation.val_top_k=-2"], ["config.generation.val_top_k=-2", "integer >= 0"]),
    (["--config.generation.backend=jetsteam"], ["config.generation.backend='jetsteam'",
                                                "allowed: one of 'native', 'jetstream'"]),
    (["--config.generation.max_concurrent_decodes=16"],
     ["config.generation.max_concurrent_decodes=16", "0 with generation.backend='native'"]),
    (["--config.grpo.stop_at_validation_metric=accuracy",
      "--config.grpo.stop_at_validation_threshold=0.5",
      "--config.grpo.stop_at_validation_confidence=1.0"],
     ["config.grpo.stop_at_validation_confidence=1.0", "a number > 0 and < 1"]),
    (["--config.grpo.stop_at_validation_metric=pass@2/gsm8k",
      "--config.grpo.stop_at_validation_threshold=0.5"],  # arithmetic rows name no source
     ["config.grpo.stop_at_validation_metric='pass@2/gsm8k'", "no validation source 'gsm8k'"]),
]


def _assert_all_refused(tmp_path, cases):
  """One CLI process per (extra args, fragments) case, run concurrently (each spends its few
  seconds importing jax): each must end in one clean line and write nothing."""
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jaxgrpo.train", f"--workdir={tmp_path / str(i)}",
       f"--config={MATH}:smoke", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=env(), cwd=ROOT) for i, (args, _) in enumerate(cases)]
  for i, (proc, (args, fragments)) in enumerate(zip(procs, cases)):
    stdout, stderr = proc.communicate(timeout=600)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    try:
      assert_clean_error(done, *fragments)
      assert not os.path.exists(tmp_path / str(i))  # nothing written for a refused run
    except AssertionError as e:
      raise AssertionError(f"case {args}: {e}") from None


def test_validation_settings_are_refused_at_startup(tmp_path):
  _assert_all_refused(tmp_path, REFUSED)


@pytest.mark.slow
def test_smoke_run_writes_results(straight_run):
  # conftest.py's run of tests/cli.py's STRAIGHT (ARGS, logging to wandb too): the smoke
  # preset for 8 steps, a training temperature of 0.9 that the unset validation
  # temperature follows (plots off: drawing them costs seconds per run; validation.png is
  # drawn on demand below).
  workdir, proc = straight_run
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "finished 8 steps" in proc.stdout
  records = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  train = [r for r in records if r["split"] == "train"]
  val = [r for r in records if r["split"] == "val"]
  assert [r["step"] for r in train] == list(range(1, 9))
  assert [r["step"] for r in val] == [0, 2, 4, 6, 8]  # at start, every val_period=2
  for key in ("reward_mean", "reward_std", "accuracy", "zero_std_group_fraction",
              "completion_length_mean", "completion_length_max", "truncated_fraction",
              "loss", "kl", "clip_fraction", "grad_norm", "learning_rate",
              "rollout_tokens_per_s", "reward/exact_match"):
    assert key in train[0], key
  # Smoke validation: 32 prompts x k=2.
  for key in ("accuracy", "accuracy_stderr", "pass@1", "pass@2", "pass_k", "avg_length",
              "truncated_fraction", "wall_time_s"):
    assert key in val[0], key
  assert val[0]["num_prompts"] == 32 and val[0]["num_rollouts"] == 64
  assert val[0]["pass@2"] == val[0]["pass_k"] and 0 <= val[0]["accuracy"] <= 1
  samples = [json.loads(l) for l in open(workdir / "val_samples" / "step_2.jsonl")]
  assert len(samples) == 32 and all(len(s["completions"]) == 2 for s in samples)
  config = json.load(open(workdir / "config.json"))
  assert config["grpo"]["max_num_steps"] == 8 and config["mesh"]["data"] == 1
  # micro_batch_size 'auto' with no memory limit (CPU): the whole batch, nothing compiled,
  # said in one line, and config.json holds the number.
  assert config["grpo"]["micro_batch_size"] == 32
  assert ("micro_batch_size=auto -> 32 (the whole batch: no memory limit to plan against; "
          "set mesh.memory_limit_gib to choose)") in proc.stderr
  assert config["generation"]["temperature"] == config["generation"]["val_temperature"] == 0.9
  summary = json.load(open(workdir / "summary.json"))
  # Each profile compiled exactly once over the whole run.
  assert summary["compilations"] == {"update": 1, "train_sampler": 1, "val_sampler": 1}
  assert "final_val_accuracy" in summary and summary["stopped_early"] is False
  assert summary["checkpoint"].endswith(os.path.join("checkpoints", "8"))
  assert os.listdir(workdir / "tb" / "train")
  # The user's reward file (cli.USER) was imported, got every row's own columns (on the
  # run's one device; tests/test_multihost.py: 2 processes of 2), and its dict
  # keys are logged, train and val, in metrics.jsonl and TensorBoard.
  for row in train + val:
    assert row["reward/fixture_columns/aligned"] == 1.0, row
    assert row["reward_errors/fixture_columns"] == row["reward_unscored_fraction"] == 0.0
  assert all(r["reward/fixture_columns"] == 0.0 and r["reward_s"] >= 0 for r in train)
  tags = {tag for tag, _, _ in cli.tb_scalars(str(workdir / "tb" / "train"))}
  assert {"reward/fixture_columns/aligned", "reward/fixture_columns/ids",
          "reward_errors/fixture_columns", "reward_errors/exact_match"} <= tags
  plot = subprocess.run([sys.executable, "-m", "jaxgrpo.plot", str(workdir)],
                        capture_output=True, text=True, timeout=120)
  assert plot.returncode == 0 and plot.stdout.strip() == str(workdir / "validation.png")
  # The README's `tensorboard --logdir <workdir>/tb` reads these events: the command is
  # installed with jaxgrpo and its own inspector finds both splits' scalars.
  tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
  inspect = subprocess.run([tensorboard, "--inspect", f"--logdir={workdir / 'tb'}"],
                           capture_output=True, text=True, timeout=120)
  assert inspect.returncode == 0, inspect.stderr
  assert "tb/train:" in inspect.stdout and "reward/fixture_columns/aligned" in inspect.stdout
  # (TensorBoard tags allow no "@": tensorboardX writes pass@2 as pass_2.)
  assert "tb/val:" in inspect.stdout and "pass_2" in inspect.stdout
  # wandb (offline) got every metric of metrics.jsonl under the same name and step, the
  # resolved config and summary.json's values.
  (wandb,) = cli.wandb_runs(str(workdir))
  logged = {(r["split"], r["step"], k) for r in train + val
            for k in r if k not in ("step", "split", "time")}
  assert logged == {(k.split("/")[0], h["step"], k.split("/", 1)[1]) for h in wandb["history"]
                    for k in h if "/" in k and not k.startswith("_")}
  assert wandb["config"]["grpo"] == config["grpo"]
  assert wandb["summary"]["compilations"] == summary["compilations"]
  assert wandb["summary"]["best_val_accuracy"] == summary["best_val_accuracy"]


def test_a_tracker_that_cannot_log_is_one_line_before_compiling(tmp_path):
  # wandb online without an API key: wandb.init would fail (or ask on a TTY) after the
  # first compilation; the check answers at start-up and names both ways out.
  proc = run_train(f"--config={MATH}:smoke", "--config.logging.trackers=tensorboard,wandb",
                   workdir=tmp_path / "w", WANDB_MODE="", WANDB_API_KEY="",
                   NETRC=str(tmp_path / "no-netrc"))
  assert_clean_error(proc, "config.logging.trackers: wandb has no API key",
                     "WANDB_MODE=offline")
  assert not os.path.exists(tmp_path / "w")


def test_auto_with_nothing_that_fits_is_one_line_before_the_first_rollout(tmp_path):
  proc = run_train(f"--config={MATH}:smoke", "--config.grpo.micro_batch_size=auto",
                   "--config.mesh.memory_limit_gib=0.00001", workdir=tmp_path / "w")
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error")]
  assert len(errors) == 1 and errors[0].startswith(
      "error: config.grpo.micro_batch_size=auto: no valid size fits the update step in "
      "10.49 KiB per chip (tried 1: "), errors  # 1 device: sub-groups 1, 2, then 4, 8, ...
  assert "Traceback" not in proc.stderr
  # The search compiled the update (AOT); nothing else was: no sampler, no checkpoint, no
  # training row.
  compiled = [l for l in proc.stderr.splitlines() if "Finished XLA compilation of" in l]
  assert any("jit(step_fn)" in l for l in compiled), compiled  # the update step
  assert not any("jit(traced)" in l for l in compiled), compiled  # never a sampler
  assert not os.path.exists(tmp_path / "w" / "checkpoints")
  assert not os.path.exists(tmp_path / "w" / "metrics.jsonl")


def test_help_exits_zero(tmp_path):
  proc = run_train("--help", workdir=tmp_path / "w")
  assert proc.returncode == 0 and "--config=FILE" in proc.stdout


GSM8K = os.path.join(ROOT, "configs", "gsm8k.py")
QWEN2 = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2")


def test_gsm8k_config_needs_a_model_and_checks_it_before_compiling(tmp_path):
  proc = run_train(f"--config={GSM8K}", workdir=tmp_path / "a")
  assert_clean_error(proc, "config.model.hf_checkpoint=None", "--config.model.hf_checkpoint=")
  proc = run_train(f"--config={GSM8K}:cpu", f"--config.model.hf_checkpoint={QWEN2}",
                   "--config.model.d_model=32", workdir=tmp_path / "b")
  assert_clean_error(proc, "config.model.d_model=32", f"the checkpoint {QWEN2} has 64")
  broken = tmp_path / "qwen2"
  shutil.copytree(QWEN2, broken)
  os.remove(broken / "tokenizer.json")
  proc = run_train(f"--config={GSM8K}:cpu", f"--config.model.hf_checkpoint={broken}",
                   workdir=tmp_path / "c")
  assert_clean_error(proc, f"{broken}/tokenizer.json: missing")


# Pod flags and paths refused before anything starts (jax.distributed is never reached).
POD_REFUSED = [
    (["--workdir=gs://bucket/run"], ["--workdir=gs://bucket/run", "GCS FUSE"]),
    (["--coordinator_address=127.0.0.1:1234"],
     ["--coordinator_address, --num_processes and --process_id go together"]),
    (["--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=2"],
     ["--process_id=2", "allowed 0..1"]),
]


def test_pod_flags_are_refused_at_startup(tmp_path):
  _assert_all_refused(tmp_path, POD_REFUSED)


@pytest.mark.slow
def test_train_never_imports_jetstream_or_tensorflow(tmp_path):
  # The jetstream extra pulls TensorFlow (~2 GB; ~6 s and ~700 MiB resident to import): importing
  # jaxgrpo.train and running the default config must not even try to import it. The
  # subprocess records (and refuses) every attempt, so this holds with or without the extra.
  assert_smoke_run_imports_nothing_heavy(tmp_path / "w")


# The README's own-data example and what the data must be for the model to read it.


def readme_own_data_command(tmp_path, **replace):
  """The README's "Your own data" command for bash, with its data paths in `tmp_path` (the
  rows below) and this interpreter; `replace` maps more README text to what runs."""
  readme = open(os.path.join(ROOT, "README.md")).read()
  section = readme.split("## Your own data", 1)[1]
  command = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
  for split, n in (("train", 16), ("val", 8)):
    write(tmp_path / f"{split}.jsonl", "".join(
        json.dumps({"question": f"Sam has {i} apples and buys 2 more. How many now?",
                    "answer": str(i + 2)}) + "\n" for i in range(n)))
    command = command.replace(f"data/{split}.jsonl", str(tmp_path / f"{split}.jsonl"))
  for old, new in replace.items():
    assert old in command, (old, command)
    command = command.replace(old, new)
  return command.replace("python -m", f"{sys.executable} -m", 1)


def run_bash(command, workdir):
  return subprocess.run(["bash", "-c", f"{command.strip()} --workdir={workdir}"],
                        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)


def test_readme_template_typed_in_double_quotes_is_refused_with_the_hint(tmp_path):
  # The README's command as first written: "...\n..." gives a backslash and an n.
  command = readme_own_data_command(
      tmp_path, **{"$'Question: {question}\\nAnswer:'": '"Question: {question}\\nAnswer:"'})
  proc = run_bash(command, tmp_path / "w")
  assert_clean_error(proc, 'config.data.prompt_template="Question: {question}\\nAnswer:": '
                     "holds a backslash followed by n, not a newline",
                     "--config.data.prompt_template=$'Question: {question}\\nAnswer:'")
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.slow
def test_readme_own_data_example_trains_on_a_real_newline(tmp_path):
  # The command exactly as the README shows it (2 steps of the :cpu preset with the qwen2
  # fixture), through bash: the prompt the model sees has a newline after the question.
  proc = run_bash(readme_own_data_command(tmp_path), tmp_path / "w")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "finished 2 steps" in proc.stdout
  config = json.load(open(tmp_path / "w" / "config.json"))
  assert config["data"]["prompt_template"] == "Question: {question}\nAnswer:"
  first = json.loads(open(tmp_path / "w" / "val_samples" / "step_0.jsonl").readline())
  assert ("Question: Sam has 0 apples and buys 2 more. How many now?\nAnswer:"
          in first["prompt"]), first["prompt"]
  assert "cannot encode" not in proc.stderr  # a byte-level BPE encodes any text


@pytest.mark.slow
def test_readme_own_reward_example_trains_validates_and_evaluates(tmp_path):
  # The README's reward file is the shipped one, and its two commands run as shown (2
  # steps, into tmp_path): the user's reward scores, logs its own key and drives validation,
  # and `evaluate` imports the same file and gives the run's validation back.
  section = open(os.path.join(ROOT, "README.md")).read().split("## Your own reward", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert code == open(os.path.join(ROOT, "examples", "close_enough", "rewards.py")).read()
  commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
  commands = (commands.replace("max_num_steps=200", "max_num_steps=2")
              .replace("runs/close", str(tmp_path / "close"))
              .replace("python -m", f"{sys.executable} -m"))
  proc = subprocess.run(["bash", "-ec", commands], capture_output=True, text=True, env=env(),
                        cwd=ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "finished 2 steps" in proc.stdout and "results in" in proc.stdout
  rows = [json.loads(l) for l in open(tmp_path / "close" / "metrics.jsonl")]
  for row in rows:
    assert row["reward_errors/close_enough"] == 0.0
    assert 0 <= row["reward/close_enough/abs_error"], row
  val = [r for r in rows if r["split"] == "val"]
  assert [r["step"] for r in val] == [0, 2]
  # The correctness reward is the user's: validation's accuracy is its mean score.
  samples = [json.loads(l) for l in open(tmp_path / "close" / "val_samples" / "step_2.jsonl")]
  assert val[-1]["accuracy"] == pytest.approx(
      sum(sum(s["rewards"]) for s in samples) / sum(len(s["rewards"]) for s in samples))
  evals = glob.glob(str(tmp_path / "close" / "eval" / "step_2-*" / "eval.json"))
  doc = json.load(open(evals[0]))
  assert doc["metrics"]["accuracy"] == val[-1]["accuracy"]


def arithmetic_rows(path, spaced_every=0):
  """40 addition problems; with `spaced_every`, every so many is written `100 + 200=`, whose
  spaces the embedded model's 16-token vocabulary lacks."""
  rows = []
  for i in range(40):
    spaced = spaced_every and i % spaced_every == 0
    rows.append(json.dumps({"question": f"{100 + i}{' + ' if spaced else '+'}{200 + i}=",
                            "answer": f"{300 + 2 * i:04d}"}) + "\n")
  return write(path, "".join(rows))


def test_prompts_with_unknown_characters_warn_in_one_line_and_train(tmp_path):
  # Rows 0, 10, 20 and 30 have spaces, all four among the 32 training rows (rows 32-39 are
  # held out for validation; 40 checked in all). The run goes on; it stops at its step-0
  # validation (threshold 0), so only the validation sampler compiles.
  path = arithmetic_rows(tmp_path / "mixed.jsonl", spaced_every=10)
  proc = run_train(f"--config={MATH}:smoke", "--config.data.source=jsonl",
                   f"--config.data.train_path={path}", "--config.data.num_val_examples=8",
                   "--config.data.max_prompt_length=12",
                   "--config.grpo.stop_at_validation_metric=accuracy",
                   "--config.grpo.stop_at_validation_threshold=0", workdir=tmp_path / "w")
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = [l for l in proc.stderr.splitlines() if "cannot encode" in l]
  assert warnings == [
      "warning: 4 of the 40 prompts checked (8 validation, 32 of 32 training) have text that "
      "the tokenizer of model.checkpoint='@embedded/arith3' (16 tokens) cannot encode and "
      "turns into <unk>: ' ' (1 distinct; first in training row 0); the model sees <unk> in "
      "place of that text"], proc.stderr[-3000:]
  assert "stopped early after 0 steps" in proc.stdout


def test_prompts_the_model_cannot_read_at_all_are_refused(tmp_path):
  # The run: the README's template with the embedded model, whose vocabulary has
  # none of "Question:", so every prompt is mostly <unk>. Refused before the prompt-length
  # check (which would have blamed max_prompt_length) and before any compilation.
  path = arithmetic_rows(tmp_path / "train.jsonl")
  proc = run_train(f"--config={MATH}:smoke", "--config.data.source=jsonl",
                   f"--config.data.train_path={path}", "--config.data.num_val_examples=8",
                   "--config.data.prompt_template=Question: {question}\nAnswer:",
                   workdir=tmp_path / "w")
  assert_clean_error(proc, "every one of the 40 prompts checked (8 validation, 32 of 32 "
                     "training) has text that the tokenizer of model.checkpoint="
                     "'@embedded/arith3' (16 tokens) cannot encode and turns into <unk>: "
                     "'Q', 'u', 'e', 's', 't', 'i', 'o', 'n', ... (14 distinct, 14 of them in "
                     "data.prompt_template's own text)", "use a model whose tokenizer covers")


def test_unknown_token_check_samples_training_rows_evenly():
  # 3000 training rows: at most 1000 are checked, every third (0, 3, ..., 2997). Row 1 has
  # a space but is not checked; row 300 is, and is the first named. A tokenizer without an
  # unknown token (byte-level BPE) checks nothing.
  from jaxgrpo.model.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  tok = Tokenizer.char_level("0123456789+=")
  train_rows = [{"question": f"{i}+1="} for i in range(3000)]
  train_rows[1] = train_rows[300] = {"question": "1 +1="}
  val_rows = [{"question": "2+2="}] * 10
  warning = loading.check_encodable(tok, "{question}", train_rows, val_rows, "M")
  assert warning.startswith("warning: 1 of the 1010 prompts checked (10 validation, 1000 of "
                            "3000 training) have text that the tokenizer of M (16 tokens)")
  assert "first in training row 300" in warning
  assert loading.check_encodable(tok, "{question}", train_rows[:1] + val_rows, val_rows,
                               "M") is None
  qwen = hf.hf_tokenizer(QWEN2)
  assert loading.check_encodable(qwen, "{question}", train_rows, val_rows, "M") is None


@pytest.mark.slow
def test_a_resumed_run_says_how_many_steps_it_trained_and_from_where(straight_run, tmp_path):
  # The straight run (8 steps, a checkpoint every 2) copied without its step-8 checkpoint,
  # as if killed during step 8: the same command resumes from step 6 and trains 2 steps.
  # The summary used to say "finished 8 steps", the step reached, in this process's time.
  workdir, run = straight_run
  assert run.returncode == 0, run.stderr[-2000:]
  shutil.copytree(workdir, tmp_path / "w")
  shutil.rmtree(tmp_path / "w" / "checkpoints" / "8")
  proc = run_train(*STRAIGHT, workdir=tmp_path / "w")
  assert proc.returncode == 0, proc.stderr[-3000:]
  last = proc.stdout.strip().splitlines()[-1]
  # The validations span the whole run, and the line says so.
  assert re.match(r"finished 2 steps in \d+s \(resumed from step 6, now at step 8\); the "
                  r"run's val accuracy ", last), last
  # The progress console's own last line (on stderr) counts the same way.
  assert re.search(r"^done: 2 steps in \S+ \(resumed from step 6\) \|", proc.stderr, re.M)
  summary = json.load(open(tmp_path / "w" / "summary.json"))
  assert (summary["steps"], summary["steps_this_run"], summary["resumed_step"]) == (8, 2, 6)
  # Which steps each process trained: the straight run's 1-8 cut at 6 (7 and 8 redone), then
  # this process's 7-8.
  history = [(h["first_step"], h["last_step"]) for h in summary["history"]]
  assert history == [(1, 6), (7, 8)], summary["history"]
  assert summary["history"][0]["redone_after"] == 6
  assert summary["history"][1]["resumed_from"].endswith(os.path.join("checkpoints", "6"))
  # wandb: the same run continued (trackers.json kept its id), every step once: the first
  # process's rows 7-8 stay (exact resume redid them identically), the second adds none.
  first, second = cli.wandb_runs(str(tmp_path / "w"))
  assert first["id"] == second["id"]
  steps = lambda split: [h["step"] for r in (first, second) for h in r["history"]
                         if f"{split}/accuracy" in h]
  assert steps("train") == list(range(1, 9)) and steps("val") == [0, 2, 4, 6, 8]
  assert second["summary"]["steps_this_run"] == 2


def _hashes(folder):
  """relative path -> sha256 of every file under `folder`."""
  import hashlib  # pylint: disable=g-import-not-at-top
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.mark.slow
def test_rerunning_a_finished_run_touches_nothing(straight_run, tmp_path):
  # The same command again on a finished run used to rewrite summary.json with a process
  # that trained nothing ("checkpoint": null, wall time 0.4 s, every compile count 0) and
  # move config.json aside. Now: one line, exit 0, every file byte-identical, no compile.
  workdir, run = straight_run
  assert run.returncode == 0, run.stderr[-2000:]
  shutil.copytree(workdir, tmp_path / "w")
  before = _hashes(tmp_path / "w")
  proc = run_train(*STRAIGHT, workdir=tmp_path / "w")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().splitlines() == [
      f"{tmp_path / 'w'} already finished at step 8; --config.grpo.max_num_steps=N (N > 8) "
      "to train further, or another --workdir"]
  assert "Compiling" not in proc.stderr
  assert _hashes(tmp_path / "w") == before
  # A max_num_steps below the saved step is a config error, and touches nothing either.
  proc = run_train(*STRAIGHT, "--config.grpo.max_num_steps=4", workdir=tmp_path / "w")
  assert_clean_error(proc, "config.grpo.max_num_steps=4", "already at step 8",
                     "8 or more to continue it")
  assert _hashes(tmp_path / "w") == before


@pytest.mark.slow
def test_a_resume_with_a_changed_config_says_what_changed_and_keeps_the_old_one(straight_run,
                                                                              tmp_path):
  # It used to print only "resuming from ... at step 8" and rename config.json to
  # config.1.json without a word.
  workdir, run = straight_run
  assert run.returncode == 0, run.stderr[-2000:]
  shutil.copytree(workdir, tmp_path / "w")
  w = tmp_path / "w"
  original = (w / "config.json").read_text()
  lr = json.loads(original)["optim"]["learning_rate"]
  # G cannot change on resume: one line naming the key, nothing touched.
  before = _hashes(w)
  proc = run_train(*STRAIGHT, "--config.grpo.max_num_steps=10",
                   "--config.grpo.num_generations_per_prompt=2", workdir=w)
  assert_clean_error(proc, "config.grpo.num_generations_per_prompt=2", "which a resume "
                     "cannot change", f"allowed: {json.loads(original)['grpo']['num_generations_per_prompt']}")
  assert _hashes(w) == before
  proc = run_train(*STRAIGHT, "--config.grpo.max_num_steps=10", "--config.optim.learning_rate=0.001",
                   workdir=w)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (f"resuming {w} at step 8 with 2 changed keys: grpo.max_num_steps 8 -> 10, "
          f"optim.learning_rate {json.dumps(lr)} -> 0.001 (the earlier config is kept as "
          f"{w}/config.until_step_8.json)") in proc.stdout.splitlines()
  assert (w / "config.until_step_8.json").read_text() == original
  assert json.loads((w / "config.json").read_text())["optim"]["learning_rate"] == 0.001


def test_the_startup_line_comes_before_jax_loads(tmp_path):
  # It used to print nothing for the first ~8 s, and a default ./runs/<time> workdir was
  # named only by the last line. The line says what the run is before jax is imported (an
  # import hook marks that moment on stderr), then the devices once jax is up; here a value
  # that validation refuses (it needs the device count) ends the run after both.
  script = textwrap.dedent(f"""
      import sys
      class Mark:
        def find_spec(self, name, path=None, target=None):
          if name == "jax" and "jax" not in sys.modules:
            print("JAX IMPORTED", file=sys.stderr, flush=True)
          return None
      sys.meta_path.insert(0, Mark())
      from jaxgrpo import train
      sys.exit(train.main(["train", "--config={MATH}:smoke", "--workdir={tmp_path / 'w'}",
                           "--config.grpo.num_generations_per_prompt=1"]))
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=env(), cwd=ROOT, timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.strip() and "Finished tracing" not in l]
  assert lines[0] == (f"jaxgrpo.train: workdir {tmp_path / 'w'} | config {MATH}, preset smoke"
                      " | 3 steps"), lines
  assert lines[1] == "JAX IMPORTED", lines
  assert lines[-1].startswith("error: config.grpo.num_generations_per_prompt=1"), lines


def test_a_flag_error_answers_without_importing_jax():
  # jaxgrpo.config used to import grpo (and so jax, optax, flax) for three tuples of names,
  # and the error path imported the data and model modules: 1.4 s for an unknown key.
  script = textwrap.dedent(f"""
      import sys
      from jaxgrpo import train
      rc = train.main(["train", "--config={MATH}", "--config.grpo.nonexistent=1"])
      print("RC", rc, "JAX", "jax" in sys.modules, "GRAIN", "grain" in sys.modules)
  """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=env(), cwd=ROOT, timeout=120)
  assert proc.stdout.split() == ["RC", "2", "JAX", "False", "GRAIN", "False"], proc.stderr
  assert proc.stderr.strip() == "error: config.grpo.nonexistent: unknown key"


def test_a_bad_boolean_and_an_unregistered_reward_are_sentences(tmp_path):
  # They used to print absl's tuple ('Non-boolean argument to boolean flag', 'maybe') and a
  # bare "unknown key" that did not say which rewards exist.
  proc = run_train(f"--config={MATH}:smoke", "--config.logging.plots=maybe",
                   workdir=tmp_path / "a")
  assert_clean_error(proc, "config.logging.plots=maybe: allowed: true or false")
  assert "(" not in proc.stderr.split("allowed")[0]
  proc = run_train(f"--config={MATH}:smoke", "--config.rewards.foo=1", workdir=tmp_path / "b")
  assert_clean_error(proc, "config.rewards.foo: unknown reward",
                     "registered rewards: exact_match, format, math")


FLAKY_REWARDS = """
import time

import jaxgrpo.rewards

@jaxgrpo.rewards.register("flaky_raises")
def raises(completions, answers, *, question, **columns):
  if any(q.startswith("1") for q in question):
    raise ValueError("cannot score a question that starts with 1")
  return [1.0] * len(completions)

@jaxgrpo.rewards.register("flaky_sleeps")
def sleeps(completions, answers, **columns):
  time.sleep(30)
  return [1.0] * len(completions)

@jaxgrpo.rewards.register("flaky_short")
def short(completions, answers, **columns):
  return [1.0]

@jaxgrpo.rewards.register("always_raises")
def always(completions, answers, **columns):
  raise RuntimeError("the verifier is down")
"""


@pytest.mark.slow
def test_rewards_that_raise_hang_or_miscount_never_stop_a_run(tmp_path):
  # Three broken rewards beside exact_match: the run finishes; each loses exactly the rows it
  # failed (the raising one only the questions starting with 1: a failed call is retried
  # row by row), and each one's first traceback is printed once.
  module = write(tmp_path / "flaky.py", FLAKY_REWARDS)
  workdir = tmp_path / "w"
  proc = run_train(f"--config={MATH}:smoke", "--config.grpo.max_num_steps=2",
                   f"--config.user_modules={module}", "--config.reward_timeout_s=1",
                   "--config.reward_workers=2", "--config.rewards.flaky_raises=1",
                   "--config.rewards.flaky_sleeps=1", "--config.rewards.flaky_short=1",
                   workdir=workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "finished 2 steps" in proc.stdout
  config = json.load(open(workdir / "config.json"))
  rows = data_lib.make_sources(ml_collections.ConfigDict(config["data"]))[0]
  steps = [json.loads(l) for l in open(workdir / "train_prompts.jsonl")]
  train = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  train = [r for r in train if r["split"] == "train"]
  for row, step in zip(train, steps):
    ones = np.mean([rows[i]["question"].startswith("1") for i in step["row_ids"]])
    assert row["reward_errors/flaky_raises"] == pytest.approx(ones), row
    assert row["reward_errors/flaky_sleeps"] == row["reward_errors/flaky_short"] == 1.0
    assert row["reward_errors/exact_match"] == row["reward_unscored_fraction"] == 0.0
  for name, text in (("flaky_raises", "ValueError: cannot score a question that starts"),
                     ("flaky_sleeps", "within reward_timeout_s=1 s"),
                     ("flaky_short", "returned 1 values for")):
    assert proc.stderr.count(f"warning: reward '{name}' failed") >= 2  # each step, validation
    assert proc.stderr.count(text) >= 2
  assert proc.stderr.count("Traceback") == 1  # the raising reward's, once
  # A reward that fails on every row: the run stops after reward_max_failed_steps, saving
  # nothing (smoke would save step 2; the stop comes first), with one line.
  proc = run_train(f"--config={MATH}:smoke", f"--config.user_modules={module}",
                   "--config.rewards.exact_match=0", "--config.rewards.always_raises=1",
                   "--config.reward_max_failed_steps=2", workdir=tmp_path / "broken")
  assert proc.returncode == 1, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: every reward failed on every row for 2 steps in a row "
                         "(steps 1-2; reward_max_failed_steps=2): a broken reward"), last
  saved = tmp_path / "broken" / "checkpoints"
  assert not saved.exists() or not os.listdir(saved)


def test_an_override_that_does_nothing_is_refused_before_jax_loads(tmp_path):
  """The one line comes before the devices line: nothing of jax was started."""
  done = cli.run_train(f"--config={MATH}:smoke", "--config.env.max_turns=3", workdir=tmp_path)
  assert_clean_error(done, "config.env.max_turns: ignored while env.name=''")
  assert "devices: " not in done.stderr
  assert not os.path.exists(tmp_path / "config.json")


def verl_gsm8k(folder, n_train=16, n_val=8):
  """verl's GSM8K Parquet layout (examples/data_preprocess/gsm8k.py), made here with pyarrow:
  the prompt as chat messages, the answer under reward_model.ground_truth."""
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  os.makedirs(folder, exist_ok=True)
  for split, n in (("train", n_train), ("test", n_val)):
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"Sam has {i} apples and buys 2 more. "
                         "How many now? Let's think step by step and output the final "
                         "answer after \"####\"."}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": split, "index": i}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(folder, f"{split}.parquet"))
  return rows


def test_chat_messages_with_the_embedded_model_are_one_line(tmp_path):
  verl_gsm8k(tmp_path / "data", n_train=40)
  done = cli.run_train(f"--config={MATH}:smoke",
                       f"--config.data.train_path={tmp_path / 'data' / 'train.parquet'}",
                       "--config.data.question_key=prompt",
                       "--config.data.answer_key=reward_model.ground_truth",
                       workdir=tmp_path / "w")
  assert_clean_error(done, "config.data.question_key='prompt': the column holds chat "
                     "messages", "the model has no chat template", "data.use_chat_template=True")
  assert "data.source='jsonl'" in done.stderr  # switched by the train_path, and said so
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.slow
def test_readme_verl_gsm8k_parquet_trains_as_is(tmp_path):
  """Issue 48: the README's command on verl's layout trains 2 steps on the Qwen2 fixture,
  and each prompt the model sees is the chat template's rendering of the row's messages."""
  from jaxgrpo.model import chat
  rows = verl_gsm8k(tmp_path / "gsm8k")
  section = open(os.path.join(ROOT, "README.md")).read().split("## Your own data", 1)[1]
  command = re.findall(r"```bash\n(.*?)```", section, re.S)[1]
  assert "question_key=prompt" in command
  command = (command.replace("$HOME/data/gsm8k", str(tmp_path / "gsm8k"))
             .replace("python -m", f"{sys.executable} -m", 1))
  proc = run_bash(command, tmp_path / "w")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The fixture is a tiny random model: its steps may train no row, which the run says
  # (issue 60); no other warning (the rows, their messages and columns read as they are).
  warnings = [l for l in proc.stderr.splitlines() if "warning" in l]
  assert "finished 2 steps" in proc.stdout
  assert all("trained no row" in l for l in warnings), warnings
  template = chat.ChatTemplate.from_folder(os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2"))
  samples = [json.loads(l) for l in open(tmp_path / "w" / "val_samples" / "step_2.jsonl")]
  assert [s["prompt"] for s in samples] == [template.render(r["prompt"]) for r in rows]
  assert samples[0]["answer"] == "2"

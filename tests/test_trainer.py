"""The device loop's pieces, in process: build() and one train_step on the smoke preset."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import cli  # tests/cli.py
from jaxgrpo import rewards
from jaxgrpo.algo import dynamic
from jaxgrpo.run import build, checkpoint, setup as setup_lib, trainer
from jaxgrpo import config as config_lib
from jaxgrpo import data as data_lib
from jaxgrpo.model import lora
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.runtime import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  # absl flags parse once per process, so the variants below copy this config.
  return setup_lib.prepare(["train", f"--config={ROOT}/configs/math.py:smoke",
                        f"--workdir={tmp_path_factory.mktemp('run')}",
                        "--config.mesh.data=8"])


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_reference_policy_only_when_beta_positive(smoke, beta, registry):
  # A reward that scores 0 and keeps what it was given: every column of the batch's rows.
  seen = []
  rewards.register("_test_seen")(lambda c, a, **columns: seen.append(columns) or [0.0] * len(c))
  config = ml_collections.ConfigDict(smoke.config.to_dict())
  config.grpo.beta = beta
  config.rewards["_test_seen"] = 1.0
  setup = dataclasses.replace(smoke, config=config)
  engine, state, ref_params, update = build.training(setup)
  if beta == 0:
    assert ref_params is None  # no copy of the parameters, no reference forward pass
  else:
    assert ref_params is not None
  batch = next(setup.train_batches)
  state, metrics = trainer.train_step(setup, engine, state, ref_params, update, batch, step=1)
  assert int(state.step) == 1
  g = config.grpo.num_generations_per_prompt
  # The rows come in calls of consecutive rows (one per reward worker), in order.
  got = {k: [x for call in seen for x in call[k]] for k in seen[0]}
  assert got["question"] == [q for q in batch["questions"] for _ in range(g)]
  assert got["prompts"] == [p for p in batch["prompts"] for _ in range(g)]
  assert len(got["completion_ids"]) == len(batch["prompts"]) * g
  for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm", "learning_rate",
              "reward_mean", "accuracy", "zero_std_group_fraction", "rollout_tokens_per_s"):
    assert np.isfinite(metrics[key]), key
  # 8 prompts x 4 samples, sharded over 8 devices; each profile compiled once.
  assert engine.compilations["train"] == 1



def test_a_step_with_no_row_scored_logs_no_nan(smoke, registry):
  """Issue 48: every reward row lost (here: a reward that returns None for each) gave
  reward_mean=nan accuracy=nan, which the trackers logged as NaN. The means over no rows
  are left out; reward_unscored_fraction says why, and no update ran."""
  rewards.register("_test_none")(lambda c, a, **columns: [None] * len(c))
  config = ml_collections.ConfigDict(smoke.config.to_dict())
  config.rewards = ml_collections.ConfigDict({"_test_none": 1.0})
  config.reward_workers = 0
  setup = dataclasses.replace(smoke, config=config)
  setup.__dict__.pop("scorer", None)  # the cached scorer is the smoke config's
  engine, state, ref_params, update = build.training(setup)
  state, metrics = trainer.train_step(setup, engine, state, ref_params, update,
                                      next(setup.train_batches), step=1)
  assert metrics["reward_unscored_fraction"] == 1.0 and int(state.step) == 0
  for key in ("reward_mean", "reward_std", "accuracy", "reward/_test_none", "loss"):
    assert key not in metrics, key
  assert all(np.isfinite(v) for v in metrics.values()), metrics


def variant(smoke, workdir, **grpo):
  """The smoke setup with other grpo values and its own workdir (no second flag parse)."""
  config = ml_collections.ConfigDict(smoke.config.to_dict())
  for key, value in grpo.items():
    config.grpo[key] = value
  return dataclasses.replace(smoke, config=config, workdir=str(workdir))


def rows(workdir, split):
  return [r for r in metrics_lib.read_metrics(str(workdir)) if r["split"] == split]


def test_a_run_that_trains_nothing_says_why_once_and_counts_the_steps(smoke, tmp_path, capsys):
  """Issue 60: with every completion truncated under mask_truncated_completions the update
  trained no row, and the progress line showed loss=0 step after step, no warning. Two new
  tokens cannot hold an answer and its end token, so every row is truncated (and scores 0:
  every group is flat too); the first such step warns with both reasons."""
  setup = variant(smoke, tmp_path, max_num_steps=3, val_at_start=False, val_period=0,
                  val_at_end=False, mask_truncated_completions=True)
  setup.config.generation.max_new_tokens = 2
  setup.config.logging.trackers = ""
  assert trainer.run(setup) == 0
  assert [r["trained_rows"] for r in rows(tmp_path, "train")] == [0, 0, 0]
  out, err = capsys.readouterr()
  assert "; 3 of them trained no row (see the warning" in out.strip().splitlines()[-1]
  warnings = [line for line in err.splitlines() if "trained no row" in line]
  assert len(warnings) == 1 and warnings[0].startswith("warning: step 1 trained no row: ")
  assert ("every row was truncated at generation.max_new_tokens=2 and "
          "grpo.mask_truncated_completions=True") in warnings[0]
  assert "every group's rewards were equal" in warnings[0]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["steps_without_training"] == 3


def test_trained_rows_are_in_the_loss_and_in_a_group_with_a_signal():
  """Hand-made: groups of 2. Group 0 differs (both rows train), group 1 is flat (neither),
  group 2 differs but its second row is truncated (masked: only the first trains) and
  group 3 differs only through an unscored row (its one scored row: flat)."""
  from jaxgrpo.algo import grpo  # pylint: disable=g-import-not-at-top
  rewards_N = np.array([1, 0, 1, 1, 1, 0, 1, 0], np.float32)
  scored_N = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
  truncated_N = np.array([0, 0, 0, 0, 0, 1, 0, 0], bool)
  np.testing.assert_array_equal(grpo.trained_rows(rewards_N, scored_N, truncated_N, 2, True),
                                [1, 1, 0, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(grpo.trained_rows(rewards_N, scored_N, truncated_N, 2, False),
                                [1, 1, 0, 0, 1, 1, 0, 0])
  config = ml_collections.ConfigDict({"grpo": {"mask_truncated_completions": True},
                                      "generation": {"max_new_tokens": 64}})
  why = trainer.untrained_why({"reward_unscored_fraction": 1.0}, config)
  assert why.startswith("no reward scored any row")
  why = trainer.untrained_why({"reward_unscored_fraction": 0.0, "truncated_fraction": 0.5,
                               "zero_std_group_fraction": 0.5}, config)
  assert why.startswith("every row of a group whose rewards differ was truncated at "
                        "generation.max_new_tokens=64")


def test_early_stop_after_a_met_validation_saves_that_step(smoke, tmp_path):
  # accuracy >= 0 holds at the first validation, which (no val_at_start) is at step 2.
  setup = variant(smoke, tmp_path, val_at_start=False, val_period=2, max_num_steps=3,
                  stop_at_validation_metric="accuracy", stop_at_validation_threshold=0.0)
  assert trainer.run(setup) == 0
  assert [r["step"] for r in rows(tmp_path, "train")] == [1, 2]
  assert [r["step"] for r in rows(tmp_path, "val")] == [2]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["stopped_early"] and summary["early_stop"]["step"] == 2
  assert summary["early_stop"]["metric"] == "accuracy"
  ckpts = checkpoint.Checkpoints(str(tmp_path / "checkpoints"), read_only=True)
  assert ckpts.steps() == [2]
  restored, meta = ckpts.restore(2)
  assert int(restored["step"]) == 2 and meta["reason"] == "early_stop"
  assert meta["data"]["num_rows"] == 200  # the data iterator's state went with it
  ckpts.close()


def test_early_stop_at_start_trains_nothing_and_pass_k_can_stop_alone(smoke, tmp_path):
  # First learn the initial validation's numbers (same params and val_seed every time).
  probe = variant(smoke, tmp_path / "probe", val_at_start=True,
                  stop_at_validation_metric="accuracy", stop_at_validation_threshold=0.0)
  assert trainer.run(probe) == 0
  assert rows(tmp_path / "probe", "train") == []  # stopped before any training step
  assert not os.path.exists(tmp_path / "probe" / "checkpoints" / "0")  # nothing to save
  first = rows(tmp_path / "probe", "val")[0]
  assert first["pass_k"] > first["accuracy"]  # k=2 samples: some prompts pass only once
  threshold = (first["accuracy"] + first["pass_k"]) / 2
  # pass_k reaches the threshold while accuracy does not: the pass_k rule stops the run.
  setup = variant(smoke, tmp_path / "pass_k", val_at_start=True,
                  stop_at_validation_metric="pass_k", stop_at_validation_threshold=threshold)
  assert trainer.run(setup) == 0
  val = rows(tmp_path / "pass_k", "val")
  assert len(val) == 1 and val[0]["accuracy"] < threshold <= val[0]["pass_k"]
  assert rows(tmp_path / "pass_k", "train") == []
  assert json.load(open(tmp_path / "pass_k" / "summary.json"))["stopped_early"]


class _ScriptedValidator:
  """Stands in for validation.Validator: returns the scripted metrics of each step, so the
  stop rule is tested on numbers chosen to sit on either side of the threshold."""

  SCRIPT = {  # step -> (accuracy, its lower bound); the threshold below is 0.5
      2: (0.60, 0.45),  # the mean reaches 0.5, its 0.95 bound does not
      4: (0.58, 0.52),  # both do: the confidence rule stops here
      6: (0.70, 0.66)}

  def __init__(self, *args, **kwargs):
    self.confidence = kwargs["confidence"]

  def __call__(self, params, step):
    accuracy, bound = self.SCRIPT.get(step, (0.0, 0.0))
    out = {"accuracy": accuracy, "num_prompts": 32}
    if self.confidence is not None:
      out["accuracy_lcb"] = bound
    return out


@pytest.mark.parametrize("confidence,stop_step", [(None, 2), (0.95, 4)])
def test_confidence_rule_waits_for_the_lower_bound(smoke, tmp_path, monkeypatch, confidence,
                                                   stop_step):
  monkeypatch.setattr(trainer.validation, "Validator", _ScriptedValidator)
  setup = variant(smoke, tmp_path, val_at_start=False, val_period=2, max_num_steps=6,
                  stop_at_validation_metric="accuracy", stop_at_validation_threshold=0.5,
                  stop_at_validation_confidence=confidence)
  assert trainer.run(setup) == 0
  assert [r["step"] for r in rows(tmp_path, "val")] == list(range(2, stop_step + 1, 2))
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["early_stop"]["step"] == stop_step
  if confidence is not None:
    assert summary["early_stop"]["lower_bound"] == 0.52
    assert "0.95 lower bound 0.52" in summary["early_stop"]["message"]


def test_a_missing_stop_metric_fails_loudly(smoke, tmp_path):
  # The validator refuses this at startup; past it (a bug), the loop must not train on.
  setup = variant(smoke, tmp_path, val_at_start=True, stop_at_validation_metric="pass@3",
                  stop_at_validation_threshold=0.5)
  with pytest.raises(KeyError, match=r"'pass@3'.*accuracy, accuracy_stderr"):
    trainer.run(setup)
  assert rows(tmp_path, "train") == []


def test_twenty_steps_with_validation_compile_each_function_once(smoke, tmp_path, capsys):
  # The check: validation every 5 steps (at start and at steps 5..20) between
  # updates must reuse the compiled update step and samplers. No checkpoint until the end
  # and no TensorBoard keep the 20 steps cheap.
  setup = variant(smoke, tmp_path, max_num_steps=20, val_period=5, val_at_start=True)
  setup.config.checkpoint.save_period = 0
  setup.config.logging.trackers = ""
  assert trainer.run(setup) == 0
  assert [r["step"] for r in rows(tmp_path, "val")] == [0, 5, 10, 15, 20]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["steps"] == 20
  assert summary["compilations"] == {"update": 1, "train_sampler": 1, "val_sampler": 1}
  assert summary["peak_rss_mib"] > 0
  out, err = capsys.readouterr()
  last = out.strip().splitlines()[-1]
  assert last.startswith("finished 20 steps"), last
  assert "compiled: update 1, samplers train 1 / val 1; peak RSS " in last, last
  assert "warning" not in err, err


def test_each_validation_logs_its_plots_to_every_tracker(smoke, tmp_path):
  # Plots on, three trackers: at every validation validation.png (redrawn) and the pass@j
  # ladder reach wandb and trackio as images, and TensorBoard's Images tab.
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  from trackio.sqlite_storage import SQLiteStorage  # pylint: disable=g-import-not-at-top
  setup = variant(smoke, tmp_path, max_num_steps=1, val_period=1, val_at_start=True)
  setup.config.logging.trackers = "tensorboard,wandb,trackio"
  setup.config.logging.plots = True
  setup.config.logging.run_name = f"images-{os.getpid()}"
  setup.config.checkpoint.save_period = 0
  assert trainer.run(setup) == 0
  (run,) = cli.wandb_runs(str(tmp_path))
  for name in ("validation", "pass_at_k"):
    images = [(h["step"], h[f"val/{name}"]["_type"]) for h in run["history"]
              if f"val/{name}" in h]
    assert images == [(0, "image-file"), (1, "image-file")]
  assert os.path.exists(tmp_path / "validation.png")
  assert os.path.exists(tmp_path / "plots" / "pass_at_k.png")
  rows = SQLiteStorage.get_logs(setup.config.logging.project, setup.config.logging.run_name)
  assert [r["step"] for r in rows if "val/pass_at_k" in r] == [0, 1]
  assert [r["step"] for r in rows if "train/loss" in r] == [1]
  events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "val"))
  events.Reload()
  assert sorted(events.Tags()["images"]) == ["pass_at_k", "validation"]
  assert [e.step for e in events.Images("validation")] == [0, 1]


def test_a_recompile_is_named_in_a_warning_and_the_summary_line():
  summary = {"steps": 4, "stopped_early": False, "wall_time_s": 9.0, "checkpoint": None,
             "compilations": {"update": 3, "train_sampler": 1, "val_sampler": 2},
             "peak_rss_mib": 811.6}
  assert trainer._summary_line(summary, "w").endswith(
      "; compiled: update 3, samplers train 1 / val 2; peak RSS 812 MiB; results in w")
  warnings = trainer._recompile_warnings(summary["compilations"])
  assert [w.split(" compiled ")[0] for w in warnings] == [
      "warning: the update step", "warning: the validation sampler"]
  assert "compiled 3 times" in warnings[0]


def test_the_summary_claims_no_gain_with_a_single_validation():
  """A run stopped (Ctrl-C) before its second validation has one accuracy: no 'x -> x
  (+0.000)' comparison (issue 48)."""
  base = {"stopped_early": False, "wall_time_s": 9.0, "checkpoint": None,
          "compilations": {"update": 1, "train_sampler": 1, "val_sampler": 1},
          "peak_rss_mib": 800.0}
  grpo = type("G", (), {"stop_at_validation_metric": None})
  one = {**trainer._summary({0: {"accuracy": 0.24}}, grpo, None, 3, None), **base}
  assert "val_accuracy_gain" not in one and one["final_val_step"] == 0
  line = trainer._summary_line(one, "w", "SIGINT")
  assert "; val accuracy 0.240 at step 0; no later validation;" in line and "->" not in line
  two = {**trainer._summary({0: {"accuracy": 0.24}, 20: {"accuracy": 0.5}}, grpo, None, 20,
                            None), **base}
  assert "; val accuracy 0.240 -> 0.500 (+0.260);" in trainer._summary_line(two, "w")


def test_dynamic_sampling_updates_on_the_first_informative_groups_in_data_order(smoke, registry,
                                                                             monkeypatch):
  # A hand-built reward (in the main process: reward_workers=0, so one call sees the
  # generation batch's rows in order): a group is informative when its question starts
  # with an even digit, its first sample then scoring 1. The smoke batch has B = 8 groups
  # of G = 4; generation batches of 8 prompts, at most 2.
  g = smoke.config.grpo.num_generations_per_prompt

  def even(completions, answers, *, question, **columns):
    return [float(i % g == 0 and int(q[0]) % 2 == 0) for i, q in enumerate(question)]

  rewards.register("_test_even")(even)
  config = ml_collections.ConfigDict(smoke.config.to_dict())
  config.rewards = ml_collections.ConfigDict({"exact_match": 0.0, "_test_even": 1.0})
  config.reward_workers = 0
  config.grpo.update(dynamic_sampling="filter", oversample_factor=1.0,
                     max_generation_batches=2)
  setup = dataclasses.replace(smoke, config=config)
  engine, state, ref_params, update = build.training(setup)
  sampled, updated = [], []
  sample = engine.sample
  monkeypatch.setattr(engine, "sample", lambda name, params, tokens, mask, **kw: (
      sampled.append(np.asarray(tokens)), sample(name, params, tokens, mask, **kw))[1])
  to_global = trainer.sharding_lib.to_global
  monkeypatch.setattr(trainer.sharding_lib, "to_global", lambda mesh, tree: (
      updated.append(tree) if isinstance(tree, dict) and "scored_N" in tree else None,
      to_global(mesh, tree))[1])
  consumed = []
  state, metrics = trainer.train_step(setup, engine, state, ref_params, update,
                                      next(setup.train_batches), step=1, consumed=consumed)
  train_rows = data_lib.make_sources(setup.config.data)[0]  # the run's rows, by their ids
  flags = [np.array([int(train_rows[i]["question"][0]) % 2 == 0 for i in ids])
           for ids in consumed]
  chosen, filled = dynamic.choose(flags, 8)
  assert metrics["dynamic_sampling/generation_batches"] == len(consumed) == len(sampled)
  assert metrics["dynamic_sampling/kept_groups_fraction"] == sum(map(sum, flags)) / (
      8 * len(consumed))
  assert metrics["dynamic_sampling/filled_flat_groups"] == filled
  # The update saw exactly the chosen prompts, in data order, and their rewards.
  prompts = np.concatenate(sampled)
  np.testing.assert_array_equal(np.asarray(updated[0]["prompt_tokens_BxL"]), prompts[chosen])
  kept = np.concatenate(flags)[chosen]
  np.testing.assert_array_equal(
      np.asarray(updated[0]["rewards_N"]).reshape(8, g),
      np.array([[1.0] + [0.0] * (g - 1) if k else [0.0] * g for k in kept]))
  assert metrics["zero_std_group_fraction"] == filled / 8


# LoRA (model/lora.py) through the trainer's pieces: here for the module's smoke setup.
def _lora_setup(smoke, rank=4, **model):
  config = ml_collections.ConfigDict(smoke.config.to_dict())
  config.model.lora_rank = rank
  config.optim.learning_rate = 1e-2  # large enough that the adapters move in two steps
  for key, value in model.items():
    config.model[key] = value
  config = config_lib.validate(config, jax.device_count())
  return dataclasses.replace(smoke, config=config)


def test_lora_trains_only_the_adapters_and_the_base_is_the_reference(smoke, beta=0.04):
  # beta > 0: the base is also the KL's reference policy (the path beta 0 takes, minus the
  # penalty).
  setup = _lora_setup(smoke)
  setup.config.unlock()
  setup.config.grpo.beta = beta
  engine, state, base, update = build.training(setup)
  before = jax.tree.map(np.asarray, base)
  # The state is the adapters (and Adam's moments of them): no optimizer state per weight.
  assert set(state.params) == set(lora.TARGETS)
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
  n_adapters = sum(x.size for x in jax.tree.leaves(state.params))
  assert n_opt <= 2 * n_adapters + 8
  # The samplers' first policy is the base itself.
  for a, b in zip(jax.tree.leaves(update.policy(state, base)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  for step in (1, 2):
    state, metrics = trainer.train_step(setup, engine, state, base, update,
                                        next(setup.train_batches), step=step)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
  # The base did not move; B did (it started at 0).
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(state.params["q"]["b"]).max()) > 0
  assert engine.compilations["train"] == 1 and update.compilations == 1


def test_a_lora_step_on_8_devices_equals_it_on_1(smoke):
  setup = _lora_setup(smoke)
  batch = next(setup.train_batches)
  results = []
  for devices in (jax.devices()[:1], jax.devices()):
    mesh = sharding_lib.make_mesh({"data": len(devices), "fsdp": 1, "tensor": 1}, devices)
    engine, state, base, update = build.training(setup, mesh)
    state, _ = trainer.train_step(setup, engine, state, base, update, dict(batch), step=1)
    results.append(jax.tree.map(np.asarray, state.params))
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)



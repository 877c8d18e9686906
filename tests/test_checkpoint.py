"""Checkpoints: exact round trips, retention (latest + best), fallback past a broken one, and
the resume checks the command line makes before any compilation."""

import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cli import MATH, assert_clean_error, run_train  # tests/cli.py
from jaxgrpo.run import checkpoint
from jaxgrpo.algo import grpo
from jaxgrpo.model import sharding
from jaxgrpo.model import decoder as model

from numpy_params import random_params  # tests/numpy_params.py

CFG = model.ModelConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2,
                        head_dim=16, mlp_dim=64)


def small_state(step=0):
  params = {"w": jnp.arange(16.0).reshape(4, 4), "b": jnp.zeros(4)}
  return grpo.TrainState(jnp.int32(step), params, optax.adam(1e-3).init(params))


def test_sharded_state_round_trips(tmp_path):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  params = sharding.shard_params(random_params(CFG, 0), CFG, mesh)
  state = grpo.init_state(params, optax.adam(1e-3), mesh)
  state = state._replace(step=jnp.int32(7))
  ckpts = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
  path = ckpts.save(7, state, {"reason": "end", "data": {"iterator": "{}", "seed": 0}})
  ckpts.close()  # waits for the asynchronous write
  assert path == str(tmp_path / "checkpoints" / "7")

  reopened = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
  assert reopened.steps() == [7]
  restored, meta = reopened.restore(7, state)
  reopened.close()
  assert int(restored.step) == 7 and meta["reason"] == "end" and meta["data"]["seed"] == 0
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == want.sharding  # restored straight onto the mesh layout
  assert checkpoint.read_meta(str(tmp_path / "checkpoints"), 7)["reason"] == "end"
  # The evaluation reads the parameters alone (not the optimizer's moments), straight into
  # another mesh's layout.
  other = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  like = sharding.abstract_params(CFG, other)
  only = checkpoint.Checkpoints(str(tmp_path / "checkpoints"), read_only=True)
  params_only = only.restore_params(7, like)
  only.close()
  assert jax.tree.structure(params_only) == jax.tree.structure(state.params)
  for got, want, target in zip(jax.tree.leaves(params_only), jax.tree.leaves(state.params),
                               jax.tree.leaves(like)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == target.sharding


def test_a_carry_round_trips_beside_the_state_and_a_checkpoint_without_one_restores(tmp_path):
  # Partial rollouts save the rows they carry as a third item; a restore that asks for it
  # gets it in meta["carry"], and a synchronous run's checkpoint (no carry) restores with
  # none, so partial rollouts can start from it with nothing carried.
  state = small_state(3)
  carry = {"pool": np.arange(6, dtype=np.int32).reshape(2, 3), "count": np.array([4, 0])}
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), carry)
  ckpts = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
  ckpts.save(3, state, {"reason": "period"}, carry=carry)
  ckpts.save(4, small_state(4), {"reason": "end"})
  ckpts.close()
  reopened = checkpoint.Checkpoints(str(tmp_path / "checkpoints"), read_only=True)
  _, meta = reopened.restore(3, state, carry_like=like)
  for key, value in carry.items():
    np.testing.assert_array_equal(np.asarray(meta["carry"][key]), value)
  restored, meta = reopened.restore(4, state, carry_like=like)
  reopened.close()
  assert int(restored.step) == 4 and "carry" not in meta


def test_keeps_the_latest_and_the_best(tmp_path):
  # Ten saves; validations at 2, 4, 6, 8 with pass@4 0.5, 0.9, 0.3, 0.4. max_to_keep=2
  # keeps 9 and 10, best_to_keep=1 keeps 4 (0.9): everything else goes.
  ckpts = checkpoint.Checkpoints(str(tmp_path), max_to_keep=2, best_metric="pass@4")
  values = {2: 0.5, 4: 0.9, 6: 0.3, 8: 0.4}
  for step in range(1, 11):
    ckpts.save(step, small_state(step), {"step": step},
               {"pass@4": values[step], "accuracy": 0.1} if step in values else None)
  ckpts.close()
  assert checkpoint.step_dirs(str(tmp_path)) == [4, 9, 10]


def test_restore_latest_falls_back_past_a_broken_one(tmp_path):
  ckpts = checkpoint.Checkpoints(str(tmp_path))
  for step in (1, 2, 3):
    ckpts.save(step, small_state(step), {"step": step})
  ckpts.close()
  shutil.rmtree(tmp_path / "3" / "state")  # as if killed mid-write
  ckpts = checkpoint.Checkpoints(str(tmp_path))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step, state, meta = ckpts.restore_latest(small_state())
  ckpts.close()
  assert step == 2 and int(state.step) == 2 and meta == {"step": 2}
  message = str(caught[0].message)
  assert f"{tmp_path}/3 is unreadable" in message and f"resuming from {tmp_path}/2" in message


def test_restore_latest_at_most_restores_the_named_step_or_the_newest_before_it(tmp_path):
  # `resume=.../checkpoints/<step>` restores with at_most=<step>: that step itself when it
  # exists (an off-by-one would restore its neighbour), else the newest before it.
  ckpts = checkpoint.Checkpoints(str(tmp_path))
  for step in (2, 4, 6):
    ckpts.save(step, small_state(step), {"step": step})
  ckpts.close()
  ckpts = checkpoint.Checkpoints(str(tmp_path), read_only=True)
  for at_most, want in ((2, 2), (4, 4), (5, 4), (6, 6), (None, 6), (100, 6)):
    step, state, meta = ckpts.restore_latest(small_state(), at_most=at_most)
    assert (step, int(state.step), meta["step"]) == (want, want, want), at_most
  assert ckpts.restore_latest(small_state(), at_most=1) is None
  ckpts.close()


def test_set_aside_moves_newer_checkpoints_and_locate_reads_paths(tmp_path):
  ckpts = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
  for step in (2, 4, 6):
    ckpts.save(step, small_state(step), {"step": step})
  ckpts.close()
  with pytest.warns(UserWarning, match="moved the newer checkpoint"):
    moved = checkpoint.set_aside_after(str(tmp_path / "checkpoints"), 2)
  assert moved == [f"{tmp_path}/checkpoints.set_aside/4-0",
                   f"{tmp_path}/checkpoints.set_aside/6-0"]
  assert checkpoint.step_dirs(str(tmp_path / "checkpoints")) == [2]
  assert checkpoint.locate(str(tmp_path)) == (str(tmp_path / "checkpoints"), None)
  assert checkpoint.locate(f"{tmp_path}/checkpoints/2/") == (str(tmp_path / "checkpoints"), 2)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A workdir with checkpoints of the smoke run (random init, d_model 128)."""
  workdir = tmp_path_factory.mktemp("saved")
  ckpts = checkpoint.Checkpoints(str(workdir / "checkpoints"))
  arch = dict(vocab_size=16, d_model=128, num_layers=2)
  ckpts.save(2, small_state(2), {"step": 2, "model": arch, "layout": model.PARAM_LAYOUT})
  ckpts.close()
  return workdir


def test_resume_settings_are_checked_before_compiling(saved_run, tmp_path):
  proc = run_train(f"--config={MATH}:smoke", "--config.checkpoint.resume=never",
                   workdir=saved_run)
  assert_clean_error(proc, "config.checkpoint.resume='never'", "already holds checkpoints",
                     "(steps [2])", "allowed: 'auto'")
  proc = run_train(f"--config={MATH}:smoke", f"--config.checkpoint.resume={tmp_path}/nope",
                   workdir=tmp_path / "w")
  assert_clean_error(proc, f"config.checkpoint.resume='{tmp_path}/nope'", "no checkpoint there")
  proc = run_train(f"--config={MATH}:smoke", "--config.model.checkpoint=",
                   "--config.model.d_model=64", f"--config.checkpoint.resume={saved_run}",
                   workdir=tmp_path / "w")
  assert_clean_error(proc, "config.model.d_model=64", f"{saved_run}/checkpoints/2", "has 128")
  assert os.listdir(saved_run / "checkpoints") == ["2"]  # nothing saved was touched



def test_resume_with_another_seed_is_refused(saved_run, tmp_path):
  # The saved data state says seed 0; a run with seed 1 would sample another data order.
  ckpts = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
  data_state = {"iterator": "{}", "seed": 0, "num_rows": 200, "batch_size": 8,
                "process_index": 0, "process_count": 1}
  ckpts.save(4, small_state(4), {"step": 4, "data": data_state, "layout": model.PARAM_LAYOUT})
  ckpts.close()
  proc = run_train(f"--config={MATH}:smoke", "--config.seed=1", workdir=tmp_path)
  assert_clean_error(proc, "config.checkpoint.resume", f"{tmp_path}/checkpoints/4",
                     "'seed': 0", "'seed': 1", "data order would differ")


def test_a_checkpoint_of_per_layer_parameters_is_refused_in_one_line(tmp_path):
  # Checkpoints written before the layers were stacked hold layer_0, layer_1, ... and no
  # "layout" in their meta: restoring them into the stacked tree would fail deep in orbax
  # after compiling, so the resume check names the folder and the way out (export it).
  ckpts = checkpoint.Checkpoints(str(tmp_path / "checkpoints"))
  old = {"layer_0": {"w": jnp.ones(2)}, "layer_1": {"w": jnp.ones(2)}}
  ckpts.save(3, grpo.TrainState(jnp.int32(3), old, ()), {"step": 3, "model": {}})
  ckpts.close()
  proc = run_train(f"--config={MATH}:smoke", workdir=tmp_path)
  assert_clean_error(proc, "config.checkpoint.resume", f"{tmp_path}/checkpoints/3",
                     "per-layer parameters", "python -m jaxgrpo.export",
                     "--config.model.hf_checkpoint=DIR")
  assert os.listdir(tmp_path / "checkpoints") == ["3"]  # nothing saved was touched

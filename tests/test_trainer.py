"""The device loop's pieces, in process: build() and one train_step on the smoke preset."""

import dataclasses
import os

import ml_collections
import numpy as np
import pytest

from jaxgrpo import train, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  # absl flags parse once per process, so the variants below copy this config.
  return train.prepare(["train", f"--config={ROOT}/configs/math.py:smoke",
                        f"--workdir={tmp_path_factory.mktemp('run')}",
                        "--config.mesh.data=8"])


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_reference_policy_only_when_beta_positive(smoke, beta):
  config = ml_collections.ConfigDict(smoke.config.to_dict())
  config.grpo.beta = beta
  setup = dataclasses.replace(smoke, config=config)
  engine, state, ref_params, update = trainer.build(setup)
  if beta == 0:
    assert ref_params is None  # no copy of the parameters, no reference forward pass
  else:
    assert ref_params is not None
  state, metrics = trainer.train_step(setup, engine, state, ref_params, update,
                                      next(setup.train_batches), step=1)
  assert int(state.step) == 1
  for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm", "learning_rate",
              "reward_mean", "accuracy", "zero_std_group_fraction", "rollout_tokens_per_s"):
    assert np.isfinite(metrics[key]), key
  # 8 prompts x 4 samples, sharded over 8 devices; each profile compiled once.
  assert engine.compilations["train"] == 1


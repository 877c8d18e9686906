"""run/build.py's rollout seam: the kind read from the config once (kind_of), and the engine
and its sources built together from it (rollouts)."""

import importlib.util
import os

import pytest

from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import partial, sampling
from jaxgrpo.run import build, partial_rollouts, rollouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**overrides):
  spec = importlib.util.spec_from_file_location("math_config",
                                                os.path.join(ROOT, "configs", "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("smoke")
  for key, value in overrides.items():
    section, name = key.split("__")
    config[section][name] = value
  return config


@pytest.mark.parametrize("overrides,engine,source", [
    ({}, "native", "single"),
    ({"grpo__dynamic_sampling": "filter"}, "native", "dynamic"),
    ({"generation__max_tokens_per_step": 2}, "partial", "partial"),
    ({"env__name": "calculator"}, "episodes", "episodes"),
    ({"generation__backend": "jetstream"}, "jetstream", "single"),
    ({"generation__backend": "jetstream", "grpo__dynamic_sampling": "filter"},
     "jetstream", "dynamic"),
])
def test_kind_of_reads_each_way_a_run_samples(overrides, engine, source):
  kind = build.kind_of(_config(**overrides))
  assert (kind.engine, kind.source) == (engine, source)
  assert kind.episodes == (source == "episodes") and kind.partial == (source == "partial")


@pytest.mark.parametrize("overrides,engine_type,source_type", [
    ({}, sampling.RolloutEngine, rollouts.SingleTurn),
    ({"grpo__dynamic_sampling": "filter"}, sampling.RolloutEngine, rollouts.DynamicSampling),
    ({"generation__max_tokens_per_step": 2}, partial.PartialEngine,
     partial_rollouts.PartialRollouts),
])
def test_rollouts_builds_the_engine_and_its_sources_of_one_kind(overrides, engine_type,
                                                                 source_type):
  """The engine and the training source come from one call, so they cannot disagree (the
  trainer picked the source by its own flags beside build.make_engine's)."""
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  from jaxgrpo import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.validate(_config(**overrides), 8)
  cfg, _, tokenizer = loading.load_policy(config, checks=False)
  mesh = sharding_lib.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
  batches = type("Batches", (), {"local_batch_size": 2, "__next__": lambda self: None})()
  made = build.rollouts(config, cfg, tokenizer, mesh, scorer=None, train_batches=batches)
  assert type(made.engine) is engine_type and type(made.source) is source_type
  assert type(made.val_source) is rollouts.SingleTurn and made.runner is None
  assert build.rollouts(config, cfg, tokenizer, mesh).source is None  # evaluate: no training
  made.close()  # no runner: nothing to stop


@pytest.mark.parametrize("lora_rank,beta,want_ref", [(0, 0.0, None), (0, 0.04, "copy"),
                                                     (4, 0.0, "params"), (4, 0.04, "params")])
def test_training_and_sizing_share_one_state_and_reference_rule(lora_rank, beta, want_ref):
  """build.training places and run/sizing.py lowers the same state and reference: LoRA
  trains the adapters with the base as the reference (whatever beta), else the params with
  a copy as the reference only when beta > 0."""
  config = _config(model__lora_rank=lora_rank, grpo__beta=beta)
  made = []
  state, ref = build.state_and_reference(
      config, "params", "opt", "mesh", adapters=lambda: "adapters",
      init_state=lambda p, o, m: made.append((p, o, m)) or f"state({p})",
      copy=lambda p: "copy")
  assert state == ("state(adapters)" if lora_rank else "state(params)")
  assert ref == want_ref and made == [("adapters" if lora_rank else "params", "opt", "mesh")]

"""config.validate: every bad value is one line naming the key, the value and what is allowed."""

import importlib.util
import os

import pytest

from jaxgrpo import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def math_config(arg=None):
  spec = importlib.util.spec_from_file_location("math_cfg", os.path.join(ROOT, "configs",
                                                                         "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_default_and_smoke_configs_validate_and_lock():
  for arg in (None, "smoke"):
    c = config_lib.validate(math_config(arg), num_devices=8)
    assert c.mesh.data == 8  # -1 resolved to the remaining devices
    with pytest.raises(AttributeError):
      c.new_key = 1  # locked


def test_validate_leaves_callers_config_alone():
  c = math_config()
  config_lib.validate(c, num_devices=8)
  assert c.mesh.data == -1


@pytest.mark.parametrize("path,value,expect", [
    ("grpo.num_generations_per_prompt", 1, "config.grpo.num_generations_per_prompt=1"),
    ("grpo.beta", -0.1, "config.grpo.beta=-0.1"),
    ("grpo.loss_agg", "mean", "'token_mean'"),
    ("grpo.scale_rewards", "std", "'group', 'batch', 'none'"),
    ("grpo.kl_type", "k2", "'k1', 'k3'"),
    ("grpo.epsilon", 1.5, "config.grpo.epsilon=1.5"),
    ("grpo.epsilon_high", 0.1, "grpo.epsilon=0.2"),
    ("generation.temperature", 0.0, "greedy"),
    ("generation.top_p", 0.0, "config.generation.top_p=0.0"),
    ("generation.top_k", -1, "config.generation.top_k=-1"),
    ("generation.top_k", 17, "vocab_size=16"),
    ("optim.learning_rate", 0.0, "config.optim.learning_rate=0.0"),
    ("optim.schedule", "linear", "'cosine', 'constant'"),
    ("grpo.num_prompts_per_step", 12, "a multiple of 8"),
    ("grpo.val_batch_size", 4, "a multiple of 8"),
    ("model.num_kv_heads", 3, "a multiple of model.num_kv_heads=3"),
    ("data.source", "csv", "'arithmetic', 'jsonl'"),
    ("data.prompt_template", "Q:", "{question}"),
    ("mesh.tensor", 3, "mesh"),
])
def test_bad_values_name_the_key(path, value, expect):
  c = math_config()
  section, key = path.split(".")
  c[section][key] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, num_devices=8)
  msg = str(e.value)
  assert expect in msg and "\n" not in msg


def test_wrong_type_is_named():
  # ConfigDict refuses type changes on override, but a user's own config file can hold any
  # type, so the validator checks types itself.
  import ml_collections
  raw = math_config().to_dict()
  raw["grpo"]["max_num_steps"] = "many"
  with pytest.raises(config_lib.ConfigError, match=r"config.grpo.max_num_steps='many'"):
    config_lib.validate(ml_collections.ConfigDict(raw), num_devices=1)


def test_unknown_and_missing_keys():
  c = math_config()
  c.grpo.num_genrations = 4
  with pytest.raises(config_lib.ConfigError, match="config.grpo.num_genrations: unknown key"):
    config_lib.validate(c, num_devices=1)
  c = math_config()
  del c.optim["grad_clip"]
  with pytest.raises(config_lib.ConfigError, match="config.optim.grad_clip: missing"):
    config_lib.validate(c, num_devices=1)


def test_rewards_checked_against_registry():
  c = math_config()
  c.rewards.accuracy = 1.0
  with pytest.raises(config_lib.ConfigError, match="config.rewards.accuracy: unknown reward"):
    config_lib.validate(c, num_devices=1)
  c = math_config()
  c.rewards.exact_match = 0.0
  with pytest.raises(config_lib.ConfigError, match="every weight is 0"):
    config_lib.validate(c, num_devices=1)


def test_jsonl_source_needs_a_train_path():
  c = math_config()
  c.data.source = "jsonl"
  with pytest.raises(config_lib.ConfigError, match="config.data.train_path"):
    config_lib.validate(c, num_devices=1)

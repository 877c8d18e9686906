"""config.validate: every bad value is one line naming the key, the value and what is allowed."""

import importlib.util
import json
import os
import re

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


def test_multi_slice_mesh_is_stored_per_slice():
  # 2 slices of 4 devices: config.json keeps the per-slice data size, so the mesh built from
  # the resolved config is the one validated (data 2 x 4 = 8 over both slices).
  c = math_config()
  c.mesh.dcn_data = 2
  resolved = config_lib.validate(c, num_devices=8)
  assert (resolved.mesh.data, resolved.mesh.dcn_data) == (4, 2)
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  assert sharding.resolve_mesh_shape(resolved.mesh.to_dict(), 8) == (8, 1, 1, 1, 1)


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
    ("mesh.dcn_data", 3, "config.mesh.dcn_data=3"),
    ("grpo.stop_at_validation_confidence", 0.0, "a number > 0 and < 1"),
    ("grpo.stop_at_validation_confidence", 1.5, "a number > 0 and < 1"),
    ("grpo.stop_at_validation_confidence", 0.9, "None while grpo.stop_at_validation_metric"),
    ("mesh.dcn_data", 0, "config.mesh.dcn_data=0"),
    # 32 prompts x 8 rollouts on 8 devices: each device holds whole groups (64, 128, 256) or
    # one sub-group of 1, 2 or 4 completions (8, 16, 32), and it divides the 256 rollouts.
    ("grpo.micro_batch_size", 12, "one of [8, 16, 32, 64, 128, 256]"),
    ("grpo.micro_batch_size", 24, "one of [8, 16, 32, 64, 128, 256]"),
    ("grpo.micro_batch_size", 192, "dividing the batch's 256 rollouts"),
    ("grpo.micro_batch_size", -64, "config.grpo.micro_batch_size=-64"),
    # Packed micro-batches (issue 51): the budget holds the longest sequence (math.py: a
    # 9-token prompt and 5 new tokens), and replaces micro-batches of rows.
    ("grpo.micro_batch_tokens", 13, "0, 'auto' or at least 14, the longest sequence"),
    ("grpo.micro_batch_tokens", -1, "config.grpo.micro_batch_tokens=-1"),
    ("grpo.logprob_chunk_size", 0, "config.grpo.logprob_chunk_size=0"),
    ("grpo.logprob_chunk_size", -16, "config.grpo.logprob_chunk_size=-16"),
    ("model.remat", "dots", "'none', 'full', 'save_dots'"),
    ("model.attention", "flash", "None or one of 'xla', 'cudnn', 'splash'"),
    # cuDNN's kernel needs a GPU: on CPU (and for a TPU compile check) a line, not a
    # RuntimeError from inside the first compilation.
    ("model.attention", "cudnn", "None or 'xla' on cpu (cuDNN's fused attention needs a GPU)"),
    ("logging.trackers", "tensorboard,mlflow",
     "a comma-separated list among tensorboard, wandb, trackio ('' for metrics.jsonl only)"),
    ("logging.project", " ", "config.logging.project=' ': allowed: a non-empty string"),
])
def test_bad_values_name_the_key(path, value, expect):
  c = math_config()
  section, key = path.split(".")
  c[section][key] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, num_devices=8)
  msg = str(e.value)
  assert expect in msg and "\n" not in msg


def test_micro_batch_and_chunk_sizes_that_fit_validate():
  c = math_config()
  c.grpo.micro_batch_size, c.grpo.logprob_chunk_size, c.model.remat = 64, 3, "full"
  resolved = config_lib.validate(c, num_devices=8)
  assert (resolved.grpo.micro_batch_size, resolved.grpo.logprob_chunk_size) == (64, 3)


def test_a_token_budget_beside_a_micro_batch_of_rows_is_refused():
  # Packing replaces micro-batches of rows: a number for both is one line naming the pair
  # ('auto', as gsm8k.py ships it, steps aside: run/sizing.py).
  c = math_config()
  c.grpo.micro_batch_size, c.grpo.micro_batch_tokens = 64, 128
  with pytest.raises(config_lib.ConfigError, match=r"config.grpo.micro_batch_size=64: allowed: "
                     r"0 or 'auto' while grpo.micro_batch_tokens=128 packs"):
    config_lib.validate(c, num_devices=8)
  c.grpo.micro_batch_size = 0
  assert config_lib.validate(c, num_devices=8).grpo.micro_batch_tokens == 128


def test_context_parallelism_splits_packed_rows_only():
  # mesh.context > 1 splits the update's packed rows (issue 51): without a token budget it
  # would split nothing; with one, each chip of a context pair holds half a packed row.
  c = math_config()
  c.mesh.context = 2
  # On one device too (issue 60: it named the device count, not the missing token budget).
  for devices in (8, 1):
    with pytest.raises(config_lib.ConfigError, match=r"config.mesh.context=2: allowed: 1 "
                       r"unless grpo.micro_batch_tokens is set"):
      config_lib.validate(c, num_devices=devices)
  c.grpo.micro_batch_tokens = 15
  with pytest.raises(config_lib.ConfigError, match=r"micro_batch_tokens=15: allowed: a multiple "
                     r"of mesh.context=2"):
    config_lib.validate(c, num_devices=8)
  c.grpo.micro_batch_tokens = 16
  resolved = config_lib.validate(c, num_devices=8)
  assert (resolved.mesh.data, resolved.mesh.context) == (4, 2)


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


def test_a_replaced_key_names_its_successor():
  c = math_config()
  c.logging.tensorboard = False  # logging.trackers replaced it
  with pytest.raises(config_lib.ConfigError, match=r"config.logging.tensorboard: replaced by "
                     r"config.logging.trackers \('tensorboard' is in its default list; "
                     r"--config.logging.trackers='' writes metrics.jsonl only\)"):
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


def test_a_template_with_backslash_n_is_refused_with_the_quoting_that_works():
  # What `--config.data.prompt_template="Question: {question}\nAnswer:"` hands over: a
  # backslash and an n. The hint's $'...' form doubles \boxed's backslash (so that $''
  # keeps one) and leaves \n, which $'' turns into a newline.
  c = math_config()
  c.data.prompt_template = "Question: {question}\\nAnswer in \\boxed{{}}:"
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.validate(c, num_devices=1)
  assert str(err.value) == (
      'config.data.prompt_template="Question: {question}\\nAnswer in \\boxed{{}}:": holds '
      "a backslash followed by n, not a newline (a shell passes \\n inside quotes as two "
      "characters); allowed: real newlines, e.g. --config.data.prompt_template="
      "$'Question: {question}\\nAnswer in \\\\boxed{{}}:' in bash or zsh, or \"\\n\" in a "
      "Python config file")
  c.data.prompt_template = "Question: {question}\nAnswer in \\boxed{{}}:"  # a real newline
  assert config_lib.validate(c, num_devices=1).data.prompt_template.count("\n") == 1


def parse_overrides(*overrides):
  """The config as `--config=configs/math.py --config.X=...` gives it, then validated.

  A fresh FlagValues per call, so absl's parse-once rule does not apply.
  """
  import sys
  from absl import flags
  from ml_collections import config_flags
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "", flag_values=fv)
  argv = ["train", f"--config={ROOT}/configs/math.py", *overrides]
  saved, sys.argv = sys.argv, argv  # config_flags reads overrides from sys.argv
  try:
    fv(argv)
    return config_lib.validate(holder.value, num_devices=8)
  finally:
    sys.argv = saved


def test_val_profile_follows_train_unless_set():
  c = parse_overrides("--config.generation.temperature=0.7", "--config.generation.top_k=5")
  assert (c.generation.val_temperature, c.generation.val_top_k) == (0.7, 5)
  assert c.generation.val_top_p == c.generation.top_p == 1.0
  c = parse_overrides("--config.generation.val_temperature=0.1")
  assert c.generation.val_temperature == 0.1 and c.generation.temperature == 1.0
  c = parse_overrides("--config.generation.temperature=0.5",
                      "--config.generation.val_temperature=0")
  assert (c.generation.temperature, c.generation.val_temperature) == (0.5, 0)
  # The resolved values of both profiles are what config.json shows.
  shown = json.loads(config_lib.to_json(c))["generation"]
  assert shown["val_temperature"] == 0 and shown["val_top_p"] == 1.0 and shown["val_top_k"] == 0


@pytest.mark.parametrize("path,value,expect", [
    ("grpo.val_num_generations_per_prompt", 0, "config.grpo.val_num_generations_per_prompt=0"),
    ("generation.val_temperature", -0.5, "None or a number >= 0"),
    ("generation.val_top_p", 0.0, "None or a number > 0 and <= 1"),
    ("generation.val_top_p", 1.5, "config.generation.val_top_p=1.5"),
    ("generation.val_top_k", -1, "None or an integer >= 0"),
    ("generation.val_top_k", 17, "at most model.vocab_size=16"),
    ("grpo.stop_at_validation_metric", "pass@8", "needs 8 samples per prompt but "
     "val_num_generations_per_prompt=4; allowed: accuracy, reward_mean, pass@1, pass@2, "
     "pass@4, pass_k"),
    ("grpo.stop_at_validation_metric", "acc", "validation does not report this metric"),
    ("grpo.stop_at_validation_metric", "pass@3", "allowed: accuracy"),
])
def test_validation_keys_are_checked(path, value, expect):
  c = math_config()
  c.grpo.val_num_generations_per_prompt = 4
  section, key = path.split(".")
  c[section][key] = value
  if key == "stop_at_validation_metric":
    c.grpo.stop_at_validation_threshold = 0.5
  with pytest.raises(config_lib.ConfigError, match=re.escape(expect)):
    config_lib.validate(c, num_devices=8)


def test_stop_rule_needs_both_halves_and_pass_k_needs_k_above_one():
  c = math_config()
  c.grpo.stop_at_validation_metric = "pass@1"
  with pytest.raises(config_lib.ConfigError, match="stop_at_validation_threshold=None"):
    config_lib.validate(c, num_devices=8)
  c = math_config()
  c.grpo.stop_at_validation_threshold = 0.9
  with pytest.raises(config_lib.ConfigError,
                     match="stop_at_validation_metric=None: stop_at_validation_threshold=0.9"):
    config_lib.validate(c, num_devices=8)
  c = math_config()
  c.grpo.val_num_generations_per_prompt = 1
  c.grpo.stop_at_validation_metric, c.grpo.stop_at_validation_threshold = "pass_k", 0.5
  with pytest.raises(config_lib.ConfigError, match=r"pass_k'?: reported only when .* \(it is 1\)"):
    config_lib.validate(c, num_devices=8)
  c.grpo.val_num_generations_per_prompt = 2  # now it is reported
  assert config_lib.validate(c, num_devices=8).grpo.stop_at_validation_metric == "pass_k"


def test_user_modules_register_before_the_names_and_the_stop_rule_are_checked(tmp_path,
                                                                             registry):
  # A user correctness reward with preds (config.user_modules): its name is accepted, and
  # maj@k, which votes on its preds, is a stop metric; without preds maj@k is refused.
  path = tmp_path / "mine.py"
  path.write_text("import jaxgrpo.rewards\n"
                  "@jaxgrpo.rewards.register('voted', correctness=True, pred=True)\n"
                  "def voted(c, a, **k):\n  return [{'score': 1.0, 'pred': x} for x in c]\n"
                  "@jaxgrpo.rewards.register('unvoted', correctness=True)\n"
                  "def unvoted(c, a, **k):\n  return [1.0] * len(c)\n")
  c = math_config()
  c.user_modules = str(path)
  c.rewards.voted = 1.0
  c.grpo.val_num_generations_per_prompt = 4
  c.grpo.stop_at_validation_metric, c.grpo.stop_at_validation_threshold = "maj@4", 0.9
  assert config_lib.validate(c, num_devices=8).rewards.voted == 1.0
  c.rewards.voted, c.rewards.unvoted = 0.0, 1.0
  with pytest.raises(config_lib.ConfigError, match="maj@4"):
    config_lib.validate(c, num_devices=8)
  c.user_modules = str(tmp_path / "nope.py")
  with pytest.raises(config_lib.ConfigError, match=r"^config\.user_modules: \S*nope\.py: no "
                     r"such file$"):
    config_lib.validate(c, num_devices=8)


def test_a_backend_limit_is_refused_with_backend_and_key():
  # What a rollout backend cannot do is refused at startup, never silently ignored, by the
  # check beside the backend's code (run/build.py; issue 61 removed the empty table
  # config.BACKEND_LIMITS that promised a second system): JetStream's slots decode at their
  # own steps, so it takes no decode blocks (checked before its extra is looked for).
  assert not hasattr(config_lib, "BACKEND_LIMITS")
  c = math_config()
  c.generation.backend, c.generation.decode_block_size = "jetstream", 8
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "config.generation.decode_block_size=8: allowed: 0 with generation.backend='jetstream'")):
    config_lib.validate(c, num_devices=8)


def test_checkpoint_keys_are_checked():
  c = math_config()
  c.checkpoint.best_metric = "pass@2"  # k=1 reports pass@1 only
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "config.checkpoint.best_metric='pass@2': validation does not report it with "
      "val_num_generations_per_prompt=1; allowed: accuracy, reward_mean, pass@1")):
    config_lib.validate(c, num_devices=8)
  c = math_config()
  c.checkpoint.best_metric, c.grpo.val_period = "accuracy", 0
  with pytest.raises(config_lib.ConfigError, match="grpo.val_period=0"):
    config_lib.validate(c, num_devices=8)
  for key, value in (("max_to_keep", 0), ("save_period", -1), ("best_to_keep", 0),
                     ("resume", "")):
    c = math_config()
    c.checkpoint[key] = value
    with pytest.raises(config_lib.ConfigError, match=f"config.checkpoint.{key}="):
      config_lib.validate(c, num_devices=8)


def _jetstream(monkeypatch, installed: bool):
  """backend='jetstream' as if the extra were (or were not) installed: the validator only
  looks for the package (importing it would import TensorFlow)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      (object() if installed else None) if name == "jetstream" else real(name, *a)))
  c = math_config()
  c.generation.backend = "jetstream"
  return c


def test_jetstream_backend_without_the_extra_names_the_install(monkeypatch):
  c = _jetstream(monkeypatch, installed=False)
  with pytest.raises(config_lib.ConfigError, match=r"config.generation.backend='jetstream': "
                     r"allowed: 'native', or 'jetstream' after pip install 'jaxgrpo\[jetstream\]'"):
    config_lib.validate(c, num_devices=8)


def test_jetstream_slots_split_over_the_data_axes(monkeypatch):
  c = _jetstream(monkeypatch, installed=True)
  assert config_lib.validate(c, num_devices=8).generation.max_concurrent_decodes == 0  # auto
  c.generation.max_concurrent_decodes = 16
  config_lib.validate(c, num_devices=8)
  c.generation.max_concurrent_decodes = 12  # 8 data-parallel devices
  with pytest.raises(config_lib.ConfigError, match="max_concurrent_decodes=12: allowed: 0 .* "
                     "or a multiple of 8"):
    config_lib.validate(c, num_devices=8)


def test_jetstream_backend_runs_on_one_process(monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  c = _jetstream(monkeypatch, installed=True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(config_lib.ConfigError, match="backend='jetstream': allowed: 'native' on "
                     "2 processes"):
    config_lib.validate(c, num_devices=8)


# Native-only keys: the jetstream backend's slots decode at their own steps and read the
# whole cache (decode blocks), and it refills finished slots (compaction). Never silently
# ignored: refused, and accepted with the native backend.
@pytest.mark.parametrize("key, value", [("decode_block_size", 64), ("compact_stages", 2)])
def test_native_only_keys_are_refused_with_the_jetstream_backend(monkeypatch, key, value):
  c = _jetstream(monkeypatch, installed=True)
  c.generation[key] = value
  with pytest.raises(config_lib.ConfigError, match=f"{key}={value}: .*allowed: 0 with "
                     "generation.backend='jetstream'"):
    config_lib.validate(c, num_devices=8)
  c.generation.backend = "native"
  assert config_lib.validate(c, num_devices=8).generation[key] == value
  c.generation[key] = -1
  with pytest.raises(config_lib.ConfigError, match=f"{key}=-1: allowed: an integer"):
    config_lib.validate(c, num_devices=8)


def test_slots_are_refused_with_the_native_backend():
  c = math_config()
  c.generation.max_concurrent_decodes = 8  # never silently ignored
  with pytest.raises(config_lib.ConfigError, match="max_concurrent_decodes=8: allowed: 0 with "
                     "generation.backend='native'"):
    config_lib.validate(c, num_devices=8)


def test_scan_layers_is_a_bool_or_none_and_resolves_by_platform():
  # model.scan_layers is an execution choice (not architecture): True, False, or None for
  # "by platform": unrolled on CPU (faster steps there), scanned on TPU and GPU.
  import ml_collections
  import jax  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import build  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model, sharding
  raw = math_config().to_dict()
  raw["model"]["scan_layers"] = "yes"
  with pytest.raises(config_lib.ConfigError, match=r"config.model.scan_layers='yes'.*True or "
                     r"False"):
    config_lib.validate(ml_collections.ConfigDict(raw), num_devices=1)
  assert [model.resolve_scan_layers(None, p) for p in ("cpu", "tpu", "gpu")] == [
      False, True, True]
  assert model.resolve_scan_layers(False, "tpu") is False
  assert model.resolve_scan_layers(True, "cpu") is True
  # The trainer resolves it from the mesh's devices, for the update and the samplers alike
  # (a random init: scan_layers None must not be refused as a missing architecture key).
  c = math_config()
  c.model.checkpoint = ""
  config_lib.validate(c, num_devices=1)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  assert build.loss_config(c, mesh).scan_layers is False
  c.model.scan_layers = True
  assert build.loss_config(c, mesh).scan_layers is True


@pytest.mark.parametrize("key, value, expect", [
    ("dynamic_sampling", "on", r"config\.grpo\.dynamic_sampling='on': allowed: one of 'off', "
     r"'filter'"),
    ("oversample_factor", 0.5, r"config\.grpo\.oversample_factor=0\.5: allowed: a number >= 1"),
    ("dynamic_sampling_metric", "math", r"config\.grpo\.dynamic_sampling_metric='math': "
     r"allowed: None \(the total reward\) or a reward with a weight > 0: exact_match"),
])
def test_dynamic_sampling_settings_are_checked(key, value, expect):
  c = math_config()
  c.grpo.dynamic_sampling = "filter"
  c.grpo[key] = value
  with pytest.raises(config_lib.ConfigError, match="^" + expect):
    config_lib.validate(c, num_devices=8)


def test_dynamic_sampling_needs_the_native_sampler(monkeypatch):
  _jetstream(monkeypatch, installed=True)
  c = math_config()
  c.grpo.dynamic_sampling, c.generation.backend = "filter", "jetstream"
  with pytest.raises(config_lib.ConfigError, match="only the native sampler"):
    config_lib.validate(c, num_devices=1)


# Every command-line override that does nothing under the math config (issue 48): the key,
# what its message says makes it idle, and the settings under which the same key acts.
IDLE_OVERRIDES = [
    ("data.train_path", "data.source='arithmetic'", {}),  # applied: see the test below
    ("data.val_path", "data.source='arithmetic'", {"data.source": "jsonl"}),
    ("data.question_key", "data.source='arithmetic'", {"data.source": "jsonl"}),
    ("data.answer_key", "data.source='arithmetic'", {"data.source": "jsonl"}),
    ("data.chat_template_date", "data.use_chat_template=False",
     {"data.use_chat_template": True}),
    ("data.num_digits", "data.source='jsonl'", None),  # idle under jsonl: checked below
    ("env.kwargs", "env.name=''", {"env.name": "tools"}),
    ("env.max_turns", "env.name=''", {"env.name": "tools"}),
    ("env.max_observation_tokens", "env.name=''", {"env.name": "tools"}),
    ("env.stop_strings", "env.name=''", {"env.name": "tools"}),
    ("env.observation_truncation_side", "env.name=''", {"env.name": "tools"}),
    ("env.timeout_s", "env.name=''", {"env.name": "tools"}),
    ("env.workers", "env.name=''", {"env.name": "tools"}),
    ("grpo.oversample_factor", "grpo.dynamic_sampling='off'", {"grpo.dynamic_sampling": "filter"}),
    ("grpo.max_generation_batches", "grpo.dynamic_sampling='off'",
     {"grpo.dynamic_sampling": "filter"}),
    ("grpo.dynamic_sampling_metric", "grpo.dynamic_sampling='off'",
     {"grpo.dynamic_sampling": "filter"}),
    ("grpo.kl_type", "grpo.beta=0.0", {"grpo.beta": 0.04}),
    ("reward_timeout_s", "reward_workers=0", {"reward_workers": 2}),
    ("checkpoint.best_to_keep", "checkpoint.best_metric=None",
     {"checkpoint.best_metric": "accuracy"}),
    ("model.lora_alpha", "model.lora_rank=0", {"model.lora_rank": 4}),
    ("model.lora_targets", "model.lora_rank=0", {"model.lora_rank": 4}),
    ("logging.project", "logging.trackers='tensorboard'", {"logging.trackers": "wandb"}),
    ("logging.run_name", "logging.trackers='tensorboard'", {"logging.trackers": "trackio"}),
    ("logging.tags", "logging.trackers='tensorboard'", {"logging.trackers": "tensorboard,wandb"}),
    ("mesh.memory_limit_gib", "only 'auto' plans", {"grpo.micro_batch_size": "auto"}),
    ("generation.gather_weights", "mesh.fsdp=1", {"mesh.fsdp": -1}),
    ("grpo.micro_batch_size", "grpo.micro_batch_tokens=16", {"grpo.micro_batch_tokens": 0}),
    ("grpo.max_staleness", "generation.max_tokens_per_step=0",
     {"generation.max_tokens_per_step": 2}),
    ("grpo.importance_weight_cap", "generation.max_tokens_per_step=0",
     {"generation.max_tokens_per_step": 2}),
    *((key, "no validation runs", {"grpo.val_at_end": True}) for key in (
        "generation.val_temperature", "generation.val_top_p", "generation.val_top_k",
        "grpo.val_num_generations_per_prompt", "grpo.val_batch_size", "grpo.max_val_samples",
        "grpo.val_pass_threshold", "grpo.val_seed")),
]


def _with(settings, arg=None):
  import ml_collections
  values = math_config(arg).to_dict()
  for key, value in settings.items():
    *sections, name = key.split(".")
    node = values
    for s in sections:
      node = node[s]
    node[name] = value
  return ml_collections.ConfigDict(values)


def test_the_idle_override_table_covers_every_mode_key():
  assert ({k for keys, _, _ in config_lib.MODE_KEYS for k in keys}
          == {key for key, _, _ in IDLE_OVERRIDES})


@pytest.mark.parametrize("key,why,acts", IDLE_OVERRIDES, ids=[k for k, _, _ in IDLE_OVERRIDES])
def test_an_override_that_would_do_nothing_is_refused_naming_what_makes_it_act(key, why, acts):
  idle = {"grpo.val_period": 0, "grpo.val_at_start": False, "grpo.val_at_end": False,
          "reward_workers": 0} if "val" in key or key == "reward_timeout_s" else {}
  if key == "data.num_digits":
    idle = {"data.source": "jsonl", "data.train_path": "x.jsonl"}
  if key == "grpo.micro_batch_size":  # packed micro-batches (issue 51)
    idle = {"grpo.micro_batch_tokens": 16}
  if key == "data.train_path":  # given with data.source too, the user asked for both
    with pytest.raises(config_lib.ConfigError, match=re.escape(
        "config.data.train_path: ignored while data.source='arithmetic'; add "
        "--config.data.source=jsonl")):
      config_lib.check_overrides(_with({}), {"data.train_path", "data.source"})
    return
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.check_overrides(_with(idle), {key})
  line = str(e.value)
  assert line.startswith(f"config.{key}: ignored while ") and why in line and "; add --config." in line
  assert "\n" not in line
  if acts is not None:  # the same override, with its mode on, is taken
    assert config_lib.check_overrides(_with({**idle, **acts}), {key}) == []
  # A config file may set it in any mode: only what the command line gives is checked.
  assert config_lib.check_overrides(_with(idle), set()) == []


def test_a_train_path_given_with_the_arithmetic_source_switches_it_and_says_so():
  c = _with({})
  notes = config_lib.check_overrides(c, {"data.train_path", "data.val_path"})
  assert c.data.source == "jsonl"
  assert len(notes) == 1 and "data.source='jsonl'" in notes[0] and "train_path" in notes[0]
  # data.num_digits acts under the arithmetic source only
  with pytest.raises(config_lib.ConfigError, match="data.num_digits: ignored while "
                                                    "data.source='jsonl'"):
    config_lib.check_overrides(_with({}), {"data.train_path", "data.num_digits"})


def test_overridden_keys_reads_every_form_absl_takes():
  argv = ["train", "--config=c.py", "--config.grpo.beta=0.1", "--config.env.name", "tools",
          "--noconfig.logging.plots", "--workdir=x"]
  assert config_lib.overridden_keys(argv) == {"grpo.beta", "env.name", "logging.plots"}


def test_an_environment_in_the_main_process_has_no_time_limit_to_promise():
  """Issue 50 (its timeouts item): env.timeout_s did nothing with env.workers=0, and an
  environment that exits there ends the run: refused, unless the limit is 0 (none)."""
  env = {"env.name": "tools", "generation.max_episode_tokens": 64,
         "env.kwargs": '{"tools": "calculator", "chat": "none"}'}
  with pytest.raises(config_lib.ConfigError, match=re.escape(
      "config.env.workers=0: env.timeout_s cannot be enforced in the main process; allowed: "
      "1 or more")):
    config_lib.validate(_with({**env, "env.workers": 0}), 1)
  config_lib.validate(_with({**env, "env.workers": 0, "env.timeout_s": 0}), 1)
  with pytest.raises(config_lib.ConfigError, match=re.escape("config.env.timeout_s=0: allowed: "
                                                             "a number > 0 with env.workers > 0")):
    config_lib.validate(_with({**env, "env.timeout_s": 0}), 1)


def test_what_needs_experts_or_refuses_a_window_is_one_line():
  # Checked against the model as loaded (a checkpoint names its own experts and window), by
  # the checks registered beside the code they protect (config_checks.register_model; issue
  # 61: they were hand-written in run/setup.py): mesh.expert must divide the experts, a
  # router loss needs a router, splash attention takes no sliding window. A router loss
  # with packed rows needs no model: validation refuses it.
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.runtime import config_checks  # pylint: disable=g-import-not-at-top
  dense = model_lib.ModelConfig(vocab_size=16, d_model=32, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=8, mlp_dim=64)
  moe = dataclasses.replace(dense, num_experts=6, num_experts_per_tok=2, moe_mlp_dim=16)
  gemma = dataclasses.replace(dense, sliding_window=4, sliding_window_pattern=2)
  c = config_lib.validate(math_config(), num_devices=8)
  config_checks.run_model(c, moe)  # nothing asked of the experts: fine
  cases = [
      ({"mesh.expert": 4}, moe, "config.mesh.expert=4: the model has 6 experts"),
      ({"mesh.expert": 2}, dense, "config.mesh.expert=2: the model has 0 experts"),
      ({"grpo.router_aux_loss_coef": 0.01}, dense, "the model is dense (no router)"),
      ({"model.moe_matmul": "ragged"}, dense, "config.model.moe_matmul='ragged': the model "
       "is dense"),
      ({"model.router_dtype": "compute"}, dense, "config.model.router_dtype='compute': the "
       "model is dense (no router)"),
      ({"model.attention": "splash"}, gemma, "sliding-window layers (window 4)"),
  ]
  for overrides, model, fragment in cases:
    c = config_lib.validate(math_config(), num_devices=8).unlock()
    for key, value in overrides.items():
      section, name = key.split(".")
      c[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=re.escape(fragment)):
      config_checks.run_model(c, model)
  c = config_lib.validate(math_config(), num_devices=8).unlock()
  c.mesh.expert, c.grpo.router_aux_loss_coef = 2, 0.01
  config_checks.run_model(c, moe)  # 6 experts over 2 chips, a router: fine
  packed = math_config()
  packed.grpo.router_aux_loss_coef, packed.grpo.micro_batch_tokens = 0.01, 64
  with pytest.raises(config_lib.ConfigError, match="not built with packed micro-batches"):
    config_lib.validate(packed, num_devices=8)


def _shipped(name, arg=None):
  spec = importlib.util.spec_from_file_location(f"{name}_cfg", os.path.join(ROOT, "configs",
                                                                            f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("name,arg", [("math", None), ("math", "smoke"), ("gsm8k", None),
                                      ("gsm8k", "cpu"), ("gsm8k", "long"), ("calculator", None)])
def test_val_period_0_works_with_every_shipped_config(name, arg):
  """Issue 60: --config.grpo.val_period=0 with configs/gsm8k.py was refused (its
  best_metric='accuracy' needs validations) and None could not be typed. A file's best-
  checkpoint rule now steps aside with a line; one the command line sets is still refused."""
  from jaxgrpo.run import setup  # pylint: disable=g-import-not-at-top
  config = _shipped(name, arg)
  if name == "gsm8k":
    config.model.hf_checkpoint = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2")
  had = config.checkpoint.best_metric
  config.grpo.val_period = 0
  notes = config_lib.check_overrides(config, {"grpo.val_period"})
  assert config.checkpoint.best_metric is None
  assert bool(notes) == (had is not None)
  if had is not None:
    assert notes[0].startswith(f"checkpoint.best_metric=None (the config file's {had!r}: ")
  setup.validate(config, 1)
  # Asked for on the command line too: the user's contradiction, refused in one line.
  config.checkpoint.best_metric = "accuracy"
  assert config_lib.check_overrides(config, {"grpo.val_period",
                                             "checkpoint.best_metric"}) == []
  with pytest.raises(config_lib.ConfigError, match="None while grpo.val_period=0"):
    setup.validate(config, 1)


def test_none_typed_on_the_command_line_unsets_an_optional_key():
  """config_flags hands `--config.checkpoint.best_metric=None` over as the text 'None', and
  an empty value is refused: `none` (any case) now means None for a key that may be None."""
  from jaxgrpo.run import setup  # pylint: disable=g-import-not-at-top
  config = _shipped("math", "smoke")
  config.checkpoint.best_metric = "accuracy"
  for typed in ("none", "None"):
    config.checkpoint.best_metric = typed
    assert setup.validate(config, 1).checkpoint.best_metric is None
  config.checkpoint.best_metric = "bogus"
  with pytest.raises(config_lib.ConfigError, match="best_metric='bogus'"):
    setup.validate(config, 1)


def test_micro_batch_rows_act_when_a_text_typed_token_budget_is_zero():
  """The long preset ships micro_batch_tokens='auto' (a text key), so the command line's 0
  arrives as '0': `--config.grpo.micro_batch_tokens=0 --config.grpo.micro_batch_size=8` was
  refused as an idle override (found once compile_check read overrides as train does)."""
  c = _shipped("gsm8k", "long")
  c.grpo.micro_batch_tokens, c.grpo.micro_batch_size = "0", "8"  # both text-typed there
  assert config_lib.check_overrides(c, {"grpo.micro_batch_size",
                                        "grpo.micro_batch_tokens"}) == []
  c.grpo.micro_batch_tokens = "512"
  with pytest.raises(config_lib.ConfigError, match="micro_batch_size: ignored while"):
    config_lib.check_overrides(c, {"grpo.micro_batch_size"})


def test_the_model_schema_and_a_runs_recorded_keys_follow_model_config():
  """Issue 61: a family's keys were listed three times (ModelConfig, the schema, a run's
  recorded keys in run/artifacts.py). The recorded keys derive from ModelConfig now; the
  schema (config.py imports no model code) is checked against it here."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import artifacts  # pylint: disable=g-import-not-at-top
  fields = {f.name for f in dataclasses.fields(model_lib.ModelConfig)}
  assert fields <= set(config_lib.SCHEMA["model"])
  assert set(artifacts._ARCH_KEYS) == fields - {"param_dtype", "dtype", "moe_matmul",
                                                "router_dtype"}  # pylint: disable=protected-access

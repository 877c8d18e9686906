"""envs.py: the environment registry, per-process instances and the checks on what a step
returns; the config keys that choose an environment."""

import importlib.util
import json
import os

import numpy as np
import pytest

from jaxgrpo import config as config_lib
from jaxgrpo import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _math_config():
  spec = importlib.util.spec_from_file_location("m", os.path.join(ROOT, "configs", "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("smoke")


def test_register_checks_the_class_and_get_names_the_registered():
  with pytest.raises(envs.EnvError, match=r"has no step method"):
    envs.register("_test_half")(type("Half", (), {"reset": lambda self, row, seed: None}))
  with pytest.raises(envs.EnvError, match="decorates a class"):
    envs.register("_test_fn")(lambda: None)
  with pytest.raises(envs.EnvError, match=r"unknown environment 'nope'; registered: .*tools"):
    envs.get("nope")


def test_instances_are_made_once_per_process_with_their_kwargs():
  made = []

  @envs.register("_test_counted")
  class Counted:  # pylint: disable=unused-variable
    def __init__(self, n=0):
      made.append(n)

    def reset(self, row, seed):
      return envs.Start({"n": seed}, prompt=f"{row['q']}!")

    def step(self, state, text):
      state["n"] += 1
      return None, 1, True, {}

  a = envs.instance("_test_counted", '{"n": 2}')
  assert envs.instance("_test_counted", '{"n": 2}') is a and made == [2]
  assert envs.call_reset("_test_counted", '{"n": 2}', {"q": "hi"}, 5) == ({"n": 5}, "hi!")
  # The state a step mutates goes back with its result (a worker sends both).
  assert envs.call_step("_test_counted", '{"n": 2}', {"n": 5}, "x") == (
      {"n": 6}, (None, 1.0, True, {}))


@pytest.mark.parametrize("out, error", [
    ("done", "step returned str 'done'; allowed: a tuple"),
    ((None, 1.0, True), "step returned tuple"),
    ((3, 1.0, True, {}), "step's observation is int; allowed: a str, a message"),
    (("x", "1", True, {}), "reward is str; allowed: a number or None"),
    (("x", float("nan"), True, {}), "reward is nan"),
    (("x", 1.0, "yes", {}), "done is str; allowed: bool"),
    (("x", 1.0, True, [1]), "info is list; allowed: a dict"),
])
def test_a_step_that_returns_garbage_is_named(out, error):
  with pytest.raises(ValueError, match=error.replace("(", r"\(")):
    envs.check_step(out)


def test_check_step_accepts_numpy_numbers_and_none_info():
  assert envs.check_step(("x", np.float32(0.5), np.bool_(True), None)) == ("x", 0.5, True, {})


@pytest.mark.parametrize("key, value, error", [
    ("env.name", "nope", "config.env.name='nope': unknown environment 'nope'; registered:"),
    ("env.kwargs", "{bad", "config.env.kwargs='{bad': not JSON"),
    ("env.kwargs", '{"tools": "calc"}', "environment 'tools' cannot be made with them: "
                                        "ToolError: unknown tool 'calc'"),
    ("generation.max_episode_tokens", 9, "config.generation.max_episode_tokens=9: allowed: "
                                         "more than data.max_prompt_length=9"),
    ("grpo.dynamic_sampling", "filter", "config.grpo.dynamic_sampling='filter': allowed: 'off'"
                                        " with an environment"),
    # Episode turns run on their KV cache, each row at its own slot (rollout/turns.py).
    ("generation.decode_block_size", 16, "config.generation.decode_block_size=16: allowed: 0 "
                                         "with an environment"),
])
def test_bad_environment_settings_are_one_line(key, value, error):
  c = _math_config()
  c.env.name, c.generation.max_episode_tokens = "tools", 40
  section, name = key.split(".")
  c[section][name] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, 1)
  assert error in str(e.value) and "\n" not in str(e.value)


def test_max_episode_tokens_needs_an_environment():
  c = _math_config()
  c.generation.max_episode_tokens = 40
  with pytest.raises(config_lib.ConfigError, match="max_episode_tokens=40: allowed: 0 without "
                     "an environment"):
    config_lib.validate(c, 1)


def test_an_environment_file_that_fails_to_import_is_one_line(tmp_path):
  bad = tmp_path / "my_env.py"
  bad.write_text("import jaxgrpo.envs\n\n@jaxgrpo.envs.register('x')\nclass X:\n  pass\n")
  c = _math_config()
  c.user_modules, c.env.name = str(bad), "x"
  with pytest.raises(config_lib.ConfigError, match=r"my_env.py.*has no reset, step method"):
    config_lib.validate(c, 1)
  # A tool without type hints fails the same way, at the import that registers it.
  bad.write_text("import jaxgrpo.tools\n\n@jaxgrpo.tools.tool\ndef f(x):\n  '''Doc.'''\n")
  c.env.name = "tools"
  with pytest.raises(config_lib.ConfigError, match=r"tool 'f': argument 'x' has no type hint"):
    config_lib.validate(c, 1)


def test_a_stop_string_the_tokenizer_cannot_end_a_turn_at_is_one_line(tmp_path):
  # Needs the tokenizer, so it is checked after loading, still before anything compiles.
  import cli  # pylint: disable=g-import-not-at-top
  proc = cli.run_train(f"--config={ROOT}/configs/calculator.py:smoke",
                       "--config.env.stop_strings=</tool_call>,ab", workdir=tmp_path)
  cli.assert_clean_error(proc, "config.env.stop_strings='</tool_call>,ab': stop string 'ab' "
                         "encodes to 2 tokens")


def test_tool_messages_without_a_chat_template_are_one_line_at_start_up(tmp_path):
  """Issue 50: the tools environment answers with tool messages that the model's chat
  template renders; the embedded models have none, so chat='template' (the default) is
  refused before anything compiles, naming chat='none'."""
  import cli  # pylint: disable=g-import-not-at-top
  kwargs = '{"tools": "calculator", "stop_at_call_end": true}'
  proc = cli.run_train(f"--config={ROOT}/configs/calculator.py:smoke",
                       f"--config.env.kwargs={kwargs}", workdir=tmp_path)
  cli.assert_clean_error(proc, f"config.env.kwargs='{kwargs}': environment 'tools' answers "
                         "with chat messages, which the model's chat template renders, and the "
                         "model has no chat template (the embedded models read plain text); "
                         "allowed: '{\"chat\": \"none\"}' in env.kwargs")


@pytest.mark.parametrize("template, limit, error", [
    # Numbers every message by the count of messages: a tool message renumbers the turns.
    ("{% for m in messages %}[{{ messages|length }}]{{ m.content }}{% endfor %}", 64,
     "config.env.name='tools': test: the chat template is not prefix-preserving"),
    # The Qwen2 fixture's template frames a tool message with 20 tokens (its tiny BPE).
    (None, 20, "config.env.max_observation_tokens=20: the chat template frames a tool message "
               "with 20 tokens, so no text would fit; allowed: more than 20"),
])
def test_a_chat_template_that_cannot_answer_with_a_tool_is_one_line(template, limit, error):
  from jaxgrpo import data  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import chat, hf  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  folder = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2")
  c = _math_config()
  c.env.name, c.env.max_observation_tokens = "tools", limit
  ct = (chat.ChatTemplate("test", template, {}) if template
        else chat.ChatTemplate.from_folder(folder))
  prompt = data.ChatPrompt("{question}", ct, tools=None)
  with pytest.raises(config_lib.ConfigError) as e:
    loading.check_observations(c, hf.hf_tokenizer(folder), prompt)
  assert error in str(e.value) and "\n" not in str(e.value)
  c.env.max_observation_tokens = 21
  if template is None:  # one more token: room for text
    loading.check_observations(c, hf.hf_tokenizer(folder), prompt)


def test_a_parser_the_chat_template_never_mentions_is_warned_about(capsys):
  from jaxgrpo import data  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import chat, hf  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  folder = os.path.join(ROOT, "tests", "fixtures", "templates", "llama3.1")
  c = _math_config()
  c.env.name, c.env.max_observation_tokens, c.model.hf_checkpoint = "tools", 64, folder
  prompt = data.ChatPrompt("{question}", chat.ChatTemplate.from_folder(folder))
  for parser, warned in (("hermes", True), ("llama3_json", False)):
    c.env.kwargs = json.dumps({"parser": parser})
    loading.check_observations(c, hf.hf_tokenizer(folder), prompt)
    err = capsys.readouterr().err
    assert ("warning: env.kwargs: the tool-call parser 'hermes' reads the format of templates "
            "that mention '<tool_call>'" in err) == warned, err

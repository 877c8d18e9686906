"""config.user_modules: the user's files and modules, imported once, each failure one line."""

import sys

import pytest

from jaxgrpo import plugins, rewards


def test_a_file_registers_its_rewards_once_under_a_stable_name(registry, tmp_path):
  path = tmp_path / "my_rewards.py"
  path.write_text("import jaxgrpo.rewards\n"
                  "@jaxgrpo.rewards.register('mine', correctness=True)\n"
                  "def mine(completions, answers, **columns):\n"
                  "  return [1.0] * len(completions)\n")
  names = plugins.import_modules(f" {path} , json")  # a file and an importable module
  assert names == [plugins.module_name(str(path)), "json"]
  assert "mine" in rewards.REGISTRY and rewards.CORRECTNESS[-1] == "mine"
  # A second import (evaluate's two sides, a worker's start) registers nothing twice.
  assert plugins.import_modules(str(path)) == names[:1]
  assert sys.modules[names[0]].mine is rewards.REGISTRY["mine"]


@pytest.mark.parametrize("text, message", [
    ("x = 1\nraise RuntimeError('no GPU here')\n",
     r"\S*bad\.py:2: RuntimeError: no GPU here$"),
    ("def f(:\n", r"\S*bad\.py:1: SyntaxError: invalid syntax"),
    ("import jaxgrpo.rewards\n\n@jaxgrpo.rewards.register('math')\ndef m(c, a, **k):\n"
     "  return []\n", r"\S*bad\.py:3: ValueError: reward 'math' is already registered"),
])
def test_a_module_that_fails_to_import_is_one_line_with_its_file_and_line(registry, tmp_path,
                                                                         text, message):
  path = tmp_path / "bad.py"
  path.write_text(text)
  with pytest.raises(plugins.PluginError, match=r"^config\.user_modules: " + message) as e:
    plugins.import_modules(str(path))
  assert "\n" not in str(e.value)
  assert plugins.module_name(str(path)) not in sys.modules  # a fixed file imports afresh


def test_a_missing_file_or_module_is_named():
  with pytest.raises(plugins.PluginError, match=r"^config\.user_modules: nope/r\.py: no such "
                     r"file$"):
    plugins.import_modules("nope/r.py")
  with pytest.raises(plugins.PluginError, match=r"^config\.user_modules: no_such_module_x: "
                     r"ModuleNotFoundError: No module named 'no_such_module_x'$"):
    plugins.import_modules("no_such_module_x")

"""Config checks by registration: each subsystem registers the checks of its own config
keys, and `config.validate` runs them, in order, after the schema's types and ranges. So
config.py imports none of the subsystems it checks (rewards, envs, trackers, LoRA,
sharding, ...), and a subsystem's rules live beside the code they protect.

    from jaxgrpo.runtime import config_checks

    @config_checks.register(order=40)
    def _check_config(c, num_devices: int) -> None:
      if ...:
        config_checks.fail("env.max_turns", c.env.max_turns, "an integer >= 1")

A check that needs the model as loaded (a checkpoint names its own architecture: LoRA's
rank against its shapes, splash against its window, the mesh against its heads and
experts) registers with `register_model` and gets (config, the ModelConfig); the loader
runs them (`run_model`) once the architecture is known, before anything compiles.

A check gets the config (unlocked: the mesh check stores the resolved sizes) and the
device count, and raises ConfigError: one line naming the key, the value and what is
allowed. A check registers when its module is imported. The run layer imports every such
module (run/setup.py's `register_checks`, which every command and bench calls before
validating) and then marks the registry complete: `config.validate` refuses to run on an
incomplete one, so no check is ever skipped because its module was not loaded. It lives in
runtime/, the lowest layer, so model/ and runtime/ modules can register too. No jax here.
"""

from __future__ import annotations

from typing import Any, Callable

class ConfigError(ValueError):
  """A config problem, explained in one line."""


_CHECKS: list[tuple[int, str, Callable[[Any, int], None]]] = []


def register(order: int):
  """Registers `fn(config, num_devices)` to run after the checks of lower `order`: 0 the
  mesh (later checks read its resolved sizes), 20 the user's modules and the rewards (the
  stop rule's names depend on them), 50 the rest."""
  def decorate(fn):
    name = f"{fn.__module__}.{fn.__qualname__}"
    if all(n != name for _, n, _ in _CHECKS):  # a module imported twice registers once
      _CHECKS.append((order, name, fn))
    return fn
  return decorate


_MODEL_CHECKS: list[tuple[int, str, Callable[[Any, Any], None]]] = []


def register_model(order: int):
  """Registers `fn(config, model_cfg)`, run by `run_model` once the model is known, after
  the model checks of lower `order`."""
  def decorate(fn):
    name = f"{fn.__module__}.{fn.__qualname__}"
    if all(n != name for _, n, _ in _MODEL_CHECKS):
      _MODEL_CHECKS.append((order, name, fn))
    return fn
  return decorate


_complete = [False]  # set by mark_complete: every registering module was imported


def mark_complete() -> None:
  _complete[0] = True


def run(config, num_devices: int) -> None:
  """Every registered check, by order (then registration). RuntimeError when the run
  layer has not registered every subsystem's checks yet."""
  if not _complete[0]:
    raise RuntimeError("the subsystems' config checks are not registered: call "
                       "jaxgrpo.run.setup.register_checks() before config.validate")
  for _, _, fn in sorted(_CHECKS, key=lambda item: item[0]):
    fn(config, num_devices)


def run_model(config, model_cfg) -> None:
  """Every check registered with `register_model`, by order, against the loaded model's
  ModelConfig (the validated config's own keys may leave its architecture unset)."""
  if not _complete[0]:
    raise RuntimeError("the subsystems' config checks are not registered: call "
                       "jaxgrpo.run.setup.register_checks() before loading a model")
  for _, _, fn in sorted(_MODEL_CHECKS, key=lambda item: item[0]):
    fn(config, model_cfg)


def fail(key: str, value: Any, allowed: str, reason: str | None = None):
  """Raises the one-line ConfigError: `config.<key>=<value>: [<reason>; ]allowed: ...`."""
  why = f"{reason}; " if reason else ""
  raise ConfigError(f"config.{key}={value!r}: {why}allowed: {allowed}")

"""Environments: what answers the policy between the turns of a multi-turn episode.

An environment is a class, registered by name and chosen with `config.env.name` ('' keeps
today's single-turn rollouts):

    import jaxgrpo.envs

    @jaxgrpo.envs.register("guess")
    class Guess:
      stop_strings = ()               # strings that end a turn besides the end token (optional)

      def reset(self, row, seed):     # one episode: the data row (every column) and its seed
        return {"target": int(row["answer"]), "tries": 0}   # the episode's state (picklable)

      def step(self, state, text):    # after each assistant turn: the turn's text
        state["tries"] += 1
        if text.strip() == str(state["target"]):
          return None, 1.0, True, {}  # (observation, reward, done, info)
        return " wrong, again:", 0.0, False, {"tries": state["tries"]}

A file that registers one is named in `config.user_modules` (imported at start-up, in every
process and every worker). jaxgrpo makes one instance per process, without arguments or with
`config.env.kwargs` (a JSON object).

`reset(row, seed)` returns the episode's state. The first prompt is the row's rendered prompt,
unless reset returns `Start(state, prompt)`: then `prompt` (a string, tokenized alone, as is)
replaces it. `step(state, text)` gets the state and the text of the turn just sampled (its
tokens decoded with special tokens kept, so an end token such as `<|im_end|>` is there when
it ended the turn) and returns `(observation, reward, done, info)`:
  observation  what follows, appended to the episode and never trained (observations.py):
               a str, tokenized alone and appended as it is (feedback, a model without a
               chat template); or chat messages, a dict {"role": "tool", "content": ...}
               or a list of them (`tool_message(text)` makes one), rendered by the
               model's own chat template as the token difference of the conversation
               with and without them, the next assistant turn opened; None: nothing
  reward       a number or None: added to the episode's reward
  done         True ends the episode
  info         a dict; its numeric values are logged as `env/<key>` (means over episodes),
               and `tool_calls` / `tool_errors` (counts this step) feed the `tool_calls_mean`
               and `tool_errors_fraction` metrics
The state a step mutates is the state the next step gets: in a worker process the state
travels with each call (it must pickle), in the main process it is the same object.

An environment whose observations are chat messages may say so with a class attribute
`uses_chat_template = True` (the tools environment does): a run without a chat template, or
with one that cannot continue a conversation, is then refused at start-up in one line;
otherwise such an observation fails its episode when it comes.

`close(state)`, optional, releases what an episode holds (a sandbox, a browser, a database
connection). It is called exactly once per episode whose reset returned a state, as soon as
the episode ends, whatever ended it: done, env.max_turns, the token budget, a failed or
timed-out step (in a worker, with the state the last good step returned; in the main
process, the state object as the failed step left it), or a failed reset of another
episode of its row. A run that is stopped (SIGTERM, Ctrl-C) finishes its step first, so its
episodes are closed too. A close that raises is reported, and changes no reward.

The episode's reward is the sum of its steps' rewards plus `config.rewards` applied to the
whole transcript (every completion token's text after the prompt), so the shipped rewards
and maj@k work on the final answer. An environment that raises, hangs past
`env.timeout_s` or returns something else than the above ends its episode with reward None
(the row leaves the loss and its group's statistics), counted in `env_errors/<name>`; the
first traceback is printed once. Seeds come from (seed, step, row, sample), so a
deterministic environment gives a bitwise-exact resume.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

import numpy as np
from jaxgrpo import observations
from jaxgrpo.runtime import config_checks

_REGISTRY: dict[str, type] = {}
# One instance per process and (name, kwargs): made on first use, here or in a worker.
_INSTANCES: dict[tuple[str, str], Any] = {}


@dataclasses.dataclass
class Start:
  """What `reset` may return instead of a bare state, to replace the first prompt."""

  state: Any
  prompt: str | None = None


class EnvError(ValueError):
  """An environment that cannot be used (unknown, bad class, bad kwargs), in one line."""


def register(name: str) -> Callable[[type], type]:
  """Class decorator: `@register("name")` makes the environment `config.env.name=name`."""
  if not isinstance(name, str) or not name.strip() or "," in name:
    raise EnvError(f"environment name {name!r}: must be a non-empty string without commas")

  def wrap(cls):
    if not isinstance(cls, type):
      raise EnvError(f"@jaxgrpo.envs.register({name!r}) decorates a class, not "
                     f"{type(cls).__name__}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
      raise EnvError(f"environment {name!r} ({cls.__qualname__}) has no {', '.join(missing)} "
                     "method; an environment defines reset(row, seed) and step(state, text)")
    old = _REGISTRY.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__,
                                                                   cls.__qualname__):
      raise EnvError(f"environment {name!r} is registered twice: {old.__module__}."
                     f"{old.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    _REGISTRY[name] = cls
    return cls
  return wrap


def names() -> list[str]:
  _builtins()
  return sorted(_REGISTRY)


def get(name: str) -> type:
  _builtins()
  if name not in _REGISTRY:
    raise EnvError(f"unknown environment {name!r}; registered: {', '.join(sorted(_REGISTRY))} "
                   "(an environment of your own: register it with @jaxgrpo.envs.register "
                   "in a file named in config.user_modules)")
  return _REGISTRY[name]


def _builtins() -> None:
  """Registers the built-in environments (once)."""
  if "tools" not in _REGISTRY:
    from jaxgrpo import tools  # pylint: disable=g-import-not-at-top  (tools imports no envs)
    register("tools")(tools.Tools)


def parse_kwargs(text: str) -> dict:
  """config.env.kwargs (a JSON object, '' for none) -> dict; EnvError naming the problem."""
  if not text or not text.strip():
    return {}
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise EnvError(f"not JSON ({e.msg} at character {e.pos}); allowed: a JSON object such as "
                   "'{\"tools\": \"calculator\"}'") from None
  if not isinstance(value, dict):
    raise EnvError(f"a JSON {type(value).__name__}; allowed: a JSON object")
  return value


def instance(name: str, kwargs_json: str = ""):
  """This process's instance of environment `name` with `kwargs_json` (made once)."""
  key = (name, kwargs_json or "")
  if key not in _INSTANCES:
    _INSTANCES[key] = get(name)(**parse_kwargs(kwargs_json))
  return _INSTANCES[key]


def stop_strings(name: str, kwargs_json: str = "") -> tuple[str, ...]:
  """The strings that end a turn for this environment, besides the end token."""
  return tuple(getattr(instance(name, kwargs_json), "stop_strings", ()) or ())


def tool_schemas(name: str, kwargs_json: str = "") -> list[dict] | None:
  """The tools an environment shows the model through the chat template (`tools=`), if any."""
  fn = getattr(instance(name, kwargs_json), "tool_schemas", None)
  return fn() if callable(fn) else None


def tool_message(content: str) -> dict:
  """A tool's response as an observation message: the model's chat template renders it as
  its tool turn (Qwen: a <tool_response> block in a user turn; Llama 3: an ipython turn)."""
  return {"role": "tool", "content": str(content)}


def uses_chat_template(name: str, kwargs_json: str = "") -> bool:
  """Whether the environment declares that its observations are chat messages (its
  `uses_chat_template` attribute): then the run must have a chat template that continues
  a conversation, checked at start-up."""
  return bool(getattr(instance(name, kwargs_json), "uses_chat_template", False))


def call_reset(name: str, kwargs_json: str, row: dict, seed: int):
  """One reset, as a worker runs it: (state, prompt or None)."""
  out = instance(name, kwargs_json).reset(row, seed)
  return (out.state, out.prompt) if isinstance(out, Start) else (out, None)


def call_step(name: str, kwargs_json: str, state, text: str):
  """One step, as a worker runs it: (the state after it, the step's checked result)."""
  out = instance(name, kwargs_json).step(state, text)
  return state, check_step(out)


def call_close(name: str, kwargs_json: str, state) -> None:
  """An episode's end, as a worker runs it: the environment's optional `close(state)`."""
  close = getattr(instance(name, kwargs_json), "close", None)
  if close is not None:
    close(state)


def check_step(out) -> tuple[str | None, float | None, bool, dict]:
  """A step's return checked: (observation, reward, done, info); ValueError says what is
  wrong with it (the episode then ends as an environment error)."""
  if not isinstance(out, tuple) or len(out) != 4:
    raise ValueError(f"step returned {type(out).__name__} {out!r:.60}; allowed: a tuple "
                     "(observation, reward, done, info)")
  observation, reward, done, info = out
  try:
    observations.messages_of(observation)
  except observations.ObservationError as e:
    raise ValueError(f"step's {e} (or None)") from None
  if reward is not None:
    if isinstance(reward, (bool, str)) or not isinstance(reward, (int, float, np.number)):
      raise ValueError(f"step's reward is {type(reward).__name__}; allowed: a number or None")
    reward = float(reward)
    if not math.isfinite(reward):
      raise ValueError(f"step's reward is {reward}")
  if not isinstance(done, (bool, int, np.bool_)):
    raise ValueError(f"step's done is {type(done).__name__}; allowed: bool")
  if info is None:
    info = {}
  if not isinstance(info, dict):
    raise ValueError(f"step's info is {type(info).__name__}; allowed: a dict")
  return observation, reward, bool(done), info


@config_checks.register(order=36)
def _check_config(c, num_devices: int) -> None:
  """An environment that exists and can be made with its kwargs, and a token budget that
  holds the prompt (the stop strings are checked against the tokenizer by loading)."""
  del num_devices
  e, gen = c.env, c.generation
  # In the main process a call cannot be stopped, and an environment that exits ends the
  # run: a time limit there would be a promise not kept (it needs a worker process).
  if e.name and not e.workers and e.timeout_s:
    config_checks.fail("env.workers", e.workers, "1 or more (each reset and step in a worker "
                       f"process, where env.timeout_s={e.timeout_s:g} is enforced and an "
                       "environment that exits or hangs ends only its episode), or "
                       "env.timeout_s=0 with env.workers=0 (no limit, in the main process: "
                       "for a debugger)", reason="env.timeout_s cannot be enforced in the main "
                       "process")
  if e.timeout_s == 0 and e.workers:
    config_checks.fail("env.timeout_s", 0, "a number > 0 with env.workers > 0 (0, no limit, "
                       "only with env.workers=0)")
  if not e.name:
    if gen.max_episode_tokens:
      config_checks.fail("generation.max_episode_tokens", gen.max_episode_tokens,
            "0 without an environment (env.name='' samples one completion per prompt)")
    return
  try:
    get(e.name)
  except EnvError as err:
    raise config_checks.ConfigError(f"config.env.name={e.name!r}: {err}") from None
  try:
    parse_kwargs(e.kwargs)
  except EnvError as err:
    raise config_checks.ConfigError(f"config.env.kwargs={e.kwargs!r}: {err}") from None
  try:
    instance(e.name, e.kwargs)
  except Exception as err:  # pylint: disable=broad-except  (the user's constructor)
    raise config_checks.ConfigError(f"config.env.kwargs={e.kwargs!r}: environment {e.name!r} cannot be made "
                      f"with them: {type(err).__name__}: {err}") from None
  if gen.max_episode_tokens <= c.data.max_prompt_length:
    config_checks.fail("generation.max_episode_tokens", gen.max_episode_tokens,
          f"more than data.max_prompt_length={c.data.max_prompt_length} (an episode is the "
          "prompt and every turn and observation after it)")
  if gen.backend != "native":
    config_checks.fail("env.name", e.name, f"'' with generation.backend={gen.backend!r} (episodes run on "
          "the native sampler)")
  # An episode's turns run on its KV cache, each row at its own slot (rollout/turns.py):
  # the decode's key blocks read one slot range for every row.
  if gen.decode_block_size:
    config_checks.fail("generation.decode_block_size", gen.decode_block_size, "0 with an environment "
          "(episode turns decode each row at its own slot of the KV cache they keep)")
  if c.grpo.dynamic_sampling != "off":
    config_checks.fail("grpo.dynamic_sampling", c.grpo.dynamic_sampling,
          "'off' with an environment (dynamic sampling of episodes is not built yet)")

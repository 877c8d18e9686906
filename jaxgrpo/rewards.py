"""Reward functions: a registry of host-side scorers for sampled completions.

Rewards are plain host Python and never run inside a jitted loss: the trainer
detokenizes the sampled tokens, scores them here, and ships the resulting floats
to the device (`rewards_N`, reshaped to `rewards_BxG` for advantages). Keeping
them out of jit lets a reward use regexes and sympy freely, at host cost.

Every reward has one signature,

  fn(completions: list[str], answers: list[str], **columns) -> list[float]

where `columns` holds one list per row field, each as long as `completions`:
every column of the data row other than `answer` under its own name (`question`,
`source`, `tests`, ...; None where a row lacks it), `prompts` (the rendered
prompt text) and `completion_ids` (each completion's token ids, EOS included).
In a multi-turn episode `completions` is what the policy wrote: its sampled turns,
in order, without the environment's observations (a tool's result is not the
policy's answer); `transcripts` is the whole episode after the prompt (every turn
and observation) and `turns` its parts as [{"role": "assistant" | "environment",
"text": ...}], for a reward that wants them.
A reward reads the columns it needs and ignores the rest (the built-ins use
none), so any registered reward is called the same way. A reward never raises
on odd model text: anything it cannot read scores 0.0.

A reward may also return, per row, None (it could not score the row) or a dict
with a `score` and more numbers to log; scorer.py, the one seam from a rollout to
rewards for training and validation, says how those and a reward's failures count.

Built-ins: `exact_match` (string equality, for the arithmetic task), `math`
(final-answer equivalence through math-verify, with a numeric fast path) and
`format` (a final answer is present in an accepted form). `compute` and
`combine` weight several of them into one scalar per row.

A reward registered with `correctness=True` says whether the answer is right:
training's `accuracy`, validation's accuracy and pass@j and the stop rule read
it. When several active rewards are correctness rewards, the one registered
last wins (a user's over the built-ins, `math` over `exact_match`); with none,
a rollout is correct when its total reward is > 0.

A correctness reward may also have an answer extractor (`EXTRACTORS`, by reward
name): the final answer the reward compares, with `answers_equal` its notion of
equality. Majority voting (jaxgrpo/eval/voting.py) groups a prompt's samples by
them. The reward itself extracts and compares through the very same functions,
so a vote and a reward can never disagree on what a completion answered.
"""

from collections.abc import Callable, Mapping
import decimal
import functools
import math as _math
import re
import threading
from typing import Any

from jaxgrpo import plugins
from jaxgrpo.runtime import config_checks


RewardFn = Callable[..., list[float]]

REGISTRY: dict[str, RewardFn] = {}
# The correctness rewards' names, in registration order (the last active one wins).
CORRECTNESS: list[str] = []
# Rewards registered with pred=True: their dict rows carry the answer maj@k votes on.
PREDS: set[str] = set()
# Keyword names the scorer passes itself; a data column may not take one of them.
RESERVED_COLUMNS = ("completions", "answers", "prompts", "completion_ids", "transcripts",
                    "turns")

# math-verify's timeout is signal.alarm, so it is whole seconds; one second per
# parse/verify call bounds a pathological item at about three seconds.
_TIMEOUT_S = 1
# Longer "answers" are runaway text, not answers; sympy on them costs seconds.
_MAX_ANSWER_CHARS = 1000
# Off the main thread math-verify has no timeout, so it only sees short answers
# without the constructs whose evaluation can explode (9^{9^{9^9}}, 10^6!).
_UNTIMED_MAX_CHARS = 64
_UNTIMED_UNSAFE = re.compile(r"[\^!]|\\binom|\\exp")
_REL_TOL = decimal.Decimal("1e-6")

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")
# Thousands-grouped or plain digits, optional decimals; a minus only when it is
# not a hyphen between words or numbers ("pages 3-5" ends in 5, not -5).
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


class UnknownRewardError(KeyError, ValueError):
  """An unregistered reward name; catchable as KeyError or ValueError."""

  def __str__(self) -> str:
    # KeyError would print the repr of the message, quotes included.
    return str(self.args[0]) if self.args else ""


def register(name: str, *, correctness: bool = False,
             pred: bool = False) -> Callable[[RewardFn], RewardFn]:
  """Returns a decorator that adds a reward function to REGISTRY as `name`.

  correctness: the reward says whether a completion's answer is right (0 or 1, or a score
  that `val_pass_threshold` cuts), so accuracy, pass@j, maj@k and the stop rule read it.
  pred: its rows are dicts whose `pred` is the answer it compared, which maj@k votes on
  (equal when ==), as the built-ins' answer extractors give theirs.
  """

  def decorator(fn: RewardFn) -> RewardFn:
    if name in REGISTRY:
      raise ValueError(f"reward {name!r} is already registered")
    REGISTRY[name] = fn
    if correctness:
      CORRECTNESS.append(name)
    if pred:
      PREDS.add(name)
    return fn

  return decorator


def get(name: str) -> RewardFn:
  """Returns the reward registered as `name`; UnknownRewardError otherwise."""
  try:
    return REGISTRY[name]
  except KeyError:
    raise UnknownRewardError(
        f"unknown reward {name!r}; allowed: {', '.join(sorted(REGISTRY))}"
    ) from None


def _text(value: Any) -> str:
  """Coerces a row to text: None reads as empty, numbers as their str."""
  return "" if value is None else value if isinstance(value, str) else str(value)


def _check_lengths(completions, answers, columns: Mapping[str, Any]) -> None:
  n = len(completions)
  lengths = {"answers": len(answers)}
  lengths.update({k: len(v) for k, v in columns.items()})
  bad = {k: m for k, m in lengths.items() if m != n}
  if bad:
    raise ValueError(f"{n} completions but lengths {bad}")


def _last_boxed(text: str) -> str | None:
  """Returns the content of the last brace-balanced \\boxed{...}, else None."""
  starts = [m.end() - 1 for m in _BOXED.finditer(text)]
  if not starts:
    return None
  # One pass pairing braces keeps this linear even for text full of \boxed{,
  # where rescanning from each occurrence would be quadratic.
  close_of, stack = {}, []
  for m in re.finditer(r"[{}]", text):
    if m.group() == "{":
      stack.append(m.start())
    elif stack:
      close_of[stack.pop()] = m.start()
  for start in reversed(starts):
    if start in close_of:
      return text[start + 1:close_of[start]].strip()
  return None


def _last_gsm8k(text: str) -> str | None:
  """Returns the text after the last non-empty `####` marker, else None."""
  found = [m.group(1).strip() for m in _GSM8K.finditer(text)]
  found = [f for f in found if f]
  return found[-1] if found else None


def _last_number(text: str) -> str | None:
  last = None
  for last in _NUMBER.finditer(text):
    pass
  return last.group() if last else None


def _final_answer(text: str, fallback: Callable[[str], str | None]):
  """Returns the boxed answer, else the GSM8K one, else fallback(text)."""
  for extract in (_last_boxed, _last_gsm8k, fallback):
    found = extract(text)
    if found:
      return found
  return None


def _math_reference(answer: Any) -> str | None:
  """The final answer of a reference, as math_reward compares it.

  A reference without a box or `####` is taken whole, since it is usually the
  bare answer (such as "\\frac{1}{2}") rather than a solution.
  """
  return _final_answer(_text(answer), lambda t: t.strip())


def _math_prediction(completion: Any) -> str | None:
  """The final answer of a completion, as math_reward compares it."""
  return _final_answer(_text(completion), _last_number)


def _as_number(text: str) -> decimal.Decimal | None:
  """Reads a plain number such as "-1,234.5" or "$18"; None for anything else."""
  s = text.replace("\\$", "").replace("$", "").strip().rstrip(".")
  if not _PLAIN_NUMBER.fullmatch(s):
    return None
  # Decimal, not float or int: exact, and no digit limit on runaway integers.
  return decimal.Decimal(s.replace(",", ""))


def _numbers_equal(a: decimal.Decimal, b: decimal.Decimal) -> bool:
  return abs(a - b) <= _REL_TOL * max(decimal.Decimal(1), abs(a), abs(b))


def _math_equal(ref: str, pred: str, gold_cache: dict[str, Any],
                pred_cache: dict[str, Any] | None = None) -> bool:
  """Whether two extracted answers are equivalent (numbers, then math-verify).

  `ref` takes the reference's place in math_verify.verify(gold, target), which
  is not symmetric. `pred_cache`, when given, keeps `pred`'s parse too (it may
  be `gold_cache`: both parse the same way); the reward leaves it out, since
  each completion is parsed once there anyway.
  """
  ref_num, pred_num = _as_number(ref), _as_number(pred)
  if ref_num is not None and pred_num is not None:
    return _numbers_equal(ref_num, pred_num)
  if max(len(ref), len(pred)) > _MAX_ANSWER_CHARS:
    return False
  timeout = _TIMEOUT_S
  if threading.current_thread() is not threading.main_thread():
    # signal.alarm only works on the main thread, so here math-verify runs
    # untimed and only on answers too small and tame to stall it.
    timeout = None
    if (max(len(ref), len(pred)) > _UNTIMED_MAX_CHARS
        or _UNTIMED_UNSAFE.search(ref) or _UNTIMED_UNSAFE.search(pred)):
      return ref.replace(" ", "") == pred.replace(" ", "")
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top

  # Wrapping in \boxed makes math-verify read bare LaTeX such as \frac{1}{2}.
  try:  # the G completions of a prompt share a reference
    gold = gold_cache[ref]
  except KeyError:
    gold = gold_cache[ref] = parse(f"\\boxed{{{ref}}}", parsing_timeout=timeout)
  if pred_cache is None:
    target = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
  else:
    try:
      target = pred_cache[pred]
    except KeyError:  # also when another thread just emptied a bounded cache
      target = pred_cache[pred] = parse(f"\\boxed{{{pred}}}",
                                        parsing_timeout=timeout)
  return bool(gold and target and verify(gold, target, timeout_seconds=timeout))


@register("exact_match", correctness=True)
def exact_match(completions: list[str], answers: list[str], **columns):
  """1.0 where the completion's first word equals the stripped answer.

  The completion is cut at its first whitespace, so "0579\\nmore" matches
  "0579". The comparison is on strings ("579" does not match "0579"), and an
  empty answer matches nothing.
  """
  _check_lengths(completions, answers, columns)
  scores = []
  for completion, answer in zip(completions, answers):
    words = _text(completion).split(maxsplit=1)
    answer = _text(answer).strip()
    scores.append(float(bool(answer) and bool(words) and words[0] == answer))
  return scores


@register("math", correctness=True)
def math_reward(completions: list[str], answers: list[str], **columns):
  """1.0 where the completion's final answer is equivalent to the reference.

  A final answer is the last \\boxed{...}, else the last `#### x` line, else
  (for completions only) the last number in the text. A reference without a
  box or `####` is taken whole, since it is usually the bare answer (such as
  "\\frac{1}{2}") rather than a solution. Any failure scores 0.0.
  """
  _check_lengths(completions, answers, columns)
  gold_cache: dict[str, Any] = {}
  scores = []
  for completion, answer in zip(completions, answers):
    try:
      ref = _math_reference(answer)
      pred = _math_prediction(completion)
      ok = bool(ref and pred) and _math_equal(ref, pred, gold_cache)
    except Exception:  # pylint: disable=broad-except
      # Model text is adversarial by accident; one bad row must not stop a step.
      ok = False
    scores.append(float(ok))
  return scores


@register("format")
def format_reward(completions: list[str], answers: list[str], **columns):
  """1.0 where the completion states a final answer as \\boxed{} or `####`."""
  _check_lengths(completions, answers, columns)
  return [
      float(bool(_last_boxed(t) or _last_gsm8k(t)))
      for t in map(_text, completions)
  ]


# Answer extractors: what a correctness reward compares, for majority voting.

ExtractFn = Callable[[Any], Any]
EqualFn = Callable[[Any, Any], bool]

# Reward name -> fn(completion) -> the final answer the reward compares, or None
# when the completion states none. Extractors never raise on odd model text.
EXTRACTORS: dict[str, ExtractFn] = {}
# Reward name -> fn(reference) -> the reference's answer, or None.
_REFERENCE_EXTRACTORS: dict[str, ExtractFn] = {}
# Reward name -> fn(a, b) -> bool on two non-None extracted answers.
_EQUALITIES: dict[str, EqualFn] = {}

# math-verify parses of extracted answers, shared by every answers_equal("math")
# call: parsing costs milliseconds and dominates grouping, and a prompt's
# samples (and a validation's prompts) repeat the same few answers. A parse does
# not depend on the thread that made it: off the main thread only short, tame
# answers are parsed (_math_equal), and those do not run into the timeout.
_PARSE_CACHE_MAX = 4096


class _BoundedCache(dict):
  """A dict emptied when full: bounded memory, and parses are cheap to redo."""

  def __setitem__(self, key, value):
    if len(self) >= _PARSE_CACHE_MAX:
      self.clear()
    super().__setitem__(key, value)


_PARSE_CACHE = _BoundedCache()


def register_extractor(name: str, extract: ExtractFn, reference: ExtractFn,
                       equal: EqualFn) -> None:
  """Registers the answer extractor of the reward `name`.

  Args:
    name: the reward's name in REGISTRY.
    extract: completion text -> the answer the reward compares, or None.
    reference: reference text -> the reference's answer, or None.
    equal: (a, b) -> whether two non-None answers are the same answer, where
      `a` takes the reference's place when the equality is not symmetric.
  """
  if name in EXTRACTORS:
    raise ValueError(f"answer extractor {name!r} is already registered")
  EXTRACTORS[name] = extract
  _REFERENCE_EXTRACTORS[name] = reference
  _EQUALITIES[name] = equal


def get_extractor(name: str) -> ExtractFn:
  """The answer extractor of reward `name`; UnknownRewardError otherwise."""
  try:
    return EXTRACTORS[name]
  except KeyError:
    raise UnknownRewardError(
        f"reward {name!r} has no answer extractor; allowed: "
        f"{', '.join(sorted(EXTRACTORS))}") from None


def extract_reference(name: str, answer: Any) -> Any:
  """The reference's answer as reward `name` compares it, or None."""
  get_extractor(name)
  return _REFERENCE_EXTRACTORS[name](answer)


def answers_equal(name: str, a: Any, b: Any) -> bool:
  """Whether two extracted answers are the same answer to reward `name`.

  None (no answer) equals nothing, itself included. For `math` this is the
  very test math_reward applies, math-verify behind a numeric fast path, with
  `a` in the reference's place: math_verify.verify(gold, target) is not
  symmetric (gold "1" accepts target "2x+z=1", whose right side is 1, but not
  the other way round). So math_reward(c, ref) == 1.0 exactly when
  answers_equal("math", extract_reference("math", ref), EXTRACTORS["math"](c)).
  Never raises: a failed comparison is False.
  """
  get_extractor(name)
  if a is None or b is None:
    return False
  try:
    return bool(_EQUALITIES[name](a, b))
  except Exception:  # pylint: disable=broad-except
    return False  # as the rewards score a failed comparison 0.0


def _never_raising(extract: ExtractFn) -> ExtractFn:
  """Wraps an extractor so odd text gives None, as it gives the rewards 0.0."""

  @functools.wraps(extract)
  def wrapped(text):
    try:
      return extract(text) or None  # an empty answer is no answer
    except Exception:  # pylint: disable=broad-except
      return None

  return wrapped


def _exact_match_answer(text: Any) -> str | None:
  """The completion's first word, as exact_match compares it."""
  words = _text(text).split(maxsplit=1)
  return words[0] if words else None


register_extractor(
    "math", _never_raising(_math_prediction), _never_raising(_math_reference),
    lambda a, b: _math_equal(a, b, _PARSE_CACHE, _PARSE_CACHE))
register_extractor(
    "exact_match", _never_raising(_exact_match_answer),
    _never_raising(lambda t: _text(t).strip()), lambda a, b: a == b)


def _checked_weights(weights: Mapping[str, float]) -> dict[str, float]:
  """Returns the non-zero weights after checking names and values."""
  for name, weight in weights.items():
    get(name)
    if not _math.isfinite(weight):
      raise ValueError(f"reward weight for {name!r} is not finite: {weight}")
  return {name: float(w) for name, w in weights.items() if w != 0}


def compute(weights: Mapping[str, float], completions: list[str],
            answers: list[str], **columns):
  """Scores rows with the weighted sum of the named rewards.

  Args:
    weights: reward name -> weight; zero weights are skipped.
    completions: decoded model completions, one per row.
    answers: reference answers, one per row.
    **columns: extra per-row lists, passed on to every reward.

  Returns:
    (total, breakdown): the weighted sum per row, and the unweighted values of
    each non-zero-weight reward by name, for `reward/<name>` metrics.
  """
  active = _checked_weights(weights)
  _check_lengths(completions, answers, columns)
  total = [0.0] * len(completions)
  breakdown = {}
  for name, weight in active.items():
    values = [float(v) for v in get(name)(completions, answers, **columns)]
    if len(values) != len(completions):
      raise ValueError(
          f"reward {name!r} returned {len(values)} values for "
          f"{len(completions)} completions")
    breakdown[name] = values
    total = [t + weight * v for t, v in zip(total, values)]
  return total, breakdown


def combine(weights: Mapping[str, float]) -> RewardFn:
  """Returns a reward computing the weighted sum of the named rewards."""
  weights = dict(weights)
  _checked_weights(weights)  # fail at config time, not at the first step

  def combined(completions: list[str], answers: list[str], **columns):
    return compute(weights, completions, answers, **columns)[0]

  return combined


def correctness_reward(weights: Mapping[str, float]) -> str | None:
  """The active correctness reward (the last registered with a weight > 0), or None."""
  active = [name for name in CORRECTNESS if weights.get(name, 0) > 0]
  return active[-1] if active else None


def majority_reward(weights: Mapping[str, float]) -> str | None:
  """The correctness reward whose answers maj@k votes on: None when there is none, or it has
  neither an answer extractor nor `pred`s (then there is no maj@k)."""
  name = correctness_reward(weights)
  return name if name in EXTRACTORS or name in PREDS else None


@config_checks.register(order=10)
def _check_config(c, num_devices: int) -> None:
  """Registered names with weights >= 0, one of them positive; with an environment every
  weight may be 0 (its step rewards are the episode's reward: episodes.py). First the user's
  modules (config.user_modules) are imported: they register their rewards."""
  del num_devices
  try:
    plugins.import_modules(c.user_modules)
  except plugins.PluginError as e:
    raise config_checks.ConfigError(str(e)) from None
  weights, env_name = c.rewards, c.env.name
  if not hasattr(weights, 'items') or not weights.keys():
    raise config_checks.ConfigError("config.rewards: expected name -> weight, e.g. {'math': 1.0}; "
                      f"names: {', '.join(sorted(REGISTRY))}")
  for name, weight in weights.items():
    if name not in REGISTRY:
      raise config_checks.ConfigError(f"config.rewards.{name}: unknown reward; registered rewards: "
                        f"{', '.join(sorted(REGISTRY))} (config.user_modules "
                        "registers your own)")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
      config_checks.fail(f"rewards.{name}", weight, "a number >= 0")
  if not any(w > 0 for w in weights.values()) and not env_name:
    raise config_checks.ConfigError("config.rewards: every weight is 0; give at least one reward a "
                      "positive weight (or config.env.name an environment whose step rewards "
                      "are the reward)")

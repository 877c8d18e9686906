"""Reward functions: a registry of host-side scorers for sampled completions.

Rewards are plain host Python and never run inside a jitted loss: the trainer
detokenizes the sampled tokens, scores them here, and ships the resulting floats
to the device (`rewards_N`, reshaped to `rewards_BxG` for advantages). Keeping
them out of jit lets a reward use regexes and sympy freely, at host cost.

Every reward has one signature,

  fn(completions: list[str], answers: list[str], **columns) -> list[float]

where `columns` holds extra per-row data lists (ignored by the built-ins), so
that the trainer can call any registered reward the same way. A reward never
raises on odd model text: anything it cannot read scores 0.0.

Built-ins: `exact_match` (string equality, for the arithmetic task), `math`
(final-answer equivalence through math-verify, with a numeric fast path) and
`format` (a final answer is present in an accepted form). `compute` and
`combine` weight several of them into one scalar per row.
"""

from collections.abc import Callable, Mapping
import decimal
import math as _math
import re
import threading
from typing import Any

RewardFn = Callable[..., list[float]]

REGISTRY: dict[str, RewardFn] = {}

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


def register(name: str) -> Callable[[RewardFn], RewardFn]:
  """Returns a decorator that adds a reward function to REGISTRY as `name`."""

  def decorator(fn: RewardFn) -> RewardFn:
    if name in REGISTRY:
      raise ValueError(f"reward {name!r} is already registered")
    REGISTRY[name] = fn
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


def _as_number(text: str) -> decimal.Decimal | None:
  """Reads a plain number such as "-1,234.5" or "$18"; None for anything else."""
  s = text.replace("\\$", "").replace("$", "").strip().rstrip(".")
  if not _PLAIN_NUMBER.fullmatch(s):
    return None
  # Decimal, not float or int: exact, and no digit limit on runaway integers.
  return decimal.Decimal(s.replace(",", ""))


def _numbers_equal(a: decimal.Decimal, b: decimal.Decimal) -> bool:
  return abs(a - b) <= _REL_TOL * max(decimal.Decimal(1), abs(a), abs(b))


def _math_equal(ref: str, pred: str, gold_cache: dict[str, Any]) -> bool:
  """Whether two extracted answers are equivalent (numbers, then math-verify)."""
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
  if ref not in gold_cache:  # the G completions of a prompt share a reference
    gold_cache[ref] = parse(f"\\boxed{{{ref}}}", parsing_timeout=timeout)
  gold = gold_cache[ref]
  target = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
  return bool(gold and target and verify(gold, target, timeout_seconds=timeout))


@register("exact_match")
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


@register("math")
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
      ref = _final_answer(_text(answer), lambda t: t.strip())
      pred = _final_answer(_text(completion), _last_number)
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

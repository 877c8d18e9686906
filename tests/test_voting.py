"""Tests for jaxgrpo.eval.voting (maj@k) and the answer extractors in jaxgrpo.rewards."""

import functools
import operator
import threading

import numpy as np
import pytest

from jaxgrpo import rewards
from jaxgrpo.eval import voting

MATH_EQUAL = functools.partial(rewards.answers_equal, "math")

# Three prompts, k = 5, rows p*5 .. p*5+4 belong to prompt p.
HAND_COMPLETIONS = [
    # Prompt 0, reference 3. Answers 7, 7, 3, 3, 5: a 2-2 tie between 7 and 3, which 7
    # wins by occurring first, so the majority answer is wrong (though 2 samples are right).
    "3 + 4 = 7, so the answer is \\boxed{7}.",
    "She has 7 apples.\n#### 7",
    "6 / 2 = 3\n#### 3",
    "The answer is \\boxed{3}.",
    "2 + 3 = 5",
    # Prompt 1, reference 0.5. Answers \frac{1}{2}, 0.4, 1/2, 0.4, 0.5: as strings 0.4 is
    # the only repeated answer and would win, but to math-verify the other three are one
    # answer, 1/2, with 3 votes to 0.4's 2, so the majority answer is right.
    "Half of it: \\boxed{\\frac{1}{2}}",
    "2/5 = 0.4, so \\boxed{0.4}",
    "so \\boxed{1/2}",
    "#### 0.4",
    "It is 0.5 of the whole.",
    # Prompt 2, reference 12. Three samples state no answer (no number, an empty box);
    # they do not vote, so 12 and 13 tie 1-1 and 12, first, wins: right.
    "I am not sure.",
    "Let me think again...",
    "\\boxed{}",
    "3 * 4 = 12 boxes",
    "#### 13",
]
HAND_REFERENCES = ["3"] * 5 + ["0.5"] * 5 + ["12"] * 5
HAND_ANSWERS = [["7", "7", "3", "3", "5"],
                ["\\frac{1}{2}", "0.4", "1/2", "0.4", "0.5"],
                [None, None, None, "12", "13"]]
HAND_SCORES = [[0, 0, 1, 1, 0],
               [1, 0, 1, 0, 1],
               [0, 0, 0, 1, 0]]


def _scores_PxK(completions, references, k):
  return np.asarray(rewards.math_reward(completions, references), np.float32).reshape(-1, k)


def test_hand_made_maj_at_5():
  answers_PxK = voting.group([rewards.EXTRACTORS["math"](c) for c in HAND_COMPLETIONS], 5)
  scores_PxK = _scores_PxK(HAND_COMPLETIONS, HAND_REFERENCES, 5)
  assert answers_PxK == HAND_ANSWERS
  np.testing.assert_array_equal(scores_PxK, HAND_SCORES)
  right_P = voting.maj_correct(answers_PxK, scores_PxK, MATH_EQUAL)
  assert right_P.dtype == np.float32 and right_P.shape == (3,)
  # Prompt 0 wrong (tie to 7), prompt 1 right (1/2 = 0.5 = \frac{1}{2}), prompt 2 right
  # (None does not vote; 12 beats 13 by occurring first): maj@5 = (0 + 1 + 1) / 3.
  np.testing.assert_array_equal(right_P, [0.0, 1.0, 1.0])
  assert right_P.mean() == pytest.approx(2 / 3)
  # For contrast, pass@5 is 1 (every prompt has a right sample) and accuracy is
  # (2 + 3 + 1) / 15 = 0.4.
  assert (scores_PxK.max(axis=1) > 0).mean() == 1.0
  assert scores_PxK.mean() == pytest.approx(0.4)


def test_hand_made_with_string_equality_differs():
  # String equality splits 1/2 into three singleton classes, so 0.4 (two votes) wins
  # prompt 1: maj@5 drops to 1/3. The reward's own equality is what maj@k must use.
  scores_PxK = _scores_PxK(HAND_COMPLETIONS, HAND_REFERENCES, 5)
  right_P = voting.maj_correct(HAND_ANSWERS, scores_PxK, operator.eq)
  np.testing.assert_array_equal(right_P, [0.0, 0.0, 1.0])


def test_math_equal_strings_form_one_class():
  answers = ["1/3", "\\frac{1}{2}", "0.5", "1/2"]
  # math-verify: \frac{1}{2}, 0.5 and 1/2 are one class of 3, founded at index 1.
  assert voting.majority_index(answers, MATH_EQUAL) == 1
  # As strings all four are singletons: the first occurrence wins the 4-way tie.
  assert voting.majority_index(answers, operator.eq) == 0


@pytest.mark.parametrize("answers,expected", [
    ([7, 7, 3, 3, 5], 0),  # 2-2 tie: 7 occurs first
    ([3, 7, 7, 3, 5], 0),  # 2-2 tie: 3 occurs first
    ([5, 3, 7, 7, 3], 1),  # 1-2-2: 3 and 7 tie, 3 (index 1) before 7 (index 2)
    ([5, 7, 3, 3, 3], 2),  # a clear majority wins whatever comes first
    ([1, 2, 3, 4, 5], 0),  # all distinct: the first
    ([4], 0),
])
def test_tie_broken_by_first_occurrence(answers, expected):
  assert voting.majority_index(answers, operator.eq) == expected


@pytest.mark.parametrize("answers,expected", [
    ([None] * 5, None),  # nothing to vote for
    ([], None),
    ([None, None, None, 4, 5], 3),  # None never wins, however many
    ([None, 4, None, 5, 5], 3),
])
def test_none_never_votes(answers, expected):
  assert voting.majority_index(answers, operator.eq) == expected


def test_all_none_prompt_is_wrong():
  # Even a score that says "right" cannot rescue a prompt with no answer at all.
  right_P = voting.maj_correct([[None, None], ["3", None]], [[1, 1], [1, 0]], operator.eq)
  np.testing.assert_array_equal(right_P, [0.0, 1.0])


def test_representative_takes_the_reference_place():
  # verify(gold, target) is not symmetric: gold 1 accepts the equation 2x+z=1 (its right
  # side is 1) but not the other way round. The first occurrence plays gold.
  assert rewards.answers_equal("math", "1", "2x+z=1")
  assert not rewards.answers_equal("math", "2x+z=1", "1")
  assert voting.majority_index(["1", "2x+z=1", "3", "3"], MATH_EQUAL) == 0  # 2-2, 1 first
  assert voting.majority_index(["2x+z=1", "1", "3", "3"], MATH_EQUAL) == 2  # 1-1-2


def test_compares_with_representatives_only():
  calls = []

  def equal(a, b):
    calls.append((a, b))
    return a == b

  assert voting.majority_index([1, 2, 3, 4, 5], equal) == 0
  assert len(calls) == 0 + 1 + 2 + 3 + 4  # each answer against the classes before it
  calls.clear()
  assert voting.majority_index([1] * 5, equal) == 0
  assert calls == [(1, 1)] * 4  # (representative, answer), once per later answer
  calls.clear()
  # Identical strings join without a call: agreeing samples cost no math-verify.
  assert voting.majority_index(["\\frac{1}{2}"] * 5, equal) == 0
  assert not calls


def test_math_equality_parses_each_string_once(monkeypatch):
  import math_verify  # pylint: disable=g-import-not-at-top

  parsed = []
  real_parse = math_verify.parse

  def counting_parse(text, **kwargs):
    parsed.append(text)
    return real_parse(text, **kwargs)

  monkeypatch.setattr(math_verify, "parse", counting_parse)
  monkeypatch.setattr(rewards, "_PARSE_CACHE", rewards._BoundedCache())
  answers = ["\\frac{1}{3}", "\\frac{2}{6}", "\\sqrt{4}", "\\frac{2}{6}", "\\sqrt{4}",
             "\\frac{1}{3}"]
  assert voting.majority_index(answers, MATH_EQUAL) == 0  # 1/3 = 2/6: 4 votes to 2
  assert sorted(parsed) == sorted(f"\\boxed{{{a}}}" for a in set(answers))
  parsed.clear()
  assert voting.majority_index(answers, MATH_EQUAL) == 0
  assert not parsed  # a second validation reuses the parses


def test_bounded_cache_empties_when_full(monkeypatch):
  monkeypatch.setattr(rewards, "_PARSE_CACHE_MAX", 3)
  cache = rewards._BoundedCache()
  for i in range(7):
    cache[i] = i
  assert len(cache) <= 3 and cache[6] == 6


def test_threshold():
  right_P = voting.maj_correct([["a", "a"], ["a", "b"]], [[0.5, 0.5], [1.0, 0.0]],
                               operator.eq, threshold=0.5)
  np.testing.assert_array_equal(right_P, [0.0, 1.0])


def test_k1_maj_is_accuracy():
  scores_PxK = np.array([[1.0], [0.0], [1.0], [0.0]], np.float32)
  answers_PxK = [["4"], ["5"], ["x"], [None]]
  np.testing.assert_array_equal(
      voting.maj_correct(answers_PxK, scores_PxK, MATH_EQUAL), [1.0, 0.0, 1.0, 0.0])


def test_maj_correct_checks_shapes():
  with pytest.raises(ValueError, match="3 answers, expected k=2"):
    voting.maj_correct([["a", "b", "c"]], [[1, 0]], operator.eq)
  with pytest.raises(ValueError, match="2 prompts"):
    voting.maj_correct([["a"], ["b"]], [[1]], operator.eq)


def test_group_and_the_extractors_read_rows_by_prompt():
  completions = ["#### 1", "#### 2", "#### 3", "no", "#### 5", "#### 6"]
  answers = [rewards.EXTRACTORS["math"](c) for c in completions]
  assert voting.group(answers, 3) == [["1", "2", "3"], [None, "5", "6"]]
  assert voting.group([rewards.get_extractor("exact_match")(c)
                       for c in [" 0579 \n", "", "a b"]], 1) == [["0579"], [None], ["a"]]
  with pytest.raises(ValueError, match="whole groups of k=4"):
    voting.group(answers, 4)
  with pytest.raises(KeyError, match="'format' has no answer extractor"):
    rewards.get_extractor("format")


def test_registry():
  assert {"math", "exact_match"} <= set(rewards.EXTRACTORS) <= set(rewards.REGISTRY)
  assert rewards.get_extractor("math") is rewards.EXTRACTORS["math"]
  with pytest.raises(ValueError, match="already registered"):
    rewards.register_extractor("math", str, str, operator.eq)
  with pytest.raises(ValueError, match="no answer extractor"):
    rewards.answers_equal("nope", "1", "1")


def test_math_equality_off_main_thread(monkeypatch):
  # math-verify's timeout needs the main thread; elsewhere the reward's untimed path runs.
  monkeypatch.setattr(rewards, "_PARSE_CACHE", rewards._BoundedCache())
  out = {}

  def work():
    out["index"] = voting.majority_index(["0.4", "\\frac{1}{2}", "1/2"], MATH_EQUAL)

  thread = threading.Thread(target=work)
  thread.start()
  thread.join()
  assert out["index"] == 1


@pytest.mark.parametrize("name", ["math", "exact_match"])
def test_none_equals_nothing(name):
  assert not rewards.answers_equal(name, None, None)
  assert not rewards.answers_equal(name, None, "1")
  assert not rewards.answers_equal(name, "1", None)
  assert rewards.answers_equal(name, "1", "1")


ODD_TEXT = ["", "   ", "}}}{{", "\\boxed{", "\\boxed{}}}{{", "####", "#### }}{",
            "\x00\ufffd\U0001f600 ∑∫√", "9" * 100_000, "\\boxed{" * 20_000, None, 12]

# (completion, reference) pairs across the ways math_reward reads a final answer.
MATH_PAIRS = [
    ("so \\boxed{\\frac{1}{2}}", "0.5"),
    ("so \\boxed{0.5}", "\\frac{1}{2}"),
    ("so \\boxed{\\frac{1}{3}}", "0.5"),
    ("so \\boxed{0.33}", "\\frac{1}{3}"),
    ("\\boxed{\\left\\{1, 2\\right\\}}", "\\{1,2\\}"),
    ("so \\boxed{(0,1)}", "[0,1]"),
    ("so \\boxed{30^\\circ}", "30"),
    ("first \\boxed{3}, no wait \\boxed{4}", "4"),
    ("She pays 500 + 734 = 1,234 dollars.\n#### 1,234", "1234"),
    ("#### 72", "Natalia sold 48/2 = 24 clips.\n48+24 = 72\n#### 72"),
    ("#### 71", "Natalia sold 48/2 = 24 clips.\n48+24 = 72\n#### 72"),
    ("it drops by 3 to -12 degrees", "-12"),
    ("pages 3-5", "-5"),
    ("the answer is 12 and then 13", "12"),
    ("\\boxed{2x+z=1}", "1"),
    ("\\boxed{5}", ""),
    ("\\boxed{5}", None),
] + [(t, "5") for t in ODD_TEXT] + [("5", t) for t in ODD_TEXT]

EXACT_PAIRS = [("0579", "0579"), (" 0579 \n", "0579"), ("0579 extra", " 0579 "),
               ("579", "0579"), ("", "0579"), (None, "0579"), ("x", ""), ("1 2", "1 2"),
               ("", "")]


@pytest.mark.parametrize("name,pairs", [("math", MATH_PAIRS), ("exact_match", EXACT_PAIRS)])
def test_extractors_agree_with_rewards(name, pairs):
  completions = [c for c, _ in pairs]
  references = [a for _, a in pairs]
  scores = rewards.get(name)(completions, references)
  agree = [float(rewards.answers_equal(name, rewards.extract_reference(name, a),
                                       rewards.EXTRACTORS[name](c)))
           for c, a in pairs]
  assert agree == scores
  assert 0 < sum(scores) < len(scores)  # both outcomes are exercised

"""Majority voting (maj@k) over a prompt's k sampled answers.

pass@k credits a prompt when any of its k samples is right, which a policy that
guesses widely can earn without knowing the answer; maj@k credits it only when
the answer most samples agree on is right, which is what self-consistency
decoding would return. Both come from the same k samples per prompt.

Answers are grouped with the correctness reward's own extractor and equality
(rewards.EXTRACTORS, rewards.answers_equal): for `math`, math-verify's notion of
equality, so "\\frac{1}{2}", "1/2" and "0.5" are one answer, not three.

The vote, for one prompt's answers a_0 .. a_{k-1}:

  * Classes are built in sample order. Answer i joins the first existing class
    whose representative r satisfies equal(a_r, a_i) (the representative takes
    the reference's place in an asymmetric equality); otherwise it founds a new
    class and is its representative. So a class's representative is its first
    occurrence, and each answer is compared with representatives only: at most
    k(k-1)/2 comparisons per prompt, and k - 1 when all samples agree.
  * The class with the most members wins; among classes of equal size, the one
    whose first occurrence comes first. (For [7, 7, 3, 3, 5], 7 wins.)
  * None (no answer extracted) joins no class and so never wins; a prompt whose
    k answers are all None has no majority answer and counts as wrong.

Grouping by representatives is order dependent when the equality is not
transitive (numeric tolerances, math-verify's rounding of floats to 6 places);
it is the usual greedy clustering, and with exact or well-separated answers it
equals grouping by equivalence classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def majority_index(answers_K: Sequence[Any],
                   equal: Callable[[Any, Any], bool]) -> int | None:
  """The index of the majority answer's first occurrence, or None if there is none.

  Args:
    answers_K: one prompt's k extracted answers, None where a sample has none.
    equal: (representative, answer) -> whether they are the same answer; not
      called for two identical strings, which are always one answer.

  Returns:
    The index of the representative (first occurrence) of the largest class,
    ties going to the class that occurs first; None when every answer is None.
    The module docstring states the rule in full.
  """
  reps, counts = [], []  # per class: representative's index, number of members
  for i, answer in enumerate(answers_K):
    if answer is None:
      continue
    for c, r in enumerate(reps):
      rep = answers_K[r]
      # Identical strings are one answer to any equality worth voting with, and a
      # reward that sees only the extracted answer scored them alike; skipping
      # equal() for them saves math-verify calls when the samples agree verbatim.
      if (isinstance(answer, str) and isinstance(rep, str) and answer == rep) or equal(
          rep, answer):
        counts[c] += 1
        break
    else:
      reps.append(i)
      counts.append(1)
  if not reps:
    return None
  # max returns the first of equal counts: the class whose first occurrence is earliest.
  return reps[max(range(len(reps)), key=counts.__getitem__)]


def maj_correct(answers_PxK: Sequence[Sequence[Any]], scores_PxK,
                equal: Callable[[Any, Any], bool],
                threshold: float = 0.0) -> np.ndarray:
  """1.0 for each prompt whose majority answer is right, else 0.0.

  The majority answer is judged by its representative sample's own score: the
  representative's answer is the majority answer (the class is defined as the
  answers equal to it), and the correctness reward has already compared that
  very answer with the reference through the same extractor and equality. So
  scores_PxK[p, rep] > threshold says exactly "the majority answer is right",
  with no further comparison against the reference, and maj@1 equals pass@1.
  scores_PxK must therefore come from the reward whose extractor produced the
  answers (rewards.EXTRACTORS); any other score would judge a different thing.

  Args:
    answers_PxK: P lists of the k extracted answers of each prompt (None where a
      sample has no answer), as extract_all returns them.
    scores_PxK: (P, k) per-sample correctness from that reward (0 or 1).
    equal: (representative, answer) -> bool, such as
      functools.partial(rewards.answers_equal, name).
    threshold: a sample is right when its score is greater than this.

  Returns:
    A float32 array of shape (P,) of 0.0 and 1.0; its mean is maj@k. A prompt
    whose answers are all None scores 0.0.
  """
  scores_PxK = np.asarray(scores_PxK, np.float32)
  if scores_PxK.ndim != 2 or scores_PxK.shape[0] != len(answers_PxK):
    raise ValueError(f"scores of shape {scores_PxK.shape} for {len(answers_PxK)} prompts")
  k = scores_PxK.shape[1]
  right_P = np.zeros(len(answers_PxK), np.float32)
  for p, answers_K in enumerate(answers_PxK):
    if len(answers_K) != k:
      raise ValueError(f"prompt {p} has {len(answers_K)} answers, expected k={k}")
    i = majority_index(answers_K, equal)
    right_P[p] = float(i is not None and scores_PxK[p, i] > threshold)
  return right_P


def group(answers_N: Sequence[Any], k: int) -> list[list[Any]]:
  """The N extracted answers as P lists of k (rows p*k .. p*k+k-1 are prompt p's).

  Raises ValueError when the N answers are not whole groups of k.
  """
  if k < 1 or len(answers_N) % k:
    raise ValueError(f"{len(answers_N)} answers are not whole groups of k={k}")
  return [list(answers_N[p:p + k]) for p in range(0, len(answers_N), k)]

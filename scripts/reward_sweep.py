"""Scores the GSM8K test reference solutions with the `math` reward and prints a JSON summary.

The `math` reward must be right on real data before it trains anything: a reference
solution has to earn 1.0 against its own answer and 0.0 against another item's. For every
item of the shipped `@gsm8k/test.jsonl` (1319 items) this scores, as completions:

  a_own:     the reference solution text as shipped, against its own answer;
  b_other:   the same text against item (i + 1) % n's answer (a fixed derangement), skipping
             pairs whose final answers are numerically equal (counted as `skipped`);
  c_own:     the solution rewritten the way a model answers: the reasoning without GSM8K's
             `<<...>>` calculator annotations and `#### x` line, then
             `The final answer is \\boxed{x}.`, against its own answer;
  c_other:   that rewrite against the deranged answer, with the same skips.

Each case runs with the reference given two ways: `solution`, the row's "answer" field as
`data.load_jsonl` loads it and the trainer passes it (the full solution ending in `#### x`),
and `final`, the bare final answer `x`. Two more cases are informational only:

  d_own_no_final_line: the rewritten reasoning with no final-answer line at all, so the
             reward falls back to the last number in the text;
  mv_own / mv_other: c_own / c_other with the numeric fast path turned off, so every pair
             goes through math-verify (what it would say, and what it costs per item).

Exit status: 1 if a_own misses any item, 2 if (a_own is clean but) b_other, c_own or
c_other does; the informational cases never fail the run.

    python scripts/reward_sweep.py [--path @gsm8k/test.jsonl] [--limit N] [--skip_math_verify]
"""

from __future__ import annotations

import argparse
import decimal
import json
import re
import sys
import time
from typing import Callable

from jaxgrpo import data, rewards

# GSM8K's calculator annotations, e.g. "<<48/2=24>>"; a model would not write them.
_CALC = re.compile(r"<<[^<>]*>>")
_FINAL = re.compile(r"\n?####[^\n]*\s*$")
# Failing items listed per case in the summary; the counts are always complete.
_MAX_LISTED = 50


def final_answer(solution: str) -> str:
  """The text after GSM8K's `####` marker (every test item has exactly one, at the end)."""
  return solution.rsplit("####", 1)[1].strip()


def as_decimal(answer: str) -> decimal.Decimal:
  return decimal.Decimal(answer.replace(",", ""))


def reasoning(solution: str) -> str:
  """The solution without its `#### x` line and calculator annotations."""
  return _CALC.sub("", _FINAL.sub("", solution)).rstrip()


def model_style(solution: str) -> str:
  """The solution rewritten as a model would answer: reasoning, then a boxed final answer."""
  return f"{reasoning(solution)}\nThe final answer is \\boxed{{{final_answer(solution)}}}."


def explain(completion: str, answer: str) -> str:
  """A short reason for a miss: what the reward extracted from each side."""
  # The reward's own extraction (a private helper) says whether the miss is in extraction
  # or in comparison; the sweep is a diagnostic, so it may look inside.
  # pylint: disable=protected-access
  try:
    ref = rewards._final_answer(answer, lambda t: t.strip())
    pred = rewards._final_answer(completion, rewards._last_number)
  except Exception as e:  # pylint: disable=broad-except
    return f"extraction raised {type(e).__name__}: {e}"
  return f"pred={pred!r} ref={ref!r}"[:160]


def score_case(indices: list[int], completions: list[str], answers: list[str],
               expected: float, skipped: int = 0) -> dict:
  """Scores one case in a single reward call (as the trainer would) and tallies it."""
  start = time.perf_counter()
  scores = rewards.math_reward(completions, answers)
  wall = time.perf_counter() - start
  misses = [(i, s, c, a) for i, s, c, a in zip(indices, scores, completions, answers)
            if s != expected]
  return {
      "expected": expected,
      "count": len(scores),
      "skipped": skipped,
      "score_1": sum(s == 1.0 for s in scores),
      "score_0": sum(s == 0.0 for s in scores),
      "other": sum(s not in (0.0, 1.0) for s in scores),
      "misses": len(misses),
      "failing": [{"index": i, "score": s, "reason": explain(c, a)}
                  for i, s, c, a in misses[:_MAX_LISTED]],
      "wall_s": round(wall, 3),
      "per_item_ms": round(1000 * wall / max(len(scores), 1), 3),
  }


def run_cases(solutions: list[str], refs: list[str], finals: list[str],
              to_completion: Callable[[str], str], own: bool) -> dict:
  """One case: each item's completion against its own or the next item's reference."""
  n = len(solutions)
  indices, skipped = [], 0
  for i in range(n):
    j = i if own else (i + 1) % n
    if not own and as_decimal(finals[i]) == as_decimal(finals[j]):
      skipped += 1  # the same number is a right answer to both items
      continue
    indices.append(i)
  completions = [to_completion(solutions[i]) for i in indices]
  answers = [refs[i if own else (i + 1) % n] for i in indices]
  return score_case(indices, completions, answers, 1.0 if own else 0.0, skipped)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  ap.add_argument("--path", default="@gsm8k/test.jsonl")
  ap.add_argument("--limit", type=int, default=0, help="first N items only (0 = all)")
  ap.add_argument("--skip_math_verify", action="store_true",
                  help="skip the informational math-verify-only cases (the slow part)")
  args = ap.parse_args()

  start = time.perf_counter()
  rows = data.load_jsonl(args.path)
  if args.limit:
    rows = rows[:args.limit]
  solutions = [r["answer"] for r in rows]
  finals = [final_answer(s) for s in solutions]
  # Import (and warm) math-verify and sympy before timing, so the first case does not pay it.
  rewards.math_reward(["\\boxed{\\frac{1}{2}}"], ["0.5"])

  def verbatim(s: str) -> str:
    return s

  def no_final_line(s: str) -> str:
    return reasoning(s)

  cases = {}
  for ref_name, refs in (("solution", solutions), ("final", finals)):
    cases[ref_name] = {
        "a_own": run_cases(solutions, refs, finals, verbatim, own=True),
        "b_other": run_cases(solutions, refs, finals, verbatim, own=False),
        "c_own": run_cases(solutions, refs, finals, model_style, own=True),
        "c_other": run_cases(solutions, refs, finals, model_style, own=False),
        "d_own_no_final_line": run_cases(solutions, refs, finals, no_final_line, own=True),
    }
  if not args.skip_math_verify:
    fast_path = rewards._as_number  # pylint: disable=protected-access
    rewards._as_number = lambda text: None  # pylint: disable=protected-access
    try:
      cases["final"]["mv_own"] = run_cases(solutions, finals, finals, model_style, own=True)
      cases["final"]["mv_other"] = run_cases(solutions, finals, finals, model_style,
                                             own=False)
    finally:
      rewards._as_number = fast_path  # pylint: disable=protected-access

  wall = time.perf_counter() - start
  scored = sum(c["count"] for by_ref in cases.values() for c in by_ref.values())
  summary = {
      "path": args.path,
      "items": len(rows),
      "derangement": "item i vs item (i + 1) % n",
      "cases": cases,
      "wall_s": round(wall, 2),
      "scored_pairs": scored,
      "per_pair_ms": round(1000 * wall / max(scored, 1), 3),
  }
  print(json.dumps(summary, indent=1))

  def misses(*names: str) -> int:
    return sum(cases[ref][name]["misses"] for ref in cases for name in names)

  if misses("a_own"):
    return 1
  if misses("b_other", "c_own", "c_other"):
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())

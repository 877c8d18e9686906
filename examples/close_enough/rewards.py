"""A reward of your own: right when the sum is within the row's own `tolerance`."""

import jaxgrpo.rewards


@jaxgrpo.rewards.register("close_enough", correctness=True, pred=True)
def close_enough(completions, answers, *, tolerance, **columns):
  out = []
  for completion, answer, tol in zip(completions, answers, tolerance):
    words = completion.split()
    if not words or not words[0].isdigit():
      out.append({"score": 0.0, "pred": None})  # no number: wrong, and no vote
      continue
    error = abs(int(words[0]) - int(answer))
    out.append({"score": float(error <= tol), "pred": int(words[0]), "abs_error": error})
  return out

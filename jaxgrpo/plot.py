"""Draws a run's validation curves into `<workdir>/validation.png` (and the evaluation
command's pass_at_k.png and compare.png: `pass_at_k_figure`, `compare_figure`).

One chart: `accuracy` and every logged `pass@j` against the training step, each with a shaded
+- stderr band where the stderr is finite, plus the early-stop threshold as a dashed line when the
run's config sets one, and with the confidence rule on, the stop metric's lower bound (dotted). It answers "is validation still improving, and how far from stopping?"
at a glance, which the per-metric grid in `plots/val.png` (written by `MetricsWriter.close`) does
not: there every metric has its own small axes and no uncertainty.

It reads only `metrics.jsonl` and `config.json`, so it works on a finished, crashed or still
running workdir, also on a machine without jax:

    python -m jaxgrpo.plot <workdir>
"""

import os
import sys
from typing import Optional, Sequence

from jaxgrpo.eval import plots
from jaxgrpo.runtime import metrics as metrics_lib

USAGE = plots.USAGE


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command; returns the exit status (0 drawn, 2 bad input) instead of raising."""
  args = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help") for a in args):
    print(USAGE)
    return 0

  def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2

  if len(args) != 1 or args[0].startswith("-"):
    return fail(f"expected exactly one argument, the run's workdir; got {args!r} "
                "(usage: python -m jaxgrpo.plot <workdir>)")
  workdir = args[0]
  log = os.path.join(workdir, metrics_lib.JSONL_NAME)
  if not os.path.isdir(workdir):
    return fail(f"{workdir}: no such directory; expected a run's workdir holding "
                f"{metrics_lib.JSONL_NAME}")
  if not os.path.isfile(log):
    return fail(f"{log}: not found; expected the run's metrics log in the workdir")
  try:
    path = plots.validation_plot(workdir)
  except ValueError as e:  # read_metrics names the file and line.
    return fail(str(e).replace("\n", " "))
  except OSError as e:
    return fail(f"{e.filename or workdir}: {e.strerror or e}; expected a readable log and a "
                "writable workdir")
  if path is None:
    return fail(f'{log}: no validation rows; expected at least one line with "split": "val"')
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())

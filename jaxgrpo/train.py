"""python -m jaxgrpo.train --config=configs/math.py [--config.KEY=VALUE ...] [--workdir=DIR]

The phases read top to bottom:
  1. prepare (host only): parse flags, validate the config, load the checkpoint and the data.
     Any bad input ends here with one line on stderr and exit status 2, before compilation.
  2. build (device): mesh, sharded params, the two-profile rollout engine, optimizer, update.
  3. loop: sample with the train profile -> rewards on the host -> GRPO update(s) -> log;
     validate every val_period steps (and at start / end as configured).
  4. finish: final validation, summary.json, plots, one summary line.

The command only: run/setup.py prepares, run/trainer.py runs.
"""

from __future__ import annotations

import os
import sys
import warnings

# Light imports only (no jax): the start-up line is printed before jax loads.
from jaxgrpo import config as config_lib
from jaxgrpo.run import setup as setup_lib


def _one_line_warnings() -> None:
  """jaxgrpo's own warnings as `warning: <message>`, one line (Python's default adds the
  file, line number, category and a line of source); other libraries' keep their format."""
  default, package = warnings.showwarning, os.path.dirname(os.path.abspath(__file__))

  def show(message, category, filename, lineno, file=None, line=None):
    if os.path.abspath(filename).startswith(package + os.sep):
      print(f"warning: {message}", file=file or sys.stderr, flush=True)
    else:
      default(message, category, filename, lineno, file, line)
  warnings.showwarning = show


def main(argv=None) -> int:
  argv = sys.argv if argv is None else argv
  _one_line_warnings()
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(__doc__.strip() + "\n\nFlags:\n  --config=FILE[:ARG]  run config file, e.g. "
          "configs/math.py or configs/math.py:smoke\n  --config.KEY=VALUE   override any "
          "config key (see docs/configuration.md)\n  --workdir=DIR        where the run writes "
          "(default: ./runs/<time>)\n  --coordinator_address=HOST:PORT --num_processes=N "
          "--process_id=I\n                       a multi-process rehearsal on one machine "
          "(a TPU pod needs none)")
    return 0
  try:
    setup = setup_lib.prepare(argv)
  except setup_lib.NothingToTrain as e:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() == 0:
      print(e, flush=True)
    return 0
  except Exception as e:  # pylint: disable=broad-except
    # A flag or config error is answered without importing the data and model modules.
    if not isinstance(e, config_lib.ConfigError):
      from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
      if not isinstance(e, loading.USER_ERRORS):
        raise
    print(f"error: {e}", file=sys.stderr)
    return 2
  from jaxgrpo.runtime import compile_options  # the device side: jax compiles from here on
  from jaxgrpo.run import trainer
  compile_options.enable_cache(setup.config.compilation_cache_dir)
  from jaxgrpo.run import sizing  # pylint: disable=g-import-not-at-top
  try:
    return trainer.run(setup)
  except sizing.FitError as e:  # an 'auto' size with nothing that fits: before any rollout
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())

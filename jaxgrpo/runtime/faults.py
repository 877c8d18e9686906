"""What a run does when something goes wrong: preemption signals and numerical faults.

Preemption (a TPU VM being reclaimed, a scheduler's SIGTERM, Ctrl-C): the first SIGTERM or
SIGINT only sets a flag; the loop finishes the step it is in, saves a checkpoint and exits 0.
A second signal exits at once (status 128 + signal number): orbax writes each checkpoint into
a temporary folder and renames it when complete, so the last finished checkpoint is intact.
While the run is saving a checkpoint or writing its summary (`busy`), a second signal waits
for that to finish instead, saying so, and the process then exits with 128 + signal number
(no traceback: the handlers stay installed until the run returns).

Numerical faults: a non-finite loss or gradient norm ends the run before anything is saved,
since the parameters after that update are already poisoned. The last good checkpoint stays
the newest one, and a resume starts from it.

Test hooks, for the fault tests; each does nothing when unset:
  * JAXGRPO_TEST_NAN_AT_STEP=N makes step N's rewards NaN (so its loss and gradients are NaN);
  * JAXGRPO_TEST_SIGINT_WHILE_BUSY=1 makes the process send itself SIGINT as it starts each
    `busy` section (a second signal during the preemption save, without a timing race);
  * JAXGRPO_TEST_SIGTERM_AT_STEP=N makes the process send itself SIGTERM during step N, so a
    preemption test stops at a known step instead of racing the run to its end (N = 0:
    during start-up, after the step-0 validation, before any checkpoint).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from typing import Mapping

NAN_STEP_ENV = "JAXGRPO_TEST_NAN_AT_STEP"
SIGINT_BUSY_ENV = "JAXGRPO_TEST_SIGINT_WHILE_BUSY"
SIGTERM_STEP_ENV = "JAXGRPO_TEST_SIGTERM_AT_STEP"
WATCHED = ("loss", "grad_norm")


class NumericalFault(RuntimeError):
  """A non-finite training quantity; the message names which, and the step."""


class RewardFault(RuntimeError):
  """Every reward failed on every row for several steps in a row: a broken reward."""


def check_finite(metrics: Mapping[str, float], step: int) -> None:
  bad = {k: metrics[k] for k in WATCHED if k in metrics and not math.isfinite(metrics[k])}
  if bad:
    shown = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise NumericalFault(f"non-finite {shown} at step {step}")


def nan_injection_step() -> int | None:
  value = os.environ.get(NAN_STEP_ENV)
  return int(value) if value else None


def maybe_inject_sigterm(step: int) -> None:
  """Sends this process SIGTERM when `step` is JAXGRPO_TEST_SIGTERM_AT_STEP (a test hook)."""
  value = os.environ.get(SIGTERM_STEP_ENV)
  if value and int(value) == step:
    os.kill(os.getpid(), signal.SIGTERM)


class Preemption:
  """Context manager: SIGTERM / SIGINT request a clean stop; a second one exits at once."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, stream=None):
    self.signum: int | None = None
    self.second: int | None = None  # a second signal that waited for a `busy` section
    self._stream = stream
    self._previous = {}
    self._busy: str | None = None

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name if self.signum else ""

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    stream = self._stream or sys.stderr
    if self.signum is None:
      self.signum = signum
      print(f"received {signal.Signals(signum).name}: finishing this step, then saving a "
            "checkpoint (send it again to exit at once)", file=stream, flush=True)
      return
    if self._busy is not None:
      self.second = signum
      print(f"received {signal.Signals(signum).name} again: {self._busy}, please wait",
            file=stream, flush=True)
      return
    print(f"received {signal.Signals(signum).name}, a second signal: exiting now; the last "
          "finished checkpoint is intact", file=stream, flush=True)
    os._exit(128 + signum)  # pylint: disable=protected-access

  @contextlib.contextmanager
  def busy(self, what: str):
    """A section a second signal must not cut short (`what`: "saving checkpoint 480")."""
    outer, self._busy = self._busy, what
    try:
      if os.environ.get(SIGINT_BUSY_ENV) and self.signum is not None:
        os.kill(os.getpid(), signal.SIGINT)  # test hook: the second signal, now
      yield
    finally:
      self._busy = outer

  @property
  def exit_status(self) -> int | None:
    """128 + the second signal's number, when one waited for a busy section; else None."""
    return None if self.second is None else 128 + self.second

  def __enter__(self) -> "Preemption":
    for sig in self.SIGNALS:
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals to whoever owns them
        pass
    return self

  def __exit__(self, *exc_info) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

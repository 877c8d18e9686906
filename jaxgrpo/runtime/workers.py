"""Worker processes for the user's code: rewards (scorer.py) and environments (envs.py,
episodes.py) run there, each call with a time limit, so that code which raises, hangs or
exits never stops a run.

A call is a pickled task `(fn, args, kwargs)`: `fn` goes by reference (its module and name),
so it must be a module-level function of an importable module or of a user module (the
pool's `startup` task, run once in each worker before its first call, imports
`config.user_modules`). A worker answers ("ok", fn(*args, **kwargs)), ("error", traceback)
or, from the pool, ("timeout", why).
"""

from __future__ import annotations

import collections
from multiprocessing import connection
import os
import pickle
import subprocess
import sys
import time
import traceback


def call(task, catch=Exception):
  """One call: ("ok", value) or ("error", traceback). task: (fn, args, kwargs), or those
  pickled (a worker's payload: unpickling can fail too). A worker catches BaseException as
  well (the user's sys.exit must not end it); the main process does not (Ctrl-C there is
  the user's)."""
  try:
    fn, args, kwargs = pickle.loads(task) if isinstance(task, bytes) else task
    return ("ok", fn(*args, **kwargs))
  except catch:  # pylint: disable=broad-except
    return ("error", traceback.format_exc())


# What a worker says once its start-up task ran (its first message).
READY = ("ready", None)
# How long a worker may take to start (Python, the user's modules) before a call sent to it
# is lost as timed out; its own time limit starts once it is ready.
STARTUP_LIMIT_S = 120.0


def _nothing() -> None:
  """A worker's start-up when there is none to run."""


def worker_main() -> None:
  """A worker process (`python -c ...` by WorkerPool; in argv the file descriptors of its
  two pipes and its start-up task, pickled, in hex): run the start-up task, then answer
  calls until the pipe closes."""
  calls = connection.Connection(int(sys.argv[1]), writable=False)
  answers = connection.Connection(int(sys.argv[2]), readable=False)
  # Its failure is ignored: the main process ran the same (the user's modules imported when
  # the config was checked); a call that needs what failed reports its own error.
  call(bytes.fromhex(sys.argv[3]), BaseException)
  try:  # a call's time limit counts from here, not from the process's start
    answers.send(READY)
  except (EOFError, OSError):
    return
  while True:
    try:
      payload = calls.recv_bytes()
    except (EOFError, OSError):
      return
    result = call(payload, BaseException)
    try:
      answers.send(result)
    except (EOFError, OSError):
      return
    except Exception:  # pylint: disable=broad-except
      answers.send(("error", traceback.format_exc()))  # a value that does not pickle


class WorkerPool:
  """Worker processes that run calls, each call limited to `timeout_s` seconds from
  when its worker starts it; a worker that times out or dies is replaced.

  A worker is a fresh `python -c` process talking over two pipes, not a multiprocessing
  child: it never re-imports the parent's main script (a launcher, a notebook, stdin), and
  a fork of a process that runs jax could deadlock. It sees the parent's sys.path.
  """

  def __init__(self, workers: int, timeout_s: float, startup: tuple | None = None,
               timeout_key: str = "reward_timeout_s", what: str = "reward"):
    """startup: a task (fn, args) each worker runs once, before its first call
    (plugins.import_modules and config.user_modules, for rewards and environments).
    timeout_key, what: the config key and the kind of code named in a failure's line."""
    self.timeout_s = timeout_s
    fn, args = startup if startup is not None else (_nothing, ())
    self._startup = pickle.dumps((fn, tuple(args), {})).hex()
    self.timeout_key, self.what = timeout_key, what
    self._env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(p) for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]))
    self._workers = [self._start() for _ in range(workers)]
    self._ready = [False] * workers  # READY received: the worker's start-up is done

  def _start(self):
    """(process, connection it reads calls from us on, connection we read answers on)."""
    from_parent, to_worker = os.pipe()
    from_worker, to_parent = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from jaxgrpo.runtime import workers; workers.worker_main()",
         str(from_parent), str(to_parent), self._startup],
        pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL, env=self._env)
    os.close(from_parent)
    os.close(to_parent)
    return (proc, connection.Connection(to_worker, readable=False),
            connection.Connection(from_worker, writable=False))

  def _replace(self, w: int) -> None:
    proc, calls, answers = self._workers[w]
    proc.kill()
    proc.wait()
    calls.close()
    answers.close()
    self._workers[w] = self._start()
    self._ready[w] = False

  def run(self, payloads: list[bytes], deadline: float | None = None) -> list[tuple]:
    """Each payload's result, in order: ("ok", values), ("error", traceback) or
    ("timeout", why). deadline (time.monotonic()): no call starts after it; the ones not
    started by then answer ("skipped", why) (a started call keeps its own time limit)."""
    results: list[tuple | None] = [None] * len(payloads)
    queue, idle, busy = collections.deque(range(len(payloads))), collections.deque(
        range(len(self._workers))), {}

    def died(w: int) -> tuple:
      proc = self._workers[w][0]
      proc.kill()
      code = proc.wait()
      self._replace(w)
      return ("error", f"the {self.what}'s worker process died (exit code {code}) during "
                       "the call\n")

    while queue or busy:
      while queue and deadline is not None and time.monotonic() >= deadline:
        results[queue.popleft()] = ("skipped", "not started: the calls' time budget was "
                                               "spent on slower ones\n")
      while idle and queue:
        w, i = idle.popleft(), queue.popleft()
        try:
          self._workers[w][1].send_bytes(payloads[i])
        except OSError:  # it died between calls (at its start: a module it cannot import)
          results[i] = died(w)
          idle.append(w)
          continue
        # A worker still starting reads the call once it is ready: its time starts then.
        busy[w] = (i, time.monotonic(), self._ready[w])
      if not busy:
        continue
      ends = [start + (self.timeout_s if ready else STARTUP_LIMIT_S)
              for _, start, ready in busy.values()]
      answered = connection.wait([self._workers[w][2] for w in busy],
                                 timeout=max(0.0, min(ends) - time.monotonic()))
      for w in list(busy):
        i, start, ready = busy[w]
        limit = self.timeout_s if ready else STARTUP_LIMIT_S
        if self._workers[w][2] in answered:
          try:
            answer = self._workers[w][2].recv()
          except (EOFError, OSError):
            results[i] = died(w)
          else:
            if not ready and answer == READY:
              self._ready[w] = True
              busy[w] = (i, time.monotonic(), True)
              continue
            results[i] = answer
        elif time.monotonic() - start >= limit:
          results[i] = ("timeout", f"the call did not return within {self.timeout_key}="
                                   f"{self.timeout_s:g} s (its worker was replaced)\n" if ready
                        else f"the worker did not start within {STARTUP_LIMIT_S:g} s (its "
                             "start-up imports config.user_modules)\n")
          self._replace(w)
        else:
          continue
        del busy[w]
        idle.append(w)
    return results

  def close(self) -> None:
    for proc, calls, answers in self._workers:
      calls.close()
      answers.close()
      proc.kill()
      proc.wait()
    self._workers = []

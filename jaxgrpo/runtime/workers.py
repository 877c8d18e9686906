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
import gc
import math
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


# How many rows one worker runs side by side when it runs them one by one (fan_out): a slow
# row then costs its own time limit, not the time of the rows queued behind it. Each is a
# forked child that shares the worker's memory until it writes; 16 keeps a CPU-bound
# reward's children from starving each other on a laptop and bounds the copied pages.
FAN_OUT = 16


def fan_out_waves(rows: int, width: int = FAN_OUT) -> int:
  """How many time limits a fan_out of `rows` rows can take at most."""
  return max(1, math.ceil(rows / width))


def fan_out(tasks: list, timeout_s: float, timeout_key: str = "its time limit",
            width: int = FAN_OUT) -> list[tuple]:
  """Runs in a worker: each task (fn, args, kwargs) in a child forked for it, up to `width`
  at once, each limited to timeout_s from its own start. Returns each task's result, in
  order: ("ok", value), ("error", traceback) or ("timeout", why).

  Why fork here: the worker is a plain Python process (no jax, no threads of ours), so a
  fork is safe and cheap (the user's modules are already imported), and a child can be
  killed; threads could not be, and math-verify's time limits (signal.alarm) work only in
  a process's main thread. Without fork (Windows) the tasks run one after another here,
  under the worker's own limit for the whole call."""
  if not hasattr(os, "fork"):
    return [call(t, BaseException) for t in tasks]
  results: list[tuple | None] = [None] * len(tasks)
  queue, running = collections.deque(range(len(tasks))), {}  # reader -> (i, pid, start)
  gc.freeze()  # the children's collections leave the parent's objects unwritten (unshared)
  sys.stdout.flush()
  sys.stderr.flush()  # what is buffered now would otherwise be written by every child too
  while queue or running:
    while queue and len(running) < width:
      i = queue.popleft()
      read_fd, write_fd = os.pipe()
      pid = os.fork()
      if pid == 0:  # the child: one call, its answer, and out without the parent's exit hooks
        os.close(read_fd)
        out = connection.Connection(write_fd, readable=False)
        try:
          result = call(tasks[i], BaseException)
          try:
            out.send(result)
          except Exception:  # pylint: disable=broad-except
            out.send(("error", traceback.format_exc()))  # a value that does not pickle
          sys.stdout.flush()
          sys.stderr.flush()
        finally:
          os._exit(0)  # pylint: disable=protected-access
      os.close(write_fd)
      running[connection.Connection(read_fd, writable=False)] = (i, pid, time.monotonic())
    end = min(start for _, _, start in running.values()) + timeout_s
    ready = connection.wait(list(running), timeout=max(0.0, end - time.monotonic()))
    now = time.monotonic()
    for reader in list(running):
      i, pid, start = running[reader]
      if reader in ready:
        try:
          results[i] = reader.recv()
        except (EOFError, OSError):  # it exited in the call (os._exit, a crash)
          code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
          results[i] = ("error", f"the call's process died (exit code {code}) during the "
                                 "call\n")
          pid = None
      elif now - start >= timeout_s:
        os.kill(pid, 9)
        results[i] = ("timeout", f"the call did not return within {timeout_key}="
                                 f"{timeout_s:g} s (its process was killed)\n")
      else:
        continue
      reader.close()
      if pid is not None:
        os.waitpid(pid, 0)
      del running[reader]
  gc.unfreeze()
  return results


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

  def run(self, payloads: list[bytes], limits: list[float] | None = None) -> list[tuple]:
    """Each payload's result, in order: ("ok", values), ("error", traceback) or
    ("timeout", why). limits: each call's own time limit in seconds (a fan_out's spans its
    waves), else timeout_s."""
    limits = limits or [self.timeout_s] * len(payloads)
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
      ends = [start + (limits[i] if ready else STARTUP_LIMIT_S)
              for i, start, ready in busy.values()]
      answered = connection.wait([self._workers[w][2] for w in busy],
                                 timeout=max(0.0, min(ends) - time.monotonic()))
      for w in list(busy):
        i, start, ready = busy[w]
        limit = limits[i] if ready else STARTUP_LIMIT_S
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
          if not ready:
            why = (f"the worker did not start within {STARTUP_LIMIT_S:g} s (its start-up "
                   "imports config.user_modules)")
          elif limit == self.timeout_s:
            why = f"the call did not return within {self.timeout_key}={limit:g} s"
          else:
            why = f"the call did not return within its limit of {limit:g} s"
          results[i] = ("timeout", why + (" (its worker was replaced)\n" if ready else "\n"))
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

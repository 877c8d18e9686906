"""The user's own code: `config.user_modules`, imported before the config is checked.

A comma-separated list of Python files (`path/to/my_rewards.py`) or importable modules
(`mypkg.rewards`). Importing one runs its `@jaxgrpo.rewards.register(...)` decorators, so
`config.rewards.<name>` may then weight what it registered. Every process of a pod imports the
same list (each validates the config), and so does every reward worker process, where the
rewards run.

Importing is idempotent within a process: a file is imported once, under a module name made
from its absolute path (`_jaxgrpo_user_<stem>_<hash>`), so that a second validation in the
same process (evaluate's two sides, a test) does not register its rewards twice, and a
worker process that imports the same file gets the same name, under which its functions
are sent to the worker.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback


class PluginError(ValueError):
  """A user module that cannot be imported, explained in one line."""


def module_name(path: str) -> str:
  """The module name a file is imported under: the same in every process."""
  path = os.path.abspath(path)
  stem = os.path.splitext(os.path.basename(path))[0]
  digest = hashlib.sha1(path.encode()).hexdigest()[:8]
  return f"_jaxgrpo_user_{''.join(c if c.isalnum() else '_' for c in stem)}_{digest}"


def _is_path(item: str) -> bool:
  return item.endswith(".py") or "/" in item or os.sep in item


def _where(error: BaseException, path: str | None) -> str | None:
  """`file:line` of the error in the user's own code (the innermost frame in `path`, else
  the innermost frame outside the import machinery), for the one-line message."""
  if isinstance(error, SyntaxError) and error.filename:
    return f"{error.filename}:{error.lineno}"
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if "importlib" not in f.filename and f.filename != __file__]
  own = [f for f in frames if path and os.path.abspath(f.filename) == path]
  frame = (own or frames or [None])[-1]
  return f"{frame.filename}:{frame.lineno}" if frame else None


def import_modules(spec: str) -> list[str]:
  """Imports every module of `spec` (comma-separated files or module names); returns the
  module names. Raises PluginError naming the item, the file and line of the error and the
  error itself."""
  names = []
  for item in [s.strip() for s in (spec or "").split(",") if s.strip()]:
    path = os.path.abspath(item) if _is_path(item) else None
    if path is not None and not os.path.isfile(path):
      raise PluginError(f"config.user_modules: {item}: no such file")
    name = module_name(path) if path else item
    try:
      if name not in sys.modules:
        if path is None:
          importlib.import_module(item)
        else:
          spec_ = importlib.util.spec_from_file_location(name, path)
          module = importlib.util.module_from_spec(spec_)
          sys.modules[name] = module
          try:
            spec_.loader.exec_module(module)
          except BaseException:
            del sys.modules[name]  # a fixed file is imported afresh
            raise
    except Exception as e:  # pylint: disable=broad-except
      detail = str(e).splitlines()[0] if str(e) else ""
      where = _where(e, path)
      if where and path and where.startswith(path + ":"):  # in the file itself: item:line
        where, sep = item + where[len(path):], ": "
      else:
        where, sep = f"{item}: {where}" if where else item, ": "
      raise PluginError(f"config.user_modules: {where}{sep}"
                        f"{type(e).__name__}{': ' + detail if detail else ''}") from None
    names.append(name)
  return names

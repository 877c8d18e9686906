"""Test setup: 8 fake CPU devices and LLVM optimisation level 0 (cli.FAST_COMPILE says why),
set before jax is first imported, and one persistent compilation cache for the session
(this process and every CLI subprocess it starts), so a computation compiled by one test is
loaded from disk by the next that needs it."""
import atexit
import os
import shutil
import tempfile

import cli  # tests/cli.py: imports nothing of jax

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cli.xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jaxgrpo-test-jit-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Trackers never reach the network, and never write outside the test's folders: wandb logs
# offline (its files under the workdir), trackio's project files go to a session folder
# (trackio reads TRACKIO_DIR when it is imported).
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if "TRACKIO_DIR" not in os.environ:
  os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="jaxgrpo-test-trackio-")
  atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)


import pytest  # noqa: E402  (after the environment above)


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
  """tests/cli.py's ARGS run once through the CLI, uninterrupted: (workdir, process).

  The smoke test reads its outputs and the fault tests compare interrupted runs with it.
  """
  workdir = tmp_path_factory.mktemp("straight")
  return workdir, cli.run_train(*cli.ARGS, workdir=workdir)


@pytest.fixture
def registry(monkeypatch):
  """A private copy of the reward registry, so a test's rewards leave no trace."""
  from jaxgrpo import rewards  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(rewards, "REGISTRY", dict(rewards.REGISTRY))
  monkeypatch.setattr(rewards, "CORRECTNESS", list(rewards.CORRECTNESS))
  monkeypatch.setattr(rewards, "PREDS", set(rewards.PREDS))
  return rewards.REGISTRY

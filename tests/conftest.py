"""Test setup: 8 fake CPU devices and LLVM optimisation level 0 (cli.FAST_COMPILE says why),
set before jax is first imported, and one persistent compilation cache for the session
(this process and every CLI subprocess it starts), so a computation compiled by one test is
loaded from disk by the next that needs it."""
import atexit
import fcntl
import os
import pickle
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

from jaxgrpo.run import setup as _setup  # noqa: E402

# Every subsystem's config checks (runtime/config_checks.py), as each command registers them:
# tests call config.validate directly.
_setup.register_checks()


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
  """tests/cli.py's STRAIGHT run once through the CLI, uninterrupted: (workdir, process).

  The smoke test reads its outputs and the fault tests compare interrupted runs with it.
  Once per session, not per xdist worker: the first worker that needs it runs it in the
  session's base folder (the workers' folders' parent), under a lock, and the others read
  it (tests copy the run before changing anything).
  """
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # pytest-<N>: this session's, shared by its workers
  workdir, done = base / "straight", base / "straight.pickle"
  with open(base / "straight.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      done.write_bytes(pickle.dumps(cli.run_train(*cli.STRAIGHT, workdir=workdir)))
    return workdir, pickle.loads(done.read_bytes())


@pytest.fixture
def registry(monkeypatch):
  """A private copy of the reward registry, so a test's rewards leave no trace."""
  from jaxgrpo import rewards  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(rewards, "REGISTRY", dict(rewards.REGISTRY))
  monkeypatch.setattr(rewards, "CORRECTNESS", list(rewards.CORRECTNESS))
  monkeypatch.setattr(rewards, "PREDS", set(rewards.PREDS))
  return rewards.REGISTRY


# The files that take longest, in seconds of test time (`python -m pytest --durations=0` on
# 2 cores, 2026-12-06), run first. pytest-xdist hands whole files (--dist loadfile) to
# whichever worker is free, in this order (pyproject.toml turns off its own reordering, by
# test count), so the long ones do not start last and leave one core idle at the end:
# longest first is the classic greedy schedule. Files not listed follow in their own order.
SLOWEST_FILES = {
    "test_train.py": 220, "test_faults.py": 185, "test_compile_check.py": 170,
    "test_bench.py": 82, "test_episodes.py": 82, "test_evaluate.py": 75,
    "test_trainer.py": 69, "test_partial_rollouts.py": 55, "test_microbatch.py": 47,
    "test_multihost.py": 47,
    "test_grpo.py": 46, "test_model.py": 41, "test_sharding.py": 34, "test_decode.py": 29,
    "test_sizing.py": 28, "test_lora.py": 27, "test_compile_options.py": 27,
    "test_compaction.py": 26, "test_sampling.py": 22, "test_checkpoint.py": 21,
}


def pytest_collection_modifyitems(items):
  first = {}
  for i, item in enumerate(items):
    first.setdefault(item.path.name, i)
  items.sort(key=lambda item: (-SLOWEST_FILES.get(item.path.name, 0), first[item.path.name]))

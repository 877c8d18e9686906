"""Checkpoints on orbax's CheckpointManager: `<workdir>/checkpoints/<step>/`.

A checkpoint holds everything an exact resume needs:
- `state`: the train state (step, params, optimizer state), restored straight onto the mesh;
- `meta` (JSON): the step, why it was written, the grain data iterator's state, the run seed
  and the model architecture (checked against the config before any compilation).
The rollout PRNG needs no state of its own: the key of step s is fold_in(seed, s), so a
resumed run draws exactly what the uninterrupted run would have drawn.

Saves are asynchronous (training goes on while orbax writes) and atomic: orbax writes into a
temporary folder and renames it when complete, so a run killed mid-save leaves the earlier
checkpoints intact. `close()` waits for pending writes.

Retention: the newest `max_to_keep`, plus, when a `best_metric` is set, the `best_to_keep`
checkpoints with the highest value of that validation metric (saved at validation steps with
the metric attached). A checkpoint is deleted only when neither rule keeps it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

from absl import logging
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

DIR_NAME = "checkpoints"


def step_dirs(directory: str) -> list[int]:
  """Steps with a finished checkpoint folder under `directory`, oldest first (host only)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def locate(path: str) -> tuple[str, int | None]:
  """A resume path as (checkpoints folder, step): `.../checkpoints/<step>` names one step,
  `.../checkpoints` or a workdir holding one means its newest intact checkpoint (None)."""
  path = os.path.abspath(path.rstrip("/"))
  name = os.path.basename(path)
  if name.isdigit() and os.path.isdir(path):
    return os.path.dirname(path), int(name)
  if os.path.isdir(os.path.join(path, DIR_NAME)):
    return os.path.join(path, DIR_NAME), None
  return path, None


def set_aside_after(directory: str, step: int) -> list[str]:
  """Moves checkpoints newer than `step` (a resume from an older one will write those steps
  again) to `<directory>.set_aside/<step>-<n>`: nothing saved is ever deleted here."""
  moved = []
  for later in [s for s in step_dirs(directory) if s > step]:
    n = 0
    while os.path.exists(target := os.path.join(f"{directory}.set_aside", f"{later}-{n}")):
      n += 1
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(os.path.join(directory, str(later)), target)
    warnings.warn(f"resuming from step {step}: moved the newer checkpoint "
                  f"{os.path.join(directory, str(later))} to {target}", stacklevel=2)
    moved.append(target)
  return moved


@contextlib.contextmanager
def _quiet_absl():
  """absl logging at ERROR inside the block (orbax's expected-case warnings)."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    yield
  finally:
    logging.set_verbosity(verbosity)


def read_meta(directory: str, step: int) -> dict[str, Any]:
  """The JSON part of checkpoint `step`, read on the host (no device work)."""
  with _quiet_absl():  # orbax logs a warning per read-only manager
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    manager = ocp.CheckpointManager(directory, options=options, item_names=("meta",))
  try:
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  finally:
    manager.close()


class Checkpoints:
  """The run's checkpoint folder: save (async), list, restore with fallback."""

  def __init__(self, directory: str, *, max_to_keep: int | None = None,
               best_metric: str | None = None, best_to_keep: int = 1,
               read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.best_metric = best_metric
    keep = [policies.LatestN(n=max_to_keep or None)]  # None keeps all
    if best_metric:
      keep.append(policies.BestN(get_metric_fn=lambda m: m[best_metric], n=best_to_keep,
                                 keep_checkpoints_without_metrics=False))
    if read_only:  # another run's folder, resumed from: never written or pruned
      with _quiet_absl():  # orbax warns that it is read-only, as asked
        options = ocp.CheckpointManagerOptions(read_only=True, create=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
    else:
      options = ocp.CheckpointManagerOptions(
          create=True, enable_async_checkpointing=True, cleanup_tmp_directories=True,
          preservation_policy=policies.AnyPreservationPolicy(keep))
      self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state: Any, meta: dict[str, Any],
           metrics: dict[str, float] | None = None, carry: Any = None) -> str:
    """Starts writing checkpoint `step`; returns its path. `metrics` (validation values)
    rank it for the best-checkpoint rule. carry: the rollouts a run carries between steps
    (partial rollouts: run/partial_rollouts.py), saved as a third item."""
    if self.best_metric and not (metrics and self.best_metric in metrics):
      metrics = None  # without the metric it competes only as one of the latest
    items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta)))
    if carry is not None:
      items["carry"] = ocp.args.StandardSave(carry)
    self._manager.save(int(step), args=ocp.args.Composite(**items), metrics=metrics,
                       force=True)
    return self.path(step)

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(int(step)))

  def steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, step: int, like: Any = None,
              carry_like: Any = None) -> tuple[Any, dict[str, Any]]:
    """Checkpoint `step` as (state shaped and sharded like `like`, meta). Without `like`,
    the state comes back as orbax stored it (nested dicts of arrays on one device).
    carry_like: also restore the carried rollouts (`save`'s carry), if it holds them, into
    meta["carry"]."""
    abstract = None if like is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    items = dict(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
    if not os.path.isdir(os.path.join(self.path(step), "carry")):
      carry_like = None  # a synchronous run's checkpoint: nothing carried
    if carry_like is not None:
      items["carry"] = ocp.args.StandardRestore(carry_like)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(**items))
    meta = restored.meta
    if carry_like is not None:
      meta = dict(meta, carry=restored.carry)
    return restored.state, meta

  def restore_params(self, step: int, like: Any) -> Any:
    """Only the parameters of checkpoint `step`, shaped and sharded like `like` (abstract
    arrays are enough): an evaluation never reads the optimizer's moments, twice as large."""
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            item={"params": like}, partial_restore=True,
            restore_args={"params": ocp.checkpoint_utils.construct_restore_args(like)})))
    return restored.state["params"]

  def restore_latest(self, like: Any, at_most: int | None = None, carry_like: Any = None):
    """(step, state, meta) of the newest checkpoint that restores, newest first, or None.

    A checkpoint that fails to restore (a truncated folder, a torn file) is skipped with a
    warning naming it and the one used instead; it is never deleted.
    """
    steps = [s for s in sorted(self.steps(), reverse=True) if at_most is None or s <= at_most]
    broken = []
    for step in steps:
      try:
        state, meta = self.restore(step, like, carry_like)
      except Exception as e:  # pylint: disable=broad-except
        broken.append((step, e))
        continue
      for bad, error in broken:
        # The library's own text (orbax's item lists, tensorstore's source locations) says
        # nothing a user can act on: the error's type is kept, for a bug report.
        warnings.warn(f"checkpoint {self.path(bad)} is unreadable (a missing or damaged "
                      f"file: {type(error).__name__}); resuming from {self.path(step)}",
                      stacklevel=2)
      return step, state, meta
    if broken:
      raise RuntimeError(f"no checkpoint under {self.directory} restores: "
                         + "; ".join(f"{s}: {type(e).__name__}" for s, e in broken))
    return None

  def reload(self) -> None:
    """Re-reads the folder (after checkpoints were moved out of it)."""
    self._manager.reload()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

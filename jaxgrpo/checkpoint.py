"""Checkpoints on orbax's CheckpointManager: `<workdir>/checkpoints/<step>/`.

A checkpoint holds the train state (step, params, optimizer state) and a JSON item with the
data iterator's state and why it was written, under its step number, so nothing about it is
guessed later. Saves are asynchronous: training continues while orbax writes, and `close()`
waits, so a run never exits with half a checkpoint. Resume, periodic saves, best-by-metric
retention and preemption build on this (issue 5).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

DIR_NAME = "checkpoints"


class Checkpoints:
  """The run's checkpoint folder: save, list, restore."""

  def __init__(self, workdir: str):
    self.directory = os.path.abspath(os.path.join(workdir, DIR_NAME))
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=True))

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> str:
    """Starts writing checkpoint `step` (train state + JSON `meta`); returns its path."""
    self._manager.save(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))), force=True)
    return os.path.join(self.directory, str(int(step)))

  def steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, step: int, like: Any = None) -> tuple[Any, dict[str, Any]]:
    """Checkpoint `step` as (state shaped and sharded like `like`, meta). Without `like`,
    the state comes back as orbax stored it (nested dicts of arrays on one device)."""
    abstract = None if like is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def close(self) -> None:
    """Waits for pending saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

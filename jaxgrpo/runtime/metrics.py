"""Metrics output: a JSONL log, TensorBoard scalars, console progress and plots.

One `MetricsWriter` per run. Each `write(step, split, metrics)` call

- appends one strict-JSON line to `<workdir>/metrics.jsonl` and flushes it, so a crashed or
  preempted run keeps everything it logged. Non-finite values (NaN, +-inf) are written as `null`
  because strict JSON has no spelling for them; `read_metrics` turns them back into NaN.
- hands the same row to the run's trackers (trackers.py: TensorBoard under `<workdir>/tb/<split>/`
  by default, wandb, trackio), with the same names and step.
- prints progress: a redrawn one-line bar for train writes on a TTY, one plain line per write
  otherwise (log files must not fill with carriage returns); val writes print a full line.

`images(step, split, paths)` logs PNGs (each validation's plots) to the trackers. `close()` writes
`<workdir>/summary.json` (also the trackers' run summary) and one PNG per split under
`<workdir>/plots/`.

This module is host-side only: values may be python numbers, numpy scalars or jax scalars, all
read through `float()`/`int()`, so it never imports jax. On a pod only process 0 should write;
pass `is_primary=jax.process_index() == 0` and the other hosts' writers do nothing at all.
"""

import json
import math
import numbers
import os
import sys
import time
import warnings
from typing import Any, Mapping, Optional, Sequence, TextIO

from jaxgrpo.runtime import trackers as trackers_lib

JSONL_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
# Shown on the train progress line when present, in this order; the rest live in the logs.
# Only the modes that log them show them: turns_mean and tool_calls_mean multi-turn
# episodes, padding_fraction_packed the packed update (grpo.micro_batch_tokens),
# rollout/live_fraction and staleness_mean partial rollouts (long responses' two levers).
KEY_METRICS = ("reward_mean", "accuracy", "turns_mean", "tool_calls_mean",
               "padding_fraction_packed", "rollout/live_fraction", "staleness_mean",
               "rollout_tokens_per_s", "loss")
_RESERVED = ("step", "split", "time")


def _to_number(value: Any) -> float | int:
  """Python int for integer-like values (bools, numpy/jax ints), python float otherwise."""
  if isinstance(value, numbers.Integral):
    return int(value)
  if getattr(getattr(value, "dtype", None), "kind", None) in ("b", "i", "u"):
    return int(value)
  return float(value)


def json_safe(value: Any) -> Any:
  """Recursively replaces non-finite floats with None so `allow_nan=False` dumps succeed."""
  if isinstance(value, Mapping):
    return {str(k): json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(v) for v in value]
  if isinstance(value, (str, bool)) or value is None:
    return value
  try:
    number = _to_number(value)
  except (TypeError, ValueError):
    return str(value)
  return number if math.isfinite(number) else None


def _fmt(value: float | int) -> str:
  """Four significant digits, but throughputs like 12345 stay readable instead of 1.235e+04."""
  if isinstance(value, int):
    return str(value)
  if math.isfinite(value) and 1e4 <= abs(value) < 1e7:
    return f"{value:.0f}"
  return f"{value:.4g}"


def _fmt_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def write_jsonl(path: str, records: Sequence[dict[str, Any]]) -> None:
  """One JSON object per line, written whole (a reader never sees half a file)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path + ".tmp", "w") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
  os.replace(path + ".tmp", path)


def read_metrics(path: str) -> list[dict[str, Any]]:
  """Reads a metrics log written by `MetricsWriter`.

  Args:
    path: the `metrics.jsonl` file, or the workdir that holds it.

  Returns:
    One dict per line, in file order; metric values of `null` come back as NaN. A torn final
    line (the process died mid-write) is skipped; a bad line elsewhere raises ValueError.
  """
  if os.path.isdir(path):
    path = os.path.join(path, JSONL_NAME)
  with open(path) as f:
    lines = [line for line in f.read().split("\n") if line.strip()]
  records = []
  for i, line in enumerate(lines):
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path}:{i + 1}: not a JSON line: {e}") from e
    records.append({k: (math.nan if v is None and k not in _RESERVED else v)
                    for k, v in record.items()})
  return records


def logged_validations(workdir: str) -> dict[int, dict[str, Any]]:
  """step -> the validation row logged for it in `workdir`'s metrics.jsonl (a later row for
  a step wins); {} without the file."""
  path = os.path.join(workdir, JSONL_NAME)
  rows = read_metrics(path) if os.path.exists(path) else []
  return {r["step"]: r for r in rows if r["split"] == "val"}


def read_summary(workdir: str) -> dict[str, Any] | None:
  """`workdir`'s summary.json, or None when it is missing or unreadable (a process killed
  before writing it, or mid-write)."""
  try:
    with open(os.path.join(workdir, SUMMARY_NAME)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def truncate_jsonl(path: str, step: int) -> int:
  """Keeps the lines of a step-keyed JSONL log with "step" <= `step` (a torn last line goes
  too); rewritten atomically. Returns how many lines were dropped. A missing file is fine."""
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = [line for line in f.read().split("\n") if line.strip()]
  kept = []
  for line in lines:
    try:
      if json.loads(line)["step"] <= step:
        kept.append(line)
    except (json.JSONDecodeError, KeyError, TypeError):
      pass  # a torn line from a killed writer
  with open(path + ".tmp", "w") as f:
    f.writelines(line + "\n" for line in kept)
  os.replace(path + ".tmp", path)
  return len(lines) - len(kept)


def latest_per_step(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
  """Groups records by split and step, step-sorted; a later line for a step replaces an earlier
  one, so a run resumed from an older checkpoint does not plot the abandoned steps twice."""
  by_split: dict[str, dict[int, dict[str, Any]]] = {}
  for record in records:
    by_split.setdefault(record["split"], {})[record["step"]] = record
  return {split: dict(sorted(steps.items())) for split, steps in by_split.items()}


class MetricsWriter:
  """Writes metrics to JSONL, TensorBoard and the console; summary and plots on close.

  Usable as a context manager: leaving the block calls `close()`, also on an exception, so a
  failed run still leaves its summary and plots.
  """

  def __init__(self, workdir: str, *, trackers: Sequence[str] = ("tensorboard",),
               plots: bool = True, console: bool = True, total_steps: Optional[int] = None,
               stream: Optional[TextIO] = None, is_primary: bool = True,
               resumed_step: Optional[int] = None, project: str = "jaxgrpo",
               run_name: str = "", tags: Sequence[str] = (),
               config: Optional[Mapping[str, Any]] = None):
    """Creates the writer; on the primary host, creates `workdir` and opens the log.

    Args:
      workdir: run directory; the log is appended to, so a resumed run continues one file.
      trackers: names among trackers.NAMES (tensorboard: event files under
        `workdir/tb/<split>`); () writes metrics.jsonl only.
      plots: write `workdir/plots/<split>.png` on close.
      console: print progress and the final summary line to `stream`.
      total_steps: the step count the run aims for, for the progress fraction and ETA.
      stream: console stream; None means `sys.stderr` at construction time (read late so that
        test harnesses that swap sys.stderr are honoured).
      is_primary: False on every host but process 0 of a pod: then nothing is written anywhere.
      resumed_step: the step a resumed run continues from. Rows logged after it by the
        interrupted run (steps it will redo) are dropped from `metrics.jsonl` first, and
        TensorBoard purges its events after it, so no step appears twice. -1: a fresh start
        over an interrupted start's logs (every row goes).
      project, run_name, tags, config: the tracker run's project, name (default: the
        workdir's name), tags and config (the resolved run config).
    """
    self.workdir = workdir
    self.total_steps = total_steps
    self.is_primary = is_primary
    self._plots = plots
    self._stream = (stream if stream is not None else sys.stderr) if console else None
    self._tty = bool(self._stream is not None and getattr(self._stream, "isatty", None)
                     and self._stream.isatty())
    self._bar_drawn = False
    self._start_time = time.time()
    self._first_train: Optional[tuple[int, float]] = None  # (step, time) for the ETA rate.
    self._last_train_step: Optional[int] = None
    self._closed = False
    self._jsonl = None
    self._trackers = None
    if is_primary:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, JSONL_NAME)
      logged, history = {}, []
      if resumed_step is not None and os.path.exists(path):
        # What the interrupted run logged (a continued tracker run holds these rows), then
        # what this run keeps (a tracker run that starts now gets these first).
        for record in read_metrics(path):
          logged[record["split"]] = max(logged.get(record["split"], -1), record["step"])
        truncate_jsonl(path, resumed_step)
        history = read_metrics(path) if resumed_step >= 0 else []
      self._jsonl = open(path, "a")
      self._trackers = trackers_lib.Trackers(
          trackers, workdir, project=project, run_name=run_name, tags=tags,
          config=json_safe(config or {}), resumed_step=resumed_step, logged=logged,
          history=history, stream=self._stream)

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def write(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
    """Logs one set of scalars for `split` ("train", "val", ...) at `step`."""
    if self._closed:
      raise RuntimeError("MetricsWriter.write called after close()")
    clash = [k for k in metrics if k in _RESERVED]
    if clash:
      raise ValueError(f"metric names {clash} clash with the record keys {_RESERVED}")
    if not self.is_primary:
      return
    step = int(step)
    values = {str(k): _to_number(v) for k, v in metrics.items()}
    now = time.time()
    record = {"step": step, "split": split, "time": now, **values}
    self._jsonl.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
    self._jsonl.flush()
    self._trackers.log(step, split, values)
    if split == "train":
      self._last_train_step = step
      if self._first_train is None:
        self._first_train = (step, now)
    if self._stream is not None:
      self._print(step, split, values, now)

  def images(self, step: int, split: str, paths: Mapping[str, str]) -> None:
    """Logs PNG files ({name: path}) as images of `split` at `step` to the trackers."""
    if self.is_primary and not self._closed:
      self._trackers.images(int(step), split, paths)

  def close(self, summary: Optional[Mapping[str, Any]] = None) -> None:
    """Flushes everything, writes `summary.json` and plots, prints one summary line.

    Args:
      summary: extra top-level entries for `summary.json` (for example why the run stopped);
        they override the computed ones of the same name.
    """
    if self._closed:
      return
    self._closed = True
    if not self.is_primary:
      return
    self._jsonl.close()
    by_split = latest_per_step(read_metrics(self.workdir))
    result = self._summarize(by_split)
    result.update(summary or {})
    self._trackers.summary(json_safe(result))
    self._trackers.close()
    if self._trackers.errors:
      result["tracker_errors"] = dict(self._trackers.errors)
    with open(os.path.join(self.workdir, SUMMARY_NAME), "w") as f:
      json.dump(json_safe(result), f, indent=2, allow_nan=False)
      f.write("\n")
    if self._plots:
      try:
        _plot(by_split, os.path.join(self.workdir, "plots"))
      except Exception as e:  # pylint: disable=broad-except
        # A plotting failure (fonts, disk, odd values) must never cost a finished run its exit.
        warnings.warn(f"metrics: writing plots failed: {e!r}")
    if self._stream is not None:
      self._emit(self._summary_line(result, by_split), redraw=False)

  def _summarize(self, by_split: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    last: dict[str, dict[str, Any]] = {}
    for split, steps in by_split.items():
      last[split] = {}
      for record in steps.values():  # Step order: later steps overwrite earlier values.
        last[split].update({k: v for k, v in record.items() if k not in _RESERVED})
    train_steps = by_split.get("train", {})
    result = {
        "steps": max(train_steps) if train_steps else self._last_train_step,
        "total_steps": self.total_steps,
        "wall_time_s": time.time() - self._start_time,
        "last_step": {split: max(steps) for split, steps in by_split.items() if steps},
        "last": last,
    }
    accuracies = [(r["accuracy"], s) for s, r in by_split.get("val", {}).items()
                  if isinstance(r.get("accuracy"), (int, float)) and math.isfinite(r["accuracy"])]
    if accuracies:
      # Highest accuracy; among ties the earliest step, the cheaper checkpoint to keep.
      best, best_step = max(accuracies, key=lambda a: (a[0], -a[1]))
      result["best_val_accuracy"], result["best_val_step"] = best, best_step
    return result

  def _print(self, step: int, split: str, values: dict[str, Any], now: float) -> None:
    if split != "train":
      shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
      self._emit(f"{split} step {step}: {shown}", redraw=False)
      return
    total = self.total_steps
    elapsed = _fmt_duration(now - self._start_time)
    eta = "?"
    first_step, first_time = self._first_train
    # The rate starts after the first train write, so compile time does not inflate the ETA.
    if total is not None and step > first_step:
      eta = _fmt_duration((now - first_time) / (step - first_step) * max(total - step, 0))
    shown = _key_metrics(values)
    if self._tty and total:
      done = min(max(step / total, 0.0), 1.0)
      bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
      line = f"{step}/{total} [{bar}] {done:4.0%} {elapsed}<{eta} {shown}"
    elif total:
      line = f"step {step}/{total} ({step / total:.0%}) | {elapsed} elapsed, ETA {eta} | {shown}"
    else:
      line = f"step {step} | {elapsed} elapsed | {shown}"
    self._emit(line.rstrip(" |"), redraw=self._tty)

  def _emit(self, line: str, redraw: bool) -> None:
    """Prints a line; on a TTY, `redraw` lines replace each other in place."""
    if self._tty:
      # "\r\x1b[K" clears the bar before whatever is drawn next, so lines never interleave.
      prefix = "\r\x1b[K" if self._bar_drawn else ""
      self._stream.write(prefix + line + ("" if redraw else "\n"))
      self._bar_drawn = redraw
    else:
      self._stream.write(line + "\n")
    self._stream.flush()

  def _summary_line(self, result: Mapping[str, Any],
                    by_split: dict[str, dict[int, dict[str, Any]]]) -> str:
    # A resumed process trained only the steps after its checkpoint (trainer.run's summary).
    trained = result.get("steps_this_run", result["steps"])
    parts = [f"done: {trained} steps in {_fmt_duration(result['wall_time_s'])}"]
    if result.get("resumed_step") is not None:
      parts[0] += f" (resumed from step {result['resumed_step']})"
    # The last step's own numbers: a step without an update (no row scored) has no loss,
    # and the previous step's is not this one's.
    train_steps = by_split.get("train", {})
    shown = _key_metrics(train_steps[max(train_steps)]) if train_steps else ""
    if shown:
      parts.append(f"train {shown}")
    if "best_val_accuracy" in result:
      parts.append(f"best val accuracy={_fmt(result['best_val_accuracy'])}"
                   f" @ step {result['best_val_step']}")
    return " | ".join(parts)


def _key_metrics(values: Mapping[str, Any]) -> str:
  """KEY_METRICS of one train row, as the progress and final lines show them; a step whose
  every row went unscored says so where its reward and accuracy would be."""
  shown = " ".join(f"{k}={_fmt(values[k])}" for k in KEY_METRICS if k in values)
  if values.get("reward_unscored_fraction") == 1.0:
    shown = f"(no row scored) {shown}".rstrip()
  return shown


def _plot(by_split: dict[str, dict[int, dict[str, Any]]], plot_dir: str) -> None:
  """One PNG per split, a grid of small line charts with one chart per metric."""
  # The object API with an explicit Agg canvas never touches pyplot's global backend, so no
  # display is ever opened and a caller's own pyplot state is left alone.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  os.makedirs(plot_dir, exist_ok=True)
  for split, steps in by_split.items():
    names = list(dict.fromkeys(k for r in steps.values() for k in r if k not in _RESERVED))
    if not names:
      continue
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(3.2 * cols, 2.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, name in enumerate(names):
      ax = fig.add_subplot(rows, cols, i + 1)
      points = [(s, r[name]) for s, r in steps.items()
                if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
      if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="." if len(points) < 30 else None, linewidth=1)
      ax.set_title(name, fontsize=9)
      ax.tick_params(labelsize=7)
      ax.grid(alpha=0.3)
    fig.suptitle(split, fontsize=10)
    fig.savefig(os.path.join(plot_dir, f"{split}.png"), dpi=100)

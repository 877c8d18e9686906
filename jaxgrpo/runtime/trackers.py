"""Experiment trackers: where a run's metrics go beside metrics.jsonl.

`config.logging.trackers` names them, comma-separated: `tensorboard` (event files under
`<workdir>/tb/<split>`, the default), `wandb` (Weights & Biases) and `trackio` (a local-first
tracker: a SQLite file per project, no account). `metrics.MetricsWriter` hands every row it
writes to metrics.jsonl to every tracker, with the same names and step (a tracker that
groups by split sees `train/loss`, `val/accuracy`, `val/pass@8/gsm8k`); the resolved config
is the tracker run's config, summary.json its summary, and each validation's plots are
logged as images.

Resume. A resumed run continues the same tracker run: its id (wandb) or name (trackio) is
kept in `<workdir>/trackers.json`. The steps the interrupted run logged after the
checkpoint are redone; TensorBoard purges its events after the checkpoint, and wandb and
trackio, which cannot take back a logged row, skip the rows they already hold (jaxgrpo's
resume is exact, so those rows are the redone ones, timings aside). A tracker added on
resume gets metrics.jsonl's earlier rows first, so its curve starts at step 0.

Failure. Training never stops for logging: a tracker that raises (network, quota, disk)
prints one warning line, the first time, and keeps being tried (its client may recover);
the count of failed calls goes into summary.json (`tracker_errors`). Only the tracker's own
package decides whether it needs an account: wandb in offline mode (WANDB_MODE=offline)
writes its files under `<workdir>/wandb` and needs none.

Process 0 alone makes trackers (MetricsWriter's is_primary). Host-side only: no jax.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import urlparse

from jaxgrpo.runtime import config_checks

NAMES = ("tensorboard", "wandb", "trackio")
# The package each tracker imports and the extra that installs it (tensorboard is a core
# dependency: tensorboardX writes the events, the `tensorboard` command reads them).
_PACKAGES = {"tensorboard": ("tensorboardX", None), "wandb": ("wandb", "wandb"),
             "trackio": ("trackio", "trackio")}
STATE_NAME = "trackers.json"


class TrackerError(ValueError):
  """A tracker that cannot start: one line naming the key and what is allowed."""


def parse(text: str, key: str = "config.logging.trackers") -> tuple[str, ...]:
  """'tensorboard, wandb' -> ('tensorboard', 'wandb'); '' -> () (metrics.jsonl only)."""
  names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
  unknown = [n for n in names if n not in NAMES]
  if unknown:
    raise TrackerError(f"{key}={text!r}: unknown tracker {unknown[0]!r}; allowed: a "
                       f"comma-separated list among {', '.join(NAMES)}, or '' for none")
  return names


def check_available(names: Sequence[str], key: str = "config.logging.trackers") -> None:
  """Each named tracker's package is installed (and wandb has an account or runs offline);
  else one line naming the extra. Looks the packages up without importing them."""
  for name in names:
    package, extra = _PACKAGES[name]
    if importlib.util.find_spec(package) is None:
      raise TrackerError(f"{key}: {name} is not installed; allowed: pip install -e "
                         f"'.[{extra}]' (or pip install {package}), or leave {name} out")
  if "wandb" in names and not _wandb_can_log():
    raise TrackerError(
        f"{key}: wandb has no API key (WANDB_API_KEY, or `wandb login`); allowed: log in, "
        "or WANDB_MODE=offline (files under <workdir>/wandb; `wandb sync` uploads them)")


def _wandb_can_log() -> bool:
  """An offline or disabled wandb, or an API key where wandb looks for one (the
  environment, or ~/.netrc as `wandb login` writes it)."""
  if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
    return True
  if os.environ.get("WANDB_API_KEY"):
    return True
  host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
  try:
    return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
  except (OSError, netrc.NetrcParseError):
    return False


def read_state(workdir: str) -> dict[str, Any]:
  """trackers.json: each tracker's run identity, {} without one."""
  try:
    with open(os.path.join(workdir, STATE_NAME)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _write_state(workdir: str, state: Mapping[str, Any]) -> None:
  path = os.path.join(workdir, STATE_NAME)
  with open(path + ".tmp", "w") as f:
    json.dump(state, f, indent=2)
  os.replace(path + ".tmp", path)


class TensorBoard:
  """Scalars and images under `<workdir>/tb/<split>` (one TensorBoard run per split, so
  train and val curves of a metric overlay in one chart)."""

  name = "tensorboard"

  def __init__(self, workdir: str, purge_step: int | None = None, **_):
    self.workdir, self.purge_step = workdir, purge_step
    self.writers: dict[str, Any] = {}

  def writer(self, split: str):
    if split not in self.writers:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      # The suffix keeps a resumed process that starts within the same second from
      # overwriting the first one's file (the names hold whole seconds), in file order.
      self.writers[split] = SummaryWriter(os.path.join(self.workdir, "tb", split),
                                          purge_step=self.purge_step,
                                          filename_suffix=f".{time.time_ns()}")
    return self.writers[split]

  def log(self, step: int, split: str, values: Mapping[str, float]) -> None:
    writer = self.writer(split)
    for name, value in values.items():  # NaN/inf pass through: a NaN loss is worth seeing
      writer.add_scalar(name, value, step)

  def images(self, step: int, split: str, paths: Mapping[str, str]) -> None:
    from matplotlib import image  # pylint: disable=g-import-not-at-top
    for name, path in paths.items():
      pixels = image.imread(path)[..., :3]  # float RGB(A) in [0, 1] from a PNG
      self.writer(split).add_image(name, (pixels * 255).astype("uint8"), step,
                                   dataformats="HWC")

  def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    lines = [" | ".join(columns), " | ".join("---" for _ in columns)]
    lines += [" | ".join(str(v) for v in row) for row in rows]
    self.writer("eval").add_text(name, "\n".join(lines), 0)

  def summary(self, values: Mapping[str, Any]) -> None:
    del values  # TensorBoard has no run summary; summary.json is beside the events

  def close(self) -> None:
    for writer in self.writers.values():
      writer.close()


class Wandb:
  """A Weights & Biases run in `project`; x-axis `step` (the run's step, not wandb's own
  counter, so train rows, val rows and a resumed run's rows line up)."""

  name = "wandb"

  def __init__(self, workdir: str, project: str, run_name: str, tags: Sequence[str],
               config: Mapping[str, Any], run_id: str | None, **_):
    import wandb  # pylint: disable=g-import-not-at-top
    self.wandb = wandb
    self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow",
                          dir=workdir, config=dict(config), tags=list(tags) or None)
    self.id = self.run.id  # wandb's own when new; kept in trackers.json for a resume
    self.run.define_metric("step")
    self.run.define_metric("*", step_metric="step")

  def log(self, step: int, split: str, values: Mapping[str, float]) -> None:
    self.run.log({"step": step, **{f"{split}/{k}": v for k, v in values.items()}})

  def images(self, step: int, split: str, paths: Mapping[str, str]) -> None:
    self.run.log({"step": step, **{f"{split}/{k}": self.wandb.Image(p)
                                   for k, p in paths.items()}})

  def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    self.run.log({name: self.wandb.Table(columns=list(columns),
                                         data=[list(r) for r in rows])})

  def summary(self, values: Mapping[str, Any]) -> None:
    self.run.summary.update(dict(values))

  def close(self) -> None:
    self.run.finish()


class Trackio:
  """A trackio run (a row per step in the project's SQLite file, under $TRACKIO_DIR or
  ~/.cache/huggingface/trackio; `trackio show` draws it). Keyed by its name: a resumed
  jaxgrpo run continues it."""

  name = "trackio"

  def __init__(self, project: str, run_name: str, config: Mapping[str, Any],
               resumed: bool, **_):
    import trackio  # pylint: disable=g-import-not-at-top
    self.trackio = trackio
    self.run = trackio.init(project=project, name=run_name, config=dict(config),
                            resume="allow" if resumed else "never")

  def log(self, step: int, split: str, values: Mapping[str, float]) -> None:
    self.run.log({f"{split}/{k}": v for k, v in values.items()}, step=step)

  def images(self, step: int, split: str, paths: Mapping[str, str]) -> None:
    self.run.log({f"{split}/{k}": self.trackio.Image(p) for k, p in paths.items()}, step=step)

  def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    self.run.log({name: self.trackio.Table(columns=list(columns),
                                           data=[list(r) for r in rows])})

  def summary(self, values: Mapping[str, Any]) -> None:
    del values  # trackio keeps no run summary; summary.json is in the workdir

  def close(self) -> None:
    self.run.finish()


_CLASSES = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}


class Trackers:
  """The run's trackers behind one guard: a call that raises warns once and is counted.

  names: from `parse`. workdir: where TensorBoard and wandb write and trackers.json lives.
  resumed_step: as MetricsWriter's (None: a fresh run; -1: a fresh start over an
  interrupted start's logs, which also starts new tracker runs). logged: {split: the last
  step metrics.jsonl held before a resume trimmed it}, the rows a continued tracker run
  already has. history: metrics.jsonl's rows up to the resumed step, replayed into a
  tracker run that starts now (one added on resume).
  """

  def __init__(self, names: Sequence[str], workdir: str, *, project: str = "jaxgrpo",
               run_name: str = "", tags: Sequence[str] = (),
               config: Mapping[str, Any] | None = None, resumed_step: int | None = None,
               logged: Mapping[str, int] | None = None,
               history: Sequence[Mapping[str, Any]] = (), stream=None):
    self.stream = stream
    self.errors: dict[str, int] = {}
    self.live: list[Any] = []
    resumed = resumed_step is not None and resumed_step >= 0
    state = read_state(workdir) if resumed else {}
    run_name = run_name or os.path.basename(os.path.abspath(workdir))
    self.skip: dict[str, dict[str, int]] = {}
    for name in names:
      known = state.get(name)
      tracker = self._guard(name, "start", lambda n=name, k=known: _CLASSES[n](
          workdir=workdir, project=project, run_name=run_name, tags=tags,
          config=config or {}, run_id=(k or {}).get("id"), resumed=bool(k),
          purge_step=None if resumed_step is None else resumed_step + 1))
      if tracker is None:
        continue
      self.live.append(tracker)
      if name == "tensorboard":
        continue  # its purge_step drops the redone steps itself
      state[name] = {"id": getattr(tracker, "id", None), "project": project,
                     "run_name": run_name}
      if known:  # a continued run: the rows it holds are not logged again
        self.skip[name] = dict(logged or {})
      else:  # a new run on a resumed workdir: metrics.jsonl's rows first
        for row in history:
          values = {k: v for k, v in row.items() if k not in ("step", "split", "time")}
          self._guard(name, "log", lambda t=tracker, r=row, v=values: t.log(
              r["step"], r["split"], v))
    if any(n != "tensorboard" for n in names):
      self._guard("trackers.json", "write", lambda: _write_state(workdir, state))

  def _guard(self, name: str, what: str, call: Callable[[], Any]):
    try:
      return call()
    except Exception as e:  # pylint: disable=broad-except  (logging never stops training)
      self.errors[name] = self.errors.get(name, 0) + 1
      if self.errors[name] == 1:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"warning: tracker {name}: {what} failed ({type(e).__name__}: {first}); the "
              "run goes on, metrics.jsonl has every row, and failed calls are counted in "
              "summary.json (tracker_errors)", file=self.stream or sys.stderr, flush=True)
      return None

  def _each(self, what: str, call: Callable[[Any], Any], split: str | None = None,
            step: int | None = None) -> None:
    for tracker in self.live:
      if split is not None and step <= self.skip.get(tracker.name, {}).get(split, -1):
        continue
      self._guard(tracker.name, what, lambda t=tracker: call(t))

  def log(self, step: int, split: str, values: Mapping[str, float]) -> None:
    self._each("log", lambda t: t.log(step, split, values), split, step)

  def images(self, step: int, split: str, paths: Mapping[str, str]) -> None:
    self._each("image", lambda t: t.images(step, split, paths), split, step)

  def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    self._each("table", lambda t: t.table(name, columns, rows))

  def summary(self, values: Mapping[str, Any]) -> None:
    self._each("summary", lambda t: t.summary(values))

  def close(self) -> None:
    self._each("close", lambda t: t.close())
    self.live = []


@config_checks.register(order=5)
def _check_config(c, num_devices: int) -> None:
  """logging.trackers: a comma-separated list of NAMES ('' for metrics.jsonl only)."""
  del num_devices
  try:
    parse(c.logging.trackers)
  except TrackerError:
    config_checks.fail("logging.trackers", c.logging.trackers,
                       f"a comma-separated list among {', '.join(NAMES)} ('' for "
                       "metrics.jsonl only)")

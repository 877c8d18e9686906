"""Trackers (jaxgrpo/runtime/trackers.py) behind MetricsWriter: names, availability, what
reaches wandb (offline: its files, read back by cli.wandb_runs) and trackio, resume, faults.
No network: conftest sets WANDB_MODE=offline and a session TRACKIO_DIR."""

import io
import json
import os

import pytest

import cli
from jaxgrpo.runtime import metrics, trackers


def test_parse_names_and_refuses_unknown():
  assert trackers.parse("tensorboard, wandb,wandb") == ("tensorboard", "wandb")
  assert trackers.parse("") == ()
  with pytest.raises(trackers.TrackerError, match="unknown tracker 'mlflow'; allowed: a "
                     "comma-separated list among tensorboard, wandb, trackio"):
    trackers.parse("tensorboard,mlflow")


def test_missing_package_names_its_extra(monkeypatch):
  real = trackers.importlib.util.find_spec
  monkeypatch.setattr(trackers.importlib.util, "find_spec",
                      lambda name: None if name == "wandb" else real(name))
  with pytest.raises(trackers.TrackerError,
                     match=r"wandb is not installed; allowed: pip install -e '\.\[wandb\]'"):
    trackers.check_available(("tensorboard", "wandb"))
  trackers.check_available(("tensorboard", "trackio"))


def test_wandb_online_without_an_api_key_is_refused(monkeypatch, tmp_path):
  monkeypatch.delenv("WANDB_MODE")
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
  with pytest.raises(trackers.TrackerError, match="wandb has no API key"):
    trackers.check_available(("wandb",))
  (tmp_path / "netrc").write_text("machine api.wandb.ai login user password KEY\n")
  os.chmod(tmp_path / "netrc", 0o600)
  monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
  trackers.check_available(("wandb",))  # `wandb login` wrote a key: fine
  monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
  monkeypatch.setenv("WANDB_MODE", "offline")
  trackers.check_available(("wandb",))


def _log(workdir, steps, resumed_step=None, names=("tensorboard", "wandb"), **kw):
  """A run's rows: train loss at each step, val accuracy at even steps; one image."""
  png = os.path.join(workdir, "img.png")
  if not os.path.exists(png):
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
    Figure(figsize=(1, 1)).savefig(png)
  with metrics.MetricsWriter(str(workdir), trackers=names, plots=False, console=False,
                             resumed_step=resumed_step, config={"grpo": {"beta": 0.0}},
                             tags=["a", "b"], **kw) as writer:
    for step in steps:
      writer.write(step, "train", {"loss": step / 10, "reward_mean": 0.5})
      if step % 2 == 0:
        writer.write(step, "val", {"accuracy": step / 100, "pass@2/gsm8k": 0.25})
        writer.images(step, "val", {"validation": png})


def test_wandb_gets_every_row_config_summary_and_images(tmp_path):
  _log(tmp_path, [1, 2, 3, 4])
  (run,) = cli.wandb_runs(str(tmp_path))
  logged = {(r["split"], r["step"], k) for r in metrics.read_metrics(str(tmp_path))
            for k in r if k not in ("step", "split", "time")}
  seen = {(k.split("/")[0], h["step"], k.split("/", 1)[1]) for h in run["history"]
          for k in h if "/" in k and not k.startswith("_") and k != "val/validation"}
  assert seen == logged  # val/pass@2/gsm8k keeps its name after the split
  images = [h["step"] for h in run["history"] if "val/validation" in h]
  assert images == [2, 4]
  assert run["config"]["grpo"] == {"beta": 0.0}
  assert run["summary"]["steps"] == 4 and run["summary"]["best_val_accuracy"] == 0.04
  state = json.load(open(tmp_path / trackers.STATE_NAME))
  assert state["wandb"]["id"] == run["id"]
  assert state["wandb"]["run_name"] == os.path.basename(tmp_path)
  # TensorBoard, the same rows, read by TensorBoard's own reader.
  assert ("loss", 3, pytest.approx(0.3)) in cli.tb_scalars(str(tmp_path / "tb" / "train"))


def test_resume_continues_the_run_without_duplicate_steps(tmp_path):
  # The first process logged steps 1-5 and its last checkpoint is step 2: the resumed one
  # redoes 3-5 and goes on to 6. wandb keeps its rows 3-5 (identical by exact resume).
  _log(tmp_path, [1, 2, 3, 4, 5])
  _log(tmp_path, [3, 4, 5, 6], resumed_step=2)
  first, second = cli.wandb_runs(str(tmp_path))
  assert first["id"] == second["id"]
  train = [h["step"] for run in (first, second) for h in run["history"] if "train/loss" in h]
  val = [h["step"] for run in (first, second) for h in run["history"] if "val/accuracy" in h]
  assert train == [1, 2, 3, 4, 5, 6] and val == [2, 4, 6]
  assert [r["step"] for r in metrics.read_metrics(str(tmp_path)) if r["split"] == "train"] \
      == [1, 2, 3, 4, 5, 6]
  # TensorBoard purged the redone steps: one value per step.
  steps = [s for tag, s, _ in cli.tb_scalars(str(tmp_path / "tb" / "train")) if tag == "loss"]
  assert sorted(steps) == [1, 2, 3, 4, 5, 6]


def test_tracker_added_on_resume_gets_the_earlier_rows_first(tmp_path):
  _log(tmp_path, [1, 2, 3], names=("tensorboard",))
  _log(tmp_path, [3, 4], resumed_step=2)
  (run,) = cli.wandb_runs(str(tmp_path))
  assert [h["step"] for h in run["history"] if "train/loss" in h] == [1, 2, 3, 4]


def test_trackio_gets_every_row_and_continues_on_resume(tmp_path):
  from trackio.sqlite_storage import SQLiteStorage  # pylint: disable=g-import-not-at-top
  _log(tmp_path, [1, 2, 3], names=("trackio",), project="jaxgrpo-test", run_name="r1")
  _log(tmp_path, [3, 4], resumed_step=2, names=("trackio",), project="jaxgrpo-test",
       run_name="r1")
  rows = SQLiteStorage.get_logs("jaxgrpo-test", "r1")
  assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
  assert [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r] == [
      (2, 0.02), (4, 0.04)]


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, monkeypatch):
  calls = []

  def broken(self, step, split, values):
    calls.append(step)
    raise ConnectionError("quota exceeded\nsecond line")
  monkeypatch.setattr(trackers.Wandb, "log", broken)
  stream = io.StringIO()
  with metrics.MetricsWriter(str(tmp_path), trackers=("wandb",), plots=False,
                             stream=stream) as writer:
    for step in (1, 2, 3):
      writer.write(step, "train", {"loss": 1.0})
  warnings = [line for line in stream.getvalue().splitlines() if "tracker wandb" in line]
  assert warnings == ["warning: tracker wandb: log failed (ConnectionError: quota exceeded); "
                      "the run goes on, metrics.jsonl has every row, and failed calls are "
                      "counted in summary.json (tracker_errors)"]
  assert calls == [1, 2, 3]  # tried every time: a client may recover
  assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 2, 3]
  assert json.load(open(tmp_path / "summary.json"))["tracker_errors"] == {"wandb": 3}


def test_a_tracker_that_cannot_start_is_left_out(tmp_path, monkeypatch):
  def refuse(self, **kwargs):
    raise RuntimeError("no network")
  monkeypatch.setattr(trackers.Wandb, "__init__", refuse)
  stream = io.StringIO()
  with metrics.MetricsWriter(str(tmp_path), trackers=("tensorboard", "wandb"), plots=False,
                             stream=stream) as writer:
    writer.write(1, "train", {"loss": 1.0})
  assert "warning: tracker wandb: start failed (RuntimeError: no network)" in stream.getvalue()
  assert ("loss", 1, 1.0) in cli.tb_scalars(str(tmp_path / "tb" / "train"))


def test_only_the_primary_process_makes_trackers(tmp_path):
  with metrics.MetricsWriter(str(tmp_path / "w"), trackers=("wandb",), is_primary=False) as w:
    w.write(1, "train", {"loss": 1.0})
  assert not os.path.exists(tmp_path / "w")

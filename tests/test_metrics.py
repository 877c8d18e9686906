"""Tests for jaxgrpo.runtime.metrics: JSONL, TensorBoard files, console lines, summary and plots."""

import glob
import io
import json
import math
import os

import numpy as np
import pytest

import cli

from jaxgrpo.runtime import metrics


def _run(workdir, **kwargs):
  """A short run: three train steps (one with a NaN loss) and two val points."""
  stream = io.StringIO()
  writer = metrics.MetricsWriter(workdir, total_steps=3, stream=stream, **kwargs)
  with writer:
    writer.write(1, "train", {"reward_mean": 0.25, "loss": np.float32(1.5), "rollout_tokens_per_s": 12345.6})
    writer.write(2, "train", {"reward_mean": 0.5, "loss": float("nan"), "n": np.int32(7)})
    writer.write(2, "val", {"accuracy": 0.61, "pass@k": 0.8})
    writer.write(3, "train", {"reward_mean": 0.75, "loss": 0.5})
    writer.write(3, "val", {"accuracy": 0.55, "pass@k": float("inf")})
  return stream.getvalue()


def test_jsonl_lines_parse_with_step_split_and_keys(tmp_path):
  _run(str(tmp_path), trackers=(), plots=False)
  with open(tmp_path / "metrics.jsonl") as f:
    lines = f.read().splitlines()
  assert len(lines) == 5
  records = [json.loads(line) for line in lines]  # Strict JSON: no NaN/Infinity tokens.
  assert [(r["step"], r["split"]) for r in records] == [
      (1, "train"), (2, "train"), (2, "val"), (3, "train"), (3, "val")]
  assert all(isinstance(r["time"], float) for r in records)
  assert records[0]["loss"] == 1.5 and records[0]["reward_mean"] == 0.25
  # numpy ints stay ints in the log.
  assert records[1]["n"] == 7 and isinstance(records[1]["n"], int)


def test_non_finite_values_are_null_on_disk_and_nan_on_read(tmp_path):
  _run(str(tmp_path), trackers=(), plots=False)
  with open(tmp_path / "metrics.jsonl") as f:
    raw = [json.loads(line) for line in f]
  assert raw[1]["loss"] is None
  assert raw[4]["pass@k"] is None
  records = metrics.read_metrics(str(tmp_path))
  assert math.isnan(records[1]["loss"]) and math.isnan(records[4]["pass@k"])
  assert records[1]["step"] == 2


def test_read_metrics_skips_torn_final_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "split": "train", "time": 0.0, "loss": 1.0}\n{"step": 2, "spl')
  assert [r["step"] for r in metrics.read_metrics(str(path))] == [1]


def test_tensorboard_event_files_per_split(tmp_path):
  _run(str(tmp_path), plots=False)
  for split in ("train", "val"):
    files = glob.glob(str(tmp_path / "tb" / split / "events.out.tfevents.*"))
    assert files and all(os.path.getsize(p) > 0 for p in files)
  train = cli.tb_scalars(str(tmp_path / "tb" / "train"))
  assert ("reward_mean", 3, 0.75) in train
  assert any(tag == "loss" and step == 2 and math.isnan(v) for tag, step, v in train)
  val = cli.tb_scalars(str(tmp_path / "tb" / "val"))
  assert ("accuracy", 2, pytest.approx(0.61)) in val


def test_summary_has_last_values_and_best_val_accuracy(tmp_path):
  stream = io.StringIO()
  with metrics.MetricsWriter(str(tmp_path), total_steps=3, stream=stream, trackers=(),
                             plots=False) as writer:
    writer.write(1, "train", {"reward_mean": 0.25, "loss": 1.5})
    writer.write(2, "val", {"accuracy": 0.61})
    writer.write(3, "train", {"reward_mean": 0.75})
    writer.write(3, "val", {"accuracy": 0.55})
    writer.close(summary={"stop_reason": "max_steps"})
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary["steps"] == 3
  # Last value of every metric: loss was not logged at step 3, so its step-1 value stays.
  assert summary["last"]["train"] == {"reward_mean": 0.75, "loss": 1.5}
  assert summary["last"]["val"] == {"accuracy": 0.55}
  assert summary["best_val_accuracy"] == 0.61 and summary["best_val_step"] == 2
  assert summary["stop_reason"] == "max_steps"
  assert summary["wall_time_s"] >= 0
  assert "best val accuracy=0.61 @ step 2" in stream.getvalue().splitlines()[-1]


def test_summary_non_finite_is_null(tmp_path):
  _run(str(tmp_path), trackers=(), plots=False)
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary["last"]["val"]["pass@k"] is None
  assert summary["best_val_accuracy"] == 0.61


def test_plots_one_png_per_split(tmp_path):
  _run(str(tmp_path), trackers=())
  for split in ("train", "val"):
    path = tmp_path / "plots" / f"{split}.png"
    assert path.exists() and path.stat().st_size > 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_failure_warns_instead_of_raising(tmp_path, monkeypatch):
  def broken(*args, **kwargs):
    raise RuntimeError("no fonts")
  monkeypatch.setattr(metrics, "_plot", broken)
  with pytest.warns(UserWarning, match="plots failed"):
    _run(str(tmp_path), trackers=())
  assert (tmp_path / "summary.json").exists()


def test_non_primary_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  out = _run(str(workdir), is_primary=False)
  assert out == ""
  assert not workdir.exists()


def test_console_lines_when_not_a_tty(tmp_path):
  out = _run(str(tmp_path), trackers=(), plots=False)
  lines = out.splitlines()
  assert "\r" not in out
  assert len(lines) == 6  # One per write, plus the final summary line.
  assert lines[0].startswith("step 1/3")
  assert "reward_mean=0.25" in lines[0] and "rollout_tokens_per_s=12346" in lines[0]
  assert "loss=1.5" in lines[0]
  assert "loss=nan" in lines[1]
  assert lines[2] == "val step 2: accuracy=0.61 pass@k=0.8"
  assert "ETA" in lines[3] and "reward_mean=0.75" in lines[3]
  assert lines[-1].startswith("done: 3 steps")


def test_a_step_with_no_row_scored_says_so_and_the_last_line_is_its_own(tmp_path):
  """Issue 48: the final line showed `accuracy=nan` beside the previous step's loss."""
  stream = io.StringIO()
  with metrics.MetricsWriter(str(tmp_path), trackers=(), plots=False, total_steps=2,
                                 stream=stream) as w:
    w.write(1, "train", {"reward_mean": 0.5, "accuracy": 0.5, "loss": 0.25,
                         "reward_unscored_fraction": 0.0})
    w.write(2, "train", {"reward_unscored_fraction": 1.0, "rollout_tokens_per_s": 10.0})
  lines = stream.getvalue().splitlines()
  assert "| (no row scored) rollout_tokens_per_s=10" in lines[1]
  assert lines[-1].startswith("done: 2 steps")
  assert "train (no row scored) rollout_tokens_per_s=10" in lines[-1]
  assert "loss" not in lines[-1] and "nan" not in lines[-1]


def test_the_progress_line_shows_the_long_response_metrics_a_run_logs(tmp_path):
  """Issue 60: packing's padding and partial rollouts' live fraction and staleness were
  only in the logs. Shown when logged, after the episode counts, before the throughput."""
  stream = io.StringIO()
  with metrics.MetricsWriter(str(tmp_path), trackers=(), plots=False, total_steps=2,
                             stream=stream) as w:
    w.write(1, "train", {"reward_mean": 0.5, "padding_fraction_packed": 0.07,
                         "padding_fraction_padded": 0.8, "rollout/live_fraction": 0.68,
                         "staleness_mean": 0.4, "rollout_tokens_per_s": 10.0, "loss": 0.25})
    w.write(2, "train", {"reward_mean": 0.5, "loss": 0.25})
  lines = stream.getvalue().splitlines()
  assert lines[0].endswith("| reward_mean=0.5 padding_fraction_packed=0.07 "
                           "rollout/live_fraction=0.68 staleness_mean=0.4 "
                           "rollout_tokens_per_s=10 loss=0.25"), lines[0]
  assert "fraction" not in lines[1]  # a run that does not log them shows none


class _FakeTTY(io.StringIO):

  def isatty(self):
    return True


def test_console_redraws_progress_bar_on_a_tty(tmp_path):
  stream = _FakeTTY()
  with metrics.MetricsWriter(str(tmp_path), total_steps=4, stream=stream, trackers=(),
                             plots=False) as writer:
    writer.write(1, "train", {"reward_mean": 0.123456})
    writer.write(2, "train", {"reward_mean": 0.5})
    writer.write(2, "val", {"accuracy": 0.5})
  out = stream.getvalue()
  assert out.startswith("1/4 [#####") and "reward_mean=0.1235" in out
  assert "\r\x1b[K2/4" in out
  # The val line clears the bar and ends with a newline, so nothing is drawn over it.
  assert "\r\x1b[Kval step 2: accuracy=0.5\n" in out


def test_console_off_and_write_after_close(tmp_path):
  stream = io.StringIO()
  writer = metrics.MetricsWriter(str(tmp_path), console=False, stream=stream, plots=False,
                                 trackers=())
  writer.write(1, "train", {"loss": 1.0})
  writer.close()
  writer.close()  # Idempotent.
  assert stream.getvalue() == ""
  with pytest.raises(RuntimeError):
    writer.write(2, "train", {"loss": 1.0})


def test_reserved_metric_names_rejected(tmp_path):
  with metrics.MetricsWriter(str(tmp_path), console=False, plots=False,
                             trackers=()) as writer:
    with pytest.raises(ValueError, match="clash"):
      writer.write(1, "train", {"step": 1.0})


def test_resumed_run_appends_and_later_lines_win(tmp_path):
  with metrics.MetricsWriter(str(tmp_path), console=False, plots=False,
                             trackers=()) as writer:
    writer.write(1, "train", {"loss": 3.0})
    writer.write(2, "train", {"loss": 2.0})
  # Resumed from the step-1 checkpoint: step 2 is rerun and its new value must win.
  with metrics.MetricsWriter(str(tmp_path), console=False, plots=False,
                             trackers=()) as writer:
    writer.write(2, "train", {"loss": 1.0})
  assert len(metrics.read_metrics(str(tmp_path))) == 3
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["last"]["train"]["loss"] == 1.0


def test_resumed_writer_drops_rows_after_the_resumed_step(tmp_path):
  # A run logged steps 1..5 (and a torn line) but its newest checkpoint is step 3: the
  # resumed writer keeps 1..3 and appends from there, so no step appears twice.
  with metrics.MetricsWriter(str(tmp_path), trackers=(), plots=False, console=False) as w:
    for step in range(1, 6):
      w.write(step, "train", {"loss": float(step)})
    w.write(4, "val", {"accuracy": 0.5})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "spl')
  with metrics.MetricsWriter(str(tmp_path), trackers=(), plots=False, console=False,
                             resumed_step=3) as w:
    w.write(4, "train", {"loss": 40.0})
  steps = [(r["split"], r["step"], r["loss"]) for r in metrics.read_metrics(str(tmp_path))]
  assert steps == [("train", 1, 1.0), ("train", 2, 2.0), ("train", 3, 3.0), ("train", 4, 40.0)]

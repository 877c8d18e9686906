"""Tests for jaxgrpo.plot: the validation chart's artists, the PNG file and the command."""

import json
import math
import os
import subprocess
import sys

from matplotlib.collections import PolyCollection
import pytest

from jaxgrpo.eval import plots

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _val(step, accuracy, **extra):
  return {"step": step, "split": "val", "time": 0.0, "accuracy": accuracy, **extra}


def _write_run(workdir, stop_metric="pass@4", threshold=0.8):
  """A small log: a train row to ignore, step 20 logged twice (resume), a null stderr."""
  rows = [
      {"step": 0, "split": "train", "time": 0.0, "accuracy": 0.99, "pass@1": 0.99},
      _val(0, 0.10, accuracy_stderr=0.02, **{"pass@1": 0.10, "pass@1_stderr": 0.02,
                                             "pass@2": 0.15, "pass@2_stderr": None,
                                             "pass@4": 0.20, "pass@4_stderr": 0.03,
                                             "pass@16": 0.30, "pass_k": 4}),
      _val(20, 0.90, accuracy_stderr=0.02, **{"pass@1": 0.9}),  # Abandoned by the resume.
      _val(10, 0.20, accuracy_stderr=0.02, **{"pass@1": 0.20, "pass@1_stderr": 0.02,
                                              "pass@2": 0.25, "pass@2_stderr": None,
                                              "pass@4": 0.30, "pass@4_stderr": 0.03,
                                              "pass@16": 0.40, "avg_length": 123.0}),
      _val(20, 0.30, accuracy_stderr=0.02, **{"pass@1": 0.30, "pass@1_stderr": 0.02,
                                              "pass@2": 0.35, "pass@2_stderr": None,
                                              "pass@4": 0.40, "pass@4_stderr": 0.03,
                                              "pass@16": 0.50, "num_prompts": 500,
                                              "num_rollouts": 4000}),
  ]
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  config = {"seed": 0, "grpo": {"stop_at_validation_metric": stop_metric,
                                "stop_at_validation_threshold": threshold}}
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config, f)
  return str(workdir)


def _rows(workdir):
  return plots._val_rows(os.path.join(workdir, "metrics.jsonl"))  # pylint: disable=protected-access


def _bands(ax):
  return [c for c in ax.collections if isinstance(c, PolyCollection)]


def test_val_rows_skip_train_and_later_line_wins(tmp_path):
  rows = _rows(_write_run(tmp_path))
  assert list(rows) == [0, 10, 20]
  assert rows[20]["accuracy"] == 0.30
  assert math.isnan(rows[0]["pass@2_stderr"])


def test_figure_lines_bands_threshold_and_title(tmp_path):
  rows = _rows(_write_run(tmp_path))
  ax = plots.figure(rows, "pass@4", 0.8).axes[0]
  labels = [line.get_label() for line in ax.get_lines()]
  assert labels == ["accuracy", "pass@1", "pass@2", "pass@4", "pass@16", "stop: pass@4 >= 0.8"]
  accuracy = ax.get_lines()[0]
  assert list(accuracy.get_xdata()) == [0, 10, 20]
  assert list(accuracy.get_ydata()) == [0.10, 0.20, 0.30]
  assert list(ax.get_lines()[-1].get_ydata()) == [0.8, 0.8]
  # accuracy, pass@1, pass@4 have a finite stderr; pass@2's is null and pass@16 has none.
  assert len(_bands(ax)) == 3
  assert ax.get_ylim() == pytest.approx((-0.02, 1.02))
  assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
  assert ax.get_title() == "validation (500 prompts x 8)"


def test_figure_without_threshold(tmp_path):
  rows = _rows(_write_run(tmp_path))
  for metric, threshold in ((None, None), ("pass@4", None), (None, 0.8)):
    ax = plots.figure(rows, metric, threshold).axes[0]
    assert not [l for l in ax.get_lines() if l.get_label().startswith("stop:")]
    assert len(ax.get_lines()) == 5


def test_validation_plot_writes_png(tmp_path):
  workdir = _write_run(tmp_path)
  path = plots.validation_plot(workdir)
  assert path == os.path.join(workdir, "validation.png")
  with open(path, "rb") as f:
    assert f.read(4) == b"\x89PNG"


def test_validation_plot_without_config(tmp_path):
  workdir = _write_run(tmp_path)
  os.remove(os.path.join(workdir, "config.json"))
  assert plots.validation_plot(workdir) == os.path.join(workdir, "validation.png")


def test_validation_plot_none_without_val_rows(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write(json.dumps({"step": 0, "split": "train", "time": 0.0, "loss": 1.0}) + "\n")
  assert plots.validation_plot(str(tmp_path)) is None
  assert not (tmp_path / "validation.png").exists()


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxgrpo.plot", *args], capture_output=True,
                        text=True, cwd=_ROOT, timeout=60, check=False)


def test_cli_success_and_help(tmp_path):
  workdir = _write_run(tmp_path)
  result = _cli(workdir)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == os.path.join(workdir, "validation.png")
  assert os.path.exists(result.stdout.strip())
  result = _cli("--help")
  assert result.returncode == 0
  assert "usage: python -m jaxgrpo.plot <workdir>" in result.stdout


def _assert_one_line_error(result, *fragments):
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
  assert "Traceback" not in result.stderr
  for fragment in fragments:
    assert fragment in lines[0]


def test_cli_bad_input(tmp_path):
  missing = str(tmp_path / "nope")
  _assert_one_line_error(_cli(missing), missing)
  empty = tmp_path / "empty"
  empty.mkdir()
  _assert_one_line_error(_cli(str(empty)), str(empty / "metrics.jsonl"))
  train_only = tmp_path / "train_only"
  train_only.mkdir()
  (train_only / "metrics.jsonl").write_text(
      json.dumps({"step": 0, "split": "train", "time": 0.0, "loss": 1.0}) + "\n")
  _assert_one_line_error(_cli(str(train_only)), "no validation rows")
  _assert_one_line_error(_cli())
  _assert_one_line_error(_cli(str(empty), str(train_only)))


def test_figure_draws_the_lower_bound_and_a_stop_metric_without_a_curve():
  # The confidence rule logs <metric>_lcb: drawn dotted beside the metric, so the chart shows
  # the line that must cross the threshold. maj@4/gsm8k has no curve of its own: it is drawn.
  rows = {10: {"accuracy": 0.5, "maj@4/gsm8k": 0.6, "maj@4/gsm8k_lcb": 0.48},
          20: {"accuracy": 0.6, "maj@4/gsm8k": 0.7, "maj@4/gsm8k_lcb": 0.61}}
  ax = plots.figure(rows, "maj@4/gsm8k", 0.6).axes[0]
  lines = {line.get_label(): line for line in ax.get_lines()}
  assert list(lines) == ["accuracy", "maj@4/gsm8k", "maj@4/gsm8k lower bound",
                         "stop: maj@4/gsm8k >= 0.6"]
  bound = lines["maj@4/gsm8k lower bound"]
  assert list(bound.get_ydata()) == [0.48, 0.61] and bound.get_linestyle() == ":"
  # Without a logged bound (plain rule) only the metric's own curve is added.
  plain = {s: {k: v for k, v in r.items() if not k.endswith("_lcb")} for s, r in rows.items()}
  labels = [l.get_label() for l in plots.figure(plain, "accuracy", 0.6).axes[0].get_lines()]
  assert labels == ["accuracy", "stop: accuracy >= 0.6"]


def test_pass_at_k_figure_one_line_per_source_on_a_log_axis(tmp_path):
  row = {"num_prompts": 4, "num_prompts/a": 2, "num_prompts/b": 2}
  for j, value in ((1, 0.25), (2, 0.5), (4, 0.75)):
    row[f"pass@{j}"], row[f"pass@{j}_stderr"] = value, 0.1
    row[f"pass@{j}/a"], row[f"pass@{j}_stderr/a"] = value + 0.1, float("nan")  # no band
    row[f"pass@{j}/b"], row[f"pass@{j}_stderr/b"] = value - 0.1, 0.05
  fig = plots.pass_at_k_figure(row, ["a", "b"], title="run:8")
  ax = fig.axes[0]
  assert ax.get_xscale() == "log"
  assert [l.get_label() for l in ax.lines] == ["all (n=4)", "a (n=2)", "b (n=2)"]
  assert list(ax.lines[1].get_xdata()) == [1, 2, 4]
  assert list(ax.lines[1].get_ydata()) == pytest.approx([0.35, 0.6, 0.85])
  assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 2  # a has no stderr
  assert os.path.getsize(plots.save(fig, str(tmp_path / "p.png"))) > 0


def test_compare_figure_draws_both_intervals_and_zero():
  d = {"difference": 0.1, "ci95": [0.05, 0.15], "unpaired_ci95": [-0.02, 0.22]}
  fig = plots.compare_figure({"accuracy": {"all": d, "x": d}}, ["accuracy", "accuracy"], ["x"])
  ax, = fig.axes  # a metric named twice is drawn once
  unpaired = [l for l in ax.lines if l.get_label() == "unpaired 95%"]
  assert list(unpaired[0].get_xdata()) == [-0.02, 0.22]
  assert [t.get_text() for t in ax.get_yticklabels()] == ["all", "x"]
  assert any(list(l.get_xdata()) == [0.0, 0.0] for l in ax.lines)  # the line at 0

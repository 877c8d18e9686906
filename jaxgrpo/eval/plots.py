"""The validation plots: a run's curves (`validation_plot`, `figure`: accuracy and every
pass@j against the step, +- stderr bands, the stop threshold, the stop metric's lower
bound), one validation's pass@j ladder (`pass_at_k_figure`) and a paired comparison
(`compare_figure`). They read only metrics.jsonl and config.json, so they need no jax:
`python -m jaxgrpo.plot <workdir>` (plot.py) draws validation.png with them.
"""

import json
import math
import numbers
import os
import re
import warnings
from typing import Any, Optional, Sequence

from jaxgrpo.runtime import metrics as metrics_lib

PNG_NAME = "validation.png"
CONFIG_NAME = "config.json"
USAGE = f"""usage: python -m jaxgrpo.plot <workdir>

Draws <workdir>/{PNG_NAME} from <workdir>/{metrics_lib.JSONL_NAME} (the validation rows:
accuracy and pass@j with +- stderr bands) and the early-stop threshold from
<workdir>/{CONFIG_NAME}, then prints the PNG's path."""
_PASS_AT = re.compile(r"^pass@(\d+)$")


def _finite(value: Any) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def _series_names(val_rows: dict[int, dict[str, Any]]) -> list[str]:
  """`accuracy` first, then the pass@j keys by j as a number, so pass@16 follows pass@4."""
  keys = {k for record in val_rows.values() for k in record}
  pass_at = sorted((k for k in keys if _PASS_AT.match(k)),
                   key=lambda k: int(_PASS_AT.match(k).group(1)))
  return (["accuracy"] if "accuracy" in keys else []) + pass_at


def _title(val_rows: dict[int, dict[str, Any]]) -> str:
  """The last row's validation size: a noisy curve over 50 prompts reads differently."""
  last = val_rows[max(val_rows)] if val_rows else {}
  prompts, rollouts = last.get("num_prompts"), last.get("num_rollouts")
  if not _finite(prompts):
    return "validation"
  prompts = int(prompts)
  if not _finite(rollouts):
    return f"validation ({prompts} prompts)"
  if prompts and rollouts % prompts == 0:
    return f"validation ({prompts} prompts x {int(rollouts) // prompts})"
  return f"validation ({prompts} prompts, {int(rollouts)} rollouts)"


def _draw_stop_metric(ax, val_rows, stop_metric: str) -> None:
  """The stop metric when no other curve shows it (maj@k, a per-source metric), and its
  logged lower confidence bound (`<metric>_lcb`, the confidence rule's) as a dotted line:
  the run stops when that line, not the metric, crosses the threshold."""
  for name, style in ((stop_metric, "-"), (f"{stop_metric}_lcb", ":")):
    if name == stop_metric and name in _series_names(val_rows):
      continue
    points = [(s, r[name]) for s, r in val_rows.items() if _finite(r.get(name))]
    if points:
      steps, values = zip(*points)
      label = f"{stop_metric} lower bound" if name != stop_metric else name
      ax.plot(steps, values, color="0.15", linestyle=style, marker=".", linewidth=1.4,
              markersize=4, label=label, zorder=3)


def figure(val_rows: dict[int, dict[str, Any]], stop_metric: Optional[str] = None,
           threshold: Optional[float] = None):
  """Builds the validation chart; pure (no files), so tests can inspect the artists.

  Args:
    val_rows: step -> validation record, step-sorted (as `metrics.latest_per_step` gives).
    stop_metric: the metric early stopping watches; with `threshold`, drawn as a dashed line.
    threshold: the value of `stop_metric` that stops the run.

  Returns:
    A matplotlib `Figure` attached to an Agg canvas, ready for `savefig`.
  """
  # The object API with an explicit Agg canvas never touches pyplot's global backend, so no
  # display is opened and a caller's own pyplot state is left alone (as in metrics._plot).
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top

  fig = Figure(figsize=(8, 5), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for i, name in enumerate(_series_names(val_rows)):
    points = [(s, r[name], r.get(f"{name}_stderr")) for s, r in val_rows.items()
              if _finite(r.get(name))]
    if not points:
      continue
    is_accuracy = name == "accuracy"
    color = f"C{i % 10}"
    steps, values, _ = zip(*points)
    ax.plot(steps, values, color=color, label=name, marker="o" if is_accuracy else ".",
            linewidth=2.0 if is_accuracy else 1.2, markersize=5 if is_accuracy else 4,
            zorder=3 if is_accuracy else 2)
    # Band only where the stderr is known: a missing/NaN stderr means "not measured", not 0.
    banded = [(s, v, e) for s, v, e in points if _finite(e)]
    if banded:
      b_steps, b_values, b_errs = zip(*banded)
      ax.fill_between(b_steps, [max(v - e, 0.0) for v, e in zip(b_values, b_errs)],
                      [min(v + e, 1.0) for v, e in zip(b_values, b_errs)],
                      color=color, alpha=0.25 if is_accuracy else 0.12, linewidth=0)
  if stop_metric is not None:
    _draw_stop_metric(ax, val_rows, stop_metric)
  if stop_metric is not None and _finite(threshold):
    ax.axhline(threshold, color="0.3", linestyle="--", linewidth=1.2,
               label=f"stop: {stop_metric} >= {threshold:g}")
  ax.set_ylim(-0.02, 1.02)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # Steps are whole numbers.
  ax.set_xlabel("step")
  ax.set_ylabel("value")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(loc="best", fontsize=9)
  ax.set_title(_title(val_rows))
  return fig


def _new_figure(rows: int = 1, height: float = 5.0):
  # The object API with an explicit Agg canvas, as in `figure`.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(8, height), layout="constrained")
  FigureCanvasAgg(fig)
  return fig, [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]


def save(fig, path: str) -> str:
  fig.savefig(path, dpi=100)
  return path


def pass_at_k_figure(row: dict[str, Any], sources: Sequence[str] = (), title: str = ""):
  """One evaluation's pass@j against j (log axis), +- stderr bands, overall and per source
  (`python -m jaxgrpo.evaluate` writes it as pass_at_k.png)."""
  fig, (ax,) = _new_figure()
  js = sorted(int(m.group(1)) for k in row if (m := _PASS_AT.match(k)))
  for i, source in enumerate([None, *sources]):
    suffix = f"/{source}" if source else ""
    values = [row.get(f"pass@{j}{suffix}") for j in js]
    errs = [row.get(f"pass@{j}_stderr{suffix}") for j in js]
    if not all(_finite(v) for v in values):
      continue
    color = f"C{i % 10}"
    ax.plot(js, values, color=color, marker="o", linewidth=2.0 if source is None else 1.2,
            label=f"{source or 'all'} (n={row.get('num_prompts' + suffix)})")
    if all(_finite(e) for e in errs):
      ax.fill_between(js, [max(v - e, 0.0) for v, e in zip(values, errs)],
                      [min(v + e, 1.0) for v, e in zip(values, errs)], color=color,
                      alpha=0.2, linewidth=0)
  ax.set_xscale("log", base=2)
  ax.set_xticks(js or [1], [str(j) for j in js or [1]])
  ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel("j (samples per prompt)")
  ax.set_ylabel("pass@j (unbiased estimator)")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(loc="lower right", fontsize=9)
  ax.set_title(f"pass@j, +- stderr{': ' + title if title else ''}", fontsize=10)
  return fig


def compare_figure(diffs: dict[str, Any], metrics: Sequence[str], sources: Sequence[str] = (),
                   title: str = ""):
  """B - A per metric and source: the paired 95% interval (dark) over the unpaired one that
  two separate error bars imply (light), and 0 (`evaluate --compare` writes compare.png)."""
  metrics = list(dict.fromkeys(metrics))
  fig, axes = _new_figure(len(metrics), height=1.2 + 1.1 * len(metrics) * (1 + len(sources)))
  groups = ["all", *sources]
  for ax, metric in zip(axes, metrics):
    for y, group in enumerate(groups):
      d = diffs[metric][group]
      if not _finite(d["difference"]):
        continue
      lo, hi = d["unpaired_ci95"]
      ax.plot([lo, hi], [y, y], color="C0", alpha=0.3, linewidth=8, solid_capstyle="butt",
              label="unpaired 95%" if y == 0 else None)
      lo, hi = d["ci95"]
      ax.errorbar([d["difference"]], [y], xerr=[[d["difference"] - lo], [hi - d["difference"]]],
                  color="C3", fmt="o", capsize=4, label="paired 95%" if y == 0 else None)
    ax.axvline(0.0, color="0.3", linewidth=1)
    ax.set_yticks(range(len(groups)), groups)
    ax.set_ylim(-0.7, len(groups) - 0.3)
    ax.set_title(metric, fontsize=10, loc="left")
    ax.grid(alpha=0.3, axis="x")
  if axes and axes[0].get_legend_handles_labels()[0]:
    axes[0].legend(loc="best", fontsize=8)
  fig.suptitle(title, fontsize=10)
  return fig


def _stop_rule(workdir: str) -> tuple[Optional[str], Optional[float]]:
  """(metric, threshold) from the run's config; (None, None) when absent or unreadable."""
  path = os.path.join(workdir, CONFIG_NAME)
  if not os.path.exists(path):
    return None, None
  try:
    with open(path) as f:
      grpo = json.load(f).get("grpo") or {}
  except (OSError, ValueError, AttributeError) as e:
    # The curves are still worth drawing; only the threshold line is lost.
    warnings.warn(f"{path}: cannot read the stop threshold ({e}); drawing without it")
    return None, None
  metric = grpo.get("stop_at_validation_metric")
  threshold = grpo.get("stop_at_validation_threshold")
  if metric is None or not _finite(threshold):
    return None, None
  return str(metric), float(threshold)


def _val_rows(path: str) -> dict[int, dict[str, Any]]:
  """Validation records by step, step-sorted; a later line for a step wins (a resumed run)."""
  records = [r for r in metrics_lib.read_metrics(path)
             if r.get("split") == "val" and isinstance(r.get("step"), int)]
  return metrics_lib.latest_per_step(records).get("val", {})


def validation_plot(workdir: str) -> Optional[str]:
  """Writes `<workdir>/validation.png` and returns its path; None when nothing was validated.

  Raises:
    FileNotFoundError: `<workdir>/metrics.jsonl` does not exist.
    ValueError: a line of the log other than the last is not JSON.
  """
  val_rows = _val_rows(os.path.join(workdir, metrics_lib.JSONL_NAME))
  if not val_rows:
    return None
  stop_metric, threshold = _stop_rule(workdir)
  path = os.path.join(workdir, PNG_NAME)
  figure(val_rows, stop_metric, threshold).savefig(path, dpi=100)
  return path

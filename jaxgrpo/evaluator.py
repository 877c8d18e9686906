"""The device side of `python -m jaxgrpo.evaluate`: place each policy, validate it, report.

Each policy is validated by a `validation.Validator` built exactly as the trainer builds its
own (same engine, profiles, batches, key and metrics program), so a run's checkpoint gives
the run's validation row. Two policies with the same architecture and tokenizer share one
engine and Validator: the val sampler and the metrics compile once for both.
"""

from __future__ import annotations

import dataclasses

import json
import os
import sys
import time

import jax
import numpy as np

from jaxgrpo import build, checkpoint, fit, loading, plot, scorer
from jaxgrpo.runtime import metrics as metrics_lib
from jaxgrpo.runtime import trackers as trackers_lib
from jaxgrpo.model import lora
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.eval import paired, validation

# The files an evaluation writes (python -m jaxgrpo.evaluate reads the names to refuse an --out
# that already holds results).
EVAL_JSON, SAMPLES_JSONL, PASS_AT_K_PNG = "eval.json", "samples.jsonl", "pass_at_k.png"
COMPARE_JSON, COMPARE_PNG = "compare.json", "compare.png"

# A progress line at most this often (and one at the end).
PROGRESS_EVERY_S = 2.0


def run(plan) -> int:
  primary = jax.process_index() == 0
  mesh = sharding_lib.make_mesh(plan.sides[0].config.mesh.to_dict())
  if primary:
    if plan.ignored:
      print(f"note: ignored (read only by training): {', '.join(plan.ignored)}",
            file=sys.stderr, flush=True)
    for note in plan.notes:
      print(f"note: this evaluation's validation differs from the run's: {note}",
            file=sys.stderr, flush=True)
  comparing = len(plan.sides) == 2
  validators, results = {}, []
  for name, side in zip("AB" if comparing else "-", plan.sides):
    result = evaluate_side(side, mesh, validators, plan.sources,
                           label=f"{name} ({side.label})" if comparing else side.label)
    results.append(result)
    if primary:
      folder = os.path.join(plan.out, name) if comparing else plan.out
      write_side(folder, side, result, plan.sources)
      print(f"\n{side.label}: {result['num_prompts']} prompts x k={result['sampling']['k']}"
            f", {result['wall_time_s']:.1f}s, {result['tokens_per_s']:.0f} tokens/s")
      print(table(result["metrics"], plan.metrics, plan.sources))
  if comparing:
    a, b = (r.pop("_per_prompt") for r in results)
    k = plan.sides[0].config.grpo.val_num_generations_per_prompt
    names = [m for m in validation.per_prompt_metrics(k, f"maj@{k}" in a) if m in a and m in b]
    seed = plan.sides[0].config.grpo.val_seed
    diffs = paired.compare(a, b, names, plan.sources, seed=seed)
    lines = verdict_lines(diffs, plan.metrics, plan.sources)
    if primary:
      write_compare(plan, results, diffs, lines)
      print("\nB - A, paired over prompts (95% normal interval):")
      print("\n".join(f"  {line}" for line in lines))
  if primary and plan.trackers:
    log_to_trackers(plan, results, diffs if comparing else None,
                    lines if comparing else None)
  if primary:
    print(f"results in {plan.out}", flush=True)
  return 0


def log_to_trackers(plan, results, diffs, lines) -> None:
  """The evaluation in the trackers (--trackers): its metrics at the checkpoint's step, the
  table, the verdicts and the plots; one tracker run per evaluation."""
  comparing = diffs is not None
  side = plan.sides[-1]
  step = side.restore[1] if side.restore else 0
  out = trackers_lib.Trackers(plan.trackers, plan.out, project=plan.project,
                              run_name=plan.run_name,
                              config=metrics_lib.json_safe(side.config.to_dict()))
  summary = {}
  for name, result in zip("AB" if comparing else "-", results):
    split = f"eval/{name}" if comparing else "eval"
    folder = os.path.join(plan.out, name) if comparing else plan.out
    out.log(step, split, result["metrics"])
    out.images(step, split, {"pass_at_k": os.path.join(folder, PASS_AT_K_PNG)})
    out.table(f"{split}/table", *_table_cells(result["metrics"], plan.metrics, plan.sources))
    summary.update({f"{split}/{k}": v for k, v in result["metrics"].items()})
  if comparing:
    flat = {f"{base}/{group}" if group != "all" else base: d["difference"]
            for base, groups in diffs.items() for group, d in groups.items()}
    out.log(step, "compare", flat)
    out.images(step, "compare", {"difference": os.path.join(plan.out, COMPARE_PNG)})
    out.table("compare/verdicts", ["verdict"], [[line] for line in lines])
    summary.update({f"compare/{k}": v for k, v in flat.items()})
  out.summary(metrics_lib.json_safe(summary))
  out.close()


def evaluate_side(side, mesh, validators: dict, sources, label: str) -> dict:
  """Validates one policy: {'metrics': the validation row, '_per_prompt', 'records', ...}."""
  if side.config.grpo.val_batch_size == fit.AUTO:
    # As the trainer chooses it: the largest validation batch whose val sampler fits.
    config, (choice,) = fit.resolve(side.config, side.model_cfg, side.tokenizer, mesh,
                                    len(side.data.val_rows), keys=("val_batch_size",))
    if jax.process_index() == 0:
      print(choice.line(), file=sys.stderr, flush=True)
    side.config = config
    side.val_batches = loading.validation_batches(config, side.tokenizer, side.data)
  c, g = side.config, side.config.grpo
  t0 = time.perf_counter()
  params = place(side, mesh)
  key = (side.model_cfg, side.tokenizer.hf.to_str())  # the same prompts and programs
  if key not in validators:
    engine = build.make_engine(c, side.model_cfg, side.tokenizer, mesh)
    # An environment task (config.env.name): k episodes per prompt, as the run validated.
    runner = build.make_runner(c, engine, side.tokenizer,
                               getattr(side.data.template, "add_bos", True))
    validators[key] = validation.Validator(
        engine, side.val_batches, scorer.from_config(c, side.tokenizer), runner=runner,
        k=g.val_num_generations_per_prompt,
        threshold=g.val_pass_threshold, seed=g.val_seed, mesh=mesh, sources=sources,
        stop_metric=g.stop_at_validation_metric, confidence=g.stop_at_validation_confidence,
        collect=True)
  validator = validators[key]
  engine = validator.engine
  progress = Progress(label)
  row = validator(params, side.restore[1] if side.restore else 0, progress=progress)
  del params
  tokens = int(sum(sum(r["lengths"]) for r in validator.records))
  wall = time.perf_counter() - t0
  profile = engine.profile("val")
  sp = profile.sampling
  if validator.runner is not None:  # the profile samples one turn per episode
    profile = dataclasses.replace(profile, num_samples=validator.k)
  return {"metrics": row, "_per_prompt": validator.per_prompt, "records": validator.records,
          "num_prompts": int(row["num_prompts"]), "wall_time_s": wall, "generated_tokens": tokens,
          "tokens_per_s": tokens / max(row["wall_time_s"], 1e-9),
          "sampling": {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                       "k": profile.num_samples, "max_new_tokens": profile.max_new_tokens,
                       "val_seed": g.val_seed, "pass_threshold": g.val_pass_threshold}}


def place(side, mesh):
  """The policy's parameters on the mesh: a run's checkpoint (only its parameters are
  read, straight into their shardings), else as the trainer starts a run."""
  if side.restore is None:
    return build.place_params(side.config, side.model_cfg, side.host_params, mesh)
  directory, step = side.restore
  c = side.config
  lora_run = bool(c.model.lora_rank)
  like = (fit.abstract_adapters(c, side.model_cfg, mesh) if lora_run
          else sharding_lib.abstract_params(side.model_cfg, mesh))
  ckpts = checkpoint.Checkpoints(directory, read_only=True)
  try:
    params = ckpts.restore_params(step, like)
  finally:
    ckpts.close()
  if lora_run:  # the run trained adapters: its base (from the run's config), merged
    base = build.place_params(c, side.model_cfg, side.host_params, mesh)
    params = jax.jit(lambda b, a: lora.merge(b, a, c.model.lora_alpha / c.model.lora_rank),
                     out_shardings=sharding_lib.param_shardings(side.model_cfg, mesh))(
                         base, params)
  return params


class Progress:
  """Prints `label: 128/500 prompts, 5,210 tokens/s` to stderr on process 0, rate-limited."""

  def __init__(self, label: str):
    self.label, self.last = label, 0.0
    self.on = jax.process_index() == 0

  def __call__(self, done: int, total: int, tokens: int, seconds: float) -> None:
    now = time.perf_counter()
    if self.on and (done >= total or now - self.last >= PROGRESS_EVERY_S):
      self.last = now
      print(f"{self.label}: {done}/{total} prompts, {tokens / max(seconds, 1e-9):,.0f} "
            "tokens/s", file=sys.stderr, flush=True)


def write_side(folder: str, side, result: dict, sources) -> None:
  os.makedirs(folder, exist_ok=True)
  metrics_lib.write_jsonl(os.path.join(folder, SAMPLES_JSONL), result["records"])
  doc = {"checkpoint": side.checkpoint, "label": side.label, "metrics": result["metrics"],
         "sources": list(sources), "sampling": result["sampling"],
         "num_prompts": result["num_prompts"], "generated_tokens": result["generated_tokens"],
         "tokens_per_s": result["tokens_per_s"], "wall_time_s": result["wall_time_s"],
         "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
         "platform": {"jax": jax.__version__, "backend": jax.default_backend(),
                      "devices": jax.device_count(), "processes": jax.process_count()},
         "config": side.config.to_dict()}
  _write_json(os.path.join(folder, EVAL_JSON), doc)
  plot.save(plot.pass_at_k_figure(result["metrics"], sources, title=side.label),
            os.path.join(folder, PASS_AT_K_PNG))


def _write_json(path: str, doc) -> None:
  with open(path + ".tmp", "w") as f:  # strict JSON: NaN (one prompt: no stderr) is null
    json.dump(metrics_lib.json_safe(doc), f, indent=2, allow_nan=False)
  os.replace(path + ".tmp", path)


def table(row: dict, names, sources) -> str:
  """metric | all | each source: 'value +- stderr' (stderr where the metric has one)."""
  header, body = _table_cells(row, names, sources)
  cells = [header] + body
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells)


def _table_cells(row: dict, names, sources):
  """The table's header and rows of cells (the printed table's, and the trackers')."""
  columns = ["all"] + list(sources)
  body = []
  for name in names:
    base, only = validation.split_metric(name)
    body.append([base] + [_cell(row, base, None if c == "all" else c)
                          if only in (None, c) else "" for c in columns])
  return ["metric"] + columns, body


def _cell(row, base, source) -> str:
  suffix = f"/{source}" if source else ""
  value, stderr = row.get(base + suffix), row.get(f"{base}_stderr{suffix}")
  if value is None:
    return "-"
  if stderr is None or not np.isfinite(stderr):
    return f"{value:.4f}"
  return f"{value:.4f} +- {stderr:.4f}"


def verdict_lines(diffs: dict, names, sources) -> list[str]:
  """One verdict per chosen metric and group: overall and every source, or the one named."""
  lines = []
  for name in names:
    base, only = validation.split_metric(name)
    for group in ([only] if only else ["all", *sources]):
      lines.append(paired.verdict_line(base, group, diffs[base][group]))
  return lines


def write_compare(plan, results, diffs, lines) -> None:
  doc = {"A": {"label": plan.sides[0].label, "checkpoint": plan.sides[0].checkpoint},
         "B": {"label": plan.sides[1].label, "checkpoint": plan.sides[1].checkpoint},
         "difference": "B - A, per prompt", "confidence": paired.CONFIDENCE,
         "interval": "normal: difference +- z * paired stderr (jaxgrpo/eval/paired.py)",
         "sampling": results[0]["sampling"], "sources": list(plan.sources),
         "metrics": diffs, "verdicts": lines}
  os.makedirs(plan.out, exist_ok=True)
  _write_json(os.path.join(plan.out, COMPARE_JSON), doc)
  plot.save(plot.compare_figure(diffs, [validation.split_metric(m)[0] for m in plan.metrics],
                                plan.sources, title=f"B={plan.sides[1].label} minus "
                                f"A={plan.sides[0].label}"),
            os.path.join(plan.out, COMPARE_PNG))

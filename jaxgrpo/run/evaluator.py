"""Evaluation outside a training run, for `python -m jaxgrpo.evaluate` (evaluate.py, whose
docstring says what users get): `prepare(argv) -> Plan` reads the command line and checks
every side on the host (one line, exit 2, before anything compiles); `run(plan)` places each
policy, validates it and reports.

Each policy is validated by a `validation.Validator` built exactly as the trainer builds its
own (same engine, profiles, batches, key and metrics program), so a run's checkpoint gives
the run's validation row. Two policies with the same architecture and tokenizer share one
engine and Validator: the val sampler and the metrics compile once for both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import ml_collections
import numpy as np

from jaxgrpo import config as config_lib
from jaxgrpo import rewards, scorer
from jaxgrpo.model import hf
from jaxgrpo.run import artifacts, setup
from jaxgrpo.run import build, checkpoint, sizing, loading
from jaxgrpo.eval import plots
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


# Keys no part of an evaluation reads (command-line overrides of them are named as ignored).
TRAINING_ONLY = ("seed", "optim.", "checkpoint.", "logging.", "model.remat",
                 "data.num_train_examples", "grpo.stop_at_validation_threshold",
                 *(f"grpo.{k}" for k in (
                     "num_prompts_per_step", "num_generations_per_prompt", "num_iterations",
                     "beta", "kl_type", "epsilon", "epsilon_high", "loss_agg",
                     "scale_rewards", "mask_truncated_completions", "micro_batch_size",
                     "micro_batch_tokens", "logprob_chunk_size", "max_num_steps", "val_period", "val_at_start",
                     "val_at_end", "dynamic_sampling", "oversample_factor",
                     "max_generation_batches", "dynamic_sampling_metric")))
# What validation reads: a --workdir evaluation names the ones that differ from the run's.
VALIDATION_KEYS = ("data.", "rewards.", "generation.", "grpo.val_", "grpo.max_val_samples")
# Keys under VALIDATION_KEYS that never move validation's numbers: the training profile
# (validation samples with the val_* keys, resolved), training rollouts' own budget, and
# layouts that give the same tokens (tested: decode blocks, compaction).
NOT_VALIDATION = ("generation.temperature", "generation.top_p", "generation.top_k",
                  "generation.max_tokens_per_step", "generation.decode_block_size",
                  "generation.compact_stages", "data.num_train_examples")
USER_ERRORS = loading.USER_ERRORS + (artifacts.ExportError,)


@dataclasses.dataclass
class Side:
  """One policy to evaluate: its config (model section included), model and data."""
  label: str
  config: object
  model_cfg: object
  tokenizer: object
  host_params: object  # a jaxgrpo checkpoint's weights; None: a run, an HF folder, random
  checkpoint: dict  # what was evaluated, as eval.json records it
  restore: tuple | None = None  # a run's (checkpoints folder, step)
  run_config: dict | None = None  # a run's config.json, as the run validated with it
  val_batches: list = dataclasses.field(default_factory=list)
  data: object = None  # loading.Data: batches made once an 'auto' val_batch_size is chosen


@dataclasses.dataclass
class Plan:
  sides: list  # one, or A and B
  sources: list
  metrics: list  # the table's rows and the verdicts' metrics
  out: str
  ignored: list
  notes: list
  trackers: tuple = ()  # --trackers: names among trackers.NAMES
  project: str = "jaxgrpo"
  run_name: str = ""


def _parser():
  p = argparse.ArgumentParser(prog="python -m jaxgrpo.evaluate", add_help=False,
                              allow_abbrev=False)
  p.add_argument("--workdir")
  p.add_argument("--step", type=int)
  p.add_argument("--compare")
  p.add_argument("--out")
  p.add_argument("--metrics")
  p.add_argument("--trackers", default="")
  p.add_argument("--run_name", default="")
  return p


class _Refused(Exception):
  pass


def _parse_args(argv):
  parser = _parser()
  parser.error = lambda message: (_ for _ in ()).throw(_Refused(message))  # no exit(2) + usage
  try:
    return parser.parse_known_args(argv[1:])
  except _Refused as e:
    raise config_lib.ConfigError(str(e)) from None


def prepare(argv) -> Plan:
  """Host only: every problem with the input is found here, before anything compiles."""
  args, rest = _parse_args(argv)
  if args.compare is not None and (args.workdir or args.step is not None):
    raise config_lib.ConfigError("--compare=A,B names both policies; allowed: --compare "
                                 "without --workdir/--step (use A=DIR:STEP)")
  if args.step is not None and not args.workdir:
    raise config_lib.ConfigError(f"--step={args.step}: allowed only with --workdir=DIR")
  raw = setup.parse_config([argv[0], *rest])
  overrides = [a.split("=")[0][len("--config."):] for a in rest if a.startswith("--config.")]
  if args.compare is not None:
    specs = [_compare_spec(part) for part in _two(args.compare)]
  elif args.workdir:
    specs = [(args.workdir if args.step is None else f"{args.workdir}:{args.step}", "run",
              args.workdir, args.step)]
  else:
    specs = [("config", "config", None, None)]
  sides = [_side(raw, spec, overrides) for spec in specs]
  data = None
  for side in sides:
    data = loading.load_data(side.config, side.tokenizer)
    side.data = data
    if side.config.grpo.val_batch_size != "auto":  # else chosen on the devices (sizing.py)
      side.val_batches = loading.validation_batches(side.config, side.tokenizer, data)
  c = sides[0].config
  metrics = _pick_metrics(args.metrics, c, data.val_sources)
  out = _out_dir(args.out, sides, args.compare is not None)
  ignored = [f"--config.{k}" for k in overrides if k.startswith(TRAINING_ONLY)]
  notes = list(dict.fromkeys(n for side in sides if side.restore for n in _differences(side)))
  names = _trackers(args.trackers)
  # The run's own project (its config.json), so its evaluations sit beside its training.
  run_logging = (sides[-1].run_config or {}).get("logging", {})
  project = run_logging.get("project") or c.logging.project
  run_name = args.run_name or "eval-" + "-vs-".join(
      os.path.basename(os.path.abspath(s.label.split(":")[0])) + (
          f"-step{s.restore[1]}" if s.restore else "") for s in sides)
  return Plan(sides, data.val_sources, metrics, out, ignored, notes, names, project, run_name)


def _trackers(text: str) -> tuple:
  from jaxgrpo.runtime import trackers  # pylint: disable=g-import-not-at-top
  try:
    names = trackers.parse(text, key="--trackers")
    trackers.check_available(names, key="--trackers")
  except trackers.TrackerError as e:
    raise config_lib.ConfigError(str(e)) from None
  return names


def _two(text: str) -> list[str]:
  parts = [p.strip() for p in text.split(",")]
  if len(parts) != 2 or not all(parts):
    raise config_lib.ConfigError(
        f"--compare={text!r}: allowed: two policies A,B (each a run folder DIR or DIR:STEP, "
        "a jaxgrpo checkpoint folder or a Hugging Face folder)")
  return parts


def _compare_spec(text: str) -> tuple:
  """(label, kind, path, step) of one --compare side."""
  path, _, step = text.rpartition(":")
  if path and step.isdigit():
    return text, "run", path, int(step)
  norm = os.path.abspath(text.rstrip("/"))
  parent = os.path.dirname(norm)
  if os.path.basename(norm).isdigit() and os.path.basename(parent) == "checkpoints":
    return text, "run", os.path.dirname(parent), int(os.path.basename(norm))
  folder = hf.resolve(text)
  if os.path.isfile(os.path.join(folder, "config.json")) and os.path.isdir(
      os.path.join(folder, "checkpoints")):
    return text, "run", text, None
  if os.path.isfile(os.path.join(folder, hf.MODEL_FILE)):
    return text, "checkpoint", text, None
  if hf.is_hf_folder(text):
    return text, "hf_checkpoint", text, None
  raise config_lib.ConfigError(
      f"--compare: {text}: no checkpoint there; allowed: a run folder (config.json and "
      f"checkpoints/), DIR:STEP, a jaxgrpo checkpoint folder ({hf.MODEL_FILE}) or a Hugging "
      "Face folder (config.json)")


def _side(raw, spec, overrides) -> Side:
  """One policy's validated config, model config and tokenizer (no weights read for a run)."""
  import jax  # pylint: disable=g-import-not-at-top
  label, kind, path, step = spec
  values = raw.to_dict()
  model = dict(values["model"])
  restore = run = None
  if kind == "run":
    run = artifacts.run_config(path)
    directory, step = artifacts.run_step(path, step)
    # The run's model keys, each unless overridden here (dtype, scan_layers, attention, ...).
    model.update({k: v for k, v in run.model.to_dict().items()
                  if f"model.{k}" not in overrides})
    restore = (directory, step)
    checkpoint = {"kind": "run", "workdir": os.path.abspath(path), "step": step,
                  "path": os.path.join(directory, str(step))}
  elif kind in ("checkpoint", "hf_checkpoint"):
    # Another policy's folder: its own architecture (None takes the checkpoint's).
    model.update({k: None for k in model if k not in _EXECUTION_KEYS})
    model.update(checkpoint="", hf_checkpoint="")
    model[kind] = path
    checkpoint = {"kind": kind, "path": path}
  else:
    source = "hf_checkpoint" if model["hf_checkpoint"] else (
        "checkpoint" if model["checkpoint"] else "random_init")
    checkpoint = {"kind": source, "path": model.get(source)}
  values["model"] = model
  # A chat template's date: the run's recorded one (its prompts), else today's.
  values = loading.chat_template_date(values, run.to_dict() if run is not None else None)
  config = setup.validate(ml_collections.ConfigDict(values), jax.device_count())
  model_cfg, host_params, tokenizer = loading.load_policy(config)
  if restore and not config.model.lora_rank:
    host_params = None  # the run's own weights come from its checkpoint, onto the mesh
    _check_run_checkpoint(*restore, model_cfg)
  return Side(label, config, model_cfg, tokenizer, host_params, checkpoint, restore,
              run.to_dict() if run is not None else None)


_EXECUTION_KEYS = ("param_dtype", "dtype", "remat", "scan_layers", "attention", "moe_matmul",
                   "router_dtype", "lora_rank", "lora_alpha", "lora_targets")


def _check_run_checkpoint(directory: str, step: int, model_cfg) -> None:
  from jaxgrpo.run import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  where = os.path.join(directory, str(step))
  try:
    meta = checkpoint_lib.read_meta(directory, step)
  except Exception as e:  # pylint: disable=broad-except
    raise artifacts.ExportError(f"{where}: unreadable checkpoint ({type(e).__name__})") from None
  if meta.get("layout") != model_lib.PARAM_LAYOUT:
    raise artifacts.ExportError(
        f"{where} holds per-layer parameters (written before jaxgrpo stacked its layers); "
        f"allowed: export it (python -m jaxgrpo.export {os.path.dirname(directory)} "
        f"--step={step} --out=DIR) and evaluate --config.model.hf_checkpoint=DIR")
  for key, value in dataclasses.asdict(model_cfg).items():
    saved = meta.get("model", {}).get(key, value)
    if saved != value:
      raise config_lib.ConfigError(f"config.model.{key}={value!r}: the checkpoint {where} "
                                   f"has {saved!r}; allowed: the checkpoint's value")


def _pick_metrics(text: str | None, c, sources) -> list[str]:
  """The --metrics names, checked against what this validation reports."""
  from jaxgrpo.eval import validation  # pylint: disable=g-import-not-at-top
  k = c.grpo.val_num_generations_per_prompt
  majority = k > 1 and rewards.majority_reward(c.rewards.to_dict()) is not None
  allowed = validation.per_prompt_metrics(k, majority)
  if text is None:
    return ["accuracy"] + [f"pass@{j}" for j in validation.pass_js(k)] + (
        [f"maj@{k}"] if majority else [])
  names = [m.strip() for m in text.split(",") if m.strip()]
  for name in names or [text]:
    base, source = validation.split_metric(name)
    if base not in allowed:
      raise config_lib.ConfigError(
          f"--metrics: {base!r} is not reported with val_num_generations_per_prompt={k}; "
          f"allowed: {', '.join(allowed)}, each optionally /<source>")
    if source is not None and source not in sources:
      raise config_lib.ConfigError(
          f"--metrics: {name!r}: no validation source {source!r}; sources in the data: "
          + (", ".join(sources) if sources else "none (the rows name no source)"))
  return names


def _out_dir(out: str | None, sides, comparing: bool) -> str:
  if out is not None:
    for name in (EVAL_JSON, COMPARE_JSON):
      if os.path.exists(os.path.join(out, name)):
        raise config_lib.ConfigError(f"--out={out}: already holds {name} from an earlier "
                                     "evaluation; allowed: a new or empty folder")
    return out
  # Beside what was evaluated: a run's results under its workdir (a comparison under its
  # second side's run, else its first's), never the current folder (it used to write
  # ./eval/, often the repository's root); sides that are no run go under runs/ (ignored).
  stamp = time.strftime("%Y%m%d-%H%M%S")
  runs = [s for s in sides if s.restore]
  if not comparing and runs:
    return os.path.join(runs[0].checkpoint["workdir"], "eval",
                        f"step_{runs[0].restore[1]}-{stamp}")
  if comparing and runs:
    return os.path.join(runs[-1].checkpoint["workdir"], "eval", f"compare-{stamp}")
  return os.path.join("runs", "eval", f"compare-{stamp}" if comparing else stamp)


def _differences(side) -> list[str]:
  """Validation keys whose value here differs from what the run validated with."""
  run = side.run_config
  here = side.config.to_dict()
  out = []
  for section in ("data", "rewards", "generation", "grpo"):
    for key, value in here[section].items():
      name = f"{section}.{key}"
      if value == "auto" and name == "grpo.val_batch_size":
        continue  # chosen on the devices; no batch size moves validation's numbers
      if (name.startswith(VALIDATION_KEYS) and name not in NOT_VALIDATION
          and run.get(section, {}).get(key, value) != value):
        out.append(f"{name}={value!r} (the run validated with {run[section][key]!r})")
  return out


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
  if side.config.grpo.val_batch_size == sizing.AUTO:
    # As the trainer chooses it: the largest validation batch whose val sampler fits.
    side.config, _, side.val_batches = sizing.choose_auto(
        side.config, side.model_cfg, side.tokenizer, side.data, mesh, keys=("val_batch_size",))
  c, g = side.config, side.config.grpo
  t0 = time.perf_counter()
  params = place(side, mesh)
  key = (side.model_cfg, side.tokenizer.hf.to_str())  # the same prompts and programs
  if key not in validators:
    # An environment task (config.env.name): k episodes per prompt, as the run validated.
    made = build.rollouts(c, side.model_cfg, side.tokenizer, mesh,
                          scorer=scorer.from_config(c, side.tokenizer),
                          template=side.data.template)
    validators[key] = build.make_validator(c, made, side.val_batches, mesh, sources,
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
  if build.kind_of(c).episodes:  # the profile samples one turn per episode
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
  like = (sizing.abstract_adapters(c, side.model_cfg, mesh) if lora_run
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
  plots.save(plots.pass_at_k_figure(result["metrics"], sources, title=side.label),
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
  plots.save(plots.compare_figure(diffs, [validation.split_metric(m)[0] for m in plan.metrics],
                                plan.sources, title=f"B={plan.sides[1].label} minus "
                                f"A={plan.sides[0].label}"),
            os.path.join(plan.out, COMPARE_PNG))

"""python -m jaxgrpo.evaluate --config=FILE [--workdir=DIR [--step=N]] [--config.KEY=VALUE ...]
                            [--out=DIR] [--metrics=M,...]
python -m jaxgrpo.evaluate --config=FILE --compare=A,B [--config.KEY=VALUE ...] [--out=DIR]

Grouped evaluation of a policy outside a training run, by the run's own validation code (the
Validator: the `val` sampling profile, k samples per prompt, val_seed, per-source metrics,
maj@k, the pass@j ladder). The policy is
  --workdir=DIR [--step=N]  a run's checkpoint (the newest by default): the run's config.json
                            gives the model section (architecture, tokenizer, dtypes), the
                            --config file and its overrides everything else;
  otherwise                 the config's own model: model.checkpoint, model.hf_checkpoint,
                            or the seeded random init.
With the run's config, the numbers equal the run's validation row at that step, bit for bit.

--compare=A,B evaluates two policies on the same prompts with the same seeds and reports the
per-prompt paired difference B - A (jaxgrpo/eval/paired.py). Each side is a run folder (DIR,
DIR:STEP or DIR/checkpoints/STEP), a jaxgrpo checkpoint folder (model.json, or @embedded/...)
or a Hugging Face model folder.

--metrics picks the rows of the printed table and the verdict lines (default: accuracy, each
pass@j and maj@k); `pass@4/gsm8k` names one source. The files hold every metric.

--trackers=wandb[,trackio,tensorboard] also logs the evaluation to those trackers (as
config.logging.trackers names them): every metric under eval/ (eval/A/, eval/B/ and the
paired differences under compare/ with --compare) at the checkpoint's step, the table, the
verdicts and the plots as images. The project is the run's own (its config.json's
logging.project; else the config's), --run_name defaults to eval-<what was evaluated>.

Writes into --out (default: <workdir>/eval/step_<N>-<time>; a comparison <workdir>/eval/compare-<time>
under its second side's run, else its first's; sides that are no run: runs/eval/...):
  eval.json       every metric with its stderr and per source, the checkpoint, the sampling
                  profile, wall time, tokens/s and the resolved config
  samples.jsonl   per prompt: its k completions, rewards and extracted answers
  pass_at_k.png   pass@j against j (log axis), +- stderr, one line per source
and with --compare, A/ and B/ as above beside compare.json and compare.png.
Keys only training reads (optim.*, grpo.beta, ...) are ignored and named once. Bad input is
one line on stderr and exit status 2, before anything compiles. Only process 0 writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import ml_collections

from jaxgrpo import export, loading, rewards, train
from jaxgrpo import config as config_lib
from jaxgrpo.model import hf

# Keys no part of an evaluation reads (command-line overrides of them are named as ignored).
TRAINING_ONLY = ("seed", "optim.", "checkpoint.", "logging.", "model.remat",
                 "data.num_train_examples", "grpo.stop_at_validation_threshold",
                 *(f"grpo.{k}" for k in (
                     "num_prompts_per_step", "num_generations_per_prompt", "num_iterations",
                     "beta", "kl_type", "epsilon", "epsilon_high", "loss_agg",
                     "scale_rewards", "mask_truncated_completions", "micro_batch_size",
                     "logprob_chunk_size", "max_num_steps", "val_period", "val_at_start",
                     "val_at_end", "dynamic_sampling", "oversample_factor",
                     "max_generation_batches", "dynamic_sampling_metric")))
# What validation reads: a --workdir evaluation names the ones that differ from the run's.
VALIDATION_KEYS = ("data.", "rewards.", "generation.", "grpo.val_", "grpo.max_val_samples")
USER_ERRORS = loading.USER_ERRORS + (export.ExportError,)


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
  raw = train.parse_config([argv[0], *rest])
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
    if side.config.grpo.val_batch_size != "auto":  # else chosen on the devices (fit.py)
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
    run = export.run_config(path)
    directory, step = export.run_step(path, step)
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
  config = config_lib.validate(ml_collections.ConfigDict(values), jax.device_count())
  model_cfg, host_params, tokenizer = loading.load_policy(config)
  if restore and not config.model.lora_rank:
    host_params = None  # the run's own weights come from its checkpoint, onto the mesh
    _check_run_checkpoint(*restore, model_cfg)
  return Side(label, config, model_cfg, tokenizer, host_params, checkpoint, restore,
              run.to_dict() if run is not None else None)


_EXECUTION_KEYS = ("param_dtype", "dtype", "remat", "scan_layers", "attention", "lora_rank",
                   "lora_alpha", "lora_targets")


def _check_run_checkpoint(directory: str, step: int, model_cfg) -> None:
  from jaxgrpo import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  where = os.path.join(directory, str(step))
  try:
    meta = checkpoint_lib.read_meta(directory, step)
  except Exception as e:  # pylint: disable=broad-except
    raise export.ExportError(f"{where}: unreadable checkpoint ({type(e).__name__})") from None
  if meta.get("layout") != model_lib.PARAM_LAYOUT:
    raise export.ExportError(
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
    from jaxgrpo import evaluator  # pylint: disable=g-import-not-at-top
    for name in (evaluator.EVAL_JSON, evaluator.COMPARE_JSON):
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
      if name.startswith(VALIDATION_KEYS) and run.get(section, {}).get(key, value) != value:
        out.append(f"{name}={value!r} (the run validated with {run[section][key]!r})")
  return out


def main(argv=None) -> int:
  argv = sys.argv if argv is None else argv
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(__doc__.strip())
    return 0
  try:
    plan = prepare(argv)
  except USER_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from jaxgrpo.runtime import compile_options  # the device side: jax compiles from here on
  from jaxgrpo import evaluator
  from jaxgrpo import fit  # pylint: disable=g-import-not-at-top
  compile_options.enable_cache(plan.sides[0].config.compilation_cache_dir)
  try:
    return evaluator.run(plan)
  except fit.FitError as e:  # an 'auto' val_batch_size with nothing that fits
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())

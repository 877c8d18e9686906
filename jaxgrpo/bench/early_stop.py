"""`python -m jaxgrpo.bench early-stop`: how often does a stop rule stop too early?

The plain rule stops at the first validation whose metric reaches the threshold; with a
small validation set some of those validations are lucky, and the policy's true accuracy
is still below the bar. The confidence-aware rule stops only when the metric's lower
confidence bound reaches it. This bench measures both on the embedded default (3-digit
addition), the same way for each of `--runs` seeds:

  train the default GRPO recipe (run seed s) for up to --max_steps steps; every --val_period
  steps validate twice with the run's parameters:
    - the run's validation: --val_prompts prompts x --val_k samples (its accuracy and the
      accuracy's lower bound at --confidence, as the Validator logs them);
    - a large-sample validation: every validation prompt (500) x --big_k samples, whose
      accuracy stands for the policy's true accuracy.

Both rules are read off the same trajectory (a rule does not change training before it
fires), so each run gives each rule's stop step and the large-sample accuracy there. A stop
is "early" when that accuracy is below the threshold. One JSON line per run, then a summary:
each rule's early-stop fraction, never-stopped count and mean stop step.

The threshold should sit near the accuracy the default reaches within --max_steps (0.3:
the temperature-1 accuracy of the shipped policy is ~0.26 and reaches ~0.32 by step 120;
see BENCHMARKS.md): far below it both rules stop at the first validation, far above it
neither stops.
"""

from __future__ import annotations

import statistics
import time

import jax
import ml_collections

from jaxgrpo import scorer
from jaxgrpo.run import build, loading, rollouts, trainer
from jaxgrpo import data as data_lib
from jaxgrpo.run import setup as setup_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.eval import validation
from jaxgrpo.bench import common


def _setup(args):
  """The default config (the bench's validation sizes), one device, the shipped policy."""
  config = common.default_config()
  g = config.grpo
  g.max_num_steps = args.max_steps
  g.val_num_generations_per_prompt = args.val_k
  g.val_batch_size = 100
  g.max_val_samples = 500
  g.stop_at_validation_metric = "accuracy"
  g.stop_at_validation_threshold = args.threshold
  g.stop_at_validation_confidence = args.confidence
  config = setup_lib.validate(config, 1)
  model_cfg, host_params, tokenizer = loading.load_policy(config)
  return config, model_cfg, host_params, tokenizer


def _validator(config, model_cfg, tokenizer, mesh, rows, k, confidence, seed):
  d, g = config.data, config.grpo
  engine = build.make_engine(config, model_cfg, tokenizer, mesh, val_k=k)
  batches = data_lib.validation_batches(rows, tokenizer, g.val_batch_size, d.max_prompt_length,
                                        template=d.prompt_template, process_index=0,
                                        process_count=1)
  return engine, validation.Validator(
      rollouts.SingleTurn(engine, scorer.from_config(config, tokenizer)), batches,
      threshold=g.val_pass_threshold,
      seed=seed, mesh=mesh, stop_metric="accuracy" if confidence else None,
      confidence=confidence)


def run_early_stop(args) -> list[dict]:
  t_start = time.time()
  config, model_cfg, host_params, tokenizer = _setup(args)
  devices = jax.devices()[:1]
  mesh = sharding_lib.make_mesh(config.mesh.to_dict(), devices)
  train_rows, val_rows = data_lib.make_sources(config.data)
  val_rows = val_rows[:config.grpo.max_val_samples]
  # The run's validation: the first --val_prompts prompts; the large one: all of them.
  _, small = _validator(config, model_cfg, tokenizer, mesh, val_rows[:args.val_prompts],
                        args.val_k, args.confidence, seed=0)
  _, big = _validator(config, model_cfg, tokenizer, mesh, val_rows, args.big_k, None, seed=1)
  results, per_rule = [], {"plain": [], "confidence": []}
  for run in range(args.first_seed, args.first_seed + args.runs):
    c = setup_lib.validate(_with_seed(config, run), 1)
    batches = data_lib.PromptBatches(train_rows, tokenizer, c.grpo.num_prompts_per_step,
                                     c.data.max_prompt_length, template=c.data.prompt_template,
                                     seed=run, process_index=0, process_count=1)
    setup = setup_lib.Setup(c, "", model_cfg, host_params, tokenizer, batches, [])
    engine, state, ref_params, update = build.training(setup, mesh)
    trajectory, stops = [], {"plain": None, "confidence": None}
    for step in range(1, args.max_steps + 1):
      state, _ = trainer.train_step(setup, engine, state, ref_params, update, next(batches),
                                    step)
      if step % args.val_period:
        continue
      m = small(state.params, step)
      truth = big(state.params, step)["accuracy"]
      trajectory.append(dict(step=step, accuracy=m["accuracy"], lcb=m["accuracy_lcb"],
                             large_sample_accuracy=truth))
      for rule, value in (("plain", m["accuracy"]), ("confidence", m["accuracy_lcb"])):
        if stops[rule] is None and value >= args.threshold:
          stops[rule] = dict(step=step, large_sample_accuracy=truth,
                             early=truth < args.threshold)
      if all(stops.values()):
        break
    for rule in per_rule:
      per_rule[rule].append(stops[rule])
    results.append(dict(bench="early-stop", run=run, seed=run, threshold=args.threshold,
                        stops=stops, trajectory=trajectory))
    print(f"run {run}: plain {stops['plain']} | confidence {stops['confidence']}", flush=True)
  summary = dict(bench="early-stop", summary=True, runs=args.runs, threshold=args.threshold,
                 confidence=args.confidence, val_prompts=args.val_prompts, val_k=args.val_k,
                 large_sample=dict(prompts=len(val_rows), k=args.big_k),
                 val_period=args.val_period, max_steps=args.max_steps,
                 wall_time_s=round(time.time() - t_start, 1))
  for rule, stops in per_rule.items():
    fired = [s for s in stops if s is not None]
    summary[rule] = dict(
        stopped=len(fired), never_stopped=len(stops) - len(fired),
        early_stops=sum(s["early"] for s in fired),
        early_fraction=(sum(s["early"] for s in fired) / len(fired)) if fired else None,
        mean_stop_step=statistics.fmean(s["step"] for s in fired) if fired else None,
        mean_large_sample_accuracy_at_stop=(
            statistics.fmean(s["large_sample_accuracy"] for s in fired) if fired else None))
  return results + [summary]


def _with_seed(config, seed):
  c = ml_collections.ConfigDict(config.to_dict())
  c.seed = seed
  return c


def add_parsers(sub) -> None:
  """Adds the `early-stop` subcommand to the bench's subparsers (cli.py)."""
  e = sub.add_parser("early-stop", help="plain vs confidence-aware stop rule: how often each "
                     "stops while the large-sample accuracy is still below the threshold")
  e.add_argument("--runs", type=int, default=10, help="training runs (seeds 0..runs-1)")
  e.add_argument("--first_seed", type=int, default=0, help="seed of the first run")
  e.add_argument("--threshold", type=float, default=0.3, help="accuracy to stop at")
  e.add_argument("--confidence", type=float, default=0.95, help="the confidence rule's level")
  e.add_argument("--max_steps", type=int, default=200)
  e.add_argument("--val_period", type=int, default=10)
  e.add_argument("--val_prompts", type=int, default=100, help="the run's validation prompts")
  e.add_argument("--val_k", type=int, default=1, help="the run's samples per prompt")
  e.add_argument("--big_k", type=int, default=4, help="large-sample validation: samples per "
                 "prompt over all 500 validation prompts")
  e.add_argument("--out", default=None, help="also append the JSON lines to this file")
  e.set_defaults(run=run_early_stop)


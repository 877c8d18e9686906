"""`python -m jaxgrpo.bench validation`: what grouped validation buys (see the package
docstring)."""

from __future__ import annotations

import argparse
import statistics

import jax

from jaxgrpo import scorer
from jaxgrpo.run import build, loading, rollouts
from jaxgrpo.run import setup as setup_lib
from jaxgrpo import data as data_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.eval import validation
from jaxgrpo.bench import common

def run_validation(args) -> list[dict]:
  """The `validation` subcommand: one result per k, then the summary comparing min / max k."""
  loadavg_start = common.loadavg()
  devices = jax.devices()[:1]
  config = common.default_config()
  config.grpo.max_val_samples = args.max_val_samples
  config = setup_lib.validate(config, len(devices))
  # The trainer's loader: it also checks that config.model matches the checkpoint.
  model_cfg, host_params, tokenizer = loading.load_policy(config)
  mesh = sharding_lib.make_mesh(config.mesh.to_dict(), devices)
  params = sharding_lib.shard_params(host_params, model_cfg, mesh)
  d, g, gen = config.data, config.grpo, config.generation
  val_rows = data_lib.make_sources(d)[1][:g.max_val_samples]
  batches = data_lib.validation_batches(val_rows, tokenizer, g.val_batch_size,
                                        d.max_prompt_length, template=d.prompt_template)
  results = []
  for k in args.ks:
    engine = build.make_engine(config, model_cfg, tokenizer, mesh, val_k=k)
    val_sp = engine.profile("val").sampling
    validator = validation.Validator(
        rollouts.SingleTurn(engine, scorer.from_config(config, tokenizer)), batches,
        threshold=g.val_pass_threshold, seed=0, mesh=mesh)
    first = validator(params, 0)["wall_time_s"]  # compiles the sampler and the metrics
    runs = []
    for seed in range(args.seeds):
      # The key Validator(seed=seed) would hold; a new Validator per seed would recompile
      # its metrics function (about 1 s on CPU) inside every timed call.
      validator.key = jax.random.key(seed)
      runs.append(validator(params, 0))
    accuracy = [r["accuracy"] for r in runs]
    walls = [r["wall_time_s"] for r in runs]
    results.append(dict(
        bench="validation", preset="embedded-default", checkpoint=config.model.checkpoint,
        k=k, sampling=dict(temperature=val_sp.temperature, top_p=val_sp.top_p,
                           top_k=val_sp.top_k, max_new_tokens=gen.max_new_tokens),
        workload=dict(prompts=runs[0]["num_prompts"], rollouts=runs[0]["num_rollouts"],
                      val_batch_size=g.val_batch_size, dtype=model_cfg.dtype),
        val_seeds=list(range(args.seeds)), accuracy=accuracy,
        accuracy_mean=statistics.fmean(accuracy),
        accuracy_std_across_seeds=statistics.stdev(accuracy), ddof=1,
        accuracy_stderr_mean=statistics.fmean(r["accuracy_stderr"] for r in runs),
        pass_k_mean=statistics.fmean(r[f"pass@{k}"] for r in runs),
        first_call_s=round(first, 3), median_wall_s=round(statistics.median(walls), 4),
        all_wall_s=[round(t, 4) for t in walls],
        sampler_compilations=engine.compilations["val"], **common.machine(devices, loadavg_start)))
    loadavg_start = common.loadavg()
  lo, hi = results[0], results[-1]
  kmin, kmax = lo["k"], hi["k"]
  std_hi = hi["accuracy_std_across_seeds"]
  results.append(dict(
      bench="validation", preset="embedded-default", summary=True, ks=list(args.ks),
      std_ratio=lo["accuracy_std_across_seeds"] / std_hi if std_hi > 0 else None,
      std_ratio_is=f"std_k{kmin} / std_k{kmax} (accuracy across seeds, ddof 1)",
      wall_ratio=hi["median_wall_s"] * kmin / (kmax * lo["median_wall_s"]),
      wall_ratio_is=f"(wall_k{kmax} / {kmax}) / (wall_k{kmin} / {kmin}) (median wall, per sample)",
      **common.machine(devices, loadavg_start)))
  return results


def _ks(text: str) -> tuple[int, ...]:
  """--ks: at least two distinct sample counts >= 1, e.g. '1,8'; returned sorted."""
  try:
    ks = tuple(sorted({int(x) for x in text.split(",")}))
  except ValueError:
    ks = ()
  if len(ks) < 2 or ks[0] < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: expected two or more distinct integers >= 1, "
                                     "e.g. 1,8")
  return ks



def add_parsers(sub) -> None:
  v = sub.add_parser("validation", help="grouped validation: seed spread and cost per k")
  v.add_argument("--ks", type=_ks, default=(1, 8), help="samples per prompt, e.g. 1,8")
  v.add_argument("--seeds", type=int, default=10, help="val seeds 0..N-1 per k (N >= 2)")
  v.add_argument("--max_val_samples", type=int, default=500, help="validation prompts")
  v.add_argument("--out", default=None, help="also append the JSON lines to this file")
  v.set_defaults(run=run_validation)

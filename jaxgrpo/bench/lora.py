"""`python -m jaxgrpo.bench lora -- --config=configs/math.py --config.model.lora_rank=16`:
what LoRA costs the samplers and the update, beside full fine-tuning, on the same batches.

The run is set up as `python -m jaxgrpo.train` sets it up, from the arguments after `--`,
twice: as given (LoRA, rank > 0) and with `model.lora_rank=0` (every weight trained). Each
of --reps steps takes one training batch and times, for both: the policy the samplers run
(`update.policy`: with LoRA the base with the adapters merged, one compiled function per
step), the train-profile rollout, and the update. The samplers run merged weights, so a
LoRA rollout costs the full model's plus the merge; the first step (compilation) is left
out and figures are medians.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import jax

from jaxgrpo import build, train, trainer
from jaxgrpo.bench import common


def run_lora(args) -> list[dict]:
  loadavg_start = common.loadavg()
  with tempfile.TemporaryDirectory() as workdir:
    setup = train.prepare(["train", *args.train_args, f"--workdir={workdir}"])
  if not setup.config.model.lora_rank:
    raise SystemExit("bench lora: give --config.model.lora_rank=R (> 0) after --")
  import dataclasses  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  full = ml_collections.ConfigDict(setup.config.to_dict())
  full.model.lora_rank = 0
  times = {}
  for name, config in (("lora", setup.config), ("full", full)):
    run = dataclasses.replace(setup, config=config)
    engine, state, ref_params, update = build.training(run)
    times[name] = {k: [] for k in ("policy", "rollout", "tokens", "update")}
    for rep in range(args.reps + 1):
      batch = next(run.train_batches)
      t0 = time.perf_counter()
      policy = jax.block_until_ready(update.policy(state, ref_params))
      t_policy = time.perf_counter() - t0
      t0 = time.perf_counter()
      rollout = engine.sample("train", policy, batch["prompt_tokens_BxL"],
                              batch["prompt_mask_BxL"], step=rep + 1)
      tokens = int(jax.device_get(rollout.lengths_N).sum())
      t_rollout = time.perf_counter() - t0
      state, metrics = trainer.train_step(run, engine, state, ref_params, update, batch,
                                          rep + 1)
      if rep:  # the first step compiles
        for key, value in (("policy", t_policy), ("rollout", t_rollout), ("tokens", tokens),
                           ("update", metrics["update_s"])):
          times[name][key].append(value)
  med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
  per_s = lambda m: m["tokens"] / (m["policy"] + m["rollout"])
  c = setup.config.model
  return [dict(
      bench="lora", args=list(args.train_args), lora_rank=c.lora_rank,
      lora_targets=c.lora_targets, reps=args.reps,
      **{f"{name}_{k}_s": round(v, 5) for name, m in med.items() for k, v in m.items()
         if k != "tokens"},
      lora_rollout_tokens_per_s=round(per_s(med["lora"]), 1),
      full_rollout_tokens_per_s=round(per_s(med["full"]), 1),
      rollout_tokens_per_s_ratio=round(per_s(med["lora"]) / per_s(med["full"]), 3),
      update_ratio=round(med["lora"]["update"] / med["full"]["update"], 3),
      **common.machine(jax.devices(), loadavg_start))]


def add_parsers(sub) -> None:
  r = sub.add_parser("lora", help="LoRA's rollout (merge + sampler) and update beside full")
  r.add_argument("--reps", type=common.at_least(1), default=5, help="timed steps")
  r.add_argument("--out", default=None, help="also append the JSON lines to this file")
  r.add_argument("train_args", nargs="*", default=["--config=configs/math.py",
                                                   "--config.model.lora_rank=16"],
                 help="after --: python -m jaxgrpo.train's arguments (a config, overrides)")
  r.set_defaults(run=run_lora)

"""`python -m jaxgrpo.bench rewards -- --config=configs/gsm8k.py:cpu ...`: what the reward
step costs per training step, three ways, on the same completions.

The run is set up as `python -m jaxgrpo.train` sets it up, from the arguments after `--`
(a config and overrides). Each of --reps steps samples one training batch with the run's own
engine and policy and scores its completions:
  * `compute`: decode, then `rewards.compute` in the main thread: the reward step as it was
    before the scoring seam (issue 37's "before");
  * `inline`: `scorer.Scorer` with reward_workers=0 (the main thread, errors caught);
  * `pool`: the config's `reward_workers` processes, each call with its timeout.
and then runs the update, so each line also gives the step's rollout and update seconds and
each way's share of a step (rollout + reward + update). The first step (compilation) is left
out; figures are medians over the other steps.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import jax

from jaxgrpo import rewards, scorer
from jaxgrpo.run import build, setup as setup_lib, trainer
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.bench import common


def run_rewards(args) -> list[dict]:
  loadavg_start = common.loadavg()
  with tempfile.TemporaryDirectory() as workdir:
    setup = setup_lib.prepare(["train", *args.train_args, f"--workdir={workdir}"])
    c, g = setup.config, setup.config.grpo.num_generations_per_prompt
    engine, state, ref_params, update = build.training(setup)
    inline = scorer.Scorer(c.rewards.to_dict(), setup.tokenizer)
    pool = setup.scorer
    times = {k: [] for k in ("compute", "inline", "pool", "rollout", "update")}
    for rep in range(args.reps + 1):
      batch = next(setup.train_batches)
      t0 = time.perf_counter()
      rollout = engine.sample("train", update.policy(state, ref_params),
                              batch["prompt_tokens_BxL"],
                              batch["prompt_mask_BxL"], step=rep + 1)
      tokens_NxT, lengths_N = sharding_lib.to_local((rollout.tokens_NxT, rollout.lengths_N))
      t_rollout = time.perf_counter() - t0
      answers = [row["answer"] for row in batch["rows"] for _ in range(g)]
      t0 = time.perf_counter()
      rewards.compute(c.rewards.to_dict(), setup.tokenizer.decode_batch(tokens_NxT), answers)
      t_compute = time.perf_counter() - t0
      t_inline = _timed(lambda: inline(tokens_NxT, lengths_N, batch, g))
      t_pool = _timed(lambda: pool(tokens_NxT, lengths_N, batch, g))
      state, metrics = trainer.train_step(setup, engine, state, ref_params, update, batch,
                                          rep + 1)
      if rep:  # the first step compiles
        for key, value in (("compute", t_compute), ("inline", t_inline), ("pool", t_pool),
                           ("rollout", t_rollout), ("update", metrics["update_s"])):
          times[key].append(value)
    pool.close()
  med = {k: statistics.median(v) for k, v in times.items()}
  rest = med["rollout"] + med["update"]
  return [dict(
      bench="rewards", args=list(args.train_args), rewards=c.rewards.to_dict(),
      rows_per_step=int(len(batch["rows"]) * g), reward_workers=pool.workers, reps=args.reps,
      **{f"{k}_s": round(v, 5) for k, v in med.items()},
      **{f"{k}_share": round(med[k] / (rest + med[k]), 4) for k in ("compute", "inline", "pool")},
      pool_over_compute=round(med["pool"] / med["compute"], 3) if med["compute"] else None,
      **common.machine(jax.devices(), loadavg_start))]


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def add_parsers(sub) -> None:
  r = sub.add_parser("rewards", help="the reward step's cost per training step")
  r.add_argument("--reps", type=common.at_least(1), default=5, help="timed steps")
  r.add_argument("--out", default=None, help="also append the JSON lines to this file")
  r.add_argument("train_args", nargs="*", default=["--config=configs/math.py"],
                 help="after --: python -m jaxgrpo.train's arguments (a config, overrides)")
  r.set_defaults(run=run_rewards)


"""`python -m jaxgrpo.bench episodes -- --config=configs/calculator.py`: where a multi-turn
step's rollout time goes, beside a single-turn rollout of as many sampled tokens.

The run is set up as `python -m jaxgrpo.train` sets it up (an environment config), and each
of --reps steps takes one training batch through the episode runner (episodes.py): its
sampler calls (one per turn: each prefills the episodes' contexts again and decodes the
turn) and the host's time in the environments. Beside them, on the same contexts:
  prefill  the turns' sampler calls with one new token each (a profile of max_new_tokens=1,
           compiled once here): what re-reading the context costs per turn;
  single   one single-turn rollout per step of the same prompts and G, with max_new_tokens
           the longest episode's sampled tokens, so it samples at least as many tokens per
           row as the episodes did (the engine of env.name='').
The first step (compilation) is left out; figures are medians per step.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

import jax
import ml_collections
import numpy as np

from jaxgrpo import build, train
from jaxgrpo.bench import common
from jaxgrpo.rollout import sampling


class _Timed:
  """Wraps an engine: sums the seconds of its sample calls and keeps their contexts."""

  def __init__(self, engine):
    self.engine, self.pad_id = engine, engine.pad_id
    self.seconds, self.contexts = 0.0, []

  def sample(self, name, params, tokens, mask, **kwargs):
    t0 = time.perf_counter()
    out = self.engine.sample(name, params, tokens, mask, **kwargs)
    jax.block_until_ready(out.lengths_N)
    self.seconds += time.perf_counter() - t0
    self.contexts.append((np.array(tokens), np.array(mask), kwargs))
    return out


def run_episodes(args) -> list[dict]:
  loadavg_start = common.loadavg()
  with tempfile.TemporaryDirectory() as workdir:
    setup = train.prepare(["train", *args.train_args, f"--workdir={workdir}"])
  c = setup.config
  if not c.env.name:
    raise SystemExit("bench episodes: give an environment config after -- "
                     "(e.g. --config=configs/calculator.py)")
  engine, state, ref_params, update = build.training(setup)
  params = update.policy(state, ref_params)
  # One new token per turn, on the same contexts: the prefill's share of each turn.
  one = dict(engine.profiles)
  one["train"] = dataclasses.replace(one["train"], max_new_tokens=1)
  prefill_engine = sampling.RolloutEngine(
      engine.cfg, engine.mesh, one, max_prompt_length=engine.max_prompt_length,
      eos_id=build.stop_ids(c, setup.tokenizer), pad_id=engine.pad_id, seed=c.seed,
      scan_layers=engine.scan_layers, attention=engine.attention, episodes=True)
  single_config = ml_collections.ConfigDict(c.to_dict())
  single_config.env.name, single_config.generation.max_episode_tokens = "", 0
  g = c.grpo.num_generations_per_prompt
  rows = []
  # One runner for every step, as a run has: its environment workers start once.
  runner = build.make_runner(c, engine, setup.tokenizer)
  for rep in range(args.reps + 1):
    timed = runner.engine = _Timed(engine)
    batch = next(setup.train_batches)
    ep = runner.run("train", params, batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"],
                    batch["rows"], g, key=engine.key("train", rep), step=rep)
    t0 = time.perf_counter()
    for tokens, mask, kwargs in timed.contexts:
      jax.block_until_ready(prefill_engine.sample("train", params, tokens, mask,
                                                  **kwargs).lengths_N)
    t_prefill = time.perf_counter() - t0
    sampled = int(ep.trained_NxT.sum())
    longest = max(1, int(ep.trained_NxT.sum(axis=1).max()))
    single_config.generation.max_new_tokens = longest
    single = build.make_engine(single_config, engine.cfg, setup.tokenizer, engine.mesh)
    jax.block_until_ready(single.sample("train", params, batch["prompt_tokens_BxL"],
                                        batch["prompt_mask_BxL"], step=rep).lengths_N)
    t0 = time.perf_counter()  # the second call: the first one compiled
    out = single.sample("train", params, batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"],
                        step=rep)
    single_tokens = int(jax.device_get(out.lengths_N).sum())
    t_single = time.perf_counter() - t0
    if rep:  # the first step compiles
      rows.append(dict(sampler_s=timed.seconds, calls=len(timed.contexts),
                       prefill_s=t_prefill, env_s=ep.env_s, sampled_tokens=sampled,
                       observation_tokens=int(ep.observation_tokens_N.sum()),
                       turns_mean=float(ep.turns_N.mean()),
                       tool_calls_mean=float(ep.tool_calls_N.mean()),
                       single_s=t_single, single_tokens=single_tokens,
                       single_max_new_tokens=longest))
  runner.close()
  med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
  return [dict(
      bench="episodes", args=list(args.train_args), reps=args.reps, episodes=len(ep.turns_N),
      **{k: round(v, 5) if isinstance(v, float) else v for k, v in med.items()},
      multi_tokens_per_s=round(med["sampled_tokens"] / (med["sampler_s"] + med["env_s"]), 1),
      single_tokens_per_s=round(med["single_tokens"] / med["single_s"], 1),
      prefill_share=round(med["prefill_s"] / med["sampler_s"], 3),
      env_share=round(med["env_s"] / (med["sampler_s"] + med["env_s"]), 3),
      **common.machine(jax.devices(), loadavg_start))]


def add_parsers(sub) -> None:
  r = sub.add_parser("episodes", help="a multi-turn step's sampler, prefill and environment "
                     "time, beside a single-turn rollout")
  r.add_argument("--reps", type=common.at_least(1), default=3, help="timed steps")
  r.add_argument("--out", default=None, help="also append the JSON lines to this file")
  r.add_argument("train_args", nargs="*", default=["--config=configs/calculator.py"],
                 help="after --: python -m jaxgrpo.train's arguments (a config, overrides)")
  r.set_defaults(run=run_episodes)

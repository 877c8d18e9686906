"""`python -m jaxgrpo.bench episodes -- --config=configs/calculator.py`: where a multi-turn
step's rollout time goes, beside a single-turn rollout of as many sampled tokens.

The run is set up as `python -m jaxgrpo.train` sets it up (an environment config), and each
of --reps steps takes one training batch through the episode runner (episodes.py): its
device calls (rollout/turns.py: one start, the prompts' prefill, then one turn call per
turn: append the new tokens to the KV cache, decode the turn) and the host's time in the
environments. Beside them, on the same inputs:
  append   the turns' calls again with one new token each (a profile of max_new_tokens=1,
           on a copy of each turn's cache): what appending the observation costs per turn;
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

from jaxgrpo.run import build, setup as setup_lib
from jaxgrpo.bench import common
from jaxgrpo.rollout import turns


class _Timed:
  """Wraps an episode engine: sums the seconds of its start and turn calls and keeps each
  turn's inputs (a copy of its cache: the call consumes the cache it is given)."""

  def __init__(self, engine):
    self.engine, self.pad_id = engine, engine.pad_id
    self.start_s, self.turn_s, self.turns = 0.0, 0.0, []

  def start(self, *args):
    t0 = time.perf_counter()
    cache = jax.block_until_ready(self.engine.start(*args))
    self.start_s += time.perf_counter() - t0
    return cache

  def turn(self, name, params, cache, slot, new, **kwargs):
    self.turns.append((jax.block_until_ready(jax.tree.map(lambda x: x.copy(), cache)),
                       slot.copy(), [list(ids) for ids in new], kwargs))
    t0 = time.perf_counter()
    out, cache = self.engine.turn(name, params, cache, slot, new, **kwargs)
    jax.block_until_ready((out.lengths_N, cache))
    self.turn_s += time.perf_counter() - t0
    return out, cache


def run_episodes(args) -> list[dict]:
  loadavg_start = common.loadavg()
  with tempfile.TemporaryDirectory() as workdir:
    setup = setup_lib.prepare(["train", *args.train_args, f"--workdir={workdir}"])
  c = setup.config
  if not c.env.name:
    raise SystemExit("bench episodes: give an environment config after -- "
                     "(e.g. --config=configs/calculator.py)")
  engine, state, ref_params, update = build.training(setup)
  params = update.policy(state, ref_params)
  # One new token per turn, on the same inputs: the append's share of each turn.
  one = dict(engine.profiles)
  one["train"] = dataclasses.replace(one["train"], max_new_tokens=1)
  append_engine = turns.EpisodeEngine(
      engine.cfg, engine.mesh, one, max_prompt_length=engine.max_prompt_length,
      max_episode_tokens=engine.max_episode_tokens,
      max_append_tokens=engine.max_append_tokens, eos_id=engine.eos_id, pad_id=engine.pad_id,
      seed=c.seed, scan_layers=engine.scan_layers, attention=engine.attention)
  single_config = ml_collections.ConfigDict(c.to_dict())
  single_config.env.name, single_config.generation.max_episode_tokens = "", 0
  g = c.grpo.num_generations_per_prompt
  rows = []
  # One runner for every step, as a run has: its environment workers start once.
  runner = build.rollouts(c, setup.model_cfg, setup.tokenizer, engine.mesh, engine=engine,
                          template=setup.data.template if setup.data else None).runner
  for rep in range(args.reps + 1):
    timed = runner.engine = _Timed(engine)
    batch = next(setup.train_batches)
    ep = runner.run("train", params, batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"],
                    batch["rows"], g, key=engine.key("train", rep), step=rep)
    t_append = 0.0
    for cache, slot, new, kwargs in timed.turns:
      t0 = time.perf_counter()
      jax.block_until_ready(append_engine.turn("train", params, cache, slot, new, **kwargs))
      t_append += time.perf_counter() - t0
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
      rows.append(dict(sampler_s=timed.start_s + timed.turn_s, calls=len(timed.turns),
                       start_s=timed.start_s, turn_s=timed.turn_s, append_s=t_append,
                       env_s=ep.env_s, sampled_tokens=sampled,
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
      start_share=round(med["start_s"] / med["sampler_s"], 3),
      append_share=round(med["append_s"] / med["turn_s"], 3),
      env_share=round(med["env_s"] / (med["sampler_s"] + med["env_s"]), 3),
      **common.machine(jax.devices(), loadavg_start))]


def add_parsers(sub) -> None:
  r = sub.add_parser("episodes", help="a multi-turn step's sampler, append and environment "
                     "time, beside a single-turn rollout")
  r.add_argument("--reps", type=common.at_least(1), default=3, help="timed steps")
  r.add_argument("--out", default=None, help="also append the JSON lines to this file")
  r.add_argument("train_args", nargs="*", default=["--config=configs/calculator.py"],
                 help="after --: python -m jaxgrpo.train's arguments (a config, overrides)")
  r.set_defaults(run=run_episodes)

"""`python -m jaxgrpo.bench long-tail`: partial rollouts against synchronous ones on a
long-tailed length distribution (issue 52).

A scripted policy ends rollout i at a drawn length (the round program's per-row limit, end
tokens off), so the figures depend on the distribution alone, not on what a model learns.
Both modes run the very pool and round program a run uses (run/partial_rollouts.py,
rollout/partial.py), on one device, the same model and the same rollouts:

  synchronous  each step decodes until its rows have all ended (a round budget of
               new_tokens: no row is carried, rows that end early wait for the longest),
               as the synchronous sampler does (it shares each prompt's prefill among its G
               rows and may compact; the decode steps are the same);
  partial      rounds of --max_tokens_per_step tokens; rows that end are refilled with
               the next rollouts, rows that have not ended continue at the next step.

After one warm-up step each (the compile), --steps update batches of B x G rollouts are
collected in each mode. Each line: decode steps, decode steps per trained token (the
accelerator's cost: a decode step costs about the same with 10 live rows as with 500),
the live fraction (live rows per decode step / rows), the rounds, the staleness of the
trained tokens, the groups dropped (below the staleness bound) and re-queued (at or above
it), the mean trained completion length and its ratio to the synchronous mode's
(`trained_length_ratio`: below 1 when long answers are lost), and the wall time of the
rounds here, with its ratio to the synchronous one.

Shapes (completion lengths, capped at --new_tokens): longtail: log-normal, median
new_tokens / 8, sigma 1 (reasoning-like); uniform: uniform in [1, new_tokens]; embedded:
every completion new_tokens long (the embedded default writes its 4 digits and the end
token: 5 of 5); or a file of integers, one a line.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxgrpo.bench import common
from jaxgrpo.bench import packing
from jaxgrpo.bench import step as bench_step
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import partial, sampling
from jaxgrpo.run import partial_rollouts

SP = sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
TABLE = 4096  # scripted lengths, by rollout id modulo this


class _Prompts:
  """PromptBatches' interface over random prompts: batch k holds rows k*B..k*B+B-1."""

  def __init__(self, cfg, prompts: int, prompt_len: int, seed: int):
    rng = np.random.default_rng(seed)
    self.local_batch_size, self.k, self.width = prompts, 0, prompt_len
    self.tokens = rng.integers(3, cfg.vocab_size, (TABLE, prompt_len)).astype(np.int32)
    self.real = rng.integers(max(prompt_len // 4, 1), prompt_len + 1, TABLE)

  def collate_rows(self, row_ids):
    row_ids = np.asarray(row_ids) % TABLE
    mask = np.arange(self.width)[None] >= (self.width - self.real[row_ids])[:, None]
    return {"prompt_tokens_BxL": np.where(mask, self.tokens[row_ids], 0), "prompt_mask_BxL": mask,
            "row_ids_B": row_ids.astype(np.int32)}

  def __next__(self):
    rows = np.arange(self.k * self.local_batch_size, (self.k + 1) * self.local_batch_size)
    self.k += 1
    return dict(self.collate_rows(rows), batch_offset=0)


def lengths_table(shape: str, new_tokens: int, seed: int) -> np.ndarray:
  if shape == "embedded":
    return np.full(TABLE, new_tokens, np.int32)
  return packing.completion_lengths(shape, TABLE, new_tokens, seed)


def run_mode(cfg, params, mesh, args, budget: int, lengths: np.ndarray) -> dict:
  """--steps update batches (after a warm-up step) at this round budget."""
  prompts = _Prompts(cfg, args.prompts, args.prompt_len, args.seed)
  profiles = {name: sampling.Profile(SP, 1, args.new_tokens) for name in ("train", "val")}
  engine = partial.PartialEngine(cfg, mesh, profiles, rows=args.prompts * args.generations,
                                 max_prompt_length=args.prompt_len, eos_id=None, pad_id=0,
                                 seed=args.seed)
  config = ml_collections.ConfigDict({
      "generation": {"max_tokens_per_step": budget, "max_new_tokens": args.new_tokens},
      "grpo": {"max_staleness": args.max_staleness, "importance_weight_cap": 2.0,
               "num_generations_per_prompt": args.generations,
               "num_prompts_per_step": args.prompts}})
  source = partial_rollouts.PartialRollouts(config, engine, None, prompts)
  source.limit_of = lambda ids: lengths[np.asarray(ids) % TABLE]
  source.gather(params, 1)  # warm-up: the round program's compile
  totals = {"decode_steps": 0, "trained_tokens": 0, "rounds": 0, "live": 0.0, "staleness": 0.0,
            "dropped_groups": 0, "requeued_groups": 0, "trained_rollouts": 0}
  t0 = time.perf_counter()
  for s in range(args.steps):
    got, _, _, _, metrics = source.gather(params, 2 + s)  # frozen parameters: version s+1
    totals["decode_steps"] += metrics["rollout/decode_steps"]
    totals["trained_tokens"] += int(got["length_N"].sum())
    totals["rounds"] += metrics["rollout/rounds"]
    totals["live"] += metrics["rollout/live_fraction"] * metrics["rollout/decode_steps"]
    totals["staleness"] += metrics["staleness_mean"] * int(got["length_N"].sum())
    totals["dropped_groups"] += metrics["rollout/dropped_groups"]
    totals["requeued_groups"] += metrics["rollout/requeued_groups"]
    totals["trained_rollouts"] += len(got["length_N"])
  jax.block_until_ready(source.state)
  wall = time.perf_counter() - t0
  return {"decode_steps": totals["decode_steps"], "trained_tokens": totals["trained_tokens"],
          "decode_steps_per_trained_token": totals["decode_steps"] / totals["trained_tokens"],
          "live_fraction": totals["live"] / max(totals["decode_steps"], 1),
          "rounds": totals["rounds"],
          "staleness_mean": totals["staleness"] / totals["trained_tokens"],
          "dropped_groups": totals["dropped_groups"],
          "requeued_groups": totals["requeued_groups"],
          "trained_length_mean": totals["trained_tokens"] / totals["trained_rollouts"],
          "wall_s": round(wall, 3), "compilations": engine.compilations["train"]}


def run_long_tail(args) -> list[dict]:
  start = common.loadavg()
  cfg = bench_step.preset_config(args.preset)
  mesh = sharding_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  params = sharding_lib.init_sharded(cfg, mesh, jax.random.key(args.seed))
  lengths = lengths_table(args.lengths, args.new_tokens, args.seed)
  budget = args.max_tokens_per_step or max(args.new_tokens // 8, 1)
  results = []
  sync = run_mode(cfg, params, mesh, args, args.new_tokens, lengths)
  part = run_mode(cfg, params, mesh, args, budget, lengths)
  shape = {"lengths": args.lengths, "median": float(np.median(lengths)),
           "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max())}
  for mode, got, tokens in (("synchronous", sync, args.new_tokens), ("partial", part, budget)):
    results.append({
        "bench": "long-tail", "mode": mode, "preset": args.preset, "prompts": args.prompts,
        "generations": args.generations, "new_tokens": args.new_tokens,
        "max_tokens_per_step": tokens, "steps": args.steps, **shape, **got,
        "decode_steps_ratio_to_synchronous": round(got["decode_steps_per_trained_token"]
                                                   / sync["decode_steps_per_trained_token"], 4),
        "wall_ratio_to_synchronous": round(got["wall_s"] / sync["wall_s"], 4),
        # The mean trained completion length against the synchronous mode's on the same
        # prompts: below 1 when the long answers are the ones lost (issue 63).
        "trained_length_ratio": round(got["trained_length_mean"]
                                      / sync["trained_length_mean"], 4),
        **common.machine(jax.devices(), start)})
  if args.reprefill:
    results.append(_reprefill(cfg, params, args, part, start))
  return results


def _reprefill(cfg, params, args, part: dict, start) -> dict:
  """What re-prefilling the carried rows would cost each round instead of keeping their
  caches: one prefill of every sampler row over its prompt and --reprefill written tokens,
  timed (best of 3 after a warm-up) beside the partial mode's mean round."""
  rows, width = args.prompts * args.generations, args.prompt_len + args.reprefill
  tokens, mask = jnp.ones((rows, width), jnp.int32), jnp.ones((rows, width), bool)
  prefill = jax.jit(lambda p, t, m: sampling.prefill(p, cfg, t, m)[0])
  seconds = min(common.timed(lambda: prefill(params, tokens, mask).block_until_ready(), 3)[1])
  round_s = part["wall_s"] / part["rounds"]
  return {"bench": "long-tail", "mode": "re-prefill", "preset": args.preset, "rows": rows,
          "tokens": width, "prefill_s": round(seconds, 3), "partial_round_s": round(round_s, 3),
          "ratio_to_round": round(seconds / round_s, 3), **common.machine(jax.devices(), start)}


def add_parsers(sub) -> None:
  p = sub.add_parser("long-tail", help="partial rollouts vs synchronous on long-tailed lengths")
  p.add_argument("--preset", choices=bench_step.PRESET_NAMES, default="tiny")
  p.add_argument("--prompts", type=common.at_least(1), default=8)
  p.add_argument("--generations", type=common.at_least(1), default=8)
  p.add_argument("--prompt_len", type=common.at_least(1), default=16)
  p.add_argument("--new_tokens", type=common.at_least(1), default=256)
  p.add_argument("--lengths", default="longtail",
                 help="longtail, uniform, embedded, or a file of lengths (one a line)")
  p.add_argument("--max_tokens_per_step", type=common.at_least(0), default=0,
                 help="the partial mode's round budget (0: new_tokens / 8)")
  p.add_argument("--max_staleness", type=common.at_least(0), default=1000,
                 help="the partial mode's (default: none dropped, to count every rollout)")
  p.add_argument("--steps", type=common.at_least(1), default=6)
  p.add_argument("--reprefill", type=common.at_least(0), default=0,
                 help="also time a prefill of every row over its prompt and this many "
                      "written tokens: what a round would pay to re-prefill carried rows")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="also append the JSON lines to this file")
  p.set_defaults(run=run_long_tail)

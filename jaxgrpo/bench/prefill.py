"""`python -m jaxgrpo.bench prefill`: the prefill's FLOP rate, and what prefix sharing buys."""

from __future__ import annotations

import statistics

import jax
import numpy as np

from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.bench import common, roofline

def run_prefill(args) -> list[dict]:
  """The `prefill` subcommand: the prefill's FLOP rate against the machine's matmul rate,
  and what sharing each prompt's prefill across its G samples buys.

  Workload: `--prompts` prompts of `--prompt_len` random tokens (all real, no padding), G =
  `--samples`, `--new_tokens` new tokens at temperature 1 with EOS off. `shared` is the
  engine as it runs (each prompt prefilled once, its K/V read by all G samples); `unshared`
  prefills every sample's copy of its prompt (RolloutEngine(share_prefix=False)), as a
  sampler without prefix sharing does. The two are timed alternately, call by call.
  """
  loadavg_start = common.loadavg()
  devices = jax.devices()[:1]
  cfg = common.preset_config(args.preset)
  mesh = sharding_lib.make_mesh({"data": 1}, devices)
  params = sharding_lib.init_sharded(cfg, mesh, jax.random.key(0))
  rng = np.random.default_rng(0)
  b, p, g, t = args.prompts, args.prompt_len, args.samples, args.new_tokens
  tokens = rng.integers(3, cfg.vocab_size, size=(b, p)).astype(np.int32)
  mask = np.ones((b, p), bool)
  workload = dict(prompts=b, prompt_len=p, samples=g, new_tokens=t, eos=None, dtype=cfg.dtype)

  prefill = jax.jit(lambda params, tokens, mask: sampling.prefill(params, cfg, tokens, mask))
  flops = roofline.compiled_flops(prefill.lower(params, tokens, mask).compile())
  first, times = common.timed(lambda: jax.block_until_ready(prefill(params, tokens, mask)),
                              args.reps)
  med = statistics.median(times)
  rate = roofline.matmul_rate()["flops_per_s"]
  results = [dict(bench="prefill", kind="prefill", preset=args.preset, workload=workload,
                  flops=flops, first_call_s=round(first, 3), median_s=round(med, 4),
                  all_s=[round(x, 4) for x in times], flops_per_s=round(flops / med),
                  matmul_flops_per_s=round(rate), roofline_fraction=round(flops / med / rate, 3),
                  **common.machine(devices, loadavg_start))]

  loadavg_start = common.loadavg()
  profiles = {"train": sampling.Profile(common.MODES["pure"], g, t),
              "val": sampling.Profile(common.MODES["greedy"], 1, t)}  # required, never called
  engines = {share: sampling.RolloutEngine(cfg, mesh, profiles, max_prompt_length=p,
                                           eos_id=None, pad_id=common.PAD, seed=0,
                                           share_prefix=share)
             for share in (True, False)}
  calls = {share: (lambda e=e: jax.block_until_ready(e.sample("train", params, tokens, mask)))
           for share, e in engines.items()}
  firsts = {share: common.timed(call, 0)[0] for share, call in calls.items()}
  walls = {True: [], False: []}
  for _ in range(args.reps):  # alternate, so a noisy moment hits both sides
    for share, call in calls.items():
      walls[share].append(common.timed(call, 1)[1][0])
  shared, unshared = (statistics.median(walls[s]) for s in (True, False))
  results.append(dict(
      bench="prefill", kind="prefix_sharing", preset=args.preset, workload=workload,
      # Microseconds: a short rollout's median is a few ms, and 0.1 ms steps would move the
      # ratio of the two rounded medians by several percent away from cost_ratio.
      shared_median_s=round(shared, 6), unshared_median_s=round(unshared, 6),
      shared_all_s=[round(x, 6) for x in walls[True]],
      unshared_all_s=[round(x, 6) for x in walls[False]],
      shared_first_call_s=round(firsts[True], 3), unshared_first_call_s=round(firsts[False], 3),
      cost_ratio=round(shared / unshared, 4), speedup=round(unshared / shared, 2),
      cost_ratio_is="shared / unshared median wall per rollout call",
      **common.machine(devices, loadavg_start)))
  return results




def add_parsers(sub) -> None:
  pf = sub.add_parser("prefill", help="prefill FLOP rate, and what prefix sharing buys")
  pf.add_argument("--preset", choices=sorted(common.PRESETS), default="small")
  pf.add_argument("--prompts", type=int, default=4, help="distinct prompts")
  pf.add_argument("--prompt_len", type=int, default=512, help="tokens per prompt")
  pf.add_argument("--samples", type=int, default=8, help="samples per prompt (G)")
  pf.add_argument("--new_tokens", type=int, default=16, help="tokens sampled per row")
  pf.add_argument("--reps", type=int, default=5, help="timed calls (alternating shared/unshared)")
  pf.add_argument("--out", default=None, help="also append the JSON lines to this file")
  pf.set_defaults(run=run_prefill)

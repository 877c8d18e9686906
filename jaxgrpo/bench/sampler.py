"""`python -m jaxgrpo.bench sampler`: the compiled sampler on the Tunix peer's workload
(see the package docstring)."""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxgrpo.model import decoder as model_lib
from jaxgrpo.rollout import policy as policy_lib
from jaxgrpo.bench import common, roofline

def sampler_flops(cfg: model_lib.ModelConfig, prompts: int, samples: int, prompt_len: int,
                  new_tokens: int) -> float:
  """Analytic FLOPs of one sampler call as computed: each prompt's prefill once, then
  new_tokens - 1 decode steps of every row attending over the whole L + T cache (the loop
  masks unfilled slots rather than skipping them)."""
  return (prompts * prompt_len * roofline.model_flops_per_token(cfg, prompt_len)
          + prompts * samples * (new_tokens - 1)
          * roofline.model_flops_per_token(cfg, prompt_len + new_tokens))


def bench_sampler(policy: policy_lib.Policy, mode: str, reps: int, new_tokens: int) -> dict:
  """Times `reps` full sampler calls after a first (compiling) one; returns the stats."""
  sp = common.MODES[mode]

  def call(seed):
    tokens, mask = common.prompt_batch()
    out = policy.generate(tokens, sp, num_samples=common.NUM_SAMPLES, max_new_tokens=new_tokens,
                          seed=seed, prompt_mask_BxL=mask)
    jax.block_until_ready(out)
    ids, lengths = jax.device_get((out.tokens_NxT, out.lengths_N))
    texts = [common.decode(row[:n]) for row, n in zip(ids, lengths)]
    return ids, lengths, texts, tokens.shape[1]

  t0 = time.perf_counter()
  call(0)
  first = time.perf_counter() - t0
  times = []
  for r in range(reps):
    t0 = time.perf_counter()
    ids, lengths, texts, width = call(r + 1)
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  generated = int(np.sum(lengths))
  flops = sampler_flops(policy.cfg, len(common.PROMPTS), common.NUM_SAMPLES, width, new_tokens)
  return dict(flops_per_call=flops, flops_per_s=round(flops / med), 
      mode=mode, sampling=dict(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k),
      workload=dict(prompts=len(common.PROMPTS), samples=common.NUM_SAMPLES, prompt_len=width,
                    new_tokens=new_tokens, eos=None, dtype=policy.cfg.dtype),
      tokens_per_s=round(generated / med, 1), first_call_s=round(first, 3),
      median_s=round(med, 4), all_s=[round(t, 4) for t in times],
      generated_tokens=generated, rows=int(ids.shape[0]),
      decode_steps_per_s=round(new_tokens / med, 1), sample_text=texts[0][:40])


def run_sampler(args) -> list[dict]:
  """The `sampler` subcommand: one result per mode, model built once."""
  loadavg_start = common.loadavg()
  devices = jax.devices()[:1]
  cfg = common.preset_config(args.preset)
  policy = policy_lib.Policy.init(cfg, seed=0, mesh=None, pad_id=common.PAD, eos_id=None)
  modes = list(common.MODES) if args.mode == "all" else [args.mode]
  results = []
  for mode in modes:
    stats = bench_sampler(policy, mode, args.reps, args.new_tokens)
    # The roofline's denominator, measured right after the figure it divides (same load).
    rate = roofline.matmul_rate()["flops_per_s"]
    results.append(dict(bench="sampler", preset=args.preset, n_params=policy.num_params,
                        **stats, matmul_flops_per_s=round(rate),
                        roofline_fraction=round(stats["flops_per_s"] / rate, 3),
                        **common.machine(devices, loadavg_start)))
    loadavg_start = common.loadavg()
  return results




def add_parsers(sub) -> None:
  s = sub.add_parser("sampler", help="time the compiled sampler on the peer's workload")
  s.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny")
  s.add_argument("--mode", choices=[*common.MODES, "all"], default="pure",
                 help="sampling settings; 'all' runs each and prints one line each")
  s.add_argument("--reps", type=int, default=10, help="timed calls after the first")
  s.add_argument("--out", default=None, help="also append the JSON line(s) to this file")
  s.add_argument("--new_tokens", type=int, default=common.NEW_TOKENS, help=argparse.SUPPRESS)
  s.set_defaults(run=run_sampler)

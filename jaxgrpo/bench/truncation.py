"""`python -m jaxgrpo.bench truncation`: what truncated sampling costs per decode step, alone.

One decode step's draw (`distribution.draw`: temperature, top-k / top-p, the inverse-CDF
pick, both log-probs) for --rows rows over a --vocab vocabulary (Qwen's 151,936 by
default), jitted, on random logits: normal with standard deviation --logit_std (6: peaked
like a trained model's; the top-p 0.95 nucleus holds 1 to ~200 tokens, median ~50), of which
--flat_rows rows get 0.01 (near-uniform: a nucleus of most of the vocabulary, which makes
top-p alone sort the whole vocabulary for the batch). One JSON line per mode, with the
median call and its ratio to plain sampling (`pure`) in the same process; the modes run in
turn, --reps times each, alternating, so a machine that gets busier does not favour one.

It isolates the draw from the model: on an accelerator the sampler's top-k / top-p cost is
this call's time x the decode steps (`bench rollout` measures the whole rollout).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.model import distribution
from jaxgrpo.bench import common

SP = distribution.SamplingParams
MODES = {"pure": SP(1.0, 1.0, 0), "topk50_topp095": SP(1.0, 0.95, 50),
         "topk50": SP(1.0, 1.0, 50), "topp095": SP(1.0, 0.95, 0)}


def run_truncation(args) -> list[dict]:
  loadavg_start = common.loadavg()
  devices = jax.devices()[:1]
  rng = np.random.default_rng(0)
  std = np.full((args.rows, 1), args.logit_std, np.float32)
  std[args.rows - args.flat_rows:] = 0.01
  logits = jax.device_put((rng.standard_normal((args.rows, args.vocab)) * std)
                          .astype(np.float32), devices[0])
  u = jax.device_put(rng.random(args.rows).astype(np.float32), devices[0])
  fns = {mode: jax.jit(lambda x, u, sp=MODES[mode]: distribution.draw(x, u, sp))
         for mode in args.modes}
  first = {}
  for mode, fn in fns.items():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(logits, u))
    first[mode] = time.perf_counter() - t0
  times = {mode: [] for mode in fns}
  for _ in range(args.reps):
    for mode, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(logits, u))
      times[mode].append(time.perf_counter() - t0)
  nucleus = np.asarray(jnp.sum(jnp.isfinite(distribution.candidate_logprobs(
      logits, MODES["topp095"])[0]), axis=-1))
  base = statistics.median(times["pure"]) if "pure" in times else None
  results = []
  for mode in fns:
    med = statistics.median(times[mode])
    sp = MODES[mode]
    results.append(dict(
        bench="truncation", mode=mode,
        sampling=dict(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k),
        rows=args.rows, vocab=args.vocab, logit_std=args.logit_std, flat_rows=args.flat_rows,
        nucleus_095_tokens=dict(min=int(nucleus.min()), median=float(np.median(nucleus)),
                                max=int(nucleus.max())),
        nucleus_candidates=distribution.NUCLEUS_CANDIDATES,
        median_ms=round(med * 1e3, 3), all_ms=[round(t * 1e3, 3) for t in times[mode]],
        vs_pure=None if base is None else round(med / base, 3),
        first_call_s=round(first[mode], 3), **common.machine(devices, loadavg_start)))
  return results


def add_parsers(sub) -> None:
  t = sub.add_parser("truncation", help="one decode step's draw per sampling mode (top-k, "
                     "top-p) at a real vocabulary, against plain sampling")
  t.add_argument("--rows", type=common.at_least(1), default=256)
  t.add_argument("--vocab", type=common.at_least(2), default=151936)
  t.add_argument("--logit_std", type=float, default=6.0)
  t.add_argument("--flat_rows", type=common.at_least(0), default=0,
                 help="rows of near-uniform logits (their nucleus is most of the vocabulary)")
  t.add_argument("--modes", type=common.choices(list(MODES)), default=tuple(MODES))
  t.add_argument("--reps", type=int, default=5)
  t.add_argument("--out", default=None, help="also append the JSON lines to this file")
  t.set_defaults(run=run_truncation)

"""`python -m jaxgrpo.bench backends`: what generation.backend='jetstream' costs.

On the embedded default's training rollout (32 prompts x 8 samples, 5 new tokens, the shipped
policy, one device), side by side in one process and alternating round by round: the native
sampler (one compiled while_loop per call) and the JetStream adapter (prefill, insert and
generate called from Python through JetStream's Engine API, the way its orchestrator and
MaxText's offline engine drive an engine), with one slot per row (the default) and with
--slots slots (continuous batching in waves). Each round checks that the two backends drew
the same tokens. Needs the jetstream extra (pip install 'jaxgrpo[jetstream]').

Reported per backend: the median rollout time over --rounds (the first call, compilation
included, separately), generated tokens/s, and the ratio to the native sampler.
"""

from __future__ import annotations

import importlib.util
import statistics
import time

import jax
import numpy as np

from jaxgrpo.run import build, loading
from jaxgrpo.run import setup as setup_lib
from jaxgrpo import data as data_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.bench import common


def run_backends(args) -> list[dict]:
  if importlib.util.find_spec("jetstream") is None:
    raise SystemExit("backends: needs the jetstream extra: pip install 'jaxgrpo[jetstream]'")
  loadavg_start = common.loadavg()
  devices = jax.devices()[:1]
  mesh = sharding_lib.make_mesh({"data": 1}, devices=devices)
  engines = {}
  for name, slots in (("native", 0), ("jetstream", 0), (f"jetstream_{args.slots}_slots",
                                                        args.slots)):
    config = common.default_config()
    config.generation.backend = "native" if name == "native" else "jetstream"
    config.generation.max_concurrent_decodes = slots
    config = setup_lib.validate(config, 1)
    model_cfg, host_params, tokenizer = loading.load_policy(config)
    engines[name] = build.make_engine(config, model_cfg, tokenizer, mesh)
  params = sharding_lib.shard_params(host_params, model_cfg, mesh)
  g, d = config.grpo, config.data
  train_rows, _ = data_lib.make_sources(d)
  batch = next(iter(data_lib.PromptBatches(train_rows, tokenizer, g.num_prompts_per_step,
                                           d.max_prompt_length, template=d.prompt_template,
                                           seed=config.seed)))
  times = {name: [] for name in engines}
  first = {}
  for r in range(args.rounds + 1):
    tokens = {}
    for name, engine in engines.items():
      t0 = time.perf_counter()
      rollout = engine.sample("train", params, batch["prompt_tokens_BxL"],
                              batch["prompt_mask_BxL"], step=r)
      tokens[name] = np.asarray(jax.device_get(rollout.tokens_NxT))
      elapsed = time.perf_counter() - t0
      if r:
        times[name].append(elapsed)
      else:
        first[name] = elapsed
      lengths = np.asarray(rollout.lengths_N)
    for name in engines:
      if not np.array_equal(tokens[name], tokens["native"]):
        raise SystemExit(f"backends: round {r}: {name} drew other tokens than native")
  n_tokens = int(lengths.sum())
  native = statistics.median(times["native"])
  out = []
  for name, engine in engines.items():
    med = statistics.median(times[name])
    out.append(dict(
        bench="backends", backend=name, prompts=g.num_prompts_per_step,
        samples=g.num_generations_per_prompt, new_tokens=config.generation.max_new_tokens,
        slots=(engine.engines["train"].max_concurrent_decodes if hasattr(engine, "engines")
               else None),
        rounds=args.rounds, first_call_s=round(first[name], 3), median_s=round(med, 4),
        tokens_per_s=round(n_tokens / med, 1), time_vs_native=round(med / native, 2),
        same_tokens_as_native=True,
        **common.machine(devices, loadavg_start)))
  return out


def add_parsers(sub) -> None:
  """Adds the `backends` subcommand to the bench's subparsers (cli.py)."""
  b = sub.add_parser("backends", help="native sampler vs the JetStream adapter on the "
                     "default's training rollout (needs the jetstream extra)")
  b.add_argument("--rounds", type=int, default=5, help="timed rounds after the first call")
  b.add_argument("--slots", type=int, default=64, help="the third backend's decode slots")
  b.add_argument("--out", default=None, help="also append the JSON lines to this file")
  b.set_defaults(run=run_backends)

"""`python -m jaxgrpo.bench rollout`: one GRPO rollout at a real model's shape, against the
memory-bandwidth floor.

Workload (`--preset qwen3-1.7b`, the default): a random-init Qwen3-1.7B shape (28 layers,
d_model 2048, 16 / 8 heads x 128, MLP 6144, vocab 151,936, tied, bfloat16), 32 prompts x
G = 8 samples, 256 random prompt tokens each (no padding), 512 new tokens, sampled by the
trainer's own `RolloutEngine` (its train profile) on one device. `--preset small|tiny`
shrink the model and the workload for a CPU. One JSON line per sampling mode and workload:

  modes      `pure` (temperature 1) and `topk50_topp095` (temperature 1, top-k 50, top-p
             0.95): what truncated sampling costs over the whole vocabulary;
  eos=off    every row runs all the new tokens;
  eos=longtail  rows end at long-tailed lengths: m token ids act as end ids, so a row of the
             random (near-uniform) policy ends with probability about m / V per token, and
             lengths are geometric with median --median_length (m = V (1 - 2^(-1 / median)));
             the longest rows reach the cap. Every call uses the same key, so every call
             draws the same lengths; the realised ones (min, median, mean, max) are reported.

Figures: `tokens_per_s` (tokens generated, EOS included, over the median of --reps calls;
a call encodes nothing but does block on the result and fetch the tokens and lengths to the
host), `first_call_s` (compile + run; cold: the bench never turns the persistent compilation
cache on), the peak device memory (or the process's peak RSS where the device reports none),
and the bandwidth floor: every decode step must read the weights once and each live row's K/V
for its prompt and tokens so far, so the floor is sum over steps of (weight bytes + sum over
live rows of (L + i) x K/V bytes per position) over the memory bandwidth: `--bandwidth_gbs`
(the device's nominal figure, e.g. 4800 for an H200) or, by default, a large reduction
measured in the same process (roofline.memory_bandwidth). `floor_fraction` = floor / median
call: 1 would be a sampler that only moves the bytes it must. With eos=longtail the floor
counts only live rows, so it shows what finished rows cost a sampler that keeps computing
them.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from jaxgrpo.run import trainer
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.bench import common, roofline

QWEN3_1_7B = dict(vocab_size=151936, d_model=2048, num_layers=28, num_heads=16,
                  num_kv_heads=8, head_dim=128, mlp_dim=6144, rope_theta=1e6, norm_eps=1e-6,
                  tie_embeddings=True, qk_norm=True, param_dtype="bfloat16", dtype="bfloat16")
# preset -> (model, prompts, samples, prompt_len, new_tokens, median length with EOS on)
PRESETS = {
    "qwen3-1.7b": (QWEN3_1_7B, 32, 8, 256, 512, 150),
    "small": ({**common.QWEN3, **common.PRESETS["small"]}, 16, 4, 64, 128, 40),
    "tiny": ({**common.QWEN3, **common.PRESETS["tiny"]}, 8, 4, 32, 64, 20),
}
MODES = {"pure": sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
         "topk50_topp095": sampling.SamplingParams(temperature=1.0, top_p=0.95, top_k=50)}
PAD = 0


def end_ids(vocab_size: int, median: int) -> tuple[int, ...]:
  """m ids (the last m of the vocabulary) that end a row with probability ~m / V per token
  under a uniform policy, so that half the rows end within `median` tokens."""
  m = max(1, round(vocab_size * (1 - 2 ** (-1 / median))))
  return tuple(range(vocab_size - m, vocab_size))


def floor_bytes(cfg: model_lib.ModelConfig, weights: int, prompt_len: int,
                lengths_N) -> tuple[float, dict]:
  """Bytes a rollout must read: the `weights` bytes once per decode step (as many steps as
  the longest row) and, per live row and step i, its K/V for L + i positions."""
  itemsize = np.dtype(model_lib.DTYPES[cfg.dtype]).itemsize
  kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize  # per position
  lengths = np.asarray(lengths_N, np.float64)
  # sum over a row's steps i < n of (L + i) = n * L + n (n - 1) / 2, L the prompt length
  positions = float(np.sum(lengths * prompt_len + lengths * (lengths - 1) / 2))
  total = lengths.max() * weights + positions * kv
  return total, dict(weight_bytes=int(weights), kv_bytes_per_position=int(kv),
                     kv_positions_read=positions)


def peak_memory(device) -> dict:
  stats = device.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return dict(peak_device_bytes=int(stats["peak_bytes_in_use"]))
  return dict(peak_rss_mib=trainer.peak_rss_mib())


def run_rollout(args) -> list[dict]:
  loadavg_start = common.loadavg()
  devices = jax.devices()[:1]
  arch, prompts, samples, prompt_len, new_tokens, median = PRESETS[args.preset]
  prompts = args.rollout_prompts or prompts
  samples = args.rollout_samples or samples
  prompt_len = args.rollout_prompt_len or prompt_len
  new_tokens = args.rollout_new_tokens or new_tokens
  median = args.median_length or median
  cfg = model_lib.ModelConfig(**arch)
  mesh = sharding_lib.make_mesh({"data": 1}, devices)
  t0 = time.perf_counter()
  params = jax.block_until_ready(sharding_lib.init_sharded(cfg, mesh, jax.random.key(0)))
  init_s = time.perf_counter() - t0
  leaves = jax.tree.leaves(params)
  num_params, weights = sum(x.size for x in leaves), sum(x.nbytes for x in leaves)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, cfg.vocab_size, size=(prompts, prompt_len)).astype(np.int32)
  mask = np.ones((prompts, prompt_len), bool)
  if args.bandwidth_gbs:
    bandwidth, source = args.bandwidth_gbs * 1e9, "given (--bandwidth_gbs)"
  else:
    bandwidth, source = roofline.memory_bandwidth(device=devices[0])["bytes_per_s"], "measured"
  key = jax.random.key(1)
  workloads = {"off": None, "longtail": end_ids(cfg.vocab_size, median)}
  results = []
  for mode in args.modes:
    for eos in args.eos:
      profiles = {"train": sampling.Profile(MODES[mode], samples, new_tokens),
                  "val": sampling.Profile(MODES[mode], 1, new_tokens)}  # required, never run
      engine = sampling.RolloutEngine(cfg, mesh, profiles, max_prompt_length=prompt_len,
                                      eos_id=workloads[eos], pad_id=PAD, seed=0,
                                      decode_block=args.decode_block,
                                      compact_stages=args.compact_stages)

      def call():
        out = engine.sample("train", params, tokens, mask, key=key)
        return jax.device_get((out.tokens_NxT, out.lengths_N))

      first, times = common.timed(call, args.reps)
      _, lengths = call()
      med = statistics.median(times)
      floor, parts = floor_bytes(cfg, weights, prompt_len, lengths)
      generated = int(lengths.sum())
      results.append(dict(
          bench="rollout", preset=args.preset, mode=mode, eos=eos,
          decode_block=args.decode_block, compact_stages=args.compact_stages,
          sampling=dict(temperature=MODES[mode].temperature, top_p=MODES[mode].top_p,
                        top_k=MODES[mode].top_k),
          workload=dict(prompts=prompts, samples=samples, rows=prompts * samples,
                        prompt_len=prompt_len, new_tokens=new_tokens,
                        end_ids=len(workloads[eos] or ()),
                        median_length_target=median if workloads[eos] else None,
                        dtype=cfg.dtype, params=int(num_params)),
          lengths=dict(min=int(lengths.min()), median=float(np.median(lengths)),
                       mean=round(float(lengths.mean()), 2), max=int(lengths.max())),
          generated_tokens=generated, tokens_per_s=round(generated / med, 1),
          first_call_s=round(first, 3), median_s=round(med, 4),
          all_s=[round(t, 4) for t in times], floor_s=round(floor / bandwidth, 4),
          floor_fraction=round(floor / bandwidth / med, 4), bandwidth_bytes_per_s=bandwidth,
          bandwidth_is=source, floor_bytes=floor, **parts, init_s=round(init_s, 2),
          compilations=engine.compilations["train"], **peak_memory(devices[0]),
          **common.machine(devices, loadavg_start)))
      loadavg_start = common.loadavg()
  return results


def add_parsers(sub) -> None:
  r = sub.add_parser("rollout", help="a GRPO rollout at a real model's shape (Qwen3-1.7B by "
                     "default), EOS off and long-tailed, against the bandwidth floor")
  r.add_argument("--preset", choices=list(PRESETS), default="qwen3-1.7b",
                 help="qwen3-1.7b (an accelerator's), or small / tiny for a CPU")
  r.add_argument("--modes", type=common.choices(list(MODES)), default=tuple(MODES))
  r.add_argument("--eos", type=common.choices(["off", "longtail"]), default=("off", "longtail"))
  r.add_argument("--reps", type=int, default=3, help="timed calls after the first")
  r.add_argument("--bandwidth_gbs", type=float, default=None,
                 help="the device's memory bandwidth in GB/s (default: measured)")
  r.add_argument("--decode_block", type=int, default=0,
                 help="generation.decode_block_size: 0 reads the whole cache every step")
  r.add_argument("--compact_stages", type=common.at_least(0), default=0,
                 help="generation.compact_stages: 0 computes every row until the longest ends")
  r.add_argument("--median_length", type=common.at_least(1), default=None,
                 help="eos=longtail's median completion length (default: the preset's)")
  for flag in ("prompts", "samples", "prompt_len", "new_tokens"):  # the preset's by default
    r.add_argument(f"--{flag}", dest=f"rollout_{flag}", type=common.at_least(1), default=None)
  r.add_argument("--out", default=None, help="also append the JSON lines to this file")
  r.set_defaults(run=run_rollout)

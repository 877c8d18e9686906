"""Benchmarks, one JSON line per measurement: `python -m jaxgrpo.bench sampler --preset tiny`.

`sampler` times the compiled sampler on the workload of the Tunix peer benchmark
(shared/peers/tunix_bench.py): its 8 prompts as byte-level tokens (0=pad, 1=bos, 2=eos,
3..258 = byte + 3, bos first) x 4 samples each, left-padded to 64 tokens (the longest
prompt is 33 tokens with bos; the next power of two), exactly 64 new tokens (no EOS),
float32, one CPU device, a random-init Qwen3-shaped model (seed 0).

One timed call is what a user waits for: encode and pad the prompts, sample, block on the
result, fetch tokens to the host and decode them to text. The first call (compile + run)
is reported as `first_call_s`; `tokens_per_s` is generated tokens / the median of the next
`--reps` calls, each with a new seed. The peer asks for 32 prompt slots, which Tunix raises
to 64 (the next power of two of the longest prompt), so the shapes match. One difference:
the peer prefills all 32 rows, while here each prompt is prefilled once and its 4 samples
share that prefill (the sampler's design).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxgrpo import model as model_lib  # noqa: E402
from jaxgrpo import policy as policy_lib  # noqa: E402
from jaxgrpo import sampling  # noqa: E402

PAD, BOS = 0, 1
NUM_SAMPLES = 4
NEW_TOKENS = 64
PROMPTS = (  # the peer's, verbatim
    "What is 12 + 30? Answer:",
    "Compute 7 * 6. Answer:",
    "Natalia sold 48 clips. How many?",
    "If x = 3, what is 2x + 1?",
    "Sum of 1..10 is",
    "Half of 84 is",
    "Tom has 5 apples and eats 2.",
    "The capital of France is",
)
_QWEN3 = dict(num_heads=4, num_kv_heads=2, rope_theta=1e4, norm_eps=1e-6,
              tie_embeddings=True, qk_norm=True, param_dtype="float32", dtype="float32")
PRESETS = {
    "tiny": dict(num_layers=2, d_model=128, mlp_dim=512, head_dim=32, vocab_size=512),
    "small": dict(num_layers=4, d_model=256, mlp_dim=1024, head_dim=64, vocab_size=1024),
}
MODES = {  # the peer's three sampler settings
    "pure": sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
    "topk50_topp095": sampling.SamplingParams(temperature=0.9, top_p=0.95, top_k=50),
    "greedy": sampling.SamplingParams(temperature=0.0, top_p=1.0, top_k=0),
}


def preset_config(name: str) -> model_lib.ModelConfig:
  return model_lib.ModelConfig(**_QWEN3, **PRESETS[name])


def encode(text: str) -> list[int]:
  return [BOS] + [b + 3 for b in text.encode("utf-8")]


def decode(ids) -> str:
  return bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259).decode("utf-8", errors="replace")


def prompt_batch(prompts=PROMPTS):
  """[B, P] left-padded tokens and mask, P the next power of two of the longest prompt."""
  rows = [encode(p) for p in prompts]
  longest = max(len(r) for r in rows)
  width = 1 << (longest - 1).bit_length()
  tokens = np.full((len(rows), longest), PAD, np.int32)
  mask = np.zeros((len(rows), longest), bool)
  for i, r in enumerate(rows):
    tokens[i, longest - len(r):] = r
    mask[i, longest - len(r):] = True
  return sampling.left_pad(tokens, mask, width, PAD)


def _loadavg() -> list[str]:
  try:
    with open("/proc/loadavg") as f:
      return f.read().split()[:3]
  except OSError:
    return []


def bench_sampler(policy: policy_lib.Policy, mode: str, reps: int, new_tokens: int) -> dict:
  """Times `reps` full sampler calls after a first (compiling) one; returns the stats."""
  sp = MODES[mode]

  def call(seed):
    tokens, mask = prompt_batch()
    out = policy.generate(tokens, sp, num_samples=NUM_SAMPLES, max_new_tokens=new_tokens,
                          seed=seed, prompt_mask_BxP=mask)
    jax.block_until_ready(out)
    ids, lengths = jax.device_get((out.tokens_NxT, out.lengths_N))
    texts = [decode(row[:n]) for row, n in zip(ids, lengths)]
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
  return dict(
      mode=mode, sampling=dict(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k),
      workload=dict(prompts=len(PROMPTS), samples=NUM_SAMPLES, prompt_len=width,
                    new_tokens=new_tokens, eos=None, dtype=policy.cfg.dtype),
      tokens_per_s=round(generated / med, 1), first_call_s=round(first, 3),
      median_s=round(med, 4), all_s=[round(t, 4) for t in times],
      generated_tokens=generated, rows=int(ids.shape[0]),
      decode_steps_per_s=round(new_tokens / med, 1), sample_text=texts[0][:40])


def run_sampler(args) -> list[dict]:
  """The `sampler` subcommand: one result per mode, model built once."""
  loadavg_start = _loadavg()
  devices = jax.devices()[:1]
  cfg = preset_config(args.preset)
  policy = policy_lib.Policy.init(cfg, seed=0, mesh=None, pad_id=PAD, eos_id=None)
  modes = list(MODES) if args.mode == "all" else [args.mode]
  results = []
  for mode in modes:
    stats = bench_sampler(policy, mode, args.reps, args.new_tokens)
    results.append(dict(
        bench="sampler", preset=args.preset, n_params=policy.num_params, **stats,
        jax=jax.__version__, device=str(devices[0]), platform=devices[0].platform,
        cpu_count=os.cpu_count(), loadavg_start=loadavg_start, loadavg_end=_loadavg()))
    loadavg_start = _loadavg()
  return results


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxgrpo.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="bench", required=True)
  s = sub.add_parser("sampler", help="time the compiled sampler on the peer's workload")
  s.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
  s.add_argument("--mode", choices=[*MODES, "all"], default="pure",
                 help="sampling settings; 'all' runs each and prints one line each")
  s.add_argument("--reps", type=int, default=10, help="timed calls after the first")
  s.add_argument("--out", default=None, help="also append the JSON line(s) to this file")
  s.add_argument("--new_tokens", type=int, default=NEW_TOKENS, help=argparse.SUPPRESS)
  s.set_defaults(run=run_sampler)
  return parser


def main(argv=None) -> list[dict]:
  """Parses `argv`, runs the benchmark, prints (and optionally appends) one line per result."""
  args = build_parser().parse_args(argv)
  if args.reps < 1:
    raise SystemExit(f"--reps={args.reps}: must be >= 1")
  if args.new_tokens < 1:
    raise SystemExit(f"--new_tokens={args.new_tokens}: must be >= 1")
  results = args.run(args)
  lines = [json.dumps(r) for r in results]
  for line in lines:
    print(line, flush=True)
  if args.out:
    with open(args.out, "a") as f:
      f.writelines(line + "\n" for line in lines)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])

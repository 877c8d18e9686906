"""What every benchmark shares: the machine fields each JSON line carries, the Tunix peer's
workload (its prompts as byte-level tokens, the Qwen3-shaped presets, its sampling modes),
timing and the repository's default config."""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import jax
import numpy as np

from jaxgrpo.model import decoder as model_lib
from jaxgrpo.rollout import sampling

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
QWEN3 = dict(num_heads=4, num_kv_heads=2, rope_theta=1e4, norm_eps=1e-6,
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
  return model_lib.ModelConfig(**QWEN3, **PRESETS[name])


def encode(text: str) -> list[int]:
  return [BOS] + [b + 3 for b in text.encode("utf-8")]


def decode(ids) -> str:
  return bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259).decode("utf-8", errors="replace")


def prompt_batch(prompts=PROMPTS):
  """[B, L] left-padded tokens and mask, L the next power of two of the longest prompt."""
  rows = [encode(p) for p in prompts]
  longest = max(len(r) for r in rows)
  width = 1 << (longest - 1).bit_length()
  tokens = np.full((len(rows), longest), PAD, np.int32)
  mask = np.zeros((len(rows), longest), bool)
  for i, r in enumerate(rows):
    tokens[i, longest - len(r):] = r
    mask[i, longest - len(r):] = True
  return sampling.left_pad(tokens, mask, width, PAD)


def loadavg() -> list[str]:
  try:
    with open("/proc/loadavg") as f:
      return f.read().split()[:3]
  except OSError:
    return []


def machine(devices, loadavg_start) -> dict:
  """The fields every result carries: what ran where, and how busy the machine was."""
  return dict(jax=jax.__version__, device=str(devices[0]), platform=devices[0].platform,
              cpu_count=os.cpu_count(), loadavg_start=loadavg_start, loadavg_end=loadavg())


def timed(fn, reps: int):
  """(first call s, [reps timed calls s]); fn blocks on its own result."""
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return first, times


def default_config():
  """configs/math.py's get_config(), loaded from the repository (configs/ is no package)."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "configs", "math.py")
  if not os.path.isfile(path):
    raise SystemExit(f"validation bench: {path} not found; run it from a jaxgrpo checkout")
  spec = importlib.util.spec_from_file_location("jaxgrpo_bench_math_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def at_least(lowest: int):
  """An argparse type: an integer >= lowest."""
  def parse(text: str) -> int:
    value = int(text)
    if value < lowest:
      raise argparse.ArgumentTypeError(f"{value}: must be >= {lowest}")
    return value
  return parse


def choices(allowed):
  """An argparse type: a comma-separated list of names from `allowed`, as a tuple."""
  def parse(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    bad = [x for x in names if x not in allowed]
    if bad or not names:
      raise argparse.ArgumentTypeError(f"{text!r}: allowed: a comma-separated list of "
                                       f"{', '.join(allowed)}")
    return names
  return parse

"""Roofline figures: what fraction of the machine's dense matmul rate a computation reaches.

A benchmark time alone says little about how much is left to gain; divided into the FLOPs the
computation performs and compared with what the same device does on a plain large matmul, it
says whether the time goes into arithmetic (fraction near 1) or elsewhere (dispatch, memory
traffic, small or badly shaped ops). Three pieces:
  * `matmul_rate`: the denominator, measured in the process that reports the fraction.
  * `compiled_flops`: XLA's own count for a compiled executable without loops (the update).
  * `model_flops_per_token`: an analytic count, for loops XLA cannot count (decode, prefill).
Decoding is bound by memory, not arithmetic: `memory_bandwidth` is its denominator, measured
the same way (`python -m jaxgrpo.bench rollout`).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxgrpo.model import decoder as model_lib


def matmul_rate(n: int | Sequence[int] = (1024, 2048), dtype=jnp.float32, reps: int = 5,
                device=None) -> dict:
  """The measured dense matmul FLOP rate of one device: {"flops_per_s", "n", "ms", ...}.

  This is the denominator of every roofline fraction, so it is measured in the same process
  (same threads, same XLA flags, same load on a shared machine) as the figure it divides,
  never taken from a spec sheet. For each size n, a jitted chain of n x n matmuls is warmed
  up and timed `reps` times; the median time per size damps a noisy moment, and the best
  size's rate is reported (small sizes under-use the cores, large ones can spill caches).
  """
  device = device or jax.devices()[0]
  sizes = [n] if isinstance(n, int) else list(n)
  per_size = {}
  for size in sizes:
    # A chain, so one timed call is long enough for the clock (tens of ms or more), and a
    # scale of 1/sqrt(n) keeps the values O(1): no inf or NaN to slow anything down.
    chain = max(1, (2048 // size) ** 2)
    key_a, key_b = jax.random.split(jax.random.key(0))
    a_NxN = jax.device_put(jax.random.normal(key_a, (size, size), dtype), device)
    b_NxN = jax.device_put(jax.random.normal(key_b, (size, size), dtype) * size ** -0.5, device)

    @jax.jit
    def run(a_NxN, b_NxN):
      for _ in range(chain):
        a_NxN = a_NxN @ b_NxN
      return a_NxN

    run(a_NxN, b_NxN).block_until_ready()
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      run(a_NxN, b_NxN).block_until_ready()
      times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    per_size[size] = dict(flops_per_s=2.0 * size ** 3 * chain / med,
                          ms=round(1e3 * med / chain, 3))
  best = max(per_size, key=lambda s: per_size[s]["flops_per_s"])
  return dict(flops_per_s=per_size[best]["flops_per_s"], n=best, ms=per_size[best]["ms"],
              dtype=jnp.dtype(dtype).name, reps=reps,
              per_size={str(s): round(v["flops_per_s"]) for s, v in per_size.items()})


def compiled_flops(compiled) -> float | None:
  """FLOPs of a compiled executable (`jit(f).lower(...).compile()`), as XLA counts them.

  cost_analysis() returns a dict in current jax and a list of per-module dicts in older
  ones; None when the backend gives no count. XLA counts a while loop's body once, not once
  per iteration, so this is only right for loop-free programs such as the update step; the
  sampler's decode loop must be counted analytically (`model_flops_per_token`).
  """
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  (backends without cost analysis)
    return None
  if isinstance(cost, dict):
    cost = [cost]
  flops = [c.get("flops") for c in cost or () if isinstance(c, dict)]
  flops = [float(f) for f in flops if f is not None and f >= 0]
  return sum(flops) if flops else None


def model_flops_per_token(cfg: model_lib.ModelConfig, context_len: int) -> float:
  """Forward FLOPs of one token through the decoder of model.py, attending context_len keys.

  2 FLOPs (multiply + add) per matmul weight the token touches: per layer the q, k, v, o
  projections and the three SwiGLU matrices, plus the output head (tied or not, it is a
  d_model x vocab matmul; the embedding lookup is a gather, no FLOPs). Attention adds
  q.k scores and the probability-weighted sum of values: 2 * 2 * num_heads * head_dim per
  key per layer. Norms, rotary embedding, softmax and biases are left out (a few percent at
  most for these shapes).
  """
  c = cfg
  q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  per_layer = c.d_model * q_dim + 2 * c.d_model * kv_dim + q_dim * c.d_model
  per_layer += 3 * c.d_model * c.mlp_dim
  weights = c.num_layers * per_layer + c.d_model * c.vocab_size
  attention = c.num_layers * 2 * 2 * c.num_heads * c.head_dim * context_len
  return float(2 * weights + attention)


def memory_bandwidth(nbytes: int | None = None, reps: int = 5, device=None) -> dict:
  """The measured rate at which one device reads memory: {"bytes_per_s", "nbytes", "ms"}.

  A jitted sum over a float32 array of `nbytes` (default 1 GiB on an accelerator, 256 MiB
  on a CPU: far beyond any cache), warmed up and timed `reps` times; the median is
  reported. A sum reads every byte once and computes almost nothing, so it is the floor's
  denominator for a decode step that must read the weights and the live K/V cache.
  """
  device = device or jax.devices()[0]
  if nbytes is None:
    nbytes = (256 if device.platform == "cpu" else 1024) * 2**20
  x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    total(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  return dict(bytes_per_s=nbytes / med, nbytes=nbytes, ms=round(1e3 * med, 3))

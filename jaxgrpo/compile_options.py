"""XLA options for jaxgrpo's large programs (the samplers and the update step).

On CPU, jaxgrpo compiles them at XLA backend optimisation level 2 instead of XLA's default
3. Their heavy work is matmuls, which XLA's CPU backend hands to a library (YNNPACK) at any
level, so the level only decides how hard LLVM optimises the elementwise loops around them.
Measured on the bench presets (in-process A/B, BENCHMARKS.md, "First step"): the sampler
compiles ~1 s faster (tiny 2.5-2.7 s instead of 3.6-3.8 s, small 2.6-3.0 s instead of
3.8-4.1 s) and runs as fast (0.89-1.04x the time, within the machine's noise); the
update's compile time moves by less than 0.3 s either way and it runs 0.97-1.04x as long.
Level 1 measured the same; level 0 doubled the sampler's time. Compiling without XLA's new
fusion emitters (`xla_cpu_use_fusion_emitters=false`) compiled faster still but ran 5-10%
slower.

The JetStream adapter's programs get the same options, so both backends round alike.
Other platforms get no options: TPU and GPU compile their kernels differently.
A user's own XLA_FLAGS win: an option named there is never overridden.
"""

from __future__ import annotations

import os

CPU_OPTIONS = {"xla_backend_optimization_level": 2}


def compiler_options(mesh) -> dict:
  """Options for jax.jit(compiler_options=...) of a program that runs on `mesh`."""
  if mesh.devices.flat[0].platform != "cpu":
    return {}
  user_flags = os.environ.get("XLA_FLAGS", "")
  return {k: v for k, v in CPU_OPTIONS.items() if f"--{k}" not in user_flags}

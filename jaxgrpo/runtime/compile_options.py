"""XLA options for jaxgrpo's large programs (the samplers and the update step).

On CPU, jaxgrpo compiles them at XLA backend optimisation level 2 instead of XLA's default
3. Their heavy work is matmuls, which XLA's CPU backend hands to a library (YNNPACK) at any
level, so the level only decides how hard LLVM optimises the elementwise loops around them.
Measured on the bench presets (in-process A/B, BENCHMARKS.md, "GRPO step"): the sampler
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

import contextlib
import os

CPU_OPTIONS = {"xla_backend_optimization_level": 2}


def compiler_options(mesh) -> dict:
  """Options for jax.jit(compiler_options=...) of a program that runs on `mesh`."""
  if mesh.devices.flat[0].platform != "cpu":
    return {}
  user_flags = os.environ.get("XLA_FLAGS", "")
  return {k: v for k, v in CPU_OPTIONS.items() if f"--{k}" not in user_flags}


# ------------------------------------------------- compiling for a TPU topology from a CPU

# Extra arguments of jax.experimental.topologies.get_topology_desc per generation: v4 and v5p
# run as megacore (the two TensorCores of a chip are one device), as the runtime lays them
# out on real slices. launch/compile_check.py and `bench decode-bytes` describe slices so.
TOPOLOGY_KWARGS = {"v4": {"chip_config_name": "megacore"},
                   "v5p": {"chip_config_name": "megacore"}}


@contextlib.contextmanager
def as_tpu_host():
  """While programs for TPU devices are traced and compiled from a CPU host, `jax.
  default_backend()` answers "tpu", as it does on the TPU host that will run them. jaxgrpo
  decides what a program contains from the devices it is compiled for
  (decoder.platform_of), never from this host's backend; any code path that still asked the
  backend would take the TPU host's branch here, so what compiles is what the host runs
  (jax's own modules read their backend elsewhere)."""
  import jax  # pylint: disable=g-import-not-at-top
  saved = jax.default_backend
  jax.default_backend = lambda: "tpu"
  try:
    yield
  finally:
    jax.default_backend = saved


# ------------------------------------------------- the persistent compilation cache

# jax's own variable: set (by the user, or by the test session for its subprocesses), it wins
# over config.compilation_cache_dir, and jax reads it itself.
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def default_cache_dir() -> str:
  """The per-user folder: $XDG_CACHE_HOME/jaxgrpo/jax, else ~/.cache/jaxgrpo/jax."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxgrpo", "jax")


def resolve_cache_dir(setting: str) -> str | None:
  """config.compilation_cache_dir -> the folder jax caches compiled programs in, or None.

  'auto': the environment's JAX_COMPILATION_CACHE_DIR, else the per-user folder; '': off;
  anything else: that folder (~ expanded).
  """
  if setting == "":
    return None
  if setting == "auto":
    return os.environ.get(CACHE_ENV) or default_cache_dir()
  return os.path.expanduser(setting)


def enable_cache(setting: str) -> str | None:
  """Points jax's persistent compilation cache at `setting`'s folder (before the first
  compile: jax decides once per process), or turns it off. Returns the folder or None.

  A compiled sampler or update step is then written once per machine and loaded by every
  later process with the same program, jax version and devices: a restarted run, the
  evaluation command, a second run of the same config. Programs that compile in under
  jax's `jax_persistent_cache_min_compile_time_secs` (1 s) are not worth a file and are not
  written.
  """
  import jax  # pylint: disable=g-import-not-at-top
  path = resolve_cache_dir(setting)
  jax.config.update("jax_enable_compilation_cache", path is not None)
  jax.config.update("jax_compilation_cache_dir", path)
  return path

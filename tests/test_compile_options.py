"""Tests for jaxgrpo.runtime.compile_options: which XLA options the sampler and the update get."""

import os
import types

import jax
import numpy as np
import pytest

from jaxgrpo.algo import grpo
from jaxgrpo.runtime import compile_options
from jaxgrpo.model import sharding
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.rollout import sampling

CFG = model_lib.ModelConfig(vocab_size=16, d_model=8, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=4, mlp_dim=16)
SP = sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
# An option XLA does not know: compiling with it fails, which shows the option reached XLA.
UNKNOWN = {"xla_jaxgrpo_no_such_option": 1}


@pytest.fixture(name="mesh")
def fixture_mesh():
  return sharding.make_mesh({"data": -1}, jax.devices()[:1])


def test_cpu_programs_compile_at_llvm_level_2(mesh, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert compile_options.compiler_options(mesh) == {"xla_backend_optimization_level": 2}


def test_users_xla_flags_win(mesh, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
  assert compile_options.compiler_options(mesh) == {}


def test_other_platforms_get_no_options():
  tpu = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="tpu")]))
  assert compile_options.compiler_options(tpu) == {}


def test_sampler_and_update_compile_with_the_options(mesh, monkeypatch):
  monkeypatch.setattr(compile_options, "CPU_OPTIONS", UNKNOWN)
  params = sharding.init_sharded(CFG, mesh, jax.random.key(0))
  profile = sampling.Profile(SP, 2, 2)
  sampler = sampling.compile_sampler(CFG, profile, eos_id=None, pad_id=0, mesh=mesh)
  tokens, mask = np.ones((1, 3), np.int32), np.ones((1, 3), bool)
  with pytest.raises(Exception, match="xla_jaxgrpo_no_such_option"):
    sampler.lower(params, tokens, mask, jax.random.key(1), np.zeros(1, np.int32)).compile()

  optimizer, lr = grpo.make_optimizer(1e-3, 0, 10, 0.0, 0.0, "constant")
  state = grpo.init_state(params, optimizer, mesh)
  loss = grpo.LossConfig(num_generations=2, beta=0.0, kl_type="k3", epsilon=0.2,
                         epsilon_high=0.2, loss_agg="token_mean", scale_rewards="group",
                         mask_truncated_completions=False, max_new_tokens=2)
  update = grpo.compile_update(state, None, cfg=CFG, loss=loss, sp=SP, optimizer=optimizer,
                               lr_schedule=lr, mesh=mesh)
  batch = {"prompt_tokens_BxL": tokens, "prompt_mask_BxL": mask,
           "completion_tokens_NxT": np.ones((2, 2), np.int32),
           "completion_mask_NxT": np.ones((2, 2), bool),
           "old_logp_NxT": np.zeros((2, 2), np.float32), "rewards_N": np.zeros(2, np.float32),
           "truncated_N": np.zeros(2, bool),
           "scored_N": np.ones(2, bool)}
  with pytest.raises(Exception, match="xla_jaxgrpo_no_such_option"):
    update.lower(state, batch, None).compile()


# --- The persistent compilation cache -------------------------------------------------------

def test_cache_dir_setting(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_options.CACHE_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_options.resolve_cache_dir("auto") == str(tmp_path / "xdg" / "jaxgrpo" / "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compile_options.resolve_cache_dir("auto") == str(
      tmp_path / "home" / ".cache" / "jaxgrpo" / "jax")
  monkeypatch.setenv(compile_options.CACHE_ENV, "/from/env")  # jax's own variable wins
  assert compile_options.resolve_cache_dir("auto") == "/from/env"
  assert compile_options.resolve_cache_dir("") is None
  assert compile_options.resolve_cache_dir("~/jit") == str(tmp_path / "home" / "jit")


def _train_once(tmp_path, name, *args, xdg):
  """A one-step smoke run in a fresh process with no cache variable of the test session's:
  the per-user folder is under `xdg`."""
  import cli  # tests/cli.py  # pylint: disable=g-import-not-at-top
  env = cli.env(XDG_CACHE_HOME=str(xdg))
  env.pop(compile_options.CACHE_ENV, None)
  import subprocess  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(cli.command(f"--config={cli.MATH}:smoke", "--config.grpo.max_num_steps=1",
                                    *args, workdir=tmp_path / name),
                        capture_output=True, text=True, env=env, cwd=cli.ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [l for l in proc.stderr.splitlines() if "Persistent compilation cache hit" in l]


@pytest.mark.slow
def test_a_second_process_loads_the_first_ones_compiled_programs(tmp_path):
  # On by default, in the per-user folder: the first run compiles and writes the sampler
  # (jit_traced) and the update (jit_step_fn); a second run of the same config loads them.
  xdg = tmp_path / "xdg"
  assert _train_once(tmp_path, "first", xdg=xdg) == []
  cached = os.listdir(xdg / "jaxgrpo" / "jax")
  assert any(f.startswith("jit_traced") for f in cached), cached
  assert any(f.startswith("jit_step_fn") for f in cached), cached
  hits = _train_once(tmp_path, "second", xdg=xdg)
  assert any("'jit_traced'" in l for l in hits) and any("'jit_step_fn'" in l for l in hits), hits
  # Off: nothing is read from the filled folder, and nothing is written to it (a rewrite of
  # an entry would change its modification time).
  folder = xdg / "jaxgrpo" / "jax"
  listing = lambda: sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(folder))
  before = listing()
  assert _train_once(tmp_path, "off", "--config.compilation_cache_dir=", xdg=xdg) == []
  assert listing() == before

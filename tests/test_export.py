"""python -m jaxgrpo.export: a run's checkpoint as a Hugging Face folder, bitwise."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from cli import ROOT  # tests/cli.py
from jaxgrpo import checkpoint, hf


def export(*args):
  # umask 022, a common default: every exported file must then be 0644 (safetensors alone
  # would write the weights 0600, unreadable to a serving user).
  return subprocess.run([sys.executable, "-m", "jaxgrpo.export", *map(str, args)],
                        capture_output=True, text=True, cwd=ROOT, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), umask=0o022)


@pytest.mark.slow
def test_export_writes_the_checkpoint_bitwise(straight_run, tmp_path):
  workdir, run = straight_run  # conftest.py: 8 steps of the smoke preset
  assert run.returncode == 0, run.stderr[-2000:]
  proc = export(workdir, "--out", tmp_path / "hf")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith(f"exported step 8 of {workdir}")
  files = sorted(os.listdir(tmp_path / "hf"))  # the message lists every file it wrote
  assert sorted(proc.stdout.strip().rpartition(": ")[2].split(", ")) == files
  assert {oct(os.stat(tmp_path / "hf" / f).st_mode & 0o777) for f in files} == {"0o644"}
  cfg, params, tok = hf.load_hf(str(tmp_path / "hf"))
  assert cfg.d_model == 128 and tok.eos_token == "<eos>"
  ckpts = checkpoint.Checkpoints(str(workdir / "checkpoints"), read_only=True)
  state, _ = ckpts.restore(8)
  ckpts.close()
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), b)
  # A step that was not kept, and a folder that is not a run: one line, exit status 2.
  proc = export(workdir, "--step", 5, "--out", tmp_path / "x")
  assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
  assert "--step=5: no such checkpoint" in proc.stderr and "allowed: [" in proc.stderr
  proc = export(tmp_path, "--out", tmp_path / "x")
  assert proc.returncode == 2 and "config.json: missing" in proc.stderr

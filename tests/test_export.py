"""python -m jaxgrpo.export: a run's checkpoint as a Hugging Face folder, bitwise."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from cli import ROOT  # tests/cli.py
from jaxgrpo import checkpoint
from jaxgrpo.model import hf


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


@pytest.mark.slow
def test_a_checkpoint_of_per_layer_parameters_still_exports(straight_run, tmp_path):
  # A run from before the layers were stacked holds layer_0, layer_1, ... in its train
  # state. Resuming it is refused (test_checkpoint.py), and the way out the refusal names
  # is this: export reads whatever tree orbax stored, so the old layout exports to the same
  # Hugging Face tensors as the stacked one.
  import shutil  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model  # pylint: disable=g-import-not-at-top
  workdir, run = straight_run
  assert run.returncode == 0, run.stderr[-2000:]
  ckpts = checkpoint.Checkpoints(str(workdir / "checkpoints"), read_only=True)
  state, meta = ckpts.restore(8)
  ckpts.close()
  old = tmp_path / "old"
  old.mkdir()
  shutil.copy(workdir / "config.json", old / "config.json")
  old_ckpts = checkpoint.Checkpoints(str(old / "checkpoints"))
  old_state = dict(state, params=model.unstack_layers(state["params"]))
  assert "layer_1" in old_state["params"] and "layers" not in old_state["params"]
  old_ckpts.save(8, old_state, {k: v for k, v in meta.items() if k != "layout"})
  old_ckpts.close()
  for source, out in ((workdir, tmp_path / "new_hf"), (old, tmp_path / "old_hf")):
    proc = export(source, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  a = safetensors.numpy.load_file(str(tmp_path / "new_hf" / "model.safetensors"))
  b = safetensors.numpy.load_file(str(tmp_path / "old_hf" / "model.safetensors"))
  assert sorted(a) == sorted(b) and "model.layers.1.mlp.down_proj.weight" in a
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])

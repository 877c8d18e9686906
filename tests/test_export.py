"""python -m jaxgrpo.export: a run's checkpoint as a Hugging Face folder, bitwise."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from cli import ROOT  # tests/cli.py
from jaxgrpo.run import checkpoint
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


FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")


def test_an_adapter_saved_by_peft_merges_to_its_logits_and_exports_back_the_same(tmp_path):
  # tests/fixtures/hf/qwen2_peft: rank 4, alpha 8, all-linear adapters with A and B random,
  # saved by PEFT itself on the tiny Qwen2 fixture, with the logits PEFT computed
  # (make_peft_fixture.py; no torch here). Read into our layout by hand (A[l] = lora_A.T,
  # [in, r], split into the base weight's input axes; B[l] = lora_B.T, [r, out], split into
  # its output axes), the merge W + (8/4) A B gives PEFT's logits, and save_peft writes
  # PEFT's tensors back, bit for bit, under PEFT's names.
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import artifacts as export_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import lora  # pylint: disable=g-import-not-at-top
  folder, peft_dir = os.path.join(FIXTURES, "qwen2"), os.path.join(FIXTURES, "qwen2_peft")
  cfg, base, _ = hf.load_hf(folder)
  theirs = safetensors.numpy.load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
  modules = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
  adapters = {}
  for target, (a_shape, b_shape) in lora.shapes(cfg, 4, tuple(modules)).items():
    name = lambda l, m: f"base_model.model.model.layers.{l}.{modules[target]}.lora_{m}.weight"
    adapters[target] = {
        "a": np.stack([theirs[name(l, "A")].T for l in range(2)]).reshape(a_shape),
        "b": np.stack([theirs[name(l, "B")].T for l in range(2)]).reshape(b_shape)}
  reference = np.load(os.path.join(peft_dir, "reference.npz"))
  tokens = reference["input_ids"].astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  logits = np.asarray(model_lib.forward(lora.merge(base, adapters, 2.0), cfg, tokens, mask))
  np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=1e-4)
  # Not vacuous: the adapters move the logits far beyond the tolerance.
  assert np.abs(reference["logits"] - np.asarray(
      model_lib.forward(base, cfg, tokens, mask))).max() > 1e-2
  export_lib.save_peft(str(tmp_path), cfg, adapters, rank=4, alpha=8.0, base_path=folder)
  ours = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
  assert sorted(ours) == sorted(theirs)
  for name in ours:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
  want = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
  got = json.load(open(tmp_path / "adapter_config.json"))
  for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias",
              "fan_in_fan_out", "use_rslora", "use_dora"):
    assert got[key] == want[key], key
  # PEFT matches a target by its name's last part; ours are those names.
  assert set(got["target_modules"]) == {m.rpartition(".")[2] for m in want["target_modules"]}
  assert got["base_model_name_or_path"] == folder


# The script the PEFT check runs in $JAXGRPO_PEFT_PYTHON (torch, transformers, peft; no jax):
# the base folder, PEFT's own loader onto it, float32 eager logits for the given tokens.
_PEFT_LOGITS = """
import sys, numpy as np, torch, transformers, peft
base, adapter, tokens, out = sys.argv[1:]
model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
model = peft.PeftModel.from_pretrained(model, adapter).eval()
with torch.no_grad():
  logits = model(torch.tensor(np.load(tokens))).logits
np.save(out, logits.numpy())
"""


def test_a_peft_adapter_folder_loads_in_peft_with_the_merged_logits(tmp_path):
  # Rank-4 adapters with B set (B = 0 would pass with any layout) on the tiny Qwen2 fixture,
  # written by save_peft: PEFT's PeftModel on the fixture gives the logits jaxgrpo computes
  # with the merged weights W + (alpha/r) A B, alpha 8 / rank 4 = 2. Needs torch, so it runs
  # in $JAXGRPO_PEFT_PYTHON (a 5.7 GB venv, which CI does not build: tests/fixtures/README.md)
  # and skips without it; the stored-fixture test above runs everywhere.
  python = os.environ.get("JAXGRPO_PEFT_PYTHON")
  if not python:
    pytest.skip("set JAXGRPO_PEFT_PYTHON to a python with torch, transformers and peft")
  from jaxgrpo.run import artifacts as export_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import lora  # pylint: disable=g-import-not-at-top
  folder = os.path.join(FIXTURES, "qwen2")
  cfg, base, _ = hf.load_hf(folder)
  adapters = lora.init(cfg, 4, lora.parse_targets("all-linear"), jax.random.key(0))
  for i, target in enumerate(adapters):
    b = adapters[target]["b"]
    adapters[target]["b"] = 0.1 * jax.random.normal(jax.random.key(i + 1), b.shape)
  written = export_lib.save_peft(str(tmp_path / "peft"), cfg, adapters, rank=4, alpha=8.0,
                                 base_path=folder)
  assert written == ["adapter_config.json", "adapter_model.safetensors"]
  tokens = np.array([[1, 5, 9, 2, 7, 3, 11, 4]], np.int32)
  merged = lora.merge(base, adapters, 2.0)
  want = np.asarray(jax.jit(model_lib.forward, static_argnums=1)(
      merged, cfg, tokens, np.ones(tokens.shape, bool)))
  # The adapters move the logits well beyond the tolerance, so the comparison is not vacuous.
  plain = np.asarray(model_lib.forward(base, cfg, tokens, np.ones(tokens.shape, bool)))
  assert np.abs(want - plain).max() > 1e-2
  np.save(tmp_path / "tokens.npy", tokens)
  proc = subprocess.run([python, "-c", _PEFT_LOGITS, folder, str(tmp_path / "peft"),
                         str(tmp_path / "tokens.npy"), str(tmp_path / "logits.npy")],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_peft_format_needs_a_lora_run(straight_run, tmp_path):
  from jaxgrpo.run import artifacts as export_lib  # pylint: disable=g-import-not-at-top
  workdir, run = straight_run
  assert run.returncode == 0, run.stderr[-2000:]
  with pytest.raises(export_lib.ExportError, match=r"--format=peft: .* is not a LoRA run "
                     r"\(model.lora_rank=0\): it has no adapters; allowed for it: --format=merged"):
    export_lib.export(str(workdir), str(tmp_path / "x"), fmt="peft")

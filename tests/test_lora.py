"""LoRA (jaxgrpo/model/lora.py): adapters on a frozen base, trained by the GRPO update."""

import os

import jax
import numpy as np
import pytest

from jaxgrpo import config as config_lib
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import lora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = model_lib.ModelConfig(vocab_size=16, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, mlp_dim=64)


def test_targets_by_our_names_or_hugging_faces():
  assert lora.parse_targets("all-linear") == ("q", "k", "v", "o", "gate", "up", "down")
  assert lora.parse_targets("v_proj, q") == ("q", "v")
  with pytest.raises(ValueError, match="unknown LoRA target 'qkv'; allowed: all-linear"):
    lora.parse_targets("q,qkv")


def test_adapters_follow_their_weights_axes_and_rank_is_checked():
  shapes = lora.shapes(CFG, 4, ("q", "o", "down"))
  # q [layers, d_model, heads, head_dim]: A [2, 32, 4], B [2, 4, 4, 8]; o's input is
  # (heads, head_dim): A [2, 4, 8, 4], B [2, 4, 32].
  assert shapes["q"] == ((2, 32, 4), (2, 4, 4, 8))
  assert shapes["o"] == ((2, 4, 8, 4), (2, 4, 32))
  assert shapes["down"] == ((2, 64, 4), (2, 4, 32))
  axes = lora.logical_axes(CFG, ("q",))["q"]
  assert axes == {"a": ("layers", "embed", None), "b": ("layers", None, "q_heads", "head_dim")}
  assert lora.check_rank(CFG, 32, ("q",)) is None
  assert lora.check_rank(CFG, 33, ("q",)) == (
      "rank 33 exceeds the smaller side of target 'q' (32: 32 in, 32 out)")


def test_merge_is_the_base_at_init_and_w_plus_scaled_a_b_after():
  base = model_lib.init_params(CFG, jax.random.key(0))
  base = jax.tree.map(lambda x: getattr(x, "value", x), base,
                      is_leaf=lambda x: hasattr(x, "value"))
  adapters = lora.init(CFG, 4, lora.parse_targets("all-linear"), jax.random.key(1))
  merged = lora.merge(base, adapters, 2.0)
  # B = 0: every weight is the base's, bit for bit (the first forward is the base model's).
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(base)):
    np.testing.assert_array_equal(a, b)
  # With B set: W + 2 * A @ B, per layer, for q's [d_model] x [heads * head_dim] view.
  adapters["q"]["b"] = jax.random.normal(jax.random.key(2), adapters["q"]["b"].shape)
  merged = lora.merge(base, adapters, 2.0)
  a, b = np.asarray(adapters["q"]["a"]), np.asarray(adapters["q"]["b"]).reshape(2, 4, 32)
  want = np.asarray(base["layers"]["attn"]["q"]) + 2.0 * np.einsum(
      "lir,lro->lio", a, b).reshape(2, 32, 4, 8)
  np.testing.assert_allclose(merged["layers"]["attn"]["q"], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(merged["layers"]["attn"]["k"], base["layers"]["attn"]["k"])


def test_experts_get_one_adapter_each_merged_and_exported_per_expert(tmp_path):
  # A mixture of 3 experts of F = 16 in 2 layers: gate's base is [2, 3, 32, 16], so its A is
  # [2, 3, 32, r] and B [2, 3, r, 16] (the expert axis a batch axis like the layers'); the
  # merge adds 2 * A[l, e] @ B[l, e] to expert e of layer l alone; the PEFT export names
  # each expert's own Linear, as PEFT adapts the hub's per-expert modules.
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import artifacts  # pylint: disable=g-import-not-at-top
  cfg = model_lib.ModelConfig(vocab_size=16, d_model=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                              num_experts=3, num_experts_per_tok=2, moe_mlp_dim=16)
  assert lora.shapes(cfg, 4, ("gate", "down", "q")) == {
      "gate": ((2, 3, 32, 4), (2, 3, 4, 16)), "down": ((2, 3, 16, 4), (2, 3, 4, 32)),
      "q": ((2, 32, 4), (2, 4, 4, 8))}
  assert lora.logical_axes(cfg, ("gate",))["gate"] == {
      "a": ("layers", "expert", "expert_embed", None), "b": ("layers", "expert", None, "mlp")}
  base = jax.tree.map(np.asarray, model_lib.nn.unbox(model_lib.init_params(cfg, jax.random.key(0))))
  adapters = lora.init(cfg, 4, ("gate",), jax.random.key(1))
  adapters["gate"]["b"] = jax.random.normal(jax.random.key(2), (2, 3, 4, 16))
  merged = lora.merge(base, adapters, 2.0)
  a, b = np.asarray(adapters["gate"]["a"]), np.asarray(adapters["gate"]["b"])
  want = base["layers"]["mlp"]["gate"] + 2.0 * np.einsum("leir,lero->leio", a, b)
  np.testing.assert_allclose(merged["layers"]["mlp"]["gate"], want, rtol=1e-5, atol=1e-6)
  artifacts.save_peft(str(tmp_path), cfg, adapters, rank=4, alpha=8.0, base_path="base")
  tensors = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
  assert len(tensors) == 2 * 3 * 2  # layers x experts x (A, B)
  name = "base_model.model.model.layers.1.mlp.experts.2.gate_proj"
  np.testing.assert_array_equal(tensors[f"{name}.lora_A.weight"], a[1, 2].T)  # [r, in]
  np.testing.assert_array_equal(tensors[f"{name}.lora_B.weight"], b[1, 2].T)  # [out, r]


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_exports_merged_and_evaluates(tmp_path):
  # The smoke preset with rank-4 adapters for 4 steps, a checkpoint every 2: cut at step 2
  # (as if killed during step 3) and resumed, it logs the straight run's rows bit for bit.
  import json  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import cli  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import artifacts  # pylint: disable=g-import-not-at-top
  args = (f"--config={cli.MATH}:smoke", "--config.grpo.max_num_steps=4",
          "--config.model.lora_rank=4", "--config.model.lora_alpha=8",
          "--config.optim.learning_rate=0.01", "--config.logging.trackers=")
  straight = tmp_path / "straight"
  proc = cli.run_train(*args, workdir=straight)
  assert proc.returncode == 0, proc.stderr[-3000:]
  shutil.copytree(straight, tmp_path / "cut")
  shutil.rmtree(tmp_path / "cut" / "checkpoints" / "4")
  proc = cli.run_train(*args, workdir=tmp_path / "cut")
  assert proc.returncode == 0, proc.stderr[-3000:]
  timing = lambda r: {k: v for k, v in r.items() if k != "time" and not k.endswith("_s")}
  rows = lambda w: [timing(json.loads(l)) for l in open(w / "metrics.jsonl")]
  assert rows(tmp_path / "cut") == rows(straight)
  # The checkpoint holds the adapters (and their Adam moments), not the weights.
  from jaxgrpo.run import checkpoint  # pylint: disable=g-import-not-at-top
  meta = checkpoint.read_meta(str(straight / "checkpoints"), 4)
  assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": "q,k,v,o,gate,up,down",
                          "base": "@embedded/arith3"}
  ckpts = checkpoint.Checkpoints(str(straight / "checkpoints"), read_only=True)
  state, _ = ckpts.restore(4)
  ckpts.close()
  assert set(state["params"]) == set(lora.TARGETS)
  # Export: the merged weights are the base + alpha/r A B (alpha 8, rank 4: 2 A B).
  config, model_cfg, _, merged, _ = artifacts.load_run(str(straight))
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  base = artifacts._base(config, model_cfg, loading.load_policy(config)[1])
  want = np.asarray(base["layers"]["attn"]["q"]) + np.asarray(
      lora.delta(state["params"]["q"], 2.0))
  np.testing.assert_allclose(merged["layers"]["attn"]["q"], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(merged["embedding"], base["embedding"])
  # --format=peft: the adapters as a PEFT folder and, since the run started from the
  # embedded model (no Hugging Face folder to point at), its base beside them as one.
  from jaxgrpo.model import hf  # pylint: disable=g-import-not-at-top
  step, written = artifacts.export(str(straight), str(tmp_path / "peft"), fmt="peft")
  assert step == 4 and {"adapter_config.json", "adapter_model.safetensors",
                        "base/model.safetensors", "base/config.json"} <= set(written)
  adapter_config = json.load(open(tmp_path / "peft" / "adapter_config.json"))
  assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8.0)
  assert adapter_config["base_model_name_or_path"] == str(tmp_path / "peft" / "base")
  np.testing.assert_array_equal(hf.load_hf(str(tmp_path / "peft" / "base"))[1]["layers"][
      "mlp"]["down"], base["layers"]["mlp"]["down"])
  # evaluate: the run's adapters merged into its base give the run's own validation row.
  import subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-statements
  proc = subprocess.run([sys.executable, "-m", "jaxgrpo.evaluate", *args,
                         f"--workdir={straight}", f"--out={tmp_path / 'eval'}"],
                        capture_output=True, text=True, env=cli.env(), cwd=cli.ROOT,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  row = [json.loads(l) for l in open(straight / "metrics.jsonl") if '"val"' in l][-1]
  got = json.load(open(tmp_path / "eval" / "eval.json"))["metrics"]
  assert {k: v for k, v in got.items() if k != "wall_time_s"} == {
      k: v for k, v in row.items() if k not in ("step", "split", "time", "wall_time_s")}
  # A LoRA checkpoint resumed without LoRA: one line, before compiling.
  proc = cli.run_train(f"--config={cli.MATH}:smoke", "--config.grpo.max_num_steps=6",
                       workdir=straight)
  cli.assert_clean_error(proc, "config.model.lora_rank=0: the checkpoint",
                         "was trained with lora_rank=4, lora_alpha=8.0")


def test_an_unknown_target_is_one_line():
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("m", os.path.join(ROOT, "configs", "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  c.model.lora_rank, c.model.lora_targets = 4, "q,attn"
  with pytest.raises(config_lib.ConfigError, match=r"config.model.lora_targets='q,attn': "
                     r"allowed: all-linear, or a comma-separated list of q, k, v, o"):
    config_lib.validate(c, 8)

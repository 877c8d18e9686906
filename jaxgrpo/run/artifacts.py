"""A run's artifacts: its recorded config and checkpoints read back (`run_config`,
`run_step`, `load_run`), and written out as a Hugging Face model folder (`save_hf`) or a PEFT
adapter folder (`save_peft`); `export` does either for `python -m jaxgrpo.export`
(export.py, whose docstring says what users get). evaluate (a run's checkpoint) and serve
read runs through here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import safetensors.numpy

from jaxgrpo.run import checkpoint
from jaxgrpo.model import families
from jaxgrpo.model import hf
from jaxgrpo.model import lora
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model.tokenizer import Tokenizer


# The architecture keys a run's config.json may hold, derived from ModelConfig (issue 61: a
# family's keys were listed by hand here too): a run written before a key existed lacks it,
# and absent means "from the checkpoint" (None).
_ARCH_KEYS = tuple(f.name for f in dataclasses.fields(model_lib.ModelConfig)
                   if f.name not in ("param_dtype", "dtype", "moe_matmul", "router_dtype"))


class ExportError(ValueError):
  """A workdir or step that cannot be exported, in one line."""


def run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run folder recorded (config.json), its model keys completed."""
  config_path = os.path.join(workdir, "config.json")
  if not os.path.isfile(config_path):
    raise ExportError(f"{config_path}: missing (is {workdir} a jaxgrpo run folder?)")
  with open(config_path) as f:
    values = json.load(f)
  # Keys a run from an older version did not write: absent means "from the checkpoint".
  model = {"checkpoint": "", "hf_checkpoint": "", **{k: None for k in _ARCH_KEYS},
           # A run from before router_dtype (which routed in the compute dtype) reads back
           # with the default: its dense models have no router, and a mixture's routing in
           # float32 is the exact computation its bfloat16 one rounded.
           "moe_matmul": "auto", "router_dtype": "float32", **values.get("model", {})}
  mesh = {"expert": 1, **values.get("mesh", {})}
  generation = {"gather_weights": True, **values.get("generation", {})}
  return ml_collections.ConfigDict({**values, "model": model, "mesh": mesh,
                                    "generation": generation})


def run_step(workdir: str, step: int | None = None) -> tuple[str, int]:
  """(checkpoints folder, step) of a run's checkpoint `step` (default: the newest)."""
  directory = os.path.join(workdir, checkpoint.DIR_NAME)
  steps = checkpoint.step_dirs(directory)
  if not steps:
    raise ExportError(f"{directory}: no checkpoints")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ExportError(f"--step={step}: no such checkpoint in {directory}; allowed: {steps}")
  return directory, step


def load_run(workdir: str, step: int | None = None, merge: bool = True):
  """A run folder's config, model config, tokenizer and the parameters of checkpoint `step`
  (default: the newest): (config, model_cfg, tokenizer, params, step). Host arrays. A LoRA
  run's params are its adapters merged into its base, or with merge=False the adapters
  {target: {"a", "b"}} as the checkpoint holds them."""
  config, cfg, tokenizer, host_params, params, step = _load(workdir, step)
  if config.model.get("lora_rank") and merge:  # W + alpha/r A B on the run's base
    params = jax.tree.map(np.asarray, lora.merge(
        _base(config, cfg, host_params), params, config.model.lora_alpha / config.model.lora_rank))
  return config, cfg, tokenizer, params, step


def _load(workdir: str, step: int | None):
  """(config, model_cfg, tokenizer, the starting policy's host params or None, the
  checkpoint's params, step)."""
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  config = run_config(workdir)
  directory, step = run_step(workdir, step)
  try:
    # The run's recorded config: checked when it ran (an older run's lacks newer keys).
    cfg, host_params, tokenizer = loading.load_policy(config, checks=False)
  except loading.USER_ERRORS as e:
    raise ExportError(str(e)) from None
  ckpts = checkpoint.Checkpoints(directory, read_only=True)
  try:
    state, _ = ckpts.restore(step)
  finally:
    ckpts.close()
  return config, cfg, tokenizer, host_params, state["params"], step


def _base(config, cfg, host_params):
  """A LoRA run's frozen base as host arrays, from where the run took it (build.place_params:
  its Hugging Face folder, jaxgrpo checkpoint or seeded random init), on one device."""
  from jaxgrpo.run import build  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  mesh = sharding_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  return jax.tree.map(np.asarray, build.place_params(config, cfg, host_params, mesh))


FORMATS = ("merged", "peft")


def export(workdir: str, out: str, step: int | None = None,
           fmt: str = "merged") -> tuple[int, list[str]]:
  """Exports checkpoint `step` (default: the newest) of `workdir` to `out`, as a Hugging
  Face folder (`merged`) or, for a LoRA run, a PEFT adapter folder (`peft`)."""
  if fmt not in FORMATS:
    raise ExportError(f"--format={fmt}: allowed: {', '.join(FORMATS)}")
  if fmt == "merged":
    config, cfg, tokenizer, params, step = load_run(workdir, step)
    source = config.model.get("hf_checkpoint") or config.model.get("checkpoint") or None
    return step, save_hf(out, cfg, params, tokenizer, source=source)
  config, cfg, tokenizer, host_params, adapters, step = _load(workdir, step)
  m = config.model
  if not m.get("lora_rank"):
    raise ExportError(f"--format=peft: {workdir} is not a LoRA run (model.lora_rank=0): it "
                      "has no adapters; allowed for it: --format=merged")
  written = []
  if m.hf_checkpoint:  # the adapter goes onto the Hugging Face folder the run started from
    base_path = os.path.abspath(hf.resolve(m.hf_checkpoint))
  else:  # jaxgrpo weights: written beside the adapter as a Hugging Face folder PEFT can load
    base_path = os.path.abspath(os.path.join(out, "base"))
    base = jax.tree.map(np.asarray, _base(config, cfg, host_params))
    written += [f"base/{name}" for name in
                save_hf(base_path, cfg, base, tokenizer, source=m.checkpoint or None)]
  written += save_peft(out, cfg, adapters, rank=m.lora_rank, alpha=m.lora_alpha,
                       base_path=base_path)
  return step, written


def save_peft(out: str, cfg: model_lib.ModelConfig, adapters, *, rank: int, alpha: float,
              base_path: str) -> list[str]:
  """Writes adapters {target: {"a": [layers, in..., r], "b": [layers, r, out...]}} as a PEFT
  LoRA folder: per layer and target, lora_A.weight [r, in] and lora_B.weight [out, r] in
  torch's Linear layout, named after the base's Hugging Face tensor (hf_names), so PEFT adds
  (alpha/r) B A x to the base projection, our x A B (alpha/r) transposed. A mixture's
  experts ([layers, E, in, r]) get one adapter per expert, on that expert's projection, as
  PEFT targets the hub's per-expert Linear modules. Float32, as trained. Returns the files
  written."""
  os.makedirs(out, exist_ok=True)
  names = hf.hf_names(cfg)
  tensors, modules = {}, []
  for target, adapter in adapters.items():
    a, b = np.asarray(adapter["a"], np.float32), np.asarray(adapter["b"], np.float32)
    ours = "/".join(lora.TARGETS[target][0])  # "attn/q"
    per_expert = lora.expert_axes(cfg, target)
    for i in range(cfg.num_layers):
      for j in range(cfg.num_experts) if per_expert else (None,):
        key = f"layer_{i}/{ours}" + ("" if j is None else f"[{j}]")
        a_ij, b_ij = (a[i], b[i]) if j is None else (a[i, j], b[i, j])
        theirs = names[key][0].removesuffix(".weight")
        tensors[f"base_model.model.{theirs}.lora_A.weight"] = np.ascontiguousarray(
            a_ij.reshape(-1, rank).T)
        tensors[f"base_model.model.{theirs}.lora_B.weight"] = np.ascontiguousarray(
            b_ij.reshape(rank, -1).T)
    modules.append(theirs.rpartition(".")[2])  # "q_proj"
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
      "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": modules,
      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
  with open(os.path.join(out, "adapter_config.json"), "w") as f:
    json.dump(adapter_config, f, indent=2)
  safetensors.numpy.save_file(tensors, os.path.join(out, "adapter_model.safetensors"),
                              metadata={"format": "pt"})
  written = ["adapter_config.json", "adapter_model.safetensors"]
  hf.follow_umask(out, written)
  return written


def hf_family(cfg: model_lib.ModelConfig, source_arch: str | None = None) -> families.Family:
  """The family whose transformers class computes what this ModelConfig computes: the
  folder's the run started from (`source_arch`) when it still does (two families may share
  a layout), else the first registered that does."""
  family, _ = families.by_architecture(source_arch)
  if family is not None and family.matches(cfg):
    return family
  try:
    return families.for_config(cfg)
  except families.Unsupported as e:
    raise hf.PretrainedError(str(e)) from None


def save_hf(out: str, cfg: model_lib.ModelConfig, params, tokenizer: Tokenizer,
            source: str | None = None) -> list[str]:
  """Writes a Hugging Face folder transformers and vLLM load: config.json, model.safetensors,
  tokenizer files. `source` (the folder the run started from) lends its config.json keys,
  tokenizer_config.json (chat template) and generation_config.json, which are copied as
  they were. Returns the files written."""
  os.makedirs(out, exist_ok=True)
  source = hf.resolve(source) if source else None
  hf_cfg, source_arch = {}, None
  if source and hf.is_hf_folder(source):
    with open(os.path.join(source, hf.HF_CONFIG)) as f:
      hf_cfg = json.load(f)
    # A text-and-vision folder's language model: written as the text model it is.
    source_arch = (hf_cfg.get("architectures") or [None])[0]
    hf_cfg = dict(hf_cfg.get("text_config", hf_cfg))
  family = hf_family(cfg, source_arch)
  hf_cfg.update({
      "architectures": [family.architecture], "model_type": family.model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "intermediate_size": cfg.mlp_dim, "rope_theta": cfg.rope_theta,
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": cfg.param_dtype})
  hf_cfg.setdefault("max_position_embeddings", 32768)
  family.write(hf_cfg, cfg)  # the family's own keys (model/families/)
  hf_cfg.setdefault("eos_token_id", tokenizer.eos_id)
  if tokenizer.bos_id is not None:
    hf_cfg.setdefault("bos_token_id", tokenizer.bos_id)
  with open(os.path.join(out, hf.HF_CONFIG), "w") as f:
    json.dump(hf_cfg, f, indent=2)
  flat = hf.flatten(params)
  tensors = {theirs: np.ascontiguousarray(hf.to_hf(hf.part(flat, ours), how))
             for ours, (theirs, how) in hf.hf_names(cfg).items()}
  safetensors.numpy.save_file(tensors, os.path.join(out, hf.HF_WEIGHTS),
                              metadata={"format": "pt"})
  written = [hf.HF_CONFIG, hf.HF_WEIGHTS]
  copied = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json")
  for name in copied if source and hf.is_hf_folder(source) else ():
    if os.path.isfile(os.path.join(source, name)):
      shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
      written.append(name)
  if "tokenizer.json" not in written:  # jaxgrpo's own format: write what transformers reads
    written += tokenizer.save(out)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
      json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                 "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
                 "bos_token": tokenizer.bos_token}, f, indent=2)
    written.append("tokenizer_config.json")
  hf.follow_umask(out, written)
  return written

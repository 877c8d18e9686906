"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, every layer's MLP a mixture of
SwiGLU experts (model/moe.py). Hugging Face stores one tensor per expert; ours is one
[E, in, out] tensor per layer, named here with the expert's index (`layer_0/mlp/gate[3]`)."""

from jaxgrpo.model.families import base

_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_mlp_dim")


def _read(hf: dict) -> dict:
  # transformers 5 writes num_local_experts beside num_experts; the hub's 4.x files have
  # num_experts only.
  dense_layers, step = hf.get("mlp_only_layers") or [], hf.get("decoder_sparse_step", 1)
  if dense_layers or step != 1:
    raise base.Unsupported(f"mlp_only_layers={dense_layers}, decoder_sparse_step={step}; "
                           "allowed: [] and 1 (every layer a mixture of experts, as every "
                           "released Qwen3-MoE)")
  moe = dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")),
             num_experts_per_tok=hf.get("num_experts_per_tok"),
             moe_mlp_dim=hf.get("moe_intermediate_size"))
  missing = [base.HF_KEYS[k] for k in _MOE_KEYS if moe[k] is None]
  if missing:
    raise base.Unsupported(f"missing key {missing[0]!r} (a Qwen3-MoE config names "
                           "num_experts, num_experts_per_tok and moe_intermediate_size)")
  return {**base.read_llama_shaped(hf), **moe, "qk_norm": True,
          "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def _write(hf: dict, cfg) -> None:
  base.write_llama_shaped(hf, cfg)
  hf.update({"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
             "moe_intermediate_size": cfg.moe_mlp_dim, "norm_topk_prob": cfg.norm_topk_prob,
             "decoder_sparse_step": 1, "mlp_only_layers": []})
  hf.pop("num_local_experts", None)  # transformers 5 derives it from num_experts


def _layer_names(cfg, ours: str, theirs: str) -> dict:
  names = {**base.pre_norms(ours, theirs),
           f"{ours}/mlp/router": (f"{theirs}.mlp.gate.weight", "T")}
  for j in range(cfg.num_experts):
    for p in ("gate", "up", "down"):
      names[f"{ours}/mlp/{p}[{j}]"] = (f"{theirs}.mlp.experts.{j}.{p}_proj.weight", "T")
  return names


FAMILY = base.register(base.Family(
    architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", name="Qwen3-MoE",
    layout={**base.LLAMA_SHAPED, "qk_norm": True, "qkv_bias": False, "num_experts": True},
    read=_read, write=_write, layer_names=_layer_names,
    end_of_turn="<|im_end|>", tool_parser="hermes"))

"""Llama 3.x (LlamaForCausalLM): the layout the others depart from, Llama 3.1's RoPE scaling."""

from jaxgrpo.model.families import base


def _read(hf: dict) -> dict:
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise base.Unsupported("Llama with attention_bias/mlp_bias is not supported")
  return base.read_llama_shaped(hf)


def _write(hf: dict, cfg) -> None:
  base.write_llama_shaped(hf, cfg)
  hf.setdefault("attention_bias", False)
  hf.setdefault("mlp_bias", False)


FAMILY = base.register(base.Family(
    architecture="LlamaForCausalLM", model_type="llama", name="Llama 3.x",
    layout={**base.LLAMA_SHAPED, "qk_norm": False, "qkv_bias": False, "num_experts": False},
    read=_read, write=_write, layer_names=base.llama_layer_names,
    end_of_turn="<|eot_id|>", tool_parser="llama3_json"))

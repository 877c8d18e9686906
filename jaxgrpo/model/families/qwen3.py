"""Qwen3 dense (Qwen3ForCausalLM): the Llama layout with each head's q and k RMS-normed."""

from jaxgrpo.model.families import base

FAMILY = base.register(base.Family(
    architecture="Qwen3ForCausalLM", model_type="qwen3", name="Qwen3",
    layout={**base.LLAMA_SHAPED, "qk_norm": True, "qkv_bias": False, "num_experts": False},
    read=lambda hf: {**base.read_llama_shaped(hf), "qk_norm": True},
    write=base.write_llama_shaped, layer_names=base.llama_layer_names,
    end_of_turn="<|im_end|>", tool_parser="hermes"))

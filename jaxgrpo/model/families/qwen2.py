"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): the Llama layout with biases on q/k/v."""

from jaxgrpo.model.families import base

FAMILY = base.register(base.Family(
    architecture="Qwen2ForCausalLM", model_type="qwen2", name="Qwen2.5",
    layout={**base.LLAMA_SHAPED, "qkv_bias": True, "qk_norm": False, "num_experts": False},
    read=lambda hf: {**base.read_llama_shaped(hf), "qkv_bias": True},
    write=base.write_llama_shaped, layer_names=base.llama_layer_names,
    end_of_turn="<|im_end|>", tool_parser="hermes"))

"""The model families jaxgrpo reads and writes as Hugging Face folders, one module each
(base.py says what a family is). A new family is its module and one line here."""

from jaxgrpo.model.families import base
from jaxgrpo.model.families import gemma3, llama, qwen2, qwen3, qwen3_moe  # registration

Family, Unsupported, FAMILIES, HF_KEYS = base.Family, base.Unsupported, base.FAMILIES, base.HF_KEYS
architectures, by_architecture, for_config = base.architectures, base.by_architecture, base.for_config
del gemma3, llama, qwen2, qwen3, qwen3_moe

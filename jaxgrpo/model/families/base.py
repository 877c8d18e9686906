"""What a model family is, and the registry every family joins (issue 61).

A family is one transformers architecture (`Qwen2ForCausalLM`, ...) and everything jaxgrpo
must know to read its folders and write them back: the class and `model_type`, config.json
-> ModelConfig (`read`) and back (`write`), the per-layer tensor names beyond attention's
(`layer_names`), the ModelConfig switches that tell its computation apart (`layout`, which
export uses to name the class a trained model is), how its config.json spells our fields
(`keys`), and its chat specifics (the token that ends an assistant turn, the tool-call
format its instruct models are tuned on). model/hf.py (folders) and run/artifacts.py
(export) hold nothing family-specific: they ask the family. docs/architecture.md says how
to add one.

The shared pieces the Llama-shaped families read and write alike (RoPE with Llama 3's
scaling, SwiGLU only, the pre-norms and the dense MLP's tensor names) are here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxgrpo.model import decoder as model_lib


class Unsupported(ValueError):
  """A config.json value a family cannot read, in one line (model/hf.py adds the file)."""


# Our ModelConfig field -> the config.json key it is read from (a family whose config.json
# spells one differently overrides it in Family.keys), so an error about a folder names the
# key as the folder spells it.
HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size",
           "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "mlp_dim": "intermediate_size", "norm_eps": "rms_norm_eps",
           "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
           "num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
           "moe_mlp_dim": "moe_intermediate_size", "norm_topk_prob": "norm_topk_prob",
           "hidden_act": "hidden_act", "sliding_window": "sliding_window",
           "query_pre_attn_scalar": "query_pre_attn_scalar"}

# The layout of the Llama-shaped families: SwiGLU, plain w norms before each sublayer only,
# unscaled embeddings, no window, head_dim's attention scale.
LLAMA_SHAPED = {"hidden_act": "silu", "norm_plus_one": False, "post_norms": False,
                "embed_scale": False, "sliding_window": 0, "query_pre_attn_scalar": 0.0,
                "rope_scaling_type": "llama3"}


@dataclasses.dataclass(frozen=True)
class Family:
  """One transformers architecture. `read(hf)` takes config.json (a dict, defaults merged)
  and returns the ModelConfig fields that are the family's own (the sizes every family
  shares are read by hf.py); it raises Unsupported for a value it cannot compute.
  `write(hf, cfg)` sets the family's own keys in the config.json being written (the shared
  sizes are already there). `layer_names(cfg, ours, theirs)` maps layer tensors beyond the
  attention projections (norms, MLP) to Hugging Face names, see hf.hf_names."""
  architecture: str
  model_type: str
  layout: Mapping[str, Any]
  read: Callable[[dict], dict]
  write: Callable[[dict, model_lib.ModelConfig], None]
  layer_names: Callable[[model_lib.ModelConfig, str, str], dict]
  keys: Mapping[str, str] = dataclasses.field(default_factory=lambda: HF_KEYS)
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Other architectures whose folder holds this family's model: name -> config.json to the
  # model's own block (Gemma 3's text-and-vision folders: their text_config).
  wrappers: Mapping[str, Callable[[dict], dict]] = dataclasses.field(default_factory=dict)
  tie_default: bool = False
  end_of_turn: str = ""  # the token its chat template ends an assistant turn with
  tool_parser: str | None = None  # the jaxgrpo.tools parser its instruct models call with
  name: str = ""  # for people: "Qwen2.5", "Llama 3.x"

  def matches(self, cfg: model_lib.ModelConfig) -> bool:
    """Whether `cfg` computes what this family's transformers class computes."""
    for field, want in self.layout.items():
      have = getattr(cfg, field)
      if (bool(have) != want) if isinstance(want, bool) else (have != want):
        return False
    return True


FAMILIES: dict[str, Family] = {}  # architecture -> Family, in registration order


def register(family: Family) -> Family:
  if family.architecture in FAMILIES:
    raise ValueError(f"model family {family.architecture} is registered twice")
  FAMILIES[family.architecture] = family
  return family


def architectures() -> tuple[str, ...]:
  """Every `architectures` a folder's config.json may name: each family's, and wrappers'."""
  return (*FAMILIES, *(w for f in FAMILIES.values() for w in f.wrappers))


def by_architecture(arch: str | None) -> tuple[Family | None, Callable[[dict], dict]]:
  """(the family, how to take its block out of config.json) of config.json's architecture;
  (None, ...) when no family reads it."""
  if arch in FAMILIES:
    return FAMILIES[arch], lambda hf: hf
  for family in FAMILIES.values():
    if arch in family.wrappers:
      return family, family.wrappers[arch]
  return None, lambda hf: hf


def for_config(cfg: model_lib.ModelConfig) -> Family:
  """The family whose transformers class computes what `cfg` computes (export names it)."""
  for family in FAMILIES.values():
    if family.matches(cfg):
      return family
  layouts = "; ".join(f"{f.architecture}: " + ", ".join(
      f"{k}={v}" for k, v in f.layout.items() if k not in LLAMA_SHAPED or
      LLAMA_SHAPED[k] != v) for f in FAMILIES.values())
  have = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in dict.fromkeys(
      k for f in FAMILIES.values() for k in f.layout))
  raise Unsupported(f"no Hugging Face architecture computes this model ({have}); "
                    f"allowed layouts: {layouts}")


# ------------------------------------------------- pieces the Llama-shaped families share

def read_rope(hf: dict) -> dict:
  """RoPE's base and Llama 3's frequency scaling. transformers 5 writes `rope_parameters`
  (theta and scaling together); 4.x wrote `rope_theta` and `rope_scaling`. Both are read."""
  rp = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", rp.get("rope_theta", 10_000.0))
  out = {"rope_theta": float(theta)}
  rs = hf.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
  if rs and rs.get("rope_type", rs.get("type")) != "default":
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "llama3":
      raise Unsupported(f"rope_scaling type {kind!r} is not supported; allowed: none or "
                        "'llama3'")
    out.update(rope_scaling_factor=float(rs["factor"]),
               rope_low_freq_factor=float(rs["low_freq_factor"]),
               rope_high_freq_factor=float(rs["high_freq_factor"]),
               rope_original_max_positions=int(rs["original_max_position_embeddings"]))
  return out


def read_llama_shaped(hf: dict) -> dict:
  """The checks and RoPE every Llama-shaped family reads alike."""
  if hf.get("hidden_act", "silu") != "silu":
    raise Unsupported(f"hidden_act={hf['hidden_act']!r}; allowed: 'silu'")
  if hf.get("use_sliding_window"):
    raise Unsupported("use_sliding_window=true is not supported")
  return read_rope(hf)


def write_llama_shaped(hf: dict, cfg: model_lib.ModelConfig) -> None:
  hf["hidden_act"] = "silu"
  if cfg.rope_scaling_factor:
    hf["rope_scaling"] = {
        "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_positions}


def pre_norms(ours: str, theirs: str) -> dict:
  """A norm before each sublayer (Llama's input_layernorm / post_attention_layernorm)."""
  return {f"{ours}/attn_norm/scale": (f"{theirs}.input_layernorm.weight", "same"),
          f"{ours}/mlp_norm/scale": (f"{theirs}.post_attention_layernorm.weight", "same")}


def dense_mlp(ours: str, theirs: str) -> dict:
  return {f"{ours}/mlp/{p}": (f"{theirs}.mlp.{p}_proj.weight", "T")
          for p in ("gate", "up", "down")}


def llama_layer_names(cfg, ours: str, theirs: str) -> dict:
  del cfg
  return {**pre_norms(ours, theirs), **dense_mlp(ours, theirs)}

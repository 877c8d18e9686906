"""Gemma 3 (Gemma3ForCausalLM; the text model of Gemma3ForConditionalGeneration folders).

Its departures from the Llama layout are ModelConfig switches: GeGLU, (1 + w) norms before
and after each sublayer, scaled embeddings, query_pre_attn_scalar, local layers with a
window and their own RoPE base. config.json comes in two layouts: transformers 5's
(`layer_types`, per-type `rope_parameters`) and 4.x's (`sliding_window_pattern`,
`rope_local_base_freq`, `rope_theta`, `rope_scaling`); both are read, 5's is written
(4.5x reads it too).
"""

from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model.families import base

# Gemma3TextConfig's defaults (transformers 5.24), which the hub's text_config blocks rely
# on (gemma-3-4b-it's names only the sizes that differ).
DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
KEYS = {**base.HF_KEYS, "hidden_act": "hidden_activation",
        "rope_local_theta": "rope_local_base_freq",
        "sliding_window_pattern": "sliding_window_pattern"}


def _text_model(hf: dict) -> dict:
  """A text-and-vision folder's config.json: its text model's block."""
  return {**hf.get("text_config", {}), "tie_word_embeddings": hf.get("tie_word_embeddings", True)}


def _pattern(hf: dict) -> int:
  """Every how-many-th layer is global (1: all global)."""
  layers, types = hf["num_hidden_layers"], hf.get("layer_types")
  if not types:
    return int(hf.get("sliding_window_pattern", 6))
  globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
  pattern = globals_[0] + 1 if globals_ else 0
  want = [i for i in range(layers) if pattern and (i + 1) % pattern == 0]
  if (sorted(set(types)) not in (["full_attention", "sliding_attention"],
                                 ["sliding_attention"], ["full_attention"])
      or globals_ != want or len(types) != layers):
    raise base.Unsupported(f"layer_types {types}: allowed a global (full_attention) layer "
                           "every n-th and sliding_attention between")
  return pattern if types.count("sliding_attention") else 1


def _read(hf: dict) -> dict:
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in ACTIVATIONS:
    raise base.Unsupported(f"hidden_activation={act!r}; allowed: {', '.join(ACTIVATIONS)}")
  for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
    if hf.get(key):
      raise base.Unsupported(f"{key}={hf[key]!r} is not supported (Gemma 3 has none; Gemma "
                             "2's soft-capping is not built); allowed: null")
  rp = hf.get("rope_parameters") or {}
  if "full_attention" in rp:
    full, local = rp["full_attention"], rp.get("sliding_attention") or {}
    theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
    scaling = full if full.get("rope_type", "default") != "default" else None
    if local.get("rope_type", "default") != "default":
      raise base.Unsupported(f"the sliding layers' rope_type {local['rope_type']!r} is not "
                             "supported; allowed: 'default'")
  else:
    theta, local_theta = hf.get("rope_theta", 1e6), hf.get("rope_local_base_freq", 1e4)
    scaling = hf.get("rope_scaling")
  out = dict(hidden_act=ACTIVATIONS[act], norm_plus_one=True, post_norms=True,
             embed_scale=True, qk_norm=True,
             query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
             sliding_window=int(hf.get("sliding_window") or 0),
             sliding_window_pattern=_pattern(hf),
             rope_theta=float(theta), rope_local_theta=float(local_theta))
  if scaling:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "linear":
      raise base.Unsupported(f"Gemma's rope_scaling type {kind!r} is not supported; "
                             "allowed: none or 'linear'")
    out.update(rope_scaling_factor=float(scaling["factor"]), rope_scaling_type="linear")
  return out


def _int_if_whole(x: float):
  return int(x) if float(x).is_integer() else x


def _write(hf: dict, cfg) -> None:
  """transformers 5's layout (per layer type RoPE, the layer types listed); the keys of
  4.x's layout that would disagree are dropped."""
  for key in ("hidden_act", "rope_theta", "rope_scaling", "rope_local_base_freq",
              "sliding_window_pattern", "_sliding_window_pattern"):
    hf.pop(key, None)
  full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling_factor:
    full.update(rope_type="linear", factor=cfg.rope_scaling_factor)
  hf.update({
      "hidden_activation": "gelu_pytorch_tanh",
      # transformers' strict config takes an int here (Gemma 3's are).
      "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
      "sliding_window": cfg.sliding_window or None,
      "layer_types": ["sliding_attention" if model_lib.is_local(i, cfg) else "full_attention"
                      for i in range(cfg.num_layers)],
      "rope_parameters": {"full_attention": full, "sliding_attention": {
          "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}},
      "final_logit_softcapping": None, "attn_logit_softcapping": None})


def _layer_names(cfg, ours: str, theirs: str) -> dict:
  """A norm before and after each sublayer."""
  return {f"{ours}/attn_norm/scale": (f"{theirs}.input_layernorm.weight", "same"),
          f"{ours}/post_attn_norm/scale": (f"{theirs}.post_attention_layernorm.weight", "same"),
          f"{ours}/mlp_norm/scale": (f"{theirs}.pre_feedforward_layernorm.weight", "same"),
          f"{ours}/post_mlp_norm/scale": (f"{theirs}.post_feedforward_layernorm.weight", "same"),
          **base.dense_mlp(ours, theirs)}


FAMILY = base.register(base.Family(
    architecture="Gemma3ForCausalLM", model_type="gemma3_text", name="Gemma 3",
    layout={"hidden_act": "gelu_tanh", "norm_plus_one": True, "post_norms": True,
            "embed_scale": True, "qk_norm": True, "qkv_bias": False, "num_experts": False},
    read=_read, write=_write, layer_names=_layer_names, keys=KEYS, defaults=DEFAULTS,
    wrappers={"Gemma3ForConditionalGeneration": _text_model}, tie_default=True,
    end_of_turn="<end_of_turn>", tool_parser=None))

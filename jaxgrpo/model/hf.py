"""Pretrained weights on disk: a folder with `model.json`, `model.safetensors`, `tokenizer.json`.

This is jaxgrpo's own layout (parameter names are the Flax tree paths joined by '/'), used by
the shipped warm-start checkpoint. A folder name starting with `@embedded/` resolves to
`jaxgrpo/assets/`, so configs can name shipped checkpoints without knowing the install path.

Loading reads everything on the host before any device work, and every problem (missing
folder or file, unknown architecture key, a tensor of the wrong shape) is a
`PretrainedError` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import flax.linen as nn
import jax
import numpy as np
import safetensors
import safetensors.numpy

from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model.tokenizer import Tokenizer

EMBEDDED_PREFIX = "@embedded/"
# The package's assets folder (jaxgrpo/assets), one level above this one.
_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
MODEL_FILE, WEIGHTS_FILE = "model.json", "model.safetensors"


class PretrainedError(ValueError):
  """A checkpoint folder that cannot be used, explained in one line naming the file."""


def resolve(path: str) -> str:
  if path.startswith(EMBEDDED_PREFIX):
    return os.path.join(_ASSETS, path[len(EMBEDDED_PREFIX):])
  return path


def _name(path) -> str:
  """A tree path as a tensor name: ('layer_0', 'attn', 'q') -> 'layer_0/attn/q'."""
  return "/".join(str(getattr(k, "key", k)) for k in path)


def flatten(params) -> dict[str, np.ndarray]:
  """Host copies named as on disk: each layer's tensors apart (`layer_3/attn/q`), whatever
  the in-memory layout (stacked under `layers`, see model.stack_layers)."""
  if "layers" in params:
    params = model_lib.unstack_layers(params)
  return {_name(path): np.asarray(jax.device_get(leaf))
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _unflatten(flat: dict[str, np.ndarray]):
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def save_pretrained(path: str, cfg: model_lib.ModelConfig, params, tokenizer: Tokenizer):
  """Writes the folder (host copies of the parameters; call on process 0 only)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, MODEL_FILE), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  safetensors.numpy.save_file(flatten(params), os.path.join(path, WEIGHTS_FILE))
  follow_umask(path, [MODEL_FILE, WEIGHTS_FILE, *tokenizer.save(path)])


def inspect_pretrained(path: str, need_weights: bool = True):
  """Returns (ModelConfig, Tokenizer) of a jaxgrpo checkpoint folder, reading no weights
  (need_weights=False: the weights file need not be there, as for a compile check)."""
  folder = resolve(path)
  if not os.path.isdir(folder):
    raise PretrainedError(f"{path}: no such checkpoint folder")
  model_file = os.path.join(folder, MODEL_FILE)
  weights_file = os.path.join(folder, WEIGHTS_FILE)
  for f in (model_file, weights_file) if need_weights else (model_file,):
    if not os.path.isfile(f):
      raise PretrainedError(f"{f}: missing (a checkpoint folder holds {MODEL_FILE}, "
                            f"{WEIGHTS_FILE} and tokenizer.json)")
  try:
    with open(model_file) as f:
      cfg = model_lib.ModelConfig.from_dict(json.load(f))
  except (ValueError, TypeError) as e:
    raise PretrainedError(f"{model_file}: {e}") from None
  try:
    tokenizer = Tokenizer.from_file(folder)
  except (FileNotFoundError, ValueError) as e:
    raise PretrainedError(str(e)) from None
  return cfg, tokenizer


def load_pretrained(path: str):
  """Returns (ModelConfig, host parameter tree of numpy arrays, Tokenizer)."""
  cfg, tokenizer = inspect_pretrained(path)
  weights_file = os.path.join(resolve(path), WEIGHTS_FILE)
  params = _unflatten(safetensors.numpy.load_file(weights_file))
  expected = _expected_shapes(cfg)
  got = {k: v.shape for k, v in flatten(params).items()}
  if set(expected) != set(got):
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    raise PretrainedError(f"{weights_file}: parameter names do not match {MODEL_FILE} "
                          f"(missing {missing[:3]}, unexpected {extra[:3]})")
  for name, shape in expected.items():
    if tuple(got[name]) != tuple(shape):
      raise PretrainedError(f"{weights_file}: {name} has shape {got[name]}, "
                            f"{MODEL_FILE} implies {tuple(shape)}")
  if tokenizer.vocab_size > cfg.vocab_size:
    raise PretrainedError(f"{resolve(path)}: tokenizer has {tokenizer.vocab_size} tokens but the "
                          f"model's vocab_size is {cfg.vocab_size}")
  return cfg, model_lib.stack_layers(params), tokenizer


def _flatten_shapes(abstract) -> dict[str, tuple]:
  return {_name(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(abstract))}


# ------------------- Hugging Face model folders (read here; export.save_hf writes them)

HF_CONFIG = "config.json"
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
# architecture -> (qk_norm, qkv_bias, mixture of experts): the families' structural differences.
SUPPORTED = {"Qwen2ForCausalLM": (False, True, False), "Qwen3ForCausalLM": (True, False, False),
             "LlamaForCausalLM": (False, False, False),
             "Qwen3MoeForCausalLM": (True, False, True), "Gemma3ForCausalLM": (True, False, False)}
# Every `architectures` a folder's config.json may name: the families above, and Gemma 3's
# text-and-vision folders, whose text model is read (hf_model_config).
ARCHITECTURES = (*SUPPORTED, "Gemma3ForConditionalGeneration")
HF_MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe",
                  "Gemma3ForCausalLM": "gemma3_text"}
# Gemma3TextConfig's defaults (transformers 5.24), which the hub's text_config blocks rely on
# (gemma-3-4b-it's names only the sizes that differ).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def is_hf_folder(path: str) -> bool:
  return os.path.isfile(os.path.join(resolve(path), HF_CONFIG))


# Our ModelConfig field -> the config.json key it is read from: an error about a Hugging
# Face folder names the key as the folder spells it (Gemma 3's differ: GEMMA3_KEYS).
HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size",
           "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "mlp_dim": "intermediate_size", "norm_eps": "rms_norm_eps",
           "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
           "num_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
           "moe_mlp_dim": "moe_intermediate_size", "norm_topk_prob": "norm_topk_prob",
           "hidden_act": "hidden_act", "sliding_window": "sliding_window",
           "query_pre_attn_scalar": "query_pre_attn_scalar"}
GEMMA3_KEYS = {**HF_KEYS, "hidden_act": "hidden_activation",
               "rope_local_theta": "rope_local_base_freq",
               "sliding_window_pattern": "sliding_window_pattern"}


def hf_key(name: str, folder: str | None = None) -> str:
  """Our field `name` as the config.json of `folder` spells it (HF_KEYS)."""
  keys = HF_KEYS
  if folder is not None:
    try:
      with open(os.path.join(resolve(folder), HF_CONFIG)) as f:
        if "Gemma3" in str((json.load(f).get("architectures") or [""])[0]):
          keys = GEMMA3_KEYS
    except (OSError, ValueError):
      pass
  return keys.get(name, name)


def _in_hf_spelling(message: str, keys: dict) -> str:
  """A ModelConfig error (`model.<field>=...`) with each field as config.json spells it."""
  return re.sub(r"model\.(\w+)", lambda m: keys.get(m.group(1), m.group(0)), message)


def hf_model_config(folder: str, dtype: str = "float32") -> model_lib.ModelConfig:
  """config.json -> ModelConfig. Sampling settings in generation_config.json are never read:
  sampling is always the run config's explicit profile."""
  path = os.path.join(folder, HF_CONFIG)
  try:
    with open(path) as f:
      hf = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise PretrainedError(f"{path}: cannot read ({e})") from None
  arch = (hf.get("architectures") or [None])[0]
  if arch == "Gemma3ForConditionalGeneration":  # text and vision: the text model only
    arch, hf = "Gemma3ForCausalLM", {**hf.get("text_config", {}),
                                     "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
  if arch == "Gemma3ForCausalLM":  # keys a hub file leaves out take transformers' defaults
    hf = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or
                                    k in ("final_logit_softcapping", "attn_logit_softcapping")}}
  if arch not in SUPPORTED:
    raise PretrainedError(f"{path}: architecture {arch!r} is not supported; allowed: "
                          f"{', '.join(ARCHITECTURES)}")
  qk_norm, qkv_bias, experts = SUPPORTED[arch]
  if arch == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
    raise PretrainedError(f"{path}: Llama with attention_bias/mlp_bias is not supported")
  if arch == "Gemma3ForCausalLM":
    return _config(hf, path, dtype, qk_norm=True, qkv_bias=False, tie_default=True,
                   keys=GEMMA3_KEYS, **_gemma3(hf, path))
  if hf.get("hidden_act", "silu") != "silu":
    raise PretrainedError(f"{path}: hidden_act={hf['hidden_act']!r}; allowed: 'silu'")
  if hf.get("use_sliding_window"):
    raise PretrainedError(f"{path}: use_sliding_window=true is not supported")
  scaling = {}
  # transformers 5 writes `rope_parameters` (theta and scaling together); 4.x wrote
  # `rope_theta` and `rope_scaling`. Both are read.
  rp = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", rp.get("rope_theta", 10_000.0))
  rs = hf.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
  if rs and rs.get("rope_type", rs.get("type")) != "default":
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "llama3":
      raise PretrainedError(f"{path}: rope_scaling type {kind!r} is not supported; allowed: "
                            "none or 'llama3'")
    scaling = dict(rope_scaling_factor=float(rs["factor"]),
                   rope_low_freq_factor=float(rs["low_freq_factor"]),
                   rope_high_freq_factor=float(rs["high_freq_factor"]),
                   rope_original_max_positions=int(rs["original_max_position_embeddings"]))
  moe = {}
  if experts:
    # transformers 5 writes num_local_experts beside num_experts; the hub's 4.x files have
    # num_experts only.
    num = hf.get("num_experts", hf.get("num_local_experts"))
    dense_layers = hf.get("mlp_only_layers") or []
    step = hf.get("decoder_sparse_step", 1)
    if dense_layers or step != 1:
      raise PretrainedError(f"{path}: mlp_only_layers={dense_layers}, decoder_sparse_step="
                            f"{step}; allowed: [] and 1 (every layer a mixture of experts, "
                            "as every released Qwen3-MoE)")
    moe = dict(num_experts=num, num_experts_per_tok=hf.get("num_experts_per_tok"),
               moe_mlp_dim=hf.get("moe_intermediate_size"),
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    missing = [HF_KEYS[k] for k, v in moe.items() if v is None]
    if missing:
      raise PretrainedError(f"{path}: missing key {missing[0]!r} (a Qwen3-MoE config names "
                            "num_experts, num_experts_per_tok and moe_intermediate_size)")
  return _config(hf, path, dtype, qk_norm=qk_norm, qkv_bias=qkv_bias, tie_default=False,
                 rope_theta=float(theta), **scaling, **moe)


def _config(hf: dict, path: str, dtype: str, *, tie_default: bool, keys=HF_KEYS, **family):
  """The ModelConfig of config.json's shared keys and a family's own (`family`)."""
  try:
    heads = hf["num_attention_heads"]
    return model_lib.ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        param_dtype=dtype, dtype=dtype, **family)
  except KeyError as e:
    raise PretrainedError(f"{path}: missing key {e}") from None
  except ValueError as e:
    raise PretrainedError(f"{path}: {_in_hf_spelling(str(e), keys)}") from None


def _gemma3(hf: dict, path: str) -> dict:
  """Gemma 3's own keys: GeGLU, (1 + w) norms before and after each sublayer, scaled
  embeddings, query_pre_attn_scalar, local layers with a window and their own RoPE base
  (transformers 5: `layer_types` and per-type `rope_parameters`; 4.x:
  `sliding_window_pattern`, `rope_local_base_freq`, `rope_theta`, `rope_scaling`)."""
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in GEMMA_ACTIVATIONS:
    raise PretrainedError(f"{path}: hidden_activation={act!r}; allowed: "
                          f"{', '.join(GEMMA_ACTIVATIONS)}")
  for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
    if hf.get(key):
      raise PretrainedError(f"{path}: {key}={hf[key]!r} is not supported (Gemma 3 has none; "
                            "Gemma 2's soft-capping is not built); allowed: null")
  layers = hf["num_hidden_layers"]
  types = hf.get("layer_types")
  if types:
    globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
    pattern = globals_[0] + 1 if globals_ else 0
    want = [i for i in range(layers) if pattern and (i + 1) % pattern == 0]
    if (sorted(set(types)) not in (["full_attention", "sliding_attention"],
                                   ["sliding_attention"], ["full_attention"])
        or globals_ != want or len(types) != layers):
      raise PretrainedError(f"{path}: layer_types {types}: allowed a global (full_attention) "
                            "layer every n-th and sliding_attention between")
    if not types.count("sliding_attention"):
      pattern = 1
  else:
    pattern = int(hf.get("sliding_window_pattern", 6))
  rp = hf.get("rope_parameters") or {}
  if "full_attention" in rp:
    full, local = rp["full_attention"], rp.get("sliding_attention") or {}
    theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
    scaling = full if full.get("rope_type", "default") != "default" else None
    if local.get("rope_type", "default") != "default":
      raise PretrainedError(f"{path}: the sliding layers' rope_type "
                            f"{local['rope_type']!r} is not supported; allowed: 'default'")
  else:
    theta, local_theta = hf.get("rope_theta", 1e6), hf.get("rope_local_base_freq", 1e4)
    scaling = hf.get("rope_scaling")
  out = dict(hidden_act=GEMMA_ACTIVATIONS[act], norm_plus_one=True, post_norms=True,
             embed_scale=True, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
             sliding_window=int(hf.get("sliding_window") or 0), sliding_window_pattern=pattern,
             rope_theta=float(theta), rope_local_theta=float(local_theta))
  if scaling:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "linear":
      raise PretrainedError(f"{path}: Gemma's rope_scaling type {kind!r} is not supported; "
                            "allowed: none or 'linear'")
    out.update(rope_scaling_factor=float(scaling["factor"]), rope_scaling_type="linear")
  return out


def hf_names(cfg: model_lib.ModelConfig) -> dict[str, tuple[str, str]]:
  """Our tensor name -> (Hugging Face tensor name, how to convert it).

  A mixture's experts are one tensor of ours per layer ([E, in, out]) and one per expert in
  Hugging Face's files: ours is then named with the expert's index, `layer_0/mlp/gate[3]`
  (`part` reads it)."""
  names = {"embedding": ("model.embed_tokens.weight", "same"),
           "final_norm/scale": ("model.norm.weight", "same")}
  if not cfg.tie_embeddings:
    names["lm_head"] = ("lm_head.weight", "T")
  for i in range(cfg.num_layers):
    ours, hf = f"layer_{i}", f"model.layers.{i}"
    if cfg.post_norms:  # Gemma: a norm before and after each sublayer
      names.update({
          f"{ours}/attn_norm/scale": (f"{hf}.input_layernorm.weight", "same"),
          f"{ours}/post_attn_norm/scale": (f"{hf}.post_attention_layernorm.weight", "same"),
          f"{ours}/mlp_norm/scale": (f"{hf}.pre_feedforward_layernorm.weight", "same"),
          f"{ours}/post_mlp_norm/scale": (f"{hf}.post_feedforward_layernorm.weight", "same")})
    else:
      names.update({
          f"{ours}/attn_norm/scale": (f"{hf}.input_layernorm.weight", "same"),
          f"{ours}/mlp_norm/scale": (f"{hf}.post_attention_layernorm.weight", "same")})
    names.update({
        f"{ours}/attn/q": (f"{hf}.self_attn.q_proj.weight", "in_heads"),
        f"{ours}/attn/k": (f"{hf}.self_attn.k_proj.weight", "in_heads"),
        f"{ours}/attn/v": (f"{hf}.self_attn.v_proj.weight", "in_heads"),
        f"{ours}/attn/o": (f"{hf}.self_attn.o_proj.weight", "heads_out")})
    if cfg.num_experts:
      names[f"{ours}/mlp/router"] = (f"{hf}.mlp.gate.weight", "T")
      for j in range(cfg.num_experts):
        for p in ("gate", "up", "down"):
          names[f"{ours}/mlp/{p}[{j}]"] = (f"{hf}.mlp.experts.{j}.{p}_proj.weight", "T")
    else:
      for p in ("gate", "up", "down"):
        names[f"{ours}/mlp/{p}"] = (f"{hf}.mlp.{p}_proj.weight", "T")
    if cfg.qkv_bias:
      for p in "qkv":
        names[f"{ours}/attn/{p}_bias"] = (f"{hf}.self_attn.{p}_proj.bias", "heads")
    if cfg.qk_norm:
      for p in "qk":
        names[f"{ours}/attn/{p}_norm/scale"] = (f"{hf}.self_attn.{p}_norm.weight", "same")
  return names


def part(tree: dict, ours: str):
  """tree[ours] of a flat {name: array or shape} tree, where `name[j]` is expert j of
  tree[name] (see hf_names)."""
  if not ours.endswith("]"):
    return tree[ours]
  base, index = ours[:-1].split("[")
  value = tree[base]
  return value[1:] if isinstance(value, tuple) else value[int(index)]


def _from_hf(x: np.ndarray, how: str, shape: tuple) -> np.ndarray:
  """A torch-layout tensor ([out, in] for Linear) to ours of `shape`."""
  if how in ("same", "heads"):
    return x.reshape(shape)
  # T, in_heads ([H*Dh, D] -> [D, H, Dh]) and heads_out ([D, H*Dh] -> [H, Dh, D]) all
  # transpose torch's [out, in]; the reshape splits the head axis where there is one.
  return x.T.reshape(shape)


def to_hf(x: np.ndarray, how: str) -> np.ndarray:
  if how == "same":
    return x
  if how == "heads":  # [H, Dh] -> [H*Dh]
    return x.reshape(-1)
  if how == "T":
    return x.T
  if how == "in_heads":  # [D, H, Dh] -> [H*Dh, D]
    return x.reshape(x.shape[0], -1).T
  return x.reshape(-1, x.shape[-1]).T  # heads_out: [H, Dh, D] -> [D, H*Dh]


# A text-and-vision folder (Gemma3ForConditionalGeneration) keeps its language model under a
# prefix: `language_model.model.` in the hub's files and as transformers 5.25 saves it,
# `model.language_model.` as the in-memory module tree of other versions names it (a folder
# saved from one); both are read. The vision tower's tensors are not read.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def _weight_files(folder: str) -> dict[str, tuple[str, str]]:
  """Tensor name (a text model's: model.layers.0...) -> (safetensors file, the name stored
  there), from the index of a sharded folder or the one file."""
  index = os.path.join(folder, HF_INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      mapping = json.load(f)["weight_map"]
    stored = {name: os.path.join(folder, file) for name, file in mapping.items()}
  else:
    single = os.path.join(folder, HF_WEIGHTS)
    if not os.path.isfile(single):
      raise PretrainedError(f"{folder}: no {HF_WEIGHTS} or {HF_INDEX} (a Hugging Face model "
                            "folder holds its weights as safetensors)")
    with safetensors.safe_open(single, framework="numpy") as f:
      stored = {name: single for name in f.keys()}
  out = {}
  for name, file in stored.items():
    canonical = name
    for prefix, text in _TEXT_PREFIXES:
      if name.startswith(prefix):
        canonical = text + name[len(prefix):]
    out[canonical] = (file, name)
  return out


def inspect_hf(path: str, *, dtype: str = "float32", need_weights: bool = True):
  """(ModelConfig, Tokenizer) of a Hugging Face folder, with every tensor's name and shape
  checked from the safetensors headers (no weights read): all on the host, so a bad folder
  is one clear error before any device work.

  need_weights=False: config.json and the tokenizer files are enough (launch/compile_check.py
  checks the fit of a model before its weights are downloaded); no tensor is checked."""
  folder = resolve(path)
  if not os.path.isdir(folder):
    raise PretrainedError(f"{path}: no such model folder")
  cfg = hf_model_config(folder, dtype)
  tokenizer = hf_tokenizer(folder)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise PretrainedError(f"{folder}/tokenizer.json: {tokenizer.vocab_size} tokens but the "
                          f"embedding has vocab_size={cfg.vocab_size} rows ({HF_CONFIG})")
  if not need_weights:
    return cfg, tokenizer
  files, expected = _weight_files(folder), _expected_shapes(cfg)
  for ours, (theirs, how) in hf_names(cfg).items():
    if theirs not in files:
      raise PretrainedError(f"{folder}: tensor {theirs} is missing from the safetensors files")
    file, theirs = files[theirs]
    if not os.path.isfile(file):
      raise PretrainedError(f"{file}: no such file; {HF_INDEX} names it for "
                            f"{theirs} (an incomplete download?)")
    with safetensors.safe_open(file, framework="numpy") as f:
      tensor = f.get_slice(theirs)
      shape, kind = tuple(tensor.get_shape()), tensor.get_dtype()
    if kind not in _FLOAT_KINDS:
      raise PretrainedError(f"{file}: {theirs} is stored as {kind}; allowed: "
                            f"{', '.join(_FLOAT_KINDS)} (quantized weights are not supported)")
    if _hf_shape(part(expected, ours), how) != shape:
      raise PretrainedError(f"{file}: {theirs} has shape {shape}; {HF_CONFIG} "
                            f"implies {_hf_shape(part(expected, ours), how)}")
  return cfg, tokenizer


_FLOAT_KINDS = ("F32", "BF16", "F16")


def _expected_shapes(cfg) -> dict[str, tuple]:
  """Every tensor's shape as named on disk (one entry per layer)."""
  return _flatten_shapes(jax.eval_shape(lambda: model_lib.unstack_layers(
      nn.unbox(model_lib.init_params(cfg, jax.random.key(0))))))


def _hf_shape(shape: tuple, how: str) -> tuple:
  return tuple(to_hf(np.empty(shape, np.int8), how).shape)


def _read_tensor(file: str, name: str) -> np.ndarray:
  """One tensor as numpy; bfloat16 (which safetensors' numpy reader refuses) via ml_dtypes."""
  with safetensors.safe_open(file, framework="numpy") as f:
    try:
      return f.get_tensor(name)
    except (TypeError, ValueError):
      pass
  with safetensors.safe_open(file, framework="flax") as f:
    return np.asarray(jax.device_get(f.get_tensor(name)))


def load_hf(path: str, *, dtype: str = "float32", mesh=None):
  """Loads a Hugging Face Qwen2/Qwen3/Qwen3-MoE/Llama folder: (ModelConfig, params, Tokenizer).

  Tensors are read one at a time; with a mesh each goes straight onto its sharding, so a
  large model is never whole in one host's memory. Without one, numpy arrays come back.
  """
  cfg, tokenizer = inspect_hf(path, dtype=dtype)
  folder = resolve(path)
  files, expected = _weight_files(folder), _expected_shapes(cfg)
  shardings = None
  if mesh is not None:
    from jaxgrpo.model import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
    shardings = {_name(p): s for p, s in jax.tree_util.tree_leaves_with_path(
        sharding_lib.param_shardings(cfg, mesh))}
  np_dtype = np.dtype(model_lib.DTYPES[dtype])
  names = hf_names(cfg)

  def read(ours):
    if ours not in names:  # a mixture's experts: one Hugging Face tensor each
      return np.stack([read(f"{ours}[{j}]") for j in range(cfg.num_experts)])
    theirs, how = names[ours]
    return _from_hf(_read_tensor(*files[theirs]), how, part(expected, ours)).astype(np_dtype)

  # One stacked tensor at a time: its L layers are read, stacked on the host, and placed,
  # so the host holds at most one kind of tensor for every layer, never the model.
  flat = {}
  for ours in dict.fromkeys(n.partition("[")[0] for n in names):
    layer, _, rest = ours.partition("/")
    if layer.startswith(model_lib.LAYER_PREFIX):
      if layer != f"{model_lib.LAYER_PREFIX}0":
        continue
      ours = f"layers/{rest}"
      value = np.stack([read(f"{model_lib.LAYER_PREFIX}{i}/{rest}")
                        for i in range(cfg.num_layers)])
    else:
      value = read(ours)
    flat[ours] = value if shardings is None else jax.device_put(value, shardings[ours])
  return cfg, _unflatten(flat), tokenizer


def hf_tokenizer(folder: str) -> Tokenizer:
  """tokenizer.json with the end and pad tokens named in tokenizer_config.json.

  The end of a completion is tokenizer_config's `eos_token` (`<|im_end|>` for Qwen instruct
  models, `<|eot_id|>` for Llama 3 instruct): the end of the assistant's turn.
  """
  tok_file = os.path.join(folder, "tokenizer.json")
  if not os.path.isfile(tok_file):
    raise PretrainedError(f"{tok_file}: missing (the model folder needs its tokenizer)")
  settings = _tokenizer_config(folder)
  token = lambda v: v.get("content") if isinstance(v, dict) else v
  try:
    tok = Tokenizer.from_file(tok_file, eos_token=token(settings.get("eos_token")),
                              pad_token=token(settings.get("pad_token")),
                              bos_token=token(settings.get("bos_token")))
  except (FileNotFoundError, ValueError) as e:
    raise PretrainedError(f"{folder}/tokenizer_config.json: {e}") from None
  # The end ids the model's files list (the token ids only: no sampling setting is read).
  # One the tokenizer cannot produce is left out (it decodes to nothing) and recorded in
  # tok.unusable_end_ids as (id, file): transformers would stop at it, so the start-up
  # says so (loading.load_policy) rather than sampling past it in silence.
  ends, unusable = {tok.eos_id}, []
  for name in (HF_CONFIG, "generation_config.json"):
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      with open(path) as f:
        ids = json.load(f).get("eos_token_id")
      for i in (ids if isinstance(ids, list) else [ids]):
        if isinstance(i, int) and 0 <= i < tok.vocab_size:
          ends.add(i)
        elif i is not None and (i, path) not in unusable:
          unusable.append((i, path))
  tok.stop_ids = (tok.eos_id,) + tuple(sorted(ends - {tok.eos_id}))
  tok.unusable_end_ids = unusable
  return tok


def _tokenizer_config(folder: str) -> dict:
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise PretrainedError(f"{path}: cannot read ({e})") from None


def follow_umask(folder: str, names) -> None:
  """Gives every written file the mode the umask makes of a new file (0644 under 022).
  safetensors writes its file 0600, so a serving user other than the exporter could read
  the config but not the weights."""
  umask = os.umask(0)  # the only way to read it; set back at once
  os.umask(umask)
  for name in names:
    os.chmod(os.path.join(folder, name), 0o666 & ~umask)

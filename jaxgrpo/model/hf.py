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
from jaxgrpo.model import families
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


# ------ Hugging Face model folders (read here; run/artifacts.save_hf writes them; the
# families' own keys and tensor names are in model/families/)

HF_CONFIG = "config.json"
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
# Every `architectures` a folder's config.json may name (model/families/: each family's, and
# Gemma 3's text-and-vision folders, whose text model is read).
ARCHITECTURES = families.architectures()
HF_KEYS = families.HF_KEYS


def is_hf_folder(path: str) -> bool:
  return os.path.isfile(os.path.join(resolve(path), HF_CONFIG))


def hf_key(name: str, folder: str | None = None) -> str:
  """Our field `name` as the config.json of `folder` spells it (its family's keys)."""
  family = folder_family(folder) if folder is not None else None
  return (family.keys if family else HF_KEYS).get(name, name)


def folder_family(folder: str) -> "families.Family | None":
  """The family of a Hugging Face folder's config.json `architectures`, or None."""
  try:
    with open(os.path.join(resolve(folder), HF_CONFIG)) as f:
      return families.by_architecture((json.load(f).get("architectures") or [None])[0])[0]
  except (OSError, ValueError, AttributeError):
    return None


def _in_hf_spelling(message: str, keys: dict) -> str:
  """A ModelConfig error (`model.<field>=...`) with each field as config.json spells it."""
  return re.sub(r"model\.(\w+)", lambda m: keys.get(m.group(1), m.group(0)), message)


def hf_model_config(folder: str, dtype: str = "float32") -> model_lib.ModelConfig:
  """config.json -> ModelConfig: the sizes every family shares read here, the rest by the
  family of its `architectures` (model/families/). Sampling settings in
  generation_config.json are never read: sampling is always the run config's explicit
  profile."""
  path = os.path.join(folder, HF_CONFIG)
  try:
    with open(path) as f:
      hf = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise PretrainedError(f"{path}: cannot read ({e})") from None
  arch = (hf.get("architectures") or [None])[0]
  family, unwrap = families.by_architecture(arch)
  if family is None:
    raise PretrainedError(f"{path}: architecture {arch!r} is not supported; allowed: "
                          f"{', '.join(ARCHITECTURES)}")
  hf = unwrap(hf)
  if family.defaults:  # keys a hub file leaves out (or null) take transformers' defaults
    hf = {**family.defaults, **{k: v for k, v in hf.items() if v is not None}}
  try:
    heads = hf["num_attention_heads"]
    own = family.read(hf)
    return model_lib.ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family.tie_default)),
        param_dtype=dtype, dtype=dtype, **own)
  except KeyError as e:
    raise PretrainedError(f"{path}: missing key {e}") from None
  except families.Unsupported as e:
    raise PretrainedError(f"{path}: {e}") from None
  except ValueError as e:
    raise PretrainedError(f"{path}: {_in_hf_spelling(str(e), family.keys)}") from None


def hf_names(cfg: model_lib.ModelConfig) -> dict[str, tuple[str, str]]:
  """Our tensor name -> (Hugging Face tensor name, how to convert it): the embedding, final
  norm, head and attention here, each layer's norms and MLP by the family (layer_names).

  A mixture's experts are one tensor of ours per layer ([E, in, out]) and one per expert in
  Hugging Face's files: ours is then named with the expert's index, `layer_0/mlp/gate[3]`
  (`part` reads it)."""
  family = families.for_config(cfg)
  names = {"embedding": ("model.embed_tokens.weight", "same"),
           "final_norm/scale": ("model.norm.weight", "same")}
  if not cfg.tie_embeddings:
    names["lm_head"] = ("lm_head.weight", "T")
  for i in range(cfg.num_layers):
    ours, hf = f"layer_{i}", f"model.layers.{i}"
    names.update({
        f"{ours}/attn/q": (f"{hf}.self_attn.q_proj.weight", "in_heads"),
        f"{ours}/attn/k": (f"{hf}.self_attn.k_proj.weight", "in_heads"),
        f"{ours}/attn/v": (f"{hf}.self_attn.v_proj.weight", "in_heads"),
        f"{ours}/attn/o": (f"{hf}.self_attn.o_proj.weight", "heads_out")})
    if cfg.qkv_bias:
      for p in "qkv":
        names[f"{ours}/attn/{p}_bias"] = (f"{hf}.self_attn.{p}_proj.bias", "heads")
    if cfg.qk_norm:
      for p in "qk":
        names[f"{ours}/attn/{p}_norm/scale"] = (f"{hf}.self_attn.{p}_norm.weight", "same")
    names.update(family.layer_names(cfg, ours, hf))
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

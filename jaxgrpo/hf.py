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

import flax.linen as nn
import jax
import numpy as np
import safetensors.numpy

from jaxgrpo import model as model_lib
from jaxgrpo.tokenizer import Tokenizer

EMBEDDED_PREFIX = "@embedded/"
_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
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


def _flatten(params) -> dict[str, np.ndarray]:
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
  safetensors.numpy.save_file(_flatten(params), os.path.join(path, WEIGHTS_FILE))
  tokenizer.save(path)


def load_pretrained(path: str):
  """Returns (ModelConfig, host parameter tree of numpy arrays, Tokenizer)."""
  folder = resolve(path)
  if not os.path.isdir(folder):
    raise PretrainedError(f"{path}: no such checkpoint folder")
  model_file = os.path.join(folder, MODEL_FILE)
  weights_file = os.path.join(folder, WEIGHTS_FILE)
  for f in (model_file, weights_file):
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
  params = _unflatten(safetensors.numpy.load_file(weights_file))
  expected = _flatten_shapes(
      jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0))))
  got = {k: v.shape for k, v in _flatten(params).items()}
  if set(expected) != set(got):
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    raise PretrainedError(f"{weights_file}: parameter names do not match {MODEL_FILE} "
                          f"(missing {missing[:3]}, unexpected {extra[:3]})")
  for name, shape in expected.items():
    if tuple(got[name]) != tuple(shape):
      raise PretrainedError(f"{weights_file}: {name} has shape {got[name]}, "
                            f"{MODEL_FILE} implies {tuple(shape)}")
  if tokenizer.vocab_size > cfg.vocab_size:
    raise PretrainedError(f"{folder}: tokenizer has {tokenizer.vocab_size} tokens but the "
                          f"model's vocab_size is {cfg.vocab_size}")
  return cfg, params, tokenizer


def _flatten_shapes(abstract) -> dict[str, tuple]:
  return {_name(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(abstract))}

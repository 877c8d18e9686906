"""Checkpoint folders: round trip, the shipped warm-start, and one-line errors naming the file."""

import json
import os

import jax
import numpy as np
import pytest

from jaxgrpo import hf
from jaxgrpo import model as model_lib
from jaxgrpo.tokenizer import Tokenizer

CFG = model_lib.ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=8, mlp_dim=32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt"))
  import flax.linen as nn
  params = nn.unbox(model_lib.init_params(CFG, jax.random.key(0)))
  hf.save_pretrained(path, CFG, params, Tokenizer.char_level("0123456789+="))
  return path, params


def test_round_trip(saved):
  path, params = saved
  cfg, loaded, tok = hf.load_pretrained(path)
  assert cfg == CFG and tok.vocab_size == 16 and tok.eos_id == 2
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_shipped_warmstart_loads():
  cfg, params, tok = hf.load_pretrained("@embedded/arith3")
  assert cfg.d_model == 128 and tok.decode(tok.encode("123+456=")) == "123+456="
  # A few MB at most: it ships inside the package.
  size = os.path.getsize(os.path.join(hf.resolve("@embedded/arith3"), hf.WEIGHTS_FILE))
  assert size < 4 * 2**20


def test_errors_name_the_file(saved, tmp_path):
  with pytest.raises(hf.PretrainedError, match="nope: no such checkpoint folder"):
    hf.load_pretrained(str(tmp_path / "nope"))
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in os.listdir(saved[0]):
    (bad / name).write_bytes(open(os.path.join(saved[0], name), "rb").read())
  config = json.load(open(bad / hf.MODEL_FILE))
  config["d_model"] = 32  # the weights were saved for d_model 16
  json.dump(config, open(bad / hf.MODEL_FILE, "w"))
  with pytest.raises(hf.PretrainedError, match=r"model.safetensors: embedding has shape"):
    hf.load_pretrained(str(bad))
  config["d_model"], config["colour"] = 16, "blue"
  json.dump(config, open(bad / hf.MODEL_FILE, "w"))
  with pytest.raises(hf.PretrainedError, match=r"model.json: .*unknown keys \['colour'\]"):
    hf.load_pretrained(str(bad))
  os.remove(bad / hf.WEIGHTS_FILE)
  with pytest.raises(hf.PretrainedError, match="model.safetensors: missing"):
    hf.load_pretrained(str(bad))

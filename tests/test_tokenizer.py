"""Tests for jaxgrpo.model.tokenizer: char-level ids and round trip, save/load, file errors."""

import json
import os

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from jaxgrpo.model.tokenizer import Tokenizer

ALPHABET = "0123456789+="


@pytest.fixture(name="tok")
def fixture_tok():
  return Tokenizer.char_level(ALPHABET)


def test_char_level_special_ids_and_vocab(tok):
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 16
  assert tok.hf.token_to_id("<unk>") == 3
  # The alphabet follows the four special tokens, in order.
  assert tok.encode("0123456789+=", add_bos=False) == list(range(4, 16))


def test_char_level_encode_with_and_without_bos(tok):
  assert tok.encode("12+3=") == [1, 5, 6, 14, 7, 15]
  assert tok.encode("12+3=", add_bos=False) == [5, 6, 14, 7, 15]


def test_char_level_round_trip_is_exact(tok):
  for text in ["123+456=", "0579", "", "9"]:
    assert tok.decode(tok.encode(text)) == text


def test_char_level_keeps_spaces_and_maps_unknown_chars_to_unk():
  tok = Tokenizer.char_level("ab ")
  assert tok.decode(tok.encode("a b  a", add_bos=False)) == "a b  a"
  assert tok.encode("axb", add_bos=False) == [4, 3, 5]


def test_decode_stops_at_first_eos(tok):
  ids = tok.encode("0579", add_bos=False) + [tok.eos_id] + tok.encode("12", add_bos=False)
  assert tok.decode(ids) == "0579"
  assert tok.decode(ids, skip_special=False) == "0579<eos>"
  # Arrays from the sampler decode the same as lists; pad after eos is ignored too.
  assert tok.decode(np.array(ids + [0, 0], dtype=np.int32)) == "0579"


def test_decode_skips_pad_and_bos(tok):
  assert tok.decode([0, 0, 1, 5, 6]) == "12"
  assert tok.decode([1, 5, 6], skip_special=False) == "<bos>12"


def test_encode_batch_matches_encode(tok):
  texts = ["1+1=", "22+33=", ""]
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_save_and_from_file_round_trip(tok, tmp_path):
  tok.save(str(tmp_path))
  assert (tmp_path / "tokenizer.json").is_file()
  saved = json.loads((tmp_path / "jaxgrpo_special_tokens.json").read_text())
  assert saved == {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
  # Both the directory and the file path work; special tokens come from the sidecar.
  for path in [tmp_path, tmp_path / "tokenizer.json"]:
    loaded = Tokenizer.from_file(str(path))
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (0, 1, 2)
    assert loaded.vocab_size == 16
    assert loaded.decode(loaded.encode("98+7=")) == "98+7="


def _hf_style_file(tmp_path):
  """Writes a tokenizer.json with no sidecar, like a Hugging Face checkpoint's."""
  vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, "<unk>": 2, "a": 3, "b": 4}
  hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  hf.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
  hf.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
  path = tmp_path / "tokenizer.json"
  hf.save(str(path))
  return str(path)


def test_from_file_without_bos_and_pad_defaulting_to_eos(tmp_path):
  path = _hf_style_file(tmp_path)
  tok = Tokenizer.from_file(path, eos_token="<|im_end|>")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (1, None, 1)
  assert tok.encode("ab") == [3, 4]  # No bos to add.
  tok = Tokenizer.from_file(path, pad_token="<|endoftext|>", eos_token="<|im_end|>")
  assert tok.pad_id == 0


def test_from_file_missing_file_names_it(tmp_path):
  missing = str(tmp_path / "nope" / "tokenizer.json")
  with pytest.raises(FileNotFoundError, match="nope/tokenizer.json"):
    Tokenizer.from_file(missing, eos_token="<eos>")


def test_from_file_unknown_token_names_file_and_token(tmp_path):
  path = _hf_style_file(tmp_path)
  with pytest.raises(ValueError, match=r"tokenizer\.json: bos_token '<s>' is not in the "):
    Tokenizer.from_file(path, bos_token="<s>", eos_token="<|im_end|>")


def test_from_file_without_eos_says_so(tmp_path):
  path = _hf_style_file(tmp_path)
  with pytest.raises(ValueError, match="tokenizer.json: no eos_token given"):
    Tokenizer.from_file(path)


def test_from_file_malformed_json(tmp_path):
  path = tmp_path / "tokenizer.json"
  path.write_text("{not json")
  with pytest.raises(ValueError, match="not a valid tokenizer.json"):
    Tokenizer.from_file(str(path), eos_token="<eos>")


def test_decode_batch_stops_each_row_at_eos():
  tok = Tokenizer.char_level("0123456789+=")
  # Rows as a sampler returns them: digits, eos (2), then pad (0) or garbage after it.
  rows = np.array([[4, 9, 2, 0, 0], [5, 5, 5, 5, 5], [2, 6, 6, 6, 6]])
  assert tok.decode_batch(rows) == ["05", "11111", ""]


def test_unk_id_of_each_kind_of_tokenizer(tmp_path):
  # A character vocabulary and a word-level file name their unknown token; a Unigram model
  # keeps an unk id; the test fixtures' byte-level BPE (as Qwen's, Llama 3's) has none.
  assert Tokenizer.char_level(ALPHABET).unk_id == 3
  assert Tokenizer.from_file(_hf_style_file(tmp_path), eos_token="<|im_end|>").unk_id == 2
  unigram = tokenizers.Tokenizer(models.Unigram([("<unk>", 0.0), ("<eos>", 0.0),
                                                 ("a", -1.0)], 0))
  assert Tokenizer(unigram, pad_token="<eos>", eos_token="<eos>").unk_id == 0
  fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf",
                         "qwen2", "tokenizer.json")
  qwen = Tokenizer.from_file(fixture, eos_token="<|im_end|>")
  assert qwen.unk_id is None
  assert qwen.unknown_pieces(["Question: é €\n"]) == [[]]  # bytes encode anything


def test_unknown_pieces_are_the_text_that_becomes_unk(tok):
  # "12 + 3=" has two spaces outside the arithmetic alphabet; "Q:\n1" has Q, : and \n.
  assert tok.unknown_pieces(["12+3=", "12 + 3=", "Q:\n1"]) == [[], [" ", " "],
                                                                 ["Q", ":", "\n"]]

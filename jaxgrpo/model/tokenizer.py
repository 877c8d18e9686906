"""A thin wrapper over a Hugging Face `tokenizers.Tokenizer`.

The trainer needs four things from a tokenizer: text -> ids for prompts, ids -> text for
rewards, and the pad/bos/eos ids that the sampler and the losses mask on. This wrapper fixes
those ids once, by name, when the tokenizer is built, so no later module has to guess them
from a model's config files.

Two ways to build one:

- `Tokenizer.from_file("tokenizer.json", eos_token="<|im_end|>", ...)` for a Hugging Face
  checkpoint (Qwen2.5/Qwen3/Llama ship a `tokenizer.json`).
- `Tokenizer.char_level("0123456789+=")` for the embedded arithmetic task: one token per
  character, ids `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, then the alphabet in order.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# Written next to tokenizer.json by `save`, so that `from_file` can restore the special
# tokens of a char-level (or any saved) tokenizer without the caller naming them again.
SPECIAL_TOKENS_FILE = "jaxgrpo_special_tokens.json"
TOKENIZER_FILE = "tokenizer.json"

CHAR_PAD, CHAR_BOS, CHAR_EOS, CHAR_UNK = "<pad>", "<bos>", "<eos>", "<unk>"


class Tokenizer:
  """Text <-> ids, with the special ids the trainer relies on.

  Attributes:
    hf: the underlying `tokenizers.Tokenizer`.
    pad_id: id used for left padding of prompts and right padding of completions.
    bos_id: id prepended by `encode(add_bos=True)`, or None for models without one (Qwen).
    eos_id: id that ends a completion; `decode` stops at its first occurrence.
    vocab_size: number of ids the tokenizer can produce, added tokens included. A model's
      embedding table may be larger (checkpoints pad it); it must never be smaller.
    unk_id: the id that text outside the vocabulary becomes (`<unk>` of a character or
      word-level vocabulary), or None when the tokenizer has none: a byte-level BPE (Qwen,
      Llama 3) encodes any text.
  """

  def __init__(self, hf: tokenizers.Tokenizer, *, pad_token: str, eos_token: str,
               bos_token: str | None = None, source: str = "<in memory>"):
    self.hf = hf
    self.pad_token, self.bos_token, self.eos_token = pad_token, bos_token, eos_token
    self.pad_id = _token_id(hf, pad_token, "pad_token", source)
    self.eos_id = _token_id(hf, eos_token, "eos_token", source)
    # Every id that ends a completion for the sampler: eos_id, plus any other end ids the
    # model's files list (Qwen instruct: <|im_end|> and <|endoftext|>).
    self.stop_ids: tuple[int, ...] = (self.eos_id,)
    # End ids a model folder lists that this tokenizer cannot produce: (id, file) (hf.py).
    self.unusable_end_ids: list[tuple] = []
    self.bos_id = None if bos_token is None else _token_id(hf, bos_token, "bos_token", source)
    self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
    self.unk_id = _unk_id(hf)

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id})")

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """Returns the ids of `text`, with bos first when asked and the tokenizer has one."""
    # add_special_tokens=False: HF post-processors (e.g. Llama's) would add their own bos,
    # and we want exactly one, controlled here.
    ids = self.hf.encode(text, add_special_tokens=False).ids
    return self._with_bos(ids, add_bos)

  def encode_batch(self, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
    """Like `encode` for many texts; the Rust tokenizer runs them in parallel."""
    encodings = self.hf.encode_batch(list(texts), add_special_tokens=False)
    return [self._with_bos(e.ids, add_bos) for e in encodings]

  def unknown_pieces(self, texts: Sequence[str]) -> list[list[str]]:
    """For each text, the pieces of it that encode to `unk_id`, in order ([] for a text the
    tokenizer encodes faithfully, and for every text when it has no unknown token)."""
    if self.unk_id is None:
      return [[] for _ in texts]
    encodings = self.hf.encode_batch(list(texts), add_special_tokens=False)
    return [[text[a:b] for t, (a, b) in zip(e.ids, e.offsets) if t == self.unk_id]
            for text, e in zip(texts, encodings)]

  def decode(self, ids: Iterable[int], skip_special: bool = True,
             until_end: bool = True) -> str:
    """Returns the text of `ids` up to the first end token (eos or another of `stop_ids`).

    Args:
      ids: token ids (a list or a 1-D numpy/jax array).
      skip_special: drop special tokens (pad, bos, eos, ...) from the text. When False, the
        first end token is kept so that the caller can see where the completion ended.
      until_end: False decodes every id given (a multi-turn episode has an end token after
        each turn; the caller cuts it to its length).
    """
    ids = [int(i) for i in ids]
    # A sampled row continues past its end (padding or garbage); only the part before it is
    # the completion that rewards should score.
    end = next((i for i, t in enumerate(ids) if t in self.stop_ids), None) if until_end else None
    if end is not None:
      ids = ids[:end] if skip_special else ids[:end + 1]
    return self.hf.decode(ids, skip_special_tokens=skip_special)

  def decode_batch(self, ids_NxT) -> list[str]:
    """`decode` for every row of a [N, T] array (a sampler's completions)."""
    return [self.decode(row) for row in np.asarray(ids_NxT)]

  def save(self, path: str) -> list[str]:
    """Writes `path/tokenizer.json` and `path/jaxgrpo_special_tokens.json`; returns their
    names."""
    os.makedirs(path, exist_ok=True)
    self.hf.save(os.path.join(path, TOKENIZER_FILE))
    with open(os.path.join(path, SPECIAL_TOKENS_FILE), "w") as f:
      json.dump({"pad_token": self.pad_token, "bos_token": self.bos_token,
                 "eos_token": self.eos_token}, f, indent=2)
    return [TOKENIZER_FILE, SPECIAL_TOKENS_FILE]

  @classmethod
  def from_file(cls, path: str, pad_token: str | None = None,
                bos_token: str | None = None, eos_token: str | None = None) -> Tokenizer:
    """Loads a `tokenizer.json` (or a directory holding one).

    A special token not given here is taken from `jaxgrpo_special_tokens.json` beside the
    file when there is one (as `save` writes). `pad_token` defaults to `eos_token`, because
    Llama-family tokenizers have no pad token and pad positions are masked anyway.
    `bos_token` may stay None (Qwen has no bos).

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: no eos token was named, or a named token is not in the vocabulary.
    """
    if os.path.isdir(path):
      path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path}: no such tokenizer file")
    try:
      hf = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # The Rust side raises a bare Exception on malformed json.
      raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
    sidecar = os.path.join(os.path.dirname(path), SPECIAL_TOKENS_FILE)
    if os.path.isfile(sidecar):
      with open(sidecar) as f:
        saved = json.load(f)
      pad_token = pad_token if pad_token is not None else saved.get("pad_token")
      bos_token = bos_token if bos_token is not None else saved.get("bos_token")
      eos_token = eos_token if eos_token is not None else saved.get("eos_token")
    if eos_token is None:
      raise ValueError(f"{path}: no eos_token given; name the token that ends a completion "
                       "(e.g. eos_token='<|im_end|>' for Qwen, '<|eot_id|>' for Llama 3)")
    return cls(hf, pad_token=eos_token if pad_token is None else pad_token,
               bos_token=bos_token, eos_token=eos_token, source=path)

  @classmethod
  def char_level(cls, alphabet: str) -> Tokenizer:
    """Builds a tokenizer with one token per character of `alphabet`.

    Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, then the characters of `alphabet` in
    order (duplicates keep their first id). Characters outside the alphabet map to `<unk>`.
    """
    vocab = {CHAR_PAD: 0, CHAR_BOS: 1, CHAR_EOS: 2, CHAR_UNK: 3}
    for ch in alphabet:
      vocab.setdefault(ch, len(vocab))
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=CHAR_UNK))
    # An empty pattern matches between every pair of characters, so "isolated" splitting
    # yields one pre-token per character, spaces and newlines included.
    hf.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    # Fuse joins tokens with no separator; the default decoder would put spaces between
    # characters and break the round trip.
    hf.decoder = decoders.Fuse()
    # Registered as special so that skip_special drops them and encode never splits them.
    hf.add_special_tokens([CHAR_PAD, CHAR_BOS, CHAR_EOS, CHAR_UNK])
    return cls(hf, pad_token=CHAR_PAD, bos_token=CHAR_BOS, eos_token=CHAR_EOS,
               source=f"char_level({alphabet!r})")

  def _with_bos(self, ids: list[int], add_bos: bool) -> list[int]:
    if add_bos and self.bos_id is not None:
      return [self.bos_id] + list(ids)
    return list(ids)


def _unk_id(hf: tokenizers.Tokenizer) -> int | None:
  """The unknown token's id, from the model (WordLevel, BPE and WordPiece name a token,
  Unigram an id); None when the model has none or names a token outside its vocabulary."""
  unk_token = getattr(hf.model, "unk_token", None)
  if unk_token is not None:
    return hf.token_to_id(unk_token)
  if isinstance(hf.model, models.Unigram):  # its Python object does not expose unk_id
    return json.loads(hf.to_str())["model"].get("unk_id")
  return None


def _token_id(hf: tokenizers.Tokenizer, token: str, role: str, source: str) -> int:
  """Returns the id of `token`, or raises a ValueError naming the file and the token."""
  token_id = hf.token_to_id(token)
  if token_id is None:
    raise ValueError(f"{source}: {role} {token!r} is not in the vocabulary")
  return token_id

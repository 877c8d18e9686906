"""JetStream's `Engine` API over jaxgrpo's decoder: generation.backend='jetstream' and
`python -m jaxgrpo.serve`.

Imported only when asked for (build.make_engine with backend='jetstream', jaxgrpo.serve):
importing it imports google-jetstream 0.2.2, which imports TensorFlow through seqio. Install
it with `pip install 'jaxgrpo[jetstream]'`.

What each member of JetStream's vocabulary (also MaxText's offline engine's) is here:
  load_params() -> Params: the parameters and the decode step's rearranged weights
      (decode.prepare), made once per set of parameters, never once per token.
  prefill(params, padded_tokens, true_length) -> Prefix: one prompt's per-layer keys and
      values in the decode cache's layout, left-aligned to `max_prefill_length` as the native
      sampler left-pads its prompts, its length, and the logits that predict its first new
      token. JetStream 0.2.2's prefill returns only the prefix (later releases also return
      the first token), so the first new token is drawn by the first `generate` after insert.
  insert(prefix, decode_state, slot) -> DecodeState: the prompt into slot `slot`.
  generate(params, decode_state) -> (DecodeState, ResultTokens): for every live slot, draw a
      token from its pending logits, record it with its log-probs, and run the decode step on
      it so the next logits are ready. ResultTokens holds [token, valid, length] per slot,
      int32 as JetStream's detokenizer reads it; the log-probs stay in the decode state.
  DecodeState: the KV cache (decode.Cache with one sample per slot), each slot's position
      (prompt length), step, pending logits, and the tokens and log-probs drawn so far.

Slots sit at different steps (continuous batching), so decode.step gets one step per slot.
Tokens are drawn as the native sampler draws them (distribution.draw, with the uniform of the same
(key, row id, token index, sample)), so a slot given the native sampler's key and row id draws
the native sampler's tokens, greedy or not, up to float rounding: this backend changes how
rollouts are scheduled, not what they are. Sampling settings are therefore all honoured;
what the backend cannot do (decode blocks, compaction, several processes) is refused by
run/build.py's backend check.

backend='jetstream' drives one `Engine` per sampling profile from jetstream_rollouts.py;
`jaxgrpo.serve` puts an `Engine` behind JetStream's orchestrator and gRPC server.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, NamedTuple

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

# Importing JetStream's orchestrator sets the root logger to DEBUG with a handler on stdout,
# which would print every jax compilation-cache line of the run; the root logger is put
# back as it was.
_root = logging.getLogger()
_level, _handlers = _root.level, list(_root.handlers)
from jetstream.core import orchestrator  # pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.engine import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    engine_api, token_utils, tokenizer_api, tokenizer_pb2)
_root.setLevel(_level)
for _h in [h for h in _root.handlers if h not in _handlers]:
  _root.removeHandler(_h)

from jaxgrpo.runtime import compile_options
from jaxgrpo.model import decode, distribution
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling

# JetStream's prefill buckets (token_utils.pad_tokens): max_prefill_length must be one of them.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# The bos id this adapter reports for a tokenizer without one (Qwen): JetStream's pad_tokens
# always prepends a bos to a new request, and prefill drops a leading NO_BOS again.
NO_BOS = -1


def _fix_orchestrator_tree_map():
  """The narrow compatibility shim for google-jetstream 0.2.2 on current jax.

  Its orchestrator frees each inserted prefix with `jax.tree_map`, which jax removed (0.6):
  the AttributeError in the generate thread SIGKILLs the whole process. This replaces that one
  function, `jetstream.core.orchestrator.delete_pytree`, with the same body on `jax.tree.map`.
  jax itself and every other function stay untouched; on a jax that still has tree_map,
  nothing is replaced.
  """
  if hasattr(jax, "tree_map"):
    return

  def delete_pytree(p):
    def delete_leaf(leaf):
      if isinstance(leaf, jax.Array):
        leaf.delete()
    jax.tree.map(delete_leaf, p)

  orchestrator.delete_pytree = delete_pytree


_fix_orchestrator_tree_map()


def prefill_bucket(max_prompt_length: int) -> int:
  """The smallest JetStream prefill bucket that holds max_prompt_length tokens."""
  for bucket in PREFILL_BUCKETS:
    if bucket >= max_prompt_length:
      return bucket
  raise ValueError(f"max_prompt_length={max_prompt_length}: JetStream prefills at most "
                   f"{PREFILL_BUCKETS[-1]} tokens")


class Params(NamedTuple):
  """What `load_params` returns: the parameter tree and its decode-step layout."""

  params: Any
  weights: decode.Weights


@struct.dataclass
class Prefix:
  """One prompt after prefill (batch 1); L = max_prefill_length, left-aligned."""

  prompt_k: tuple          # per layer [1, H_kv, D, L]
  prompt_v: tuple          # per layer [1, H_kv, L, D]
  prompt_bias: jax.Array   # [1, 1, 1, L]: 0 on the prompt, -1e30 on padding
  logits_1xV: jax.Array    # predicts the first new token
  length: jax.Array        # [] int32, the prompt's true length
  row_id: jax.Array        # [] int32: the random stream (the native sampler's row id)
  sample: jax.Array        # [] int32: which of the profile's samples of this prompt


@struct.dataclass
class DecodeState:
  """Everything `generate` transforms; S = max_concurrent_decodes slots, T = max_new_tokens."""

  cache: decode.Cache      # B = S, G = 1
  logits_SxV: jax.Array    # the logits of each slot's next token
  prompt_len_S: jax.Array
  step_S: jax.Array        # tokens drawn so far
  live_S: jax.Array        # holds a request that has not ended
  row_id_S: jax.Array
  sample_S: jax.Array
  tokens_SxT: jax.Array
  logp_SxT: jax.Array      # under the profile's distribution (0 for greedy)
  raw_logp_SxT: jax.Array  # under the raw model
  key: jax.Array


class Tokenizer(tokenizer_api.Tokenizer):
  """jaxgrpo's tokenizer in JetStream's interface (its default is SentencePiece)."""

  def __init__(self, tokenizer, stop_ids):
    self.tokenizer, self.stop_ids = tokenizer, tuple(stop_ids)

  def encode(self, s: str, **kwargs):
    is_bos = kwargs.pop("is_bos", True)
    ids = np.asarray(self.tokenizer.encode(s, add_bos=False), np.int32)
    return token_utils.pad_tokens(ids, self.bos_id, self.pad_id, is_bos=is_bos,
                                  max_prefill_length=kwargs.get("max_prefill_length"),
                                  jax_padding=kwargs.get("jax_padding", True))

  def decode(self, token_ids, **kwargs) -> str:
    return self.tokenizer.hf.decode([int(t) for t in token_ids], skip_special_tokens=True)

  @property
  def pad_id(self) -> int:
    return self.tokenizer.pad_id

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def bos_id(self) -> int:
    return NO_BOS if self.tokenizer.bos_id is None else self.tokenizer.bos_id

  @property
  def stop_tokens(self) -> set[int]:
    # The engine's end ids: JetStream's default also stops at pad, which the native sampler
    # does not, and a sampled pad would end the two backends' completions differently.
    return set(self.stop_ids)


class Engine(engine_api.Engine):
  """jaxgrpo's decoder as a JetStream engine for one sampling profile."""

  def __init__(self, cfg: model_lib.ModelConfig, mesh, profile: sampling.Profile, *,
               tokenizer, max_prompt_length: int, max_concurrent_decodes: int, eos_id,
               pad_id: int, params=None, seed: int = 0, tokenizer_path: str = "",
               on_trace=None):
    """params: what `load_params` returns (jaxgrpo.serve passes a checkpoint's); a rollout
    engine passes its parameters to `prepare` instead. on_trace(name) runs once per trace of
    each compiled function, so callers can count compilations."""
    multiple = sharding_lib.batch_size_multiple(mesh)
    if max_concurrent_decodes < 1 or max_concurrent_decodes % multiple:
      raise ValueError(f"max_concurrent_decodes={max_concurrent_decodes}: must be a positive "
                       f"multiple of {multiple} (mesh data x fsdp x expert), so slots split evenly")
    self.cfg, self._mesh, self.profile = cfg, mesh, profile
    self.tokenizer, self.tokenizer_path = tokenizer, tokenizer_path
    self.pad_id, self._seed, self._params = pad_id, seed, params
    self._slots = max_concurrent_decodes
    self._prefill_length = prefill_bucket(max_prompt_length)
    self.stop_ids = () if eos_id is None else tuple(int(i) for i in np.atleast_1d(eos_id))
    self._on_trace = on_trace or (lambda name: None)
    self._requests = itertools.count()  # row ids for requests that bring none (serving)
    rep = sharding_lib.replicated(mesh)
    state = self._state_shardings()
    # The native sampler's XLA options, so both backends' programs round alike (the tests
    # compare their log-probs to 1e-5) and compile as fast.
    jit = functools.partial(jax.jit, compiler_options=compile_options.compiler_options(mesh))
    self._prepare = jit(self._traced(
        "prepare", lambda params: Params(params, decode.prepare(params, cfg))))
    self._prefill = jit(self._traced("prefill", self._prefill_fn),
                        out_shardings=self.get_prefix_destination_sharding())
    self._insert = jit(self._traced("insert", self._insert_fn), donate_argnums=(1,),
                       out_shardings=state)
    self._generate = jit(self._traced("generate", self._generate_fn), donate_argnums=(1,),
                         out_shardings=(state, rep))
    self._init_state = jit(self._traced("init_decode_state", self._init_state_fn),
                           out_shardings=state)

  def _traced(self, name, fn):
    @functools.wraps(fn)
    def traced(*args):
      self._on_trace(name)
      return fn(*args)
    return traced

  # ---------------------------------------------------------------- parameters

  def prepare(self, params) -> Params:
    """Params for `prefill` and `generate` from a parameter tree (once per rollout)."""
    return self._prepare(params)

  def load_params(self, *args, **kwargs) -> Params:
    if self._params is None:
      raise ValueError("this engine was built without parameters; pass them to prepare()")
    return self.prepare(self._params)

  # ---------------------------------------------------------------- prefill

  def prefill(self, *, params: Params, existing_prefix: Prefix | None = None,
              padded_tokens, true_length: int, row_id: int | None = None) -> Prefix:
    """padded_tokens: the prompt, right-padded (JetStream's layout). row_id names the random
    stream (a rollout passes the native sampler's row id; a served request gets the next of
    a counter)."""
    if existing_prefix is not None:
      raise NotImplementedError("jaxgrpo's engine keeps no prefix across requests "
                                "(existing_prefix)")
    padded_tokens = np.asarray(padded_tokens, np.int32)
    if padded_tokens.ndim != 1 or padded_tokens.shape[0] > self._prefill_length:
      raise ValueError(f"padded_tokens has shape {padded_tokens.shape}; expected one prompt "
                       f"of at most max_prefill_length={self._prefill_length} tokens")
    padded_tokens = np.pad(padded_tokens, (0, self._prefill_length - padded_tokens.shape[0]),
                           constant_values=self.pad_id)  # one compiled shape for every bucket
    # JetStream keeps the last max_prefill_length tokens of a longer prompt but reports its
    # whole length as true_length.
    true_length = min(int(true_length), self._prefill_length)
    row_id = next(self._requests) if row_id is None else row_id
    return self._prefill(params.params, padded_tokens, np.int32(true_length), np.int32(row_id))

  def _prefill_fn(self, params, tokens_P, true_length, row_id) -> Prefix:
    p = tokens_P.shape[0]
    dropped = tokens_P[0] == NO_BOS  # the bos JetStream prepends for a tokenizer with none
    tokens_P = jnp.where(dropped, jnp.roll(tokens_P, -1), tokens_P)
    length = true_length - dropped.astype(jnp.int32)
    shift = p - length  # left-align, as sampling.left_pad lays prompts out
    mask_P = jnp.arange(p) >= shift
    tokens_P = jnp.where(mask_P, jnp.roll(tokens_P, shift), self.pad_id)
    # Slots step at their own positions (one i per row): the unrolled, per-layer caches.
    logits, (ks, vs) = sampling.prefill(params, self.cfg, tokens_P[None], mask_P[None],
                                        scan_layers=False)
    cache = decode.init_cache(ks, vs, mask_P[None], self.cfg, 1, 1)
    return Prefix(cache.prompt_k, cache.prompt_v, cache.prompt_bias, logits, length, row_id,
                  jnp.int32(0))

  def get_prefix_destination_sharding(self) -> Prefix:
    """A prefix (one prompt) is replicated over the data axes, its KV heads split over
    tensor as in the decode state, so an insert moves no heads between devices."""
    one = lambda *axes: sharding_lib.logical_sharding(self._mesh, *axes)
    layers = self.cfg.num_layers
    rep = sharding_lib.replicated(self._mesh)
    return Prefix(prompt_k=(one(None, "cache_heads", None, "length"),) * layers,
                  prompt_v=(one(None, "cache_heads", "length", None),) * layers,
                  prompt_bias=rep, logits_1xV=rep, length=rep, row_id=rep, sample=rep)

  # ---------------------------------------------------------------- decode state

  def _state_shardings(self) -> DecodeState:
    rows1, rows2 = (sharding_lib.batch_sharding(self._mesh, n) for n in (1, 2))
    return DecodeState(cache=sharding_lib.cache_shardings(self._mesh), logits_SxV=rows2,
                       prompt_len_S=rows1, step_S=rows1, live_S=rows1, row_id_S=rows1,
                       sample_S=rows1, tokens_SxT=rows2, logp_SxT=rows2, raw_logp_SxT=rows2,
                       key=sharding_lib.replicated(self._mesh))

  def init_decode_state(self, *args, key=None, **kwargs) -> DecodeState:
    """Empty slots; `key` seeds the draws (default: the engine's seed)."""
    return self._init_state(jax.random.key(self._seed) if key is None else key)

  def _init_state_fn(self, key) -> DecodeState:
    c, s, t = self.cfg, self._slots, self.profile.max_new_tokens
    dt = model_lib.DTYPES[c.dtype]
    hk, d, p = c.num_kv_heads, c.head_dim, self._prefill_length
    zeros_s = jnp.zeros((s,), jnp.int32)
    cache = decode.Cache(
        prompt_k=tuple(jnp.zeros((s, hk, d, p), dt) for _ in range(c.num_layers)),
        prompt_v=tuple(jnp.zeros((s, hk, p, d), dt) for _ in range(c.num_layers)),
        prompt_bias=jnp.zeros((s, 1, 1, p), jnp.float32),
        gen_k=tuple(jnp.zeros((s, hk, 1, d, t), dt) for _ in range(c.num_layers)),
        gen_v=tuple(jnp.zeros((s, hk, 1, t, d), dt) for _ in range(c.num_layers)))
    return DecodeState(cache=cache, logits_SxV=jnp.zeros((s, c.vocab_size), jnp.float32),
                       prompt_len_S=zeros_s, step_S=zeros_s, live_S=jnp.zeros((s,), bool),
                       row_id_S=zeros_s, sample_S=zeros_s,
                       tokens_SxT=jnp.full((s, t), self.pad_id, jnp.int32),
                       logp_SxT=jnp.zeros((s, t), jnp.float32),
                       raw_logp_SxT=jnp.zeros((s, t), jnp.float32), key=key)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    return self._insert(prefix, decode_state, np.int32(slot))

  def _insert_fn(self, prefix: Prefix, state: DecodeState, slot) -> DecodeState:
    # The slot's generated keys and values are left as they are: generate writes slot i
    # before attending to slots <= i, so stale entries are never read.
    put = lambda buf, row: jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype),
                                                               slot, axis=0)
    cache = state.cache._replace(
        prompt_k=tuple(map(put, state.cache.prompt_k, prefix.prompt_k)),
        prompt_v=tuple(map(put, state.cache.prompt_v, prefix.prompt_v)),
        prompt_bias=put(state.cache.prompt_bias, prefix.prompt_bias))
    return state.replace(
        cache=cache, logits_SxV=put(state.logits_SxV, prefix.logits_1xV),
        prompt_len_S=state.prompt_len_S.at[slot].set(prefix.length),
        step_S=state.step_S.at[slot].set(0), live_S=state.live_S.at[slot].set(True),
        row_id_S=state.row_id_S.at[slot].set(prefix.row_id),
        sample_S=state.sample_S.at[slot].set(prefix.sample),
        tokens_SxT=state.tokens_SxT.at[slot].set(self.pad_id),
        logp_SxT=state.logp_SxT.at[slot].set(0.0),
        raw_logp_SxT=state.raw_logp_SxT.at[slot].set(0.0))

  # ---------------------------------------------------------------- generate

  def generate(self, params: Params, decode_state: DecodeState):
    return self._generate(params.weights, decode_state)

  def _generate_fn(self, weights, state: DecodeState):
    sp, t, g = self.profile.sampling, self.profile.max_new_tokens, self.profile.num_samples
    live, i = state.live_S, state.step_S
    u_S = None
    if not sp.greedy:  # the native sampler's uniform for (row id, token index)[sample]
      u_S = jax.vmap(lambda r, s, j: sampling.row_uniform(state.key, r, j, g)[s])(
          state.row_id_S, state.sample_S, i)
    token, logp, raw = distribution.draw(state.logits_SxV, u_S, sp)
    token = jnp.where(live, token, self.pad_id)
    col = jnp.minimum(i, t - 1)
    rows = jnp.arange(self._slots)
    keep = lambda buf, new: buf.at[rows, col].set(jnp.where(live, new, buf[rows, col]))
    ended = jnp.zeros_like(live)
    if self.stop_ids:
      ended = jnp.any(token[:, None] == jnp.asarray(self.stop_ids, jnp.int32), axis=-1)
    step = i + live.astype(jnp.int32)
    # Feed the drawn token (idle slots feed pad into their own rows, which nothing reads).
    logits, cache = decode.step(weights, self.cfg, token[:, None], state.prompt_len_S + col,
                                col, state.cache, mesh=self._mesh)
    new_state = state.replace(
        cache=cache, logits_SxV=logits[:, 0], step_S=step,
        live_S=live & ~ended & (step < t), tokens_SxT=keep(state.tokens_SxT, token),
        logp_SxT=keep(state.logp_SxT, logp), raw_logp_SxT=keep(state.raw_logp_SxT, raw))
    data = jnp.stack([token, live.astype(jnp.int32), step], axis=1)
    return new_state, engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                              length_idx=(2, 3), samples_per_slot=1)

  # ---------------------------------------------------------------- the rest of the API

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path, extra_ids=0)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Tokenizer:
    del metadata  # the engine holds its tokenizer already
    return Tokenizer(self.tokenizer, self.stop_ids)

  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def samples_per_slot(self) -> int:
    return 1  # a prompt's G samples take G slots and share one prefill (see the driver)

  @property
  def max_prefill_length(self) -> int:
    return self._prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None  # no CPU devices beside the accelerators are used

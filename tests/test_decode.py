"""Tests for jaxgrpo.model.decode: the sampler's decode step equals the reference forward pass."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.model import decode
from jaxgrpo.model import decoder as model
from jaxgrpo.rollout import sampling
from numpy_params import random_params  # tests/numpy_params.py

# A tiny grouped-query model: 4 query heads share 2 KV heads.
BASE = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64)

# The variants cover every switch `prepare` rearranges: grouped-query attention with tied
# embeddings; multi-head attention with QK-norm and an untied head; Qwen2's q/k/v biases
# with Llama 3 RoPE scaling and 4 query heads per KV head (r = 4).
VARIANTS = {
    "gqa_tied": BASE,
    "mha_qknorm_untied": dataclasses.replace(BASE, num_kv_heads=4, qk_norm=True,
                                             tie_embeddings=False),
    "bias_llama3_r4": dataclasses.replace(BASE, num_kv_heads=1, qkv_bias=True,
                                          rope_scaling_factor=8.0,
                                          rope_original_max_positions=16),
    # Gemma 3's layout: layer 0 local with a window of 3 (shorter than the 7-token prompts
    # and the 5 decoded tokens: it hides prompt keys and generated slots alike), layer 1
    # global; its own RoPE bases and linear scaling, query scale, norms and GeGLU.
    "gemma_window3": dataclasses.replace(
        BASE, qk_norm=True, sliding_window=3, sliding_window_pattern=2, post_norms=True,
        norm_plus_one=True, embed_scale=True, hidden_act="gelu_tanh",
        query_pre_attn_scalar=12.0, rope_theta=1e6, rope_local_theta=1e4,
        rope_scaling_factor=8.0, rope_scaling_type="linear"),
}


def _left_padded_prompts(rng, lengths, width, vocab):
  """Prompts left-padded to `width`; pads hold random tokens, so only the mask hides them."""
  tokens = rng.integers(0, vocab, size=(len(lengths), width)).astype(np.int32)
  mask = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
  return tokens, mask


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _cached_and_full_logits(cfg, params, prompt_BxL, mask_BxL, cont_BxGxT, stacked=False,
                            block=0):
  """Decode-step logits (prefill, then one decode.step per continuation token) and the full
  forward logits over [left-padded prompt | continuation] for each of the G samples.

  stacked: the scanned layers' decode (one compiled block over stacked weights and caches).
  block: the decode step's key block (0: the whole generated cache every step).
  One jit per config: a single compile instead of one per piece (CPU time is the budget).
  """
  b, p = prompt_BxL.shape
  g, t = cont_BxGxT.shape[1:]
  # Prefill once per prompt, then build the cache the way sampling.sample does.
  last_BxV, (ks, vs) = sampling.prefill(params, cfg, prompt_BxL, mask_BxL, stacked,
                                        stacked_kv=stacked)
  cache = decode.init_cache(ks, vs, mask_BxL, cfg, g, t, stacked, block)
  weights = decode.prepare(params, cfg, stacked)
  prompt_len_B = jnp.sum(mask_BxL, axis=-1)

  def step(cache, i):
    logits_BxGxV, cache = decode.step(weights, cfg, cont_BxGxT[:, :, i], prompt_len_B + i, i,
                                      cache, block)
    return cache, logits_BxGxV

  _, decoded_TxBxGxV = jax.lax.scan(step, cache, jnp.arange(t))

  rows = jnp.concatenate([jnp.repeat(prompt_BxL, g, axis=0), cont_BxGxT.reshape(b * g, t)], 1)
  rows_mask = jnp.concatenate([jnp.repeat(mask_BxL, g, axis=0), jnp.ones((b * g, t), bool)], 1)
  full = model.forward(params, cfg, rows, rows_mask).reshape(b, g, p + t, cfg.vocab_size)
  return last_BxV, decoded_TxBxGxV.transpose(1, 2, 0, 3), full


@pytest.mark.parametrize("block", [0, 2], ids=["whole_cache", "blocks_of_2"])
@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_steps_match_the_full_forward(variant, stacked, block):
  # Both decode steps (the layers unrolled over a tuple of weights, or scanned over stacked
  # weights and caches, writing only each token's slot) against the full forward; with
  # blocks of 2 the 5 generated slots are 3 blocks (the last half empty), read one by one
  # up to the current token's with an online softmax.
  cfg = VARIANTS[variant]
  params = random_params(cfg, seed=1, scale_noise=0.1)  # a dropped norm scale would show
  b, g, p, t = 3, 2, 7, 5
  rng = np.random.default_rng(0)
  # Three prompts of 7, 4 and 2 real tokens; two different continuations each.
  prompt_BxL, mask_BxL = _left_padded_prompts(rng, [7, 4, 2], p, cfg.vocab_size)
  cont_BxGxT = rng.integers(0, cfg.vocab_size, size=(b, g, t)).astype(np.int32)
  last_BxV, decoded_BxGxTxV, full = _cached_and_full_logits(cfg, params, prompt_BxL, mask_BxL,
                                                            cont_BxGxT, stacked, block)
  for j in range(g):  # the prefill's last logits predict the first continuation token
    np.testing.assert_allclose(last_BxV, full[:, j, p - 1], atol=1e-5)
  # decode step i feeds continuation token i at position len + i: full position p + i.
  np.testing.assert_allclose(decoded_BxGxTxV, full[:, :, p:], atol=1e-5)
  # The two continuations of a prompt really differ, so per-sample caches are exercised.
  assert not np.allclose(decoded_BxGxTxV[:, 0], decoded_BxGxTxV[:, 1], atol=1e-3)


def test_bfloat16_decoding_stays_close_to_float32():
  cfg32 = VARIANTS["mha_qknorm_untied"]
  cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
  params = random_params(cfg32, seed=2, scale_noise=0.1)
  rng = np.random.default_rng(1)
  prompt_BxL, mask_BxL = _left_padded_prompts(rng, [7, 3], 7, cfg32.vocab_size)
  cont_BxGxT = rng.integers(0, cfg32.vocab_size, size=(2, 2, 3)).astype(np.int32)
  _, dec16, full32 = _cached_and_full_logits(cfg16, params, prompt_BxL, mask_BxL, cont_BxGxT)
  assert dec16.dtype == jnp.float32  # logits always come back in float32
  # bfloat16 keeps 8 mantissa bits: logits of size ~1 agree to a few hundredths.
  np.testing.assert_allclose(dec16, full32[:, :, 7:], atol=0.1)


def test_prepare_keeps_each_kv_heads_queries_key_and_value_together():
  # The fused projection's [H_kv, r + 2, D, d_model] layout: KV head k's query heads are
  # k*r .. k*r + r - 1 (model.Attention's grouping), then its key, then its value.
  cfg = VARIANTS["bias_llama3_r4"]
  params = random_params(cfg, seed=3)
  w = decode.prepare(params, cfg)
  a = jax.tree.map(lambda x: x[0], params["layers"]["attn"])  # layer 0 of the stack
  qkv = np.asarray(w.layers[0].qkv)
  assert qkv.shape == (1, 6, 8, 32)
  for h in range(4):
    np.testing.assert_array_equal(qkv[0, h], a["q"][:, h].T)
  np.testing.assert_array_equal(qkv[0, 4], a["k"][:, 0].T)
  np.testing.assert_array_equal(qkv[0, 5], a["v"][:, 0].T)


def _compiled_step_hlo(cfg, b=2, g=3, p=5, t=4):
  """The optimized HLO of one decode.step for `cfg` (B prompts x G samples)."""
  params = random_params(cfg, seed=0)
  prompt, mask = _left_padded_prompts(np.random.default_rng(0), [p] * b, p, cfg.vocab_size)
  _, (ks, vs) = sampling.prefill(params, cfg, prompt, mask)
  cache = decode.init_cache(ks, vs, mask, cfg, g, t)
  fn = jax.jit(lambda w, tok, pos, c: decode.step(w, cfg, tok, pos, 0, c))
  return fn.lower(decode.prepare(params, cfg), jnp.zeros((b, g), jnp.int32),
                  jnp.full((b,), p, jnp.int32), cache).compile().as_text()


def test_gate_and_up_are_two_independent_matmuls():
  # One stacked [2 * mlp, d_model] matmul is split over two threads by XLA's CPU runtime,
  # and at 32 rows the split costs more than it saves: the tiny-preset sampler measured
  # 1.08-1.13x slower per call with it (BENCHMARKS.md). So each layer's compiled step has
  # two [mlp, N] dots and no [2 * mlp, N] one. mlp 48 (no other projection has 48 or 96
  # outputs), N = B * G = 2 * 3 rows, 2 layers: four [48, 6] dots.
  cfg = dataclasses.replace(BASE, mlp_dim=48)
  params = random_params(cfg, seed=0)
  w = decode.prepare(params, cfg).layers[0]
  np.testing.assert_array_equal(w.gate, params["layers"]["mlp"]["gate"][0].T)
  np.testing.assert_array_equal(w.up, params["layers"]["mlp"]["up"][0].T)
  dots = re.findall(r"= f32\[(\d+),(\d+)\]\{[\d,]*\} dot\(", _compiled_step_hlo(cfg))
  assert dots.count(("48", "6")) == 2 * cfg.num_layers, dots
  assert ("96", "6") not in dots, dots


def test_decode_step_does_no_per_layer_copies():
  # Every op in the token loop costs dispatch time on CPU, so nothing may scale with depth
  # except the layers' own work. Two things did: RoPE sliced each head in halves and
  # concatenated the rotated halves (one concatenation per layer), and the output projection,
  # an einsum over [H_kv, r, D], made XLA copy its [d_model, H * D] weight (32 x 32 here)
  # into a new layout every token. Compiled for 1 and for 3 layers, the step has the same
  # number of concatenations (the per-token cos/sin tables), and no copy or transpose of a
  # 32 x 32 array.
  hlos = [_compiled_step_hlo(dataclasses.replace(BASE, num_layers=n)) for n in (1, 3)]
  concats = [len(re.findall(r"= \S+ concatenate\(|%\S*concatenate\S*fusion\S* = ", h))
             for h in hlos]
  assert concats[0] == concats[1], concats
  for hlo in hlos:
    assert not re.search(r"%\S*(copy|transpose)\S* = f32\[32,32\]", hlo)
  # The embedding is the parameter as stored, [V, d_model]: no transposed copy per call.
  params = random_params(BASE, seed=0)
  np.testing.assert_array_equal(decode.prepare(params, BASE).embedding, params["embedding"])


@functools.partial(jax.jit, static_argnums=(0, 5))
def _per_row_steps(cfg, params, prompt_BxL, mask_BxL, cont_BxT, offsets):
  """Decode-step logits when row b starts offsets[b] calls late (JetStream's slots: each at
  its own step, i_B a vector). Before its start a row feeds its first token at slot 0 and
  after its end re-feeds its last at slot t-1: both are rewritten before they are read."""
  b, t = cont_BxT.shape
  last_BxV, (ks, vs) = sampling.prefill(params, cfg, prompt_BxL, mask_BxL)
  cache = decode.init_cache(ks, vs, mask_BxL, cfg, 1, t)
  weights = decode.prepare(params, cfg)
  prompt_len_B = jnp.sum(mask_BxL, axis=-1)
  out = jnp.zeros((b, t, cfg.vocab_size), jnp.float32)
  for k in range(t + max(offsets)):
    i_B = jnp.clip(k - jnp.asarray(offsets), 0, t - 1)
    tokens = jnp.take_along_axis(cont_BxT, i_B[:, None], axis=1)
    logits, cache = decode.step(weights, cfg, tokens, prompt_len_B + i_B, i_B, cache)
    for row, off in enumerate(offsets):
      if 0 <= k - off < t:
        out = out.at[row, k - off].set(logits[row, 0])
  return out


def test_decode_step_takes_one_step_per_row():
  cfg = BASE
  params = random_params(cfg, seed=1, scale_noise=0.1)
  p, t = 7, 4
  rng = np.random.default_rng(1)
  prompt_BxL, mask_BxL = _left_padded_prompts(rng, [7, 4, 2], p, cfg.vocab_size)
  cont_BxT = rng.integers(0, cfg.vocab_size, size=(3, t)).astype(np.int32)
  got = _per_row_steps(cfg, params, prompt_BxL, mask_BxL, cont_BxT, (0, 2, 1))
  rows = np.concatenate([prompt_BxL, cont_BxT], axis=1)
  full = model.forward(params, cfg, rows, np.concatenate([mask_BxL, np.ones((3, t), bool)], 1))
  # Token j of row b, fed at position length_b + j, predicts what the full pass predicts at
  # column p + j, whatever step the other rows are at.
  np.testing.assert_allclose(got, full[:, p:], atol=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_blocked_decode_reads_only_the_blocks_up_to_the_current_token(stacked):
  # Blocks of 4 over 12 generated slots. At step i every slot after i's block is poisoned
  # with NaN: the blocked step never reads them (finite logits, equal to the clean cache's),
  # while the whole-cache step reads every slot (0 x NaN = NaN). So the blocks read grow
  # with i: 1 block for i < 4, 2 for i < 8, 3 after.
  cfg = VARIANTS["gqa_tied"]
  params = random_params(cfg, seed=3, scale_noise=0.1)
  rng = np.random.default_rng(4)
  prompt_BxL, mask_BxL = _left_padded_prompts(rng, [5, 3], 5, cfg.vocab_size)
  cont_BxGxT = rng.integers(0, cfg.vocab_size, size=(2, 2, 12)).astype(np.int32)
  _, (ks, vs) = sampling.prefill(params, cfg, prompt_BxL, mask_BxL, stacked, stacked_kv=stacked)
  weights = decode.prepare(params, cfg, stacked)
  prompt_len_B = jnp.sum(mask_BxL, axis=-1)
  # Slot axes: gen_k [..., D, T] (last), gen_v [..., T, D] (second to last).
  poison = lambda x, start, axis: x.at[(Ellipsis, slice(start, None)) + (slice(None),) *
                                       (-1 - axis)].set(jnp.nan)
  for block in (4, 0):
    cache = decode.init_cache(ks, vs, mask_BxL, cfg, 2, 12, stacked, block)
    step = jax.jit(functools.partial(decode.step, weights, cfg, block=block))
    for i in range(12):
      tokens, positions = cont_BxGxT[:, :, i], prompt_len_B + i
      clean, cache = step(tokens, positions, i, cache)
      after = (decode.blocks_read(i, 4) * 4) if block else 12
      assert decode.blocks_read(i, 4) == i // 4 + 1
      if after < 12:
        bad = cache._replace(
            gen_k=jax.tree.map(lambda x: poison(x, after, -1), cache.gen_k),
            gen_v=jax.tree.map(lambda x: poison(x, after, -2), cache.gen_v))
        # Re-run step i on the poisoned cache (its own slot i is rewritten identically).
        again, _ = step(tokens, positions, i, bad)
        if block:
          np.testing.assert_array_equal(np.asarray(again), np.asarray(clean))
      if block == 0 and i < 8:
        bad = cache._replace(gen_v=jax.tree.map(lambda x: poison(x, 8, -2), cache.gen_v))
        assert np.isnan(np.asarray(step(tokens, positions, i, bad)[0])).any()

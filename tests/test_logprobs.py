"""Chunked log-probs (jaxgrpo.model.logprobs): the same numbers and gradients as the full logits,
without holding the [N, T, V] logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.algo import grpo
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.rollout import sampling
from numpy_params import assert_close_at_scale, random_params  # tests/numpy_params.py

CFG = model_lib.ModelConfig(vocab_size=48, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, mlp_dim=64, tie_embeddings=False)
SPS = (sampling.SamplingParams(0.7, 1.0, 0), sampling.SamplingParams(1.0, 0.9, 6))
B, G, T = 3, 2, 7


def _batch(cfg, b=B, t=T, seed=0):
  rng = np.random.default_rng(seed)
  prompt_mask = np.arange(5)[None, :] >= rng.integers(0, 3, (b, 1))
  lengths = rng.integers(1, t + 1, b * G)
  mask = np.arange(t)[None, :] < lengths[:, None]
  return {"prompt_tokens_BxL": np.where(prompt_mask, rng.integers(1, cfg.vocab_size, (b, 5)),
                                        0).astype(np.int32),
          "prompt_mask_BxL": prompt_mask,
          "completion_tokens_NxT": np.where(mask, rng.integers(1, cfg.vocab_size, (b * G, t)),
                                            0).astype(np.int32),
          "completion_mask_NxT": mask}


@functools.partial(jax.jit, static_argnames=("chunk", "remat"))
def _logprobs_and_grads(params, batch, chunk, remat="none"):
  """Both profiles' log-probs, and the gradient of a weighted sum of them."""
  def total(p):
    a, b = grpo.completion_logprobs(p, CFG, batch, G, SPS, chunk=chunk, remat=remat)
    weights = jnp.arange(a.size, dtype=jnp.float32).reshape(a.shape) % 5 - 2
    return jnp.sum(weights * (a + 0.5 * b)), (a, b)
  return jax.grad(total, has_aux=True)(params)


@pytest.mark.parametrize("chunk, remat", [(3, "none"), (7, "none"), (4, "full"),
                                          (2, "save_dots")])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(chunk, remat):
  # T = 7: chunk 3 leaves a last chunk of 1 (padded to 3), 7 is a single chunk; remat
  # changes what the backward recomputes, never the numbers.
  params, batch = random_params(CFG, 0), _batch(CFG)
  want_grads, want = _logprobs_and_grads(params, batch, chunk=0)
  got_grads, got = _logprobs_and_grads(params, batch, chunk=chunk, remat=remat)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert not np.allclose(want[0], want[1], atol=1e-2)  # two different profiles
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert_close_at_scale(g, w, rtol=1e-4, scale_tol=1e-6)


def _temp_bytes(cfg, chunk, b, t):
  """The compiled gradient's temporary bytes (XLA's memory_analysis): a compiler fact."""
  sp = sampling.SamplingParams(1.0, 1.0, 0)
  params = jax.eval_shape(lambda: random_params(cfg, 0))
  batch = jax.eval_shape(lambda: _batch(cfg, b, t))
  loss = lambda p, x: grpo.completion_logprobs(p, cfg, x, G, sp, chunk=chunk).sum()
  compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunking_keeps_a_32k_vocabulary_gradient_under_a_quarter_of_the_memory():
  # 16 rollouts x 64 positions x 32,768 float32 logits: 128 MiB per copy, and the plain
  # gradient holds several. Chunks of 8 positions hold 16 MiB each.
  cfg = model_lib.ModelConfig(vocab_size=32768, d_model=64, num_layers=1, num_heads=2,
                              num_kv_heads=2, head_dim=32, mlp_dim=128)
  full, chunked = _temp_bytes(cfg, 0, 8, 64), _temp_bytes(cfg, 8, 8, 64)
  assert chunked <= full / 4, (chunked, full)

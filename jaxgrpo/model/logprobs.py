"""Per-token log-probs of sampled completions without the [N, T, V] logits.

The loss needs one number per completion token, log π(o_t | ...), yet the plain forward
materialises the logits of every position: N x T x V floats, 15 GB for 32 rollouts x 768
tokens at Qwen's 151,936-token vocabulary, and as much again for their gradient. Here the
final hidden states are projected to the vocabulary a chunk of positions at a time (every
rollout of the batch, `chunk` positions), each chunk's log-softmax keeps one value per
token, and `jax.checkpoint` around the chunk makes the backward pass recompute the chunk's
logits instead of storing them: the largest vocabulary-sized tensor alive is one chunk's.
Where the peers do the same: Tunix `compute_logps_chunk_size`, NeMo-RL's chunked log-probs,
MaxText's vocabulary tiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgrpo.model import distribution
from jaxgrpo.model import decoder as model_lib


def chunked_logprobs(hidden_NxTxD, head_DxV, tokens_NxT, sps, chunk: int, mesh=None):
  """log p(token) under each profile of `sps` (a tuple of SamplingParams), one [N, T] array
  each, projecting `chunk` positions of every row at a time. mesh: the update step's, on
  which each chunk's logits are pinned (rows over the data axes, vocab over tensor).

  Positions are padded up to a multiple of `chunk` (the padding's values are dropped), so
  any chunk size works. Chunks run in a `lax.map`, i.e. one after the other.
  """
  n, t, d = hidden_NxTxD.shape
  count = -(-t // chunk)
  pad = count * chunk - t
  hidden = jnp.pad(hidden_NxTxD, ((0, 0), (0, pad), (0, 0)))
  tokens = jnp.pad(tokens_NxT, ((0, 0), (0, pad)))
  # [C, N, chunk, ...]: chunk c holds positions c*chunk.. of EVERY row, so each chunk is
  # split over the data axes like the rows are.
  hidden_CxNxKxD = hidden.reshape(n, count, chunk, d).transpose(1, 0, 2, 3)
  tokens_CxNxK = tokens.reshape(n, count, chunk).transpose(1, 0, 2)

  @jax.checkpoint  # the backward recomputes this chunk's logits rather than storing them
  def one(head, hidden_NxKxD, tokens_NxK):
    logits = model_lib.dense(hidden_NxKxD, head).astype(jnp.float32)
    logits = model_lib.constrain(logits, mesh, "batch", None, "act_vocab")
    return tuple(distribution.token_logprobs(logits, tokens_NxK, sp) for sp in sps)

  outs = jax.lax.map(lambda xs: one(head_DxV, *xs), (hidden_CxNxKxD, tokens_CxNxK))
  return tuple(o.transpose(1, 0, 2).reshape(n, count * chunk)[:, :t] for o in outs)

"""A sampling profile's token distribution: truncation, the draw, and log-probs.

The sampler (sampling.py, and the JetStream adapter) draws with `draw`; the trainer
computes the same log-probabilities of the drawn tokens with `token_logprobs` (algo/grpo.py,
logprobs.py), so the first of mu updates starts at importance ratio 1.

Token choice uses one uniform draw per row and step and an inverse-CDF pick, and greedy uses
max + min-index: both measured far cheaper on CPU than `jax.random.categorical` / `argmax`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one token is drawn. Every field is explicit: nothing falls back to a model default.

  temperature: 0 means greedy; logits are divided by it before top-k / top-p.
  top_p: nucleus mass in (0, 1]; 1 keeps everything.
  top_k: keep the k most likely tokens; 0 means off.
  """

  temperature: float
  top_p: float
  top_k: int

  def __post_init__(self):
    if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
      raise ValueError(f"temperature={self.temperature!r}: must be a number >= 0")
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 means greedy)")
    if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
      raise ValueError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p}: must be in (0, 1] (1 disables nucleus sampling)")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
      raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 means off)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def _min_index_argmax(x):
  """argmax over the last axis, lowest index on ties (max + min-index: cheaper than argmax)."""
  top = jnp.max(x, axis=-1, keepdims=True)
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(x == top, idx, x.shape[-1]), axis=-1)


# Top-p without top-k over a vocabulary larger than this looks for the nucleus among the
# this many most likely tokens first, and sorts the whole vocabulary only when a row's
# nucleus is larger (measured on CPU, 32 rows x 151,936: top-1024 22 ms, full sort 1,040 ms).
NUCLEUS_CANDIDATES = 1024


def candidate_logprobs(logits, sp: SamplingParams):
  """The profile's distribution as (candidate log-probs [..., K], candidate token ids [..., K]).

  Temperature first, then top-k, then top-p: top-p keeps the smallest prefix of the sorted
  candidates whose mass reaches p (a token is kept when the mass strictly before it is < p;
  equal logits sort by token id, as `lax.top_k` orders them). Excluded candidates get -inf.
  Without truncation the candidates are the whole vocabulary, in vocabulary order; so are
  they for top-p alone over more than NUCLEUS_CANDIDATES tokens (`_nucleus_mask`: the same
  kept set, without sorting the vocabulary when the nucleus is among the top candidates).
  """
  vocab = logits.shape[-1]
  scaled = logits / sp.temperature
  every_id = lambda: jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
  if sp.top_k > 0 and sp.top_k < vocab:
    cand, ids = jax.lax.top_k(scaled, sp.top_k)
  elif sp.top_p < 1 and vocab > NUCLEUS_CANDIDATES:
    kept = _nucleus_mask(jax.lax.stop_gradient(scaled), sp.top_p)
    return jax.nn.log_softmax(jnp.where(kept, scaled, -jnp.inf), axis=-1), every_id()
  elif sp.top_p < 1:
    cand, ids = jax.lax.top_k(scaled, vocab)  # a full descending sort
  else:
    cand, ids = scaled, every_id()
  if sp.top_p < 1:
    probs = jax.nn.softmax(cand, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cand = jnp.where(mass_before < sp.top_p, cand, -jnp.inf)
  return jax.nn.log_softmax(cand, axis=-1), ids.astype(jnp.int32)


def _nucleus_mask(scaled, top_p: float):
  """The tokens top-p keeps, as a mask [..., V] in vocabulary order.

  The sorted rule keeps a prefix of the tokens sorted by (logit descending, id ascending);
  its last kept token, of logit tau and id i*, marks the set: logit > tau, or logit == tau
  and id <= i*. That last token is found among the top NUCLEUS_CANDIDATES (one `lax.top_k`)
  for every row whose candidates hold mass >= p; only if some row's do not is the whole
  vocabulary sorted, and then only for those rows' answers. The probabilities are exp(logit
  - logsumexp over the vocabulary) in both cases, so a row's set does not depend on the other
  rows. Against the sorted method over the whole vocabulary the kept set is the same except
  where the mass before a token is within float rounding of p (the normaliser is summed in
  another order); tests/test_distribution.py compares them, ties included.
  """
  lead, vocab = scaled.shape[:-1], scaled.shape[-1]
  flat = scaled.reshape(-1, vocab)
  lse = jax.nn.logsumexp(flat, axis=-1, keepdims=True)

  def last_kept(cand, ids):
    probs = jnp.exp(cand - lse)
    kept = jnp.cumsum(probs, axis=-1) - probs < top_p  # a prefix, never empty
    j = jnp.sum(kept, axis=-1, keepdims=True) - 1
    return (jnp.take_along_axis(cand, j, axis=-1), jnp.take_along_axis(ids, j, axis=-1),
            jnp.sum(probs, axis=-1, keepdims=True) >= top_p)

  tau, last, covered = last_kept(*jax.lax.top_k(flat, NUCLEUS_CANDIDATES))

  def sort_all(_):
    tau_all, last_all, _ = last_kept(*jax.lax.top_k(flat, vocab))
    return jnp.where(covered, tau, tau_all), jnp.where(covered, last, last_all)

  tau, last = jax.lax.cond(jnp.all(covered), lambda _: (tau, last), sort_all, None)
  ids = jnp.arange(vocab, dtype=jnp.int32)
  kept = (flat > tau) | ((flat == tau) & (ids <= last))
  return kept.reshape(*lead, vocab)


def _last_positive(x):
  """Index of the last entry > 0 along the last axis (0 if none)."""
  idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.max(jnp.where(x > 0, idx, 0), axis=-1)


def inverse_cdf_pick(probs, uniform):
  """The index i with cdf[i-1] <= u * total < cdf[i], for unnormalised probs [..., K].

  Two levels, so no cumulative sum runs over all K entries: XLA's CPU cumsum cost grows much
  faster than K (210 us per step for 32 x 512, 80% of the whole draw). Blocks of ~sqrt(K)
  entries: pick a block by its cumulative mass, then the entry inside it. A pick is always
  an entry with positive probability, even when float rounding leaves u * total at the edge.
  """
  k = probs.shape[-1]
  width = int(math.ceil(math.sqrt(k)))
  blocks = -(-k // width)
  lead = probs.shape[:-1]
  p = jnp.pad(probs, [(0, 0)] * len(lead) + [(0, blocks * width - k)])
  p = p.reshape(*lead, blocks, width)
  mass = p.sum(axis=-1)                                  # [..., blocks]
  cdf = jnp.cumsum(mass, axis=-1)
  target = uniform * cdf[..., -1]
  j = jnp.minimum(jnp.sum(cdf <= target[..., None], axis=-1), _last_positive(mass))
  inside = jnp.take_along_axis(p, j[..., None, None], axis=-2)[..., 0, :]  # [..., width]
  before = jnp.take_along_axis(cdf - mass, j[..., None], axis=-1)[..., 0]
  inner = jnp.cumsum(inside, axis=-1)
  i = jnp.minimum(jnp.sum(inner <= (target - before)[..., None], axis=-1),
                  _last_positive(inside))
  return (j * width + i).astype(jnp.int32)


def draw(logits, uniform, sp: SamplingParams):
  """One token per row: (token, profile log-prob, raw log-prob). uniform in [0, 1)."""
  raw = jax.nn.log_softmax(logits, axis=-1)
  if sp.greedy:
    token = _min_index_argmax(logits)
    logp = jnp.zeros(token.shape, jnp.float32)  # a point mass
  else:
    cand_logp, ids = candidate_logprobs(logits, sp)
    pick = inverse_cdf_pick(jnp.exp(cand_logp), uniform)
    token = jnp.take_along_axis(ids, pick[..., None], axis=-1)[..., 0]
    logp = jnp.take_along_axis(cand_logp, pick[..., None], axis=-1)[..., 0]
  raw_logp = jnp.take_along_axis(raw, token[..., None], axis=-1)[..., 0]
  return token, logp, raw_logp


# log(1e-30): the log-prob given to a token that fell outside a truncated profile's
# candidate set after an update. Finite, so ratios and gradients stay finite (its ratio is
# ~0 and its gradient vanishes), where -inf would give NaN.
_OUTSIDE_LOGP = -69.0


def token_logprobs(logits, tokens, sp: SamplingParams):
  """log p(token) under the profile's distribution, differentiable in the logits.

  The trainer's ratios use this on teacher-forced logits, and the sampler produced the
  same quantity at sampling time, so the first of mu updates starts at ratio 1.
  """
  if sp.greedy:
    raise ValueError("a greedy profile (temperature 0) has no usable log-probs for training")
  if sp.top_k == 0 and sp.top_p == 1:
    logp = jax.nn.log_softmax(logits / sp.temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
  cand_logp, ids = candidate_logprobs(logits, sp)
  hit = (ids == tokens[..., None]) & jnp.isfinite(cand_logp)
  picked = jnp.sum(jnp.where(hit, cand_logp, 0.0), axis=-1)
  return jnp.where(jnp.any(hit, axis=-1), picked, _OUTSIDE_LOGP)

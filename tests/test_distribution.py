"""Tests for jaxgrpo.model.distribution: truncation (temperature, top-k, top-p), the draw, and
the trainer's log-probs of drawn tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.model import distribution

SP = distribution.SamplingParams


def test_sampling_params_has_no_defaults():
  with pytest.raises(TypeError):
    SP()  # pylint: disable=no-value-for-parameter
  with pytest.raises(TypeError):
    SP(1.0)  # pylint: disable=no-value-for-parameter


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1, top_p=1.0, top_k=0), "temperature"),
    (dict(temperature=1.0, top_p=0.0, top_k=0), "top_p"),
    (dict(temperature=1.0, top_p=1.5, top_k=0), "top_p"),
    (dict(temperature=1.0, top_p=-0.1, top_k=0), "top_p"),
    (dict(temperature=1.0, top_p=1.0, top_k=-1), "top_k"),
    (dict(temperature="1.0", top_p=1.0, top_k=0), "temperature"),
    (dict(temperature=True, top_p=1.0, top_k=0), "temperature"),
    (dict(temperature=1.0, top_p=None, top_k=0), "top_p"),
    (dict(temperature=1.0, top_p=1.0, top_k=1.5), "top_k"),
    (dict(temperature=1.0, top_p=1.0, top_k=True), "top_k"),
])
def test_sampling_params_rejects_bad_values(kwargs, field):
  with pytest.raises(ValueError, match=f"^{field}="):
    SP(**kwargs)


def test_sampling_params_accepts_edges():
  assert SP(0, 1, 0).greedy
  assert not SP(0.5, 0.01, 3).greedy
  assert SP(1.0, 1.0, np.int64(4)).top_k == 4


def _kept_probs(probs, sp):
  logp, ids = distribution.candidate_logprobs(jnp.log(jnp.array(probs)), sp)
  out = np.zeros(len(probs))
  out[np.asarray(ids)] = np.exp(np.asarray(logp))
  return out, np.asarray(logp), np.asarray(ids)


def test_top_p_hand_example():
  # Sorted probs .5, .25, .15, .1: mass strictly before each is 0, .5, .75, .9; a token is
  # kept while that mass is < p.
  # p = 0.7 keeps the first two, renormalised to .5/.75 = 2/3 and .25/.75 = 1/3.
  kept, logp, ids = _kept_probs([0.5, 0.25, 0.15, 0.1], SP(1.0, 0.7, 0))
  np.testing.assert_array_equal(ids, [0, 1, 2, 3])
  np.testing.assert_allclose(kept, [2 / 3, 1 / 3, 0, 0], rtol=1e-6)
  assert np.all(np.isneginf(logp[2:]))
  # p = 0.75: .5 + .25 reaches .75 exactly, so the third token (mass before = .75) is out.
  kept, _, _ = _kept_probs([0.5, 0.25, 0.15, 0.1], SP(1.0, 0.75, 0))
  np.testing.assert_allclose(kept, [2 / 3, 1 / 3, 0, 0], rtol=1e-6)
  # p = 0.76 keeps three: .5/.9, .25/.9, .15/.9.
  kept, logp, _ = _kept_probs([0.5, 0.25, 0.15, 0.1], SP(1.0, 0.76, 0))
  np.testing.assert_allclose(kept, [5 / 9, 2.5 / 9, 1.5 / 9, 0], rtol=1e-6)
  assert np.isneginf(logp[3]) and np.all(np.isfinite(logp[:3]))


def test_top_p_sorts_unsorted_logits():
  # Same distribution, permuted: the kept tokens are ids 2 and 0 (probs .5 and .25).
  kept, _, _ = _kept_probs([0.25, 0.1, 0.5, 0.15], SP(1.0, 0.7, 0))
  np.testing.assert_allclose(kept, [1 / 3, 0, 2 / 3, 0], rtol=1e-6)


def test_temperature_applied_before_top_p():
  # Temperature 2 on log p gives probs proportional to sqrt(p): sqrt([.5, .25, .15, .1]) =
  # [.7071, .5, .3873, .3162], sum 1.9106 -> [.370, .262, .203, .166]. With top_p = .45 the
  # mass before is 0, .370, .632 -> two tokens kept, renormalised .7071/1.2071 = .5858 and
  # .5/1.2071 = .4142. Truncating first (on [.5, .25, ...]) would keep one token only.
  kept, _, _ = _kept_probs([0.5, 0.25, 0.15, 0.1], SP(2.0, 0.45, 0))
  assert np.count_nonzero(kept) == 2
  np.testing.assert_allclose(kept, [0.5858, 0.4142, 0, 0], atol=1e-4)


def test_top_k_then_top_p():
  # top_k = 3 keeps .5, .25, .15, renormalised to .5/.9 = .556, .278, .167; top_p = .8 then
  # sees mass before 0, .556, .833 and keeps two: 2/3, 1/3.
  kept, logp, _ = _kept_probs([0.5, 0.25, 0.15, 0.1], SP(1.0, 0.8, 3))
  assert logp.shape == (3,)
  np.testing.assert_allclose(kept, [2 / 3, 1 / 3, 0, 0], rtol=1e-6)


_DRAW_P = np.array([0.4, 0.3, 0.2, 0.06, 0.04])


@pytest.mark.parametrize("sp, expected", [
    (SP(1.0, 1.0, 2), [4 / 7, 3 / 7, 0, 0, 0]),           # top-k 2: .4/.7, .3/.7
    (SP(1.0, 0.8, 0), [.4 / .9, .3 / .9, .2 / .9, 0, 0]),  # mass before 0, .4, .7, .9
    (SP(1.0, 1.0, 0), list(_DRAW_P)),                       # untruncated
], ids=["top_k", "top_p", "full"])
def test_draw_frequencies_match_profile(sp, expected):
  m = 2000
  # A deterministic grid of uniforms: token j gets the u's in [cdf[j-1], cdf[j]), i.e.
  # M * prob_j of them, give or take one.
  u = (np.arange(m) + 0.5) / m
  logits = np.broadcast_to(np.log(_DRAW_P), (m, 5))
  token, logp, raw = jax.jit(distribution.draw, static_argnums=2)(logits, u, sp)
  token = np.asarray(token)
  freq = np.bincount(token, minlength=5) / m
  np.testing.assert_allclose(freq, expected, atol=1 / m + 1e-9)
  expected = np.array(expected)
  assert np.all(expected[token] > 0)  # never a -inf candidate
  np.testing.assert_allclose(logp, np.log(expected[token]), atol=1e-5)
  np.testing.assert_allclose(raw, np.log(_DRAW_P[token]), atol=1e-5)


def test_draw_greedy_is_argmax_with_lowest_index_on_ties():
  logits = np.array([[0.0, 2.0, 1.0, 2.0], [3.0, -1.0, 0.0, 0.0]], np.float32)
  token, logp, raw = distribution.draw(logits, np.array([0.3, 0.9]), SP(0.0, 1.0, 0))
  np.testing.assert_array_equal(token, [1, 0])
  np.testing.assert_array_equal(logp, [0.0, 0.0])
  np.testing.assert_allclose(raw, jax.nn.log_softmax(logits)[np.arange(2), [1, 0]], rtol=1e-6)


def test_inverse_cdf_pick_two_levels_is_exact():
  # K=10 gives blocks of width ceil(sqrt(10))=4 (3 blocks, 2 padded slots). probs (unnormalised)
  # put mass 1,0,3,0 | 0,2,0,0 | 4,0 → total 10, cdf 1,1,4,4,4,6,6,6,10,10. With u on a grid
  # of 1000 points, token i is picked for u*10 in [cdf[i-1], cdf[i]): counts 100, 300, 200, 400,
  # and zero-probability tokens are never picked.
  probs = jnp.array([1., 0., 3., 0., 0., 2., 0., 0., 4., 0.])
  u = (jnp.arange(1000) + 0.5) / 1000
  picks = np.asarray(distribution.inverse_cdf_pick(jnp.broadcast_to(probs, (1000, 10)), u))
  counts = np.bincount(picks, minlength=10)
  assert counts.tolist() == [100, 0, 300, 0, 0, 200, 0, 0, 400, 0]
  # u at the top edge (1 - 2^-24, where u * total can round up to total) still picks the last
  # token with positive probability, never a zero-probability or padded slot.
  edge = distribution.inverse_cdf_pick(probs[None], jnp.array([1.0 - 2.0**-24]))
  assert int(edge[0]) == 8


# ------------------------------------------------- top-p alone over a large vocabulary


def _sorted_kept(logits, top_p):
  """The rule by a full sort (the method below NUCLEUS_CANDIDATES): a boolean mask [N, V]."""
  cand, ids = jax.lax.top_k(jnp.asarray(logits), logits.shape[-1])
  probs = jax.nn.softmax(cand, axis=-1)
  keep = jnp.cumsum(probs, axis=-1) - probs < top_p
  mask = np.zeros(logits.shape, bool)
  np.put_along_axis(mask, np.asarray(ids), np.asarray(keep), axis=-1)
  return mask


def _nucleus(logits, top_p):
  logp, ids = distribution.candidate_logprobs(jnp.asarray(logits), SP(1.0, top_p, 0))
  np.testing.assert_array_equal(ids, np.broadcast_to(np.arange(logits.shape[-1]), ids.shape))
  return np.asarray(logp)


def test_nucleus_ties_keep_the_lower_ids_first():
  # V = 2048 > NUCLEUS_CANDIDATES. Token 5 has logit 10, tokens 100, 200, 300, 400 tie at 8,
  # the rest -30 (mass ~1e-14). p(5) = 1 / (1 + 4 e^-2) = 0.6488 and each tied token
  # q = 0.0878; sorted by id the ties have mass before 0.6488, 0.7366, 0.8244, 0.9122, so
  # top-p 0.8 keeps ids 100 and 200 of the four, renormalised: 0.6488 / 0.8244 = 0.787 and
  # 0.0878 / 0.8244 = 0.1065 each.
  assert distribution.NUCLEUS_CANDIDATES < 2048
  logits = np.full((1, 2048), -30.0, np.float32)
  logits[0, 5], logits[0, [100, 200, 300, 400]] = 10.0, 8.0
  logp = _nucleus(logits, 0.8)
  assert set(np.flatnonzero(np.isfinite(logp[0]))) == {5, 100, 200}
  np.testing.assert_allclose(np.exp(logp[0, [5, 100, 200]]), [0.787, 0.1065, 0.1065], atol=1e-3)
  np.testing.assert_array_equal(np.isfinite(logp), _sorted_kept(logits, 0.8))


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95])
def test_nucleus_keeps_the_sorted_set(top_p):
  # Peaked rows (nucleus inside the top 1024), the same rows rounded to bfloat16 (many equal
  # logits, so the id order of ties decides), and one near-flat row whose nucleus is larger
  # than the candidates (the whole vocabulary is sorted for it): every row keeps the set the
  # full sort keeps, with the same renormalised probabilities.
  rng = np.random.default_rng(0)
  peaked = (rng.standard_normal((4, 4096)) * 4).astype(np.float32)
  ties = np.asarray(jnp.asarray(peaked, jnp.bfloat16).astype(jnp.float32))
  flat = (rng.standard_normal((1, 4096)) * 0.01).astype(np.float32)
  logits = np.concatenate([peaked, ties, flat])
  logp = _nucleus(logits, top_p)
  kept = _sorted_kept(logits, top_p)
  np.testing.assert_array_equal(np.isfinite(logp), kept)
  assert kept[-1].sum() > distribution.NUCLEUS_CANDIDATES  # the flat row needed the sort
  ref = jax.nn.log_softmax(jnp.where(kept, logits, -jnp.inf), axis=-1)
  np.testing.assert_allclose(np.where(kept, logp, 0), np.where(kept, ref, 0), atol=1e-5)
  # A row's set does not depend on the rows beside it: alone (no sort), the same values.
  np.testing.assert_array_equal(_nucleus(peaked, top_p), logp[:4])


def test_nucleus_draw_and_trainer_logprobs_agree():
  # The tie example: a grid of uniforms draws ids 5, 100, 200 in proportion 0.787 / 0.1065 /
  # 0.1065 (vocabulary order), and the trainer's log-prob of each drawn token is the draw's;
  # a token outside the nucleus gets the finite floor.
  logits = np.full((2000, 2048), -30.0, np.float32)
  logits[:, 5], logits[:, [100, 200, 300, 400]] = 10.0, 8.0
  u = (np.arange(2000) + 0.5) / 2000
  sp = SP(1.0, 0.8, 0)
  token, logp, _ = jax.jit(distribution.draw, static_argnums=2)(logits, u, sp)
  freq = np.bincount(np.asarray(token), minlength=2048)[[5, 100, 200]] / 2000
  np.testing.assert_allclose(freq, [0.787, 0.1065, 0.1065], atol=2e-3)
  trainer = distribution.token_logprobs(jnp.asarray(logits), token, sp)
  np.testing.assert_allclose(trainer, logp, atol=1e-6)
  outside = distribution.token_logprobs(jnp.asarray(logits[:1]), jnp.array([300]), sp)
  assert float(outside[0]) == distribution._OUTSIDE_LOGP  # pylint: disable=protected-access


def test_nucleus_logprobs_differentiate_like_the_masked_softmax():
  # The kept set is a constant of the logits' values; the gradient of log p(token) is the
  # masked softmax's: one-hot(token) - p over the kept tokens (p/T at temperature T = 0.5).
  rng = np.random.default_rng(1)
  logits = jnp.asarray((rng.standard_normal((3, 2048)) * 4).astype(np.float32))
  tokens = jnp.argmax(logits, axis=-1)
  sp = SP(0.5, 0.9, 0)
  grad = jax.jit(jax.grad(lambda x: distribution.token_logprobs(x, tokens, sp).sum()))(logits)
  kept = _sorted_kept(np.asarray(logits) / 0.5, 0.9)
  want = jax.grad(lambda x: jnp.take_along_axis(
      jax.nn.log_softmax(jnp.where(kept, x / 0.5, -jnp.inf), axis=-1), tokens[:, None],
      axis=-1).sum())(logits)
  np.testing.assert_allclose(grad, want, atol=1e-5)

"""rollout/partial.py: a rollout carried over rounds draws exactly the tokens and log-probs
of the same rollout decoded in one round, with the same parameters, whatever sampler row it
lands in; one compiled program serves every budget."""

import jax
import numpy as np
import pytest

from jaxgrpo.model import decoder as model
from jaxgrpo.model import sharding
from jaxgrpo.rollout import partial, sampling
from numpy_params import left_padded_prompts, peaked_params  # tests/numpy_params.py

CFG = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64)
PAD, L, T = 0, 6, 12
EOS = (43, 51, 2)  # end ids the peaked model samples in about half the rows
SP = sampling.SamplingParams(1.0, 1.0, 0)


@pytest.fixture(scope="module")
def params():
  return peaked_params(CFG)


def _engine(mesh, scan_layers, decode_block=0):
  profiles = {"train": sampling.Profile(SP, 1, T), "val": sampling.Profile(SP, 1, T)}
  return partial.PartialEngine(CFG, mesh, profiles, rows=8, max_prompt_length=L, eos_id=EOS,
                               pad_id=PAD, seed=0, scan_layers=scan_layers,
                               decode_block=decode_block)


def _decode(engine, params, budget, order):
  """Rollout i (id 5i + 2, prompt i) decoded in sampler row order[i], in rounds of `budget`
  tokens until every row ends. Returns (tokens, log-probs, lengths) by rollout, rounds."""
  prompts, mask = left_padded_prompts(CFG.vocab_size, PAD)  # 8 prompts, 1..6 real tokens
  ids = np.arange(8, dtype=np.int32) * 5 + 2
  rows = np.argsort(order)  # rows[r]: the rollout row r decodes
  state, refill, active, rounds = engine.init_state(), np.ones(8, bool), np.ones(8, bool), 0
  while active.any():
    state, r = engine.round(params, state, refill, prompts[rows], mask[rows], ids[rows],
                            active, budget)
    refill, rounds = np.zeros(8, bool), rounds + 1
    assert (np.asarray(r.drawn_N)[active] <= budget).all()
    active = active & ~np.asarray(r.ended_N)
  out = [np.asarray(x)[order] for x in (state.tokens_NxT, state.logp_NxT, state.count_N)]
  return out, rounds


@pytest.mark.parametrize("scan_layers,axes", [(False, {"data": 1}),
                                              (True, {"data": 4, "tensor": 2})])
def test_a_carried_rollout_equals_the_uninterrupted_one(params, scan_layers, axes):
  # On 8 devices too (rows over data, KV heads over tensor): the donated state keeps its
  # shardings. Frozen parameters; rounds of 3 tokens against one round of all 12, with the
  # rollouts in other sampler rows: their draws are keyed by rollout id and token index.
  mesh = sharding.make_mesh(axes, devices=jax.devices()[:int(np.prod(list(axes.values())))])
  engine = _engine(mesh, scan_layers)
  (tokens, logp, count), rounds = _decode(engine, params, T, np.arange(8))
  (tokens3, logp3, count3), rounds3 = _decode(engine, params, 3, np.arange(8)[::-1])
  assert rounds == 1 and rounds3 == 4  # the longest rollout runs to 12 tokens: 4 rounds
  # Some rollouts end early (the peaked model's end ids), some run to T; several are carried.
  assert count.min() < 4 and count.max() == T and (count > 3).sum() >= 3
  np.testing.assert_array_equal(count3, count)
  np.testing.assert_array_equal(tokens3, tokens)
  np.testing.assert_array_equal(logp3, logp)
  assert engine.compilations == {"train": 1, "val": 0}  # one program for every budget


def test_partial_rollouts_read_the_cache_in_key_blocks_each_row_at_its_own_slot(params,
                                                                                monkeypatch):
  """Issue 63: partial rollouts refused generation.decode_block_size (each row is at its
  own slot; the blocked read took one slot for all), so the long preset needed it set to 0.
  The decode step now reads the blocks up to the furthest row's, each row masked at its
  own slot. With blocks of 4 slots (12 = 3 blocks): the same tokens as reading every slot,
  log-probs to float rounding (an online softmax), and a carried rollout still equals the
  uninterrupted one exactly (the extra, fully masked blocks add exact zeros)."""
  from jaxgrpo.model import decode  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  (tokens, logp, count), _ = _decode(_engine(mesh, False), params, T, np.arange(8))
  traced, blocks = [], decode._attend_blocks  # pylint: disable=protected-access
  monkeypatch.setattr(decode, "_attend_blocks",
                      lambda *a, **k: traced.append(np.ndim(a[5])) or blocks(*a, **k))
  blocked = _engine(mesh, False, decode_block=4)
  (tokens_b, logp_b, count_b), _ = _decode(blocked, params, T, np.arange(8))
  (tokens_3, logp_3, count_3), rounds = _decode(blocked, params, 3, np.arange(8)[::-1])
  np.testing.assert_array_equal(count_b, count)
  np.testing.assert_array_equal(tokens_b, tokens)
  np.testing.assert_allclose(logp_b, logp, atol=1e-5)
  assert rounds == 4 and traced and set(traced) == {1}  # blocks read, a slot per row
  np.testing.assert_array_equal(count_3, count_b)
  np.testing.assert_array_equal(tokens_3, tokens_b)
  np.testing.assert_array_equal(logp_3, logp_b)


def test_the_draws_are_keyed_by_rollout_and_token_index():
  # u[i, j] = row_uniform(key, id i, step j): a carried row continues its own stream.
  key = jax.random.key(3)
  u = np.asarray(partial.uniforms(key, np.array([7, 9], np.int32), 4))
  assert u.shape == (2, 4)
  assert u[1, 2] == np.asarray(sampling.row_uniform(key, 9, 2, 1))[0]
  assert len(set(u.reshape(-1).tolist())) == 8


def test_training_rows_never_sample_synchronously(params):
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  engine = _engine(mesh, False)
  prompts, mask = left_padded_prompts(CFG.vocab_size, PAD)
  with pytest.raises(ValueError, match="rounds"):
    engine.sample("train", params, prompts, mask, step=1)
  got = engine.sample("val", params, prompts, mask, step=1)  # validation: synchronous
  assert np.asarray(got.tokens_NxT).shape == (8, T)

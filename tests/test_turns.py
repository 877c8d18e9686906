"""turns.py: an episode's turns on a KV cache kept between them sample exactly what a
single-turn sampler samples on the episode's whole context."""

import jax
import numpy as np
import pytest

from jaxgrpo.model import decoder as model
from jaxgrpo.model import sharding
from jaxgrpo.rollout import sampling, turns
from numpy_params import left_padded_prompts, peaked_params  # tests/numpy_params.py

CFG = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64)
PAD, L, T, E, G = 0, 6, 5, 4, 2  # prompt width, max_new_tokens, appended tokens, episodes/prompt
EOS = (43, 51, 2)  # end ids the peaked model samples in about half the rows
W = L + 2 * T + E  # max_episode_tokens: room for two turns and an observation
SP = sampling.SamplingParams(1.0, 1.0, 0)


@pytest.fixture(scope="module")
def params():
  return peaked_params(CFG)


def _profiles(t=T):
  return {"train": sampling.Profile(SP, 1, t), "val": sampling.Profile(SP, 1, t)}


def _reference(mesh, width, scan_layers):
  """A single-turn engine that prefills each episode's whole context (one sample per row)."""
  return sampling.RolloutEngine(CFG, mesh, _profiles(), max_prompt_length=width, eos_id=EOS,
                                pad_id=PAD, seed=0, scan_layers=scan_layers)


@pytest.mark.parametrize("scan_layers,axes,compact,chunk", [
    (False, {"data": 1}, 0, 16), (True, {"data": 1}, 0, 2), (False, {"data": 1}, 2, 2),
    (True, {"data": 4, "tensor": 2}, 2, 16)])
def test_two_turns_on_the_cache_equal_sampling_the_whole_context(params, scan_layers, axes,
                                                                 compact, chunk, monkeypatch):
  # On 8 devices (rows over data, KV heads over tensor) too: the cache's per-row writes and
  # the donated cache keep their shardings. With compaction, the rows that end (at token
  # EOS, or inactive) leave the decode and their stages' K/V go back to their rows. Chunk 2:
  # appends of up to 3 tokens take two chunks, the second attending to the first.
  monkeypatch.setattr(turns, "APPEND_CHUNK", chunk)
  mesh = sharding.make_mesh(axes, devices=jax.devices()[:int(np.prod(list(axes.values())))])
  engine = turns.EpisodeEngine(CFG, mesh, _profiles(), max_prompt_length=L,
                               max_episode_tokens=W, max_append_tokens=E, eos_id=EOS,
                               pad_id=PAD, seed=0, scan_layers=scan_layers,
                               compact_stages=compact)
  prompts, mask = left_padded_prompts(CFG.vocab_size, PAD)  # 8 prompts, 1..6 real tokens
  n = len(prompts) * G
  contexts = [list(prompts[i // G][mask[i // G]]) for i in range(n)]
  ids = np.arange(n, dtype=np.int32) * 3 + 1  # episode ids: the draws' streams
  cache = engine.start("train", params, prompts, mask, G)
  slot = np.zeros(n, np.int32)
  new = [[c[-1]] for c in contexts]  # turn 0 appends each prompt's last token
  rng = np.random.default_rng(0)
  ended = 0
  for turn in range(2):
    active = np.ones(n, bool)
    active[3] = turn == 0  # episode 3 ended after its first turn: it samples nothing
    key = jax.random.key(turn)
    got, cache = engine.turn("train", params, cache, slot, [new[i] if active[i] else []
                                                             for i in range(n)],
                             key=key, row_ids_B=ids, active_B=active)
    tokens, mask_w = sampling.left_pad(
        np.array([[PAD] * (W - len(c)) + c for c in contexts]),
        np.array([[False] * (W - len(c)) + [True] * len(c) for c in contexts]), W, PAD)
    want = _reference(mesh, W, scan_layers).sample("train", params, tokens, mask_w, key=key,
                                                   row_ids_B=ids)
    live = np.flatnonzero(active)
    np.testing.assert_array_equal(np.asarray(got.tokens_NxT)[live],
                                  np.asarray(want.tokens_NxT)[live])
    np.testing.assert_allclose(np.asarray(got.logp_NxT)[live], np.asarray(want.logp_NxT)[live],
                               atol=2e-5)
    assert turn == 0 or np.asarray(got.lengths_N)[3] == 0
    # The next turn appends this turn's last token and an observation of 0..2 tokens.
    out, lengths = np.asarray(got.tokens_NxT), np.asarray(got.lengths_N)
    ended += int((lengths[live] < T).sum())
    for i in live:
      obs = rng.integers(3, CFG.vocab_size, rng.integers(0, 3)).tolist()
      k = int(lengths[i])
      contexts[i] = contexts[i] + out[i, :k].tolist() + obs
      slot[i] += len(new[i]) + k - 1  # the turn's tokens but its last are in the cache
      new[i] = [int(out[i, k - 1])] + obs
  assert 0 < ended < 2 * n - 1  # some turns ended at EOS, some ran to max_new_tokens
  assert engine.compilations == {"train": 1, "val": 0}
  assert engine.start_compilations == {"train": 1, "val": 0}

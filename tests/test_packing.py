"""Token-budget micro-batches (algo/packing.py): rollouts packed end to end into rows of
micro_batch_tokens tokens give the whole-batch update's loss, diagnostics and gradients, on
one device and on 8; the first-fit layout itself by hand.

The batch is test_microbatch's: 8 prompts (left-padded to 4, real lengths 2-4) x 2
completions of 1-6 tokens, so sequences are 3-10 tokens long.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.algo import packing
from jaxgrpo.rollout import sampling
from test_microbatch import G, T, _batch, _mesh, assert_update_equals_whole_batch


def test_first_fit_decreasing_by_hand():
  # Lengths 5, 3, 4, 2 into bins of 8, longest first: 5 -> bin 0 (offset 0), 4 -> bin 1
  # (0), 3 -> bin 0 (offset 5, 5 + 3 = 8 fits exactly), 2 -> bin 1 (offset 4).
  bins, offsets, used = packing.first_fit(jnp.array([5, 3, 4, 2]), 8, 4)
  np.testing.assert_array_equal(bins, [0, 0, 1, 1])
  np.testing.assert_array_equal(offsets, [0, 5, 0, 4])
  assert int(used) == 2


def test_index_map_lays_each_row_s_real_columns_end_to_end():
  # Two rows of width 6: row 0's real tokens are columns 2-5 (4 tokens), row 1's columns
  # 1-3 (3). Budget 8: row 0 -> bin 0 at 0 (flat 2..5), row 1 can't join (4 + 3 = 7 fits!)
  # -> bin 0 at offset 4 (flat 6 + 1..3 = 7, 8, 9), then one padding slot.
  index, used = packing.index_map(jnp.array([2, 1]), jnp.array([4, 3]), 6, 8, 2)
  np.testing.assert_array_equal(index, [[2, 3, 4, 5, 7, 8, 9, -1], [-1] * 8])
  assert int(used) == 1


def test_max_micro_batches_is_the_worst_case_and_refuses_a_too_small_budget():
  # 10 rows of width 6 in rows of 13 tokens: 2 whole rows a bin -> 5 bins.
  assert packing.max_micro_batches(10, 6, 13) == 5
  with pytest.raises(ValueError, match="cannot hold one sequence"):
    packing.max_micro_batches(10, 6, 5)


def test_balance_deals_rollouts_to_shards_by_tokens_by_hand():
  # Lengths 9 1 8 2 7 3 6 4 to 2 shards of 4, longest first, each to the shard with fewer
  # tokens that has room (ties to the lower shard): 9 -> s0, 8 -> s1, 7 -> s1 (8 < 9),
  # 6 -> s0 (9 < 15), 4 -> s0 (15 = 15), 3 -> s1 (15 < 19), 2 -> s1 (18 < 19; s1 is now
  # full), 1 -> s0. Shard 0 holds rollouts 0, 6, 7, 1 (9 + 6 + 4 + 1 = 20), shard 1
  # rollouts 2, 4, 5, 3 (8 + 7 + 3 + 2 = 20), in the order dealt.
  src, tokens = packing.balance(jnp.array([9, 1, 8, 2, 7, 3, 6, 4]), 2)
  np.testing.assert_array_equal(src, [0, 6, 7, 1, 2, 4, 5, 3])
  np.testing.assert_array_equal(tokens, [20, 20])
  assert float(packing.imbalance(jnp.array([3, 1]))) == 1.5  # 3 / mean 2


def test_balance_evens_out_group_correlated_lengths_the_contiguous_split_does_not():
  """Issue 63: a hard prompt's G answers are all long, so the contiguous split puts whole
  long groups on one chip. 64 prompts x 8 answers, each group's lengths around its own
  log-normal scale, to 8 shards: the dealt split is within 5% of the mean tokens."""
  rng = np.random.default_rng(0)
  scale = rng.lognormal(np.log(300), 1.0, 64)
  lengths = np.clip(rng.lognormal(np.log(np.repeat(scale, 8)), 0.3), 1, 4096).astype(np.int32)
  contiguous = lengths.reshape(8, -1).sum(axis=1)
  src, tokens = packing.balance(jnp.asarray(lengths), 8)
  assert sorted(np.asarray(src).tolist()) == list(range(512))  # a permutation
  np.testing.assert_array_equal(tokens, lengths[np.asarray(src)].reshape(8, -1).sum(axis=1))
  assert float(packing.imbalance(jnp.asarray(contiguous))) > 1.2
  assert float(packing.imbalance(tokens)) <= 1.05


CASES = {
    # name: (mesh, loss overrides, sampling params, updates on one batch)
    # token_mean: the mesh case below.
    # With an episode's observation tokens (trained_mask): attended to, out of the loss.
    "seq_mean_beta_masked_episode": (
        {"data": 1}, dict(micro_batch_tokens=24, loss_agg="seq_mean_token_mean", beta=0.1,
                          mask_truncated_completions=True, trained_mask=True),
        sampling.SamplingParams(0.8, 1.0, 0), 2),
    "sum_norm_topk_beta_chunked_remat": (
        {"data": 1}, dict(micro_batch_tokens=10, loss_agg="seq_mean_token_sum_norm", beta=0.1,
                          kl_type="k1", mask_truncated_completions=True,
                          logprob_chunk_size=4, remat="full", scale_rewards="batch"),
        sampling.SamplingParams(1.0, 0.9, 5), 1),
    # 8 devices, fsdp 2 x context 2 x tensor 2: each packed row's 14 positions split over a
    # context pair (context parallelism), the weights over fsdp, heads over tensor.
    "mesh_fsdp_context_tensor_token_mean_beta": (
        {"fsdp": 2, "context": 2, "tensor": 2}, dict(micro_batch_tokens=14, beta=0.05),
        sampling.SamplingParams(1.0, 1.0, 0), 1),
    # 8 data shards of 2 rollouts each, dealt by tokens across the chips before each packs.
    "mesh_data4_fsdp2_dealt": (
        {"data": 4, "fsdp": 2}, dict(micro_batch_tokens=20), sampling.SamplingParams(1.0, 1.0, 0),
        1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_update_equals_whole_batch_update(name):
  mesh_shape, overrides, sp, iterations = CASES[name]
  mesh = _mesh(mesh_shape)
  aux = assert_update_equals_whole_batch(mesh, overrides, sp, iterations)[0]
  # The padding fractions: of the packed rows the loop ran (micro-batches x devices x the
  # budget), and of the padded layout (each prompt's 4 columns once a group, 6 a completion).
  b = _batch()
  real_padded = b["prompt_mask_BxL"].sum() + b["completion_mask_NxT"].sum()
  real_packed = G * b["prompt_mask_BxL"].sum() + b["completion_mask_NxT"].sum()
  shards = int(np.prod([v for k, v in mesh.shape.items() if k in ("data", "fsdp")]))
  computed = aux["packed_micro_batches"] * shards * overrides["micro_batch_tokens"]
  np.testing.assert_allclose(aux["padding_fraction_packed"], 1 - real_packed / computed,
                             rtol=1e-5)
  np.testing.assert_allclose(aux["padding_fraction_padded"],
                             1 - real_padded / (8 * 4 + 16 * T), rtol=1e-5)

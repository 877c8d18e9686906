"""Token-budget micro-batches: the update's rollouts packed into rows of a fixed number of
tokens (`grpo.micro_batch_tokens`), instead of micro-batches of rows each padded to the
longest completion.

With long-tailed lengths (long reasoning: most completions a few thousand tokens, a few at
the 16k-32k cap) a padded micro-batch computes mostly padding. Here each rollout is one
sequence [its prompt's real tokens | its completion's real tokens], and the sequences are
laid end to end in packed rows of S = micro_batch_tokens tokens, one packed row per device
per micro-batch (S is a per-chip budget, as verl's `ppo_max_token_len_per_gpu`). A sequence
is never split. Attention stays within a sequence through segment ids (model.Decoder.
score_packed: the xla path's mask, splash attention's SegmentIds), and positions restart at
0 with each sequence, so a packed token sees exactly what it saw in its padded row.

Static shapes, one compile: the packing is computed on device inside the update (first-fit
decreasing over each device's rows, a `lax.scan` of a few hundred steps), into an index map
[P, K_max, S] (P devices over the data axes, K_max the micro-batches the longest possible
rollouts would need). The update then loops over the micro-batches actually used (a
`lax.while_loop` whose trip count is the largest count over the devices), gathering one
micro-batch at a time from the padded batch, so its time follows the real tokens while
every shape stays the configured one.

Balanced across chips (issue 63): every device runs the loop as long as the fullest one
needs, so the rollouts are first dealt to the data shards by tokens (`balance`: longest
first, each to the shard with the fewest tokens that still has room; each shard gets N / P
rollouts, static shapes), and only then does each device first-fit its own. GRPO's lengths
are correlated within a group (a hard prompt's G answers are all long), so the contiguous
split the batch sharding gives puts whole long groups on one chip: on the grouped
long-tailed shape at 8 chips the fullest ran 1.37x the mean micro-batches (`python -m
jaxgrpo.bench packing --lengths grouped --chips 8`). Single rollouts move, not groups:
advantages, weights and the mask come from the whole batch before packing, so a rollout
needs nothing of its group's, and the finer grain balances better. The loss is a sum over
tokens, so where a rollout is computed changes nothing but float summation order. The
deal moves each rollout's row between chips once per update (a gather of [N, L + T]
tokens and the per-token values), small beside the forward and backward over them.
`pack` builds the layout and the micro-batches from the update's rows; grpo.packed_loss
runs the loss over them.

Prompts are computed once per rollout here (once per group in the padded layout): a
reasoning prompt is short beside its completions.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgrpo.model import sharding as sharding_lib


def max_micro_batches(rows_per_device: int, sequence: int, budget: int) -> int:
  """K_max: the micro-batches a device needs at most when every rollout has the longest
  possible sequence (prompt width + completion width). First fit never needs more: a bin
  is opened only when the next sequence fits in none, i.e. every open bin holds more than
  budget - sequence tokens, so at least budget // sequence sequences."""
  per_bin = budget // sequence
  if per_bin < 1:
    raise ValueError(f"a packed row of {budget} tokens cannot hold one sequence of "
                     f"{sequence} tokens")
  return -(-rows_per_device // per_bin)


def first_fit(lengths_R, budget: int, num_bins: int):
  """First-fit decreasing of R lengths (each <= budget) into bins of `budget` tokens.

  Returns (bin_R, offset_R, bins_used): where each sequence starts. jnp, traceable: one
  scan step per sequence, longest first, each placed in the first bin with room.
  """
  order_R = jnp.argsort(-lengths_R, stable=True)

  def place(free_K, i):
    length = lengths_R[i]
    fits_K = free_K >= length
    b = jnp.argmax(fits_K)  # the first bin with room (K_max bins always suffice)
    offset = budget - free_K[b]
    return free_K.at[b].add(-length), (b, offset)

  free_K, (bins, offsets) = jax.lax.scan(place, jnp.full((num_bins,), budget, jnp.int32),
                                         order_R)
  bin_R = jnp.zeros_like(bins).at[order_R].set(bins)
  offset_R = jnp.zeros_like(offsets).at[order_R].set(offsets)
  used = jnp.sum(free_K < budget).astype(jnp.int32)
  return bin_R, offset_R, used


def index_map(start_R, lengths_R, width: int, budget: int, num_bins: int):
  """The packed layout of one device's R rows, each a padded row of `width` columns whose
  real tokens are columns [start, start + length): [K, S] of flat indices r * width + col
  into those rows, -1 where a packed row is padding. Returns (index_KxS, bins_used)."""
  bin_R, offset_R, used = first_fit(lengths_R, budget, num_bins)
  r = lengths_R.shape[0]
  j_W = jnp.arange(width, dtype=jnp.int32)
  real_RxW = j_W[None] < lengths_R[:, None]
  slot_RxW = bin_R[:, None] * budget + offset_R[:, None] + j_W[None]
  source_RxW = jnp.arange(r, dtype=jnp.int32)[:, None] * width + start_R[:, None] + j_W[None]
  # Padding columns scatter out of bounds, and are dropped.
  slot_RxW = jnp.where(real_RxW, slot_RxW, num_bins * budget)
  flat = jnp.full((num_bins * budget,), -1, jnp.int32).at[slot_RxW.reshape(-1)].set(
      source_RxW.reshape(-1), mode="drop")
  return flat.reshape(num_bins, budget), used


def balance(lengths_N, shards: int):
  """The rollouts dealt to `shards` data shards by tokens: (src_N, tokens_P) where position
  i of the dealt batch holds rollout src_N[i] (positions [s R, (s + 1) R) are shard s's,
  R = N / shards) and tokens_P the tokens each shard got. Longest first, each to the
  shard with the fewest tokens among those with fewer than R (greedy LPT with equal
  counts: within max_length of the mean, so within a few % at real batch sizes). jnp,
  traceable: one scan step per rollout."""
  n = lengths_N.shape[0]
  per = n // shards
  order_N = jnp.argsort(-lengths_N, stable=True)
  full = jnp.iinfo(jnp.int32).max

  def place(state, i):
    tokens_P, count_P = state
    s = jnp.argmin(jnp.where(count_P < per, tokens_P, full))
    return ((tokens_P.at[s].add(lengths_N[i]), count_P.at[s].add(1)),
            s * per + count_P[s])

  zeros = jnp.zeros((shards,), jnp.int32)
  (tokens_P, _), position_N = jax.lax.scan(place, (zeros, zeros), order_N)
  return jnp.zeros((n,), jnp.int32).at[position_N].set(order_N.astype(jnp.int32)), tokens_P


def imbalance(per_chip_P):
  """max / mean over the chips: how much longer the fullest runs than an even split."""
  per_chip_P = per_chip_P.astype(jnp.float32)
  return jnp.max(per_chip_P) / jnp.maximum(jnp.mean(per_chip_P), 1e-9)


def padding_fraction(real_tokens, computed_tokens):
  """1 - real / computed: the share of computed positions that hold no token."""
  return 1.0 - real_tokens / jnp.maximum(computed_tokens, 1)


class Packed(NamedTuple):
  """A batch's packed layout (`pack`): micro_batch(k) builds the k-th packed micro-batch
  ([P, S] arrays, one packed row a data shard) for k < count; metrics are the update's
  padding_fraction_padded, padding_fraction_packed, packed_micro_batches and
  packed_chip_imbalance (max / mean of the micro-batches the chips' rows need)."""

  micro_batch: Callable
  count: jax.Array
  metrics: dict
  limit: int  # the most micro-batches count can be (the bins packed into), static


def pack(rows, group_size: int, budget: int, shards: int, mesh=None) -> Packed:
  """The packed layout of the update's rows (grpo._prepare_rows': prompt_tokens_BxL,
  prompt_mask_BxL, completion_tokens_NxT, completion_mask_NxT, and the per-token
  old_logp_NxT, weights_NxT, mask_NxT and per-row advantages_N), the rollouts dealt to
  `shards` data shards by tokens (`balance`), each shard packed on its own.

  A packed micro-batch holds tokens_RxS, positions_RxS (restarting at 0 per sequence),
  segments_RxS (the row's index + 1 on its device; 0 padding), targets_RxS (the token each
  position predicts: the next one of its sequence) and, at each position, the loss's
  values for that target: old_logp_RxS, weights_RxS, mask_RxS (False where a position
  predicts no completion token) and advantages_RxS. mesh: its packed rows split over the
  data axes and their positions over `context`.
  """
  prompt_BxL, prompt_mask_BxL = rows["prompt_tokens_BxL"], rows["prompt_mask_BxL"]
  completion_NxT, completion_mask_NxT = rows["completion_tokens_NxT"], rows["completion_mask_NxT"]
  (n, t), l = completion_NxT.shape, prompt_BxL.shape[1]
  width, per_device = l + t, n // shards
  num_bins = max_micro_batches(per_device, width, budget)
  prompt_len_N = jnp.repeat(prompt_mask_BxL.sum(axis=1).astype(jnp.int32), group_size)
  length_N = prompt_len_N + completion_mask_NxT.sum(axis=1).astype(jnp.int32)
  # Each rollout as one padded row [its prompt (left-padded) | its completion]; its real
  # tokens are the columns [l - prompt length, l + completion length).
  full_NxU = jnp.concatenate([jnp.repeat(prompt_BxL, group_size, axis=0), completion_NxT],
                             axis=1)
  per_rollout = dict(full=full_NxU, completion=completion_NxT, start=l - prompt_len_N,
                     length=length_N, advantages=rows["advantages_N"],
                     **{k: rows[k] for k in ("old_logp_NxT", "weights_NxT", "mask_NxT")})
  if shards > 1:  # dealt by tokens, so no chip waits for one that got the long groups
    src_N, _ = balance(length_N, shards)
    per_rollout = jax.tree.map(lambda x: jnp.take(x, src_N, axis=0), per_rollout)
  local = jax.tree.map(lambda x: x.reshape(shards, per_device, *x.shape[1:]), per_rollout)
  index_PxKxS, used_P = jax.vmap(lambda s, n_: index_map(s, n_, width, budget, num_bins))(
      local["start"], local["length"])

  def gather(index_S, d):
    """One device's packed row from its rows d."""
    real = index_S >= 0
    i = jnp.maximum(index_S, 0)
    r, col = i // width, i % width
    target = col + 1 - l  # the completion position this position predicts
    predicts = real & (target >= 0) & (target < t)
    tc = jnp.clip(target, 0, t - 1)
    return {"tokens_RxS": d["full"][r, col], "positions_RxS": col - d["start"][r],
            "segments_RxS": jnp.where(real, r + 1, 0), "targets_RxS": d["completion"][r, tc],
            "old_logp_RxS": d["old_logp_NxT"][r, tc],
            "weights_RxS": jnp.where(predicts, d["weights_NxT"][r, tc], 0.0),
            "mask_RxS": predicts & d["mask_NxT"][r, tc],
            "advantages_RxS": d["advantages"][r]}

  def micro_batch(k):
    m = jax.vmap(gather)(index_PxKxS[:, k], local)
    if mesh is not None:  # one packed row a data shard, its positions over `context`
      split = NamedSharding(mesh, P(sharding_lib.BATCH_AXES, "context"))
      m = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, split), m)
    return m

  count = jnp.max(used_P)  # the fullest device's: every device runs the same loop
  real_padded = (prompt_mask_BxL.sum() + completion_mask_NxT.sum()).astype(jnp.float32)
  metrics = {
      "padding_fraction_padded": padding_fraction(real_padded, n // group_size * l + n * t),
      "padding_fraction_packed": padding_fraction(length_N.sum().astype(jnp.float32),
                                                  count * shards * budget),
      "packed_micro_batches": count, "packed_chip_imbalance": imbalance(used_P)}
  return Packed(micro_batch, count, metrics, num_bins)

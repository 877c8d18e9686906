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

Each device packs its own rows (the rows the batch sharding gave it): no rollout moves
between chips; the loop runs as long as the fullest device needs.

Prompts are computed once per rollout here (once per group in the padded layout): a
reasoning prompt is short beside its completions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def padding_fraction(real_tokens, computed_tokens):
  """1 - real / computed: the share of computed positions that hold no token."""
  return 1.0 - real_tokens / jnp.maximum(computed_tokens, 1)

"""Gradient accumulation inside one compiled update: micro-batches of whole groups, one
optimizer step, and exactly the whole batch's gradient.

A rollout batch of N rows is cut into K = N / M micro-batches of M rows (`micro_batch_size`).
Only one micro-batch's activations are alive at a time: a `lax.scan` runs the forward and
backward pass of each and sums the gradients. Exactness is the caller's part: the loss of a
micro-batch must be its share of the whole batch's loss, i.e. every normaliser (token
counts, row counts, advantages) is computed on the whole batch before the split
(grpo.token_weights), so that the micro-batches' losses and gradients add up to the whole
batch's. A micro-batch holds whole groups on each device (a group's prompt computed once
for its G completions), or, when a device's share of it is fewer rows than a group (long
completions: issue 51), sub-groups: a divisor G' of G completions of one prompt, the
prompt computed once per sub-group (its tokens repeated G / G' times; a prompt is short
beside its completions), so a step at 16k tokens can hold 4 rows a chip instead of 8.
The sub-groups give the same loss and gradients (tested): the advantages and every
normaliser come from the whole groups first.

Layout: the rows of a batch are split over the data axes in contiguous blocks. Micro-batch
k takes the k-th slice of every device's block, so every device computes its share of
every micro-batch (contiguous micro-batches would leave most devices idle).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.runtime import config_checks


def split(tree, num_micro: int, shards: int, mesh=None):
  """Every [R, ...] leaf -> [K, R / K, ...]: micro-batch k = the k-th slice of each of the
  `shards` row blocks (R must divide by shards * K). With a mesh, each micro-batch's rows
  stay split over the data axes."""

  def one(x):
    rows = x.shape[0]
    local = rows // (shards * num_micro)
    y = x.reshape(shards, num_micro, local, *x.shape[1:]).swapaxes(0, 1)
    y = y.reshape(num_micro, shards * local, *x.shape[1:])
    if mesh is not None:
      spec = P(None, sharding_lib.BATCH_AXES, *([None] * (x.ndim - 1)))
      y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))
    return y

  return jax.tree.map(one, tree)


def accumulate(loss_fn: Callable, params, micro_batches, grad_shardings=None):
  """Σ_k of loss_fn(params, micro_batch_k) -> (loss, sums) and of its gradient, one
  micro-batch at a time (`lax.scan`). loss_fn returns (loss, a dict of scalar sums).

  Gradients are summed in float32 and returned in the parameters' dtype. grad_shardings
  (the parameters' shardings, a tree like params): the running sum is kept split like the
  parameters, as FSDP means it to be.
  """
  first = jax.tree.map(lambda x: x[0], micro_batches)
  zeros, add = _summation(loss_fn, params, first, grad_shardings)
  (loss, sums, grads), _ = jax.lax.scan(lambda carry, m: (add(carry, m), None), zeros,
                                        micro_batches)
  return (loss, sums), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def accumulate_dynamic(loss_fn: Callable, params, micro_batch: Callable, count, limit: int,
                       grad_shardings=None):
  """`accumulate` over micro_batch(k) for k < count, a traced scalar (packed micro-batches:
  algo/packing.py): a while loop, so the time follows the micro-batches used while every
  shape stays static. micro_batch(k) builds the k-th micro-batch inside the loop. limit:
  the most micro-batches count can be; the loop's condition states it too (the same loop),
  so the compiled program carries its bound (runtime/tpu_cost reads it)."""
  zeros, add = _summation(loss_fn, params, jax.eval_shape(micro_batch, 0), grad_shardings)
  _, (loss, sums, grads) = jax.lax.while_loop(
      lambda c: (c[0] < count) & (c[0] < limit),
      lambda c: (c[0] + 1, add(c[1], micro_batch(c[0]))), (jnp.int32(0), zeros))
  return (loss, sums), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def _summation(loss_fn: Callable, params, micro_shape, grad_shardings):
  """(zero sums, carry + one micro-batch's loss, sums and float32 gradient)."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  sums_shape = jax.eval_shape(lambda p, b: loss_fn(p, b)[1], params, micro_shape)
  split = ((lambda tree: tree) if grad_shardings is None else
           (lambda tree: jax.lax.with_sharding_constraint(tree, grad_shardings)))
  zeros = (jnp.zeros((), jnp.float32),
           jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums_shape),
           split(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)))

  def add(carry, micro):
    # Tied to this micro-batch, the parameters are no longer loop-invariant, so XLA cannot
    # hoist work on them (FSDP's all-gathers) out of the loop and hold its results for the
    # whole scan. Measured on 8 CPU devices, fsdp=8, a 4-layer d_model 1024 model with few
    # tokens: 1,456 -> 1,130 MiB of temporaries (the whole batch: 644; the rest is open).
    p, micro = jax.lax.optimization_barrier((params, micro))
    (loss, sums), grads = grad_fn(p, micro)
    plus = lambda a, b: a + b.astype(jnp.float32)
    return (plus(carry[0], loss), jax.tree.map(plus, carry[1], sums),
            split(jax.tree.map(plus, carry[2], split(grads))))

  return zeros, add


def subgroup(micro_batch_size: int, group: int, shards: int) -> int:
  """G' of the module doc: the completions of one prompt a micro-batch computes together,
  G when each device holds whole groups (or the whole batch: 0)."""
  if not micro_batch_size:
    return group
  per_device = micro_batch_size // shards
  return group if per_device % group == 0 else per_device


def valid_sizes(group: int, shards: int, batch: int) -> list[int]:
  """Every valid micro_batch_size, smallest first: on each device whole groups, or one
  sub-group (a divisor of G), dividing the batch."""
  per_device = [d for d in range(1, group) if group % d == 0] + list(
      range(group, batch // shards + 1, group))
  return [p * shards for p in per_device if batch % (p * shards) == 0]


def _check_micro_batch(g, rows: int):
  """A micro-batch divides the batch and holds, on each device, whole groups or one
  sub-group of a divisor of G completions (module doc)."""
  m, gen = g.micro_batch_size, g.num_generations_per_prompt
  if m == "auto":  # chosen at start-up among the sizes this rule allows (run/sizing.py)
    return
  if not m:
    return
  batch = g.num_prompts_per_step * gen
  sizes = valid_sizes(gen, rows, batch)
  if m not in sizes:
    config_checks.fail("grpo.micro_batch_size", m, f"one of {sizes} (mesh data x fsdp x expert={rows} "
          f"devices each holding whole groups of num_generations_per_prompt={gen}, or one "
          f"sub-group of a divisor of {gen}; dividing the batch's {batch} rollouts), or 0")


@config_checks.register(order=15)
def _check_context_needs_packing(c, num_devices: int) -> None:
  """Before the mesh is resolved (order 20): a context axis without packing is refused for
  what it lacks, not for the devices it would need (mesh.context=2 on one device)."""
  del num_devices
  context = c.mesh.context
  if context > 1 and not c.grpo.micro_batch_tokens:
    config_checks.fail("mesh.context", context, "1 unless grpo.micro_batch_tokens is set "
                       "(context parallelism splits the update's packed rows; docs/scaling.md)")


def _check_micro_batch_tokens(c):
  """Packed micro-batches (algo/packing.py): a budget that holds the longest sequence,
  instead of (not beside) micro-batches of rows; context parallelism splits packed rows."""
  g, context = c.grpo, c.mesh.context
  if not g.micro_batch_tokens:
    return
  if g.router_aux_loss_coef:
    config_checks.fail("grpo.router_aux_loss_coef", g.router_aux_loss_coef, "0, or "
                       "grpo.micro_batch_tokens=0", reason="not built with packed "
                       f"micro-batches (grpo.micro_batch_tokens={g.micro_batch_tokens})")
  if g.micro_batch_size not in (0, "auto"):
    config_checks.fail("grpo.micro_batch_size", g.micro_batch_size,
                       f"0 or 'auto' while grpo.micro_batch_tokens={g.micro_batch_tokens} packs "
                       "the micro-batches by tokens (set one of the two)")
  if g.micro_batch_tokens == "auto":
    return
  width = sequence_width(c)
  if g.micro_batch_tokens < width:
    config_checks.fail("grpo.micro_batch_tokens", g.micro_batch_tokens,
                       f"0, 'auto' or at least {width}, the longest sequence (a prompt of "
                       "data.max_prompt_length and its completion; a sequence is never split)")
  if g.micro_batch_tokens % context:
    config_checks.fail("grpo.micro_batch_tokens", g.micro_batch_tokens,
                       f"a multiple of mesh.context={context} (each chip of a context group "
                       "holds an equal share of a packed row)")


def sequence_width(c) -> int:
  """The longest rollout sequence the update sees, prompt and completion (or episode)."""
  if c.env.name:
    return c.generation.max_episode_tokens
  return c.data.max_prompt_length + c.generation.max_new_tokens


@config_checks.register(order=21)
def _check_config(c, num_devices: int) -> None:
  del num_devices
  m = c.mesh  # resolved by the mesh check (model/sharding.py)
  _check_micro_batch(c.grpo, sharding_lib.data_parallel_rows(m))
  _check_micro_batch_tokens(c)

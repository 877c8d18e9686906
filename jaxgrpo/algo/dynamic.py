"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): groups whose rewards are all equal
teach nothing, so the update gets the informative ones.

With `grpo.dynamic_sampling='filter'` a step samples generation batches of
`generation_prompts` prompts (ceil(oversample_factor x B), rounded up to a multiple of the
data-parallel devices, so the sampler is compiled once at that size), scores them, and keeps
the groups whose rewards are not all equal, by the same bitwise rule as the advantages'
flat-group test (`grpo.flat_groups`, over the rows some reward scored), on the total reward
or on one reward (`grpo.dynamic_sampling_metric`). While fewer than B groups are kept it
samples another generation batch, up to `grpo.max_generation_batches`. The update sees
exactly B groups: the first B kept, in data order (generation batch, then row). If the
batches run out, the first groups that were not kept fill the rest (flat groups: advantage
0), and the step's `dynamic_sampling/filled_flat_groups` says how many.

Deviation from DAPO: DAPO keeps sampling without a bound; a bound keeps a step's cost
bounded (verl's max_num_gen_batches, NeMo-RL's dynamic_sampling_max_gen_batches), and the
fill keeps the update's shape static, which a TPU needs.

Every process chooses from every process's rows (gathered), so the choice is the same on
every host and does not depend on how many there are. The rules are here, as pure functions
of the rewards; run/rollouts.py's DynamicSampling samples the generation batches.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from jaxgrpo.algo import grpo
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.runtime import config_checks


def generation_prompts(num_prompts: int, oversample_factor: float, multiple: int) -> int:
  """Prompts per generation batch: ceil(oversample_factor x B), rounded up to `multiple`
  (mesh data x fsdp x expert: the prompts split evenly over the data-parallel devices)."""
  wanted = math.ceil(oversample_factor * num_prompts - 1e-9)
  return max(multiple, math.ceil(wanted / multiple) * multiple)


def batch_prompts(config) -> int:
  """Prompts per sampled batch of a validated run config: num_prompts_per_step, or with
  dynamic sampling a generation batch."""
  g, m = config.grpo, config.mesh
  if g.dynamic_sampling == "off":
    return g.num_prompts_per_step
  return generation_prompts(g.num_prompts_per_step, g.oversample_factor,
                            sharding_lib.data_parallel_rows(m))


def informative(values_N, scored_N, group_size: int) -> np.ndarray:
  """True for each group whose scored values are not all equal (bitwise)."""
  values_BxG = np.asarray(values_N, np.float32).reshape(-1, group_size)
  scored_BxG = np.asarray(scored_N, bool).reshape(-1, group_size)
  return ~grpo.flat_groups(values_BxG, scored_BxG)


def choose(informative_per_batch: Sequence[np.ndarray], num_groups: int):
  """(indices of the chosen groups in the generation batches' concatenated groups, in data
  order; how many of them are fills): the first `num_groups` informative groups, then, if
  too few, the first groups that were not informative."""
  flags = np.concatenate([np.asarray(f, bool) for f in informative_per_batch])
  kept = np.flatnonzero(flags)[:num_groups]
  fill = np.flatnonzero(~flags)[:num_groups - len(kept)]
  if len(kept) + len(fill) < num_groups:
    raise ValueError(f"{len(flags)} groups sampled, fewer than the {num_groups} the update needs")
  return np.sort(np.concatenate([kept, fill])), len(fill)


@config_checks.register(order=35)
def _check_config(c, num_devices: int) -> None:
  """grpo.dynamic_sampling's keys: a metric that names an active reward, and the native
  sampler (it draws each generation batch with its own key)."""
  del num_devices
  g = c.grpo
  if g.dynamic_sampling == "off":
    return
  active = sorted(k for k, w in c.rewards.items() if w > 0)
  if g.dynamic_sampling_metric is not None and g.dynamic_sampling_metric not in active:
    config_checks.fail("grpo.dynamic_sampling_metric", g.dynamic_sampling_metric,
          f"None (the total reward) or a reward with a weight > 0: {', '.join(active)}")
  if c.generation.backend != "native":
    config_checks.fail("grpo.dynamic_sampling", g.dynamic_sampling,
          f"'off' with generation.backend={c.generation.backend!r} (only the native "
          "sampler draws generation batches of their own)")

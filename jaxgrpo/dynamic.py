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
every host and does not depend on how many there are.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import jax
import numpy as np

from jaxgrpo import grpo, scorer
from jaxgrpo.runtime import distributed
from jaxgrpo.model import sharding as sharding_lib


def generation_prompts(num_prompts: int, oversample_factor: float, multiple: int) -> int:
  """Prompts per generation batch: ceil(oversample_factor x B), rounded up to `multiple`
  (mesh data x fsdp: the prompts split evenly over the data-parallel devices)."""
  wanted = math.ceil(oversample_factor * num_prompts - 1e-9)
  return max(multiple, math.ceil(wanted / multiple) * multiple)


def batch_prompts(config) -> int:
  """Prompts per sampled batch of a validated run config: num_prompts_per_step, or with
  dynamic sampling a generation batch."""
  g, m = config.grpo, config.mesh
  if g.dynamic_sampling == "off":
    return g.num_prompts_per_step
  return generation_prompts(g.num_prompts_per_step, g.oversample_factor,
                            m.data * m.dcn_data * m.fsdp)


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


def sample_step(setup, engine, params, batch, step, consumed):
  """One training step's generation batches, until B informative groups are kept.

  Returns this process's rows of the chosen B groups as trainer.train_step uses them: (prompt
  arrays, completion arrays (tokens, mask, old log-probs, truncated), lengths, truncated,
  their Scores, rollout seconds, reward seconds, tokens generated over every batch, the
  dynamic_sampling/ metrics). Every process's rows are gathered, so every host chooses the
  same groups; each then keeps its own slice of them (rows p*B/P.. of the global batch).
  """
  gc = setup.config.grpo
  g, num = gc.num_generations_per_prompt, gc.num_prompts_per_step
  metric = gc.dynamic_sampling_metric
  parts, flags, t_rollout, t_reward, generated = [], [], 0.0, 0.0, 0
  for j in range(gc.max_generation_batches):
    if j:
      batch = next(setup.train_batches)
    ids, = distributed.gather_rows(batch["row_ids_B"])
    if consumed is not None:
      consumed.append(ids)
    t0 = time.perf_counter()
    # One key per (step, generation batch), folded from the step's own.
    rollout = engine.sample("train", params, batch["prompt_tokens_BxL"],
                            batch["prompt_mask_BxL"],
                            key=jax.random.fold_in(engine.key("train", step), j))
    local = sharding_lib.to_local((rollout.tokens_NxT, rollout.mask_NxT, rollout.logp_NxT,
                                   rollout.lengths_N, rollout.truncated_N))
    t_rollout += time.perf_counter() - t0
    t1 = time.perf_counter()
    scores = setup.scorer(local[0], local[3], batch, g, label=f"step {step}")
    t_reward += time.perf_counter() - t1
    values = scores.total_N if metric is None else scores.breakdown[metric]
    judged = scores.scored_N if metric is None else ~np.isnan(values)
    values_all, judged_all, lengths_all = distributed.gather_rows(values, judged, local[3])
    generated += int(lengths_all.sum())
    flags.append(informative(values_all, judged_all, g))
    parts.append((batch, local, scores))
    if sum(int(f.sum()) for f in flags) >= num:
      break
  chosen, filled = choose(flags, num)
  # Every row of every part, gathered (the global batch order), then the chosen groups.
  names = sorted(parts[0][2].breakdown)
  extras = distributed.union_keys({k for _, _, s in parts for k in s.extras})

  def rows(get):
    return np.concatenate([distributed.gather_rows(np.asarray(get(p)))[0] for p in parts])

  nan = lambda s: np.full(len(s.total_N), np.nan, np.float32)
  group_rows = (chosen[:, None] * g + np.arange(g)).reshape(-1)
  mine = slice(jax.process_index() * num // jax.process_count() * g,
               (jax.process_index() + 1) * num // jax.process_count() * g)
  pick = lambda get: rows(get)[group_rows][mine]  # completion rows (N = B x G)
  mine_prompts = slice(mine.start // g, mine.stop // g)
  prompt = tuple(rows(lambda p, k=k: p[0][k])[chosen][mine_prompts]
                 for k in ("prompt_tokens_BxL", "prompt_mask_BxL"))
  completion = tuple(pick(lambda p, i=i: p[1][i]) for i in (0, 1, 2, 4))
  lengths_N, truncated_N = pick(lambda p: p[1][3]), completion[3]
  scores = scorer.Scores(
      completions=[], total_N=pick(lambda p: p[2].total_N), scored_N=pick(lambda p: p[2].scored_N),
      breakdown={k: pick(lambda p, k=k: p[2].breakdown[k]) for k in names},
      extras={k: pick(lambda p, k=k: p[2].extras.get(k, nan(p[2]))) for k in extras},
      errors={k: pick(lambda p, k=k: p[2].errors[k]) for k in names},
      validation_N=pick(lambda p: p[2].validation_N), correct_N=pick(lambda p: p[2].correct_N),
      answers=None)
  sampled = sum(len(f) for f in flags)
  ds = {"dynamic_sampling/generation_batches": len(parts),
        "dynamic_sampling/kept_groups_fraction": float(sum(f.sum() for f in flags) / sampled),
        "dynamic_sampling/filled_flat_groups": int(filled)}
  return (prompt, completion, lengths_N, truncated_N, scores, t_rollout, t_reward, generated,
          ds)

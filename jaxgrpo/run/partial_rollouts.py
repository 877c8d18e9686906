"""Partial rollouts (generation.max_tokens_per_step > 0): the host's side of the rounds.

A training step collects from `PartialRollouts` as from any rollout source (rollouts.py),
but its rollouts outlive the step. This process keeps a pool of groups in flight (the G
rollouts of a prompt; each member pending, live in a sampler row, or done) and runs rounds
(rollout/partial.py) until every process holds at least B/P complete groups:

  pull     a prompt batch enters the pool (all its G x B/P rollouts pending) while every
           process has room for one and some process has more free sampler rows than
           pending rollouts; the processes pull together, so the data order stays global;
  admit    a group whose members cannot all finish within grpo.max_staleness versions
           (a member takes up to R = ceil(max_new_tokens / budget) rounds, so up to R - 1
           versions, and may wait for a free row) starts none of its pending members: it
           is re-queued (AReaL's rule that nothing drawn is thrown away, by admission);
  refill   pending rollouts take the free sampler rows, oldest group first;
  round    each live row draws at most max_tokens_per_step tokens (one compiled program);
  harvest  the rows that ended free up; each drawn token is stamped with the parameter
           version that drew it (the step's, minus one: updates so far);
  requeue  a group with a token older than grpo.max_staleness versions (one that waited
           for the update, say) is re-queued whole: its members freed and pending again,
           its prompt sampled afresh, first in line (it keeps its group id); nothing is
           lost, so the prompts that draw long answers are trained as often as the rest.
           Counted per step: rollout/requeued_groups (and dropped_stale_fraction, the
           share of the step's finished-or-requeued rollouts that were requeued). Below
           the bound (max_staleness < R - 1, warned at start-up) a group is dropped
           instead, as it could never be admitted: rollout/dropped_groups.

The step's update trains the B/P complete groups that entered first (a fixed number: the
update's shapes never change); complete groups beyond them wait for the next step (the
carry-over queue), as do the rows still decoding (rollout/carried_rows). Rollout ids (the
draws' keys) are global: group id = batches pulled x B + the prompt's global index, id =
group id x G + g, so a resumed run and every process agree on them.

Everything here is fixed-size numpy (`arrays`), so a checkpoint holds it exactly beside
the device State (the sampler rows' caches): a resume continues every carried row.
"""

from __future__ import annotations

import time
import warnings

import jax
import numpy as np

from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.run.rollouts import Collected, Source
from jaxgrpo.runtime import config_checks, distributed

PENDING, LIVE, DONE = 0, 1, 2
# The pool holds this many prompt batches' groups: the one decoding, the complete ones
# waiting, one more that entered to keep freed rows busy.
POOL_BATCHES = 3


def rounds_at_cap(gen) -> int:
  """R: the rounds (so, a step running at least one, the steps) a rollout at the length
  cap takes; max_staleness >= R - 1 is the bound at which no group need be dropped."""
  return -(-gen.max_new_tokens // gen.max_tokens_per_step)


def _min_all(x: int) -> int:
  return int(distributed.gather_rows(np.array([x]))[0].min())


def _max_all(x: int) -> int:
  return int(distributed.gather_rows(np.array([x]))[0].max())


def empty_arrays(groups: int, g: int, t: int, rows: int) -> dict[str, np.ndarray]:
  """An empty pool of `groups` groups of g rollouts of up to t tokens, and `rows` free
  sampler rows (this process's). The checkpointed form of the host state."""
  return {"group_id_S": np.full(groups, -1, np.int32), "row_id_S": np.zeros(groups, np.int32),
          "status_SxG": np.zeros((groups, g), np.int8),
          "tokens_SxGxT": np.zeros((groups, g, t), np.int32),
          "logp_SxGxT": np.zeros((groups, g, t), np.float32),
          "version_SxGxT": np.zeros((groups, g, t), np.int32),
          "length_SxG": np.zeros((groups, g), np.int32),
          "stopped_SxG": np.zeros((groups, g), bool),
          # member index s * G + g each sampler row decodes, -1 free
          "holder_N": np.full(rows, -1, np.int32),
          # how many prompt batches were pulled (the same on every process)
          "pulled_1": np.zeros(1, np.int64)}


class PartialRollouts(Source):
  """The training rollout source of partial rollouts (module docstring)."""

  pulls_batches = True  # the trainer hands it no batch: it pulls its own

  def __init__(self, config, engine, scorer, batches):
    gen, g = config.generation, config.grpo
    self.engine, self.scorer, self.batches = engine, scorer, batches
    self.budget = gen.max_tokens_per_step
    self.max_staleness = g.max_staleness
    # Versions a member may wait for a row and still finish in time (R rounds span up to
    # R - 1 versions: a step runs at least one round); negative: below the bound.
    self.slack = g.max_staleness - (rounds_at_cap(gen) - 1)
    self.g = g.num_generations_per_prompt
    self.b_global = g.num_prompts_per_step
    self.b = batches.local_batch_size
    self.t = gen.max_new_tokens
    self.a = empty_arrays(POOL_BATCHES * self.b, self.g, self.t, engine.rows)
    self.state = None  # the device State, made at the first round (or restored)
    self.limit_of = None  # a benchmark's scripted lengths: rollout ids -> most tokens

  # -- checkpoints ---------------------------------------------------------------------
  def carry(self):
    """What a checkpoint holds: the device State and this process's pool as global arrays
    (rows over the data axes, each process its own)."""
    mesh = self.engine.mesh
    state = self.state if self.state is not None else self.engine.init_state()
    self.state = state
    return {"state": state, "pool": _pool_to_global(mesh, self.a)}

  def carry_like(self):
    mesh = self.engine.mesh
    return {"state": self.engine.state_like(),
            "pool": jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                (x.shape[0] * jax.process_count(),) + x.shape[1:], x.dtype,
                sharding=sharding_lib.batch_sharding(mesh, x.ndim)), _per_device(mesh, self.a))}

  def restore(self, carry) -> None:
    self.state = carry["state"]
    pool = sharding_lib.to_local(carry["pool"])
    self.a = _pool_from_local(self.a, pool)

  # -- one step ------------------------------------------------------------------------
  def collect(self, name: str, params, batch=None, *, samples: int, step: int,
              label: str = "", **unused) -> Collected:
    del batch, unused, label
    if name != "train" or samples != self.g:
      raise ValueError("partial rollouts collect training batches only")
    got, pulled, rollout_s, generated, metrics = self.gather(params, step)
    t1 = time.perf_counter()
    scores = self.scorer(got["tokens_NxT"], got["length_N"], got["batch"], self.g,
                         label=f"step {step}")
    reward_s = time.perf_counter() - t1
    completion = (got["tokens_NxT"], got["mask_NxT"], got["logp_NxT"], ~got["stopped_N"] &
                  (got["length_N"] >= self.t))
    return Collected(got["batch"]["prompt_tokens_BxL"], got["batch"]["prompt_mask_BxL"],
                     completion, got["length_N"], completion[3], scores, pulled, rollout_s,
                     reward_s, generated=generated, metrics=metrics)

  def gather(self, params, step: int):
    """The rounds of one step, until every process holds B/P complete groups: (the groups
    taken, as `_take` gives them; the batches pulled; seconds; tokens drawn in every
    process; the step's metrics). params: version step - 1."""
    a, version = self.a, step - 1
    if self.state is None:
      self.state = self.engine.init_state()
    t0 = time.perf_counter()
    pulled, generated, live_sum, decode_steps, rounds, dropped = [], 0, 0.0, 0, 0, 0
    requeued = 0
    while True:
      pulled += self._pull()
      requeued += self._admit(version)
      refill_N = self._assign()
      active_N = a["holder_N"] >= 0
      if not distributed.any_process(bool(active_N.any())):
        raise RuntimeError("partial rollouts: no sampler row has a rollout to decode, but "
                           "fewer than grpo.num_prompts_per_step groups are complete")
      drawn, live, steps = self._round(params, refill_N, active_N, version)
      generated += drawn
      live_sum, decode_steps, rounds = live_sum + live, decode_steps + steps, rounds + 1
      late, lost = self._drop_stale(version)
      requeued, dropped = requeued + late, dropped + lost
      if _min_all(int(self._complete().size)) >= self.b:
        break
    rollout_s = time.perf_counter() - t0
    chosen = self._complete()[:self.b]
    got = self._take(chosen, version)
    stale = got["staleness_NxT"][got["mask_NxT"]]
    # This process's counts, summed over every process in one gather (staleness_max apart).
    counts = distributed.gather_rows(np.array([[
        dropped, len(got["length_N"]), stale.size, stale.sum(), generated,
        (a["holder_N"] >= 0).sum(), requeued, stale.max() if stale.size else 0]],
        np.float64))[0]
    dropped, trained_rows, tokens, stale_sum, generated, carried, requeued = counts[
        :, :7].sum(axis=0)
    # live_sum counts every process's rows already (the round program's global sum).
    rows = len(a["holder_N"]) * jax.process_count()
    metrics = {
        "rollout/live_fraction": live_sum / max(decode_steps * rows, 1),
        "rollout/carried_rows": int(carried),
        "rollout/rounds": rounds,
        "staleness_mean": float(stale_sum / max(tokens, 1.0)),
        "staleness_max": int(counts[:, 7].max()),
        "dropped_stale_fraction": float((dropped + requeued * self.g)
                                        / max(dropped + requeued * self.g + trained_rows, 1.0)),
        "rollout/requeued_groups": int(requeued),
        "rollout/dropped_groups": int(dropped // self.g),
        # decode steps this step ran (every process runs the same rounds)
        "rollout/decode_steps": int(decode_steps)}
    return got, pulled, rollout_s, int(generated), metrics

  def _pull(self) -> list[dict]:
    """Prompt batches entering the pool this round (together on every process)."""
    a, out = self.a, []
    while True:
      free_groups = int((a["group_id_S"] < 0).sum())
      idle = int((a["holder_N"] < 0).sum()) - int(
          ((a["status_SxG"] == PENDING) & (a["group_id_S"] >= 0)[:, None]).sum())
      if _min_all(free_groups) < self.b or _max_all(idle) <= 0:
        return out
      batch = next(self.batches)
      slots = np.flatnonzero(a["group_id_S"] < 0)[:self.b]
      first = int(a["pulled_1"][0]) * self.b_global + int(batch.get("batch_offset", 0))
      a["group_id_S"][slots] = first + np.arange(self.b)
      a["row_id_S"][slots] = batch["row_ids_B"]
      a["status_SxG"][slots] = PENDING
      a["length_SxG"][slots], a["stopped_SxG"][slots] = 0, False
      a["pulled_1"][0] += 1
      out.append(batch)

  def _assign(self) -> np.ndarray:
    """Pending rollouts (oldest group first) into free sampler rows; the rows to refill."""
    a = self.a
    pending = (a["status_SxG"] == PENDING) & (a["group_id_S"] >= 0)[:, None]
    order = np.argsort(a["group_id_S"], kind="stable")
    members = [s * self.g + j for s in order for j in np.flatnonzero(pending[s])]
    free = np.flatnonzero(a["holder_N"] < 0)
    refill = np.zeros(len(a["holder_N"]), bool)
    for row, m in zip(free, members):
      a["holder_N"][row] = m
      a["status_SxG"].reshape(-1)[m] = LIVE
      refill[row] = True
    return refill

  def _round(self, params, refill_N, active_N, version):
    """One device round; harvests what it drew. Returns (tokens drawn, live-row steps,
    decode steps)."""
    a = self.a
    holder = a["holder_N"]
    s_N, g_N = np.maximum(holder, 0) // self.g, np.maximum(holder, 0) % self.g
    # Only the refilled rows' prompts are read (the others keep theirs on device): the rest
    # get one pad token, real, so no row of the prefill is all padding.
    width = self.engine.max_prompt_length
    prompts_NxL = np.full((len(holder), width), self.engine.pad_id, np.int32)
    mask_NxL = np.zeros((len(holder), width), bool)
    mask_NxL[:, -1] = True
    if refill_N.any():
      rows = self.batches.collate_rows(a["row_id_S"][s_N[refill_N]])
      fresh = np.asarray(rows["prompt_tokens_BxL"])
      prompts_NxL[refill_N, width - fresh.shape[1]:] = fresh
      mask_NxL[refill_N] = False
      mask_NxL[refill_N, width - fresh.shape[1]:] = rows["prompt_mask_BxL"]
    ids = a["group_id_S"][s_N] * self.g + g_N
    before = np.where(refill_N, 0, a["length_SxG"][s_N, g_N])
    limit = None if self.limit_of is None else self.limit_of(ids)
    self.state, r = self.engine.round(params, self.state, refill_N, prompts_NxL, mask_NxL, ids,
                                      active_N, self.budget, limit)
    tokens, logp, count, ended, stopped = sharding_lib.to_local(
        (self.state.tokens_NxT, self.state.logp_NxT, self.state.count_N, r.ended_N,
         r.stopped_N))
    act = np.flatnonzero(active_N)
    s, j = s_N[act], g_N[act]
    a["tokens_SxGxT"][s, j], a["logp_SxGxT"][s, j] = tokens[act], logp[act]
    steps_T = np.arange(self.t)[None]
    drawn_now = (steps_T >= before[act, None]) & (steps_T < count[act, None])
    a["version_SxGxT"][s, j] = np.where(drawn_now, version, a["version_SxGxT"][s, j])
    a["length_SxG"][s, j] = count[act]
    end = act[ended[act]]
    a["status_SxG"][s_N[end], g_N[end]] = DONE
    a["stopped_SxG"][s_N[end], g_N[end]] = stopped[end]
    holder[end] = -1
    return int((count - np.where(active_N, before, count)).sum()), float(r.live_sum), int(
        r.steps)

  def _oldest(self, version: int) -> np.ndarray:
    """Each group's oldest drawn version (`version` where none is drawn yet)."""
    a = self.a
    started = np.arange(self.t)[None, None] < a["length_SxG"][..., None]
    return np.where(started, a["version_SxGxT"], version).min(axis=(1, 2))

  def _free_rows(self, s: int) -> None:
    """The sampler rows decoding group slot s's members, freed."""
    holder = self.a["holder_N"]
    holder[np.isin(holder, s * self.g + np.arange(self.g))] = -1

  def _requeue(self, slots) -> None:
    """Groups back to pending whole (their members' rows freed), keeping their group ids:
    their prompts are sampled afresh, first in line."""
    a = self.a
    for s in slots:
      self._free_rows(s)
      a["status_SxG"][s] = PENDING
      a["length_SxG"][s], a["stopped_SxG"][s] = 0, False

  def _admit(self, version: int) -> int:
    """Re-queues each group with a member still pending that could no longer finish
    within max_staleness versions of the group's oldest token (module docstring's admit);
    returns how many."""
    a = self.a
    if self.slack < 0:
      return 0
    waiting = (a["group_id_S"] >= 0) & (a["status_SxG"] == PENDING).any(axis=1)
    late = np.flatnonzero(waiting & (version - self._oldest(version) > self.slack))
    self._requeue(late)
    return len(late)

  def _drop_stale(self, version: int) -> tuple[int, int]:
    """Groups holding a token more than max_staleness versions old (their tokens can only
    grow older): re-queued, or below the bound dropped. Returns (groups re-queued,
    rollouts dropped)."""
    a = self.a
    stale = np.flatnonzero((a["group_id_S"] >= 0)
                           & (version - self._oldest(version) > self.max_staleness))
    if self.slack >= 0:
      self._requeue(stale)
      return len(stale), 0
    for s in stale:
      self._free_rows(s)
      a["group_id_S"][s] = -1
    return 0, len(stale) * self.g

  def _complete(self) -> np.ndarray:
    a = self.a
    done = (a["group_id_S"] >= 0) & (a["status_SxG"] == DONE).all(axis=1)
    s = np.flatnonzero(done)
    return s[np.argsort(a["group_id_S"][s], kind="stable")]

  def _take(self, chosen, version: int) -> dict:
    """The chosen groups' rows (prompt-major) for the update, and their slots freed."""
    a = self.a
    length_N = a["length_SxG"][chosen].reshape(-1)
    mask_NxT = np.arange(self.t)[None] < length_N[:, None]
    drawn_NxT = a["version_SxGxT"][chosen].reshape(-1, self.t)
    out = {"tokens_NxT": np.where(mask_NxT, a["tokens_SxGxT"][chosen].reshape(-1, self.t),
                                  self.engine.pad_id),
           "logp_NxT": np.where(mask_NxT, a["logp_SxGxT"][chosen].reshape(-1, self.t), 0.0
                                ).astype(np.float32),
           "mask_NxT": mask_NxT, "length_N": length_N,
           "stopped_N": a["stopped_SxG"][chosen].reshape(-1),
           # A carried row keeps its KV cache over updates: a token drawn after one is the
           # new weights over K/V that older versions wrote (its prompt's and earlier
           # tokens'). Its staleness counts the oldest version among them (issue 63), the
           # running minimum of the drawn versions, not the version that drew it.
           "version_NxT": drawn_NxT,
           "staleness_NxT": version - np.minimum.accumulate(
               np.where(mask_NxT, drawn_NxT, version), axis=1),
           "batch": self.batches.collate_rows(a["row_id_S"][chosen]),
           "group_id_B": a["group_id_S"][chosen].copy()}
    a["group_id_S"][chosen] = -1
    return out


def _per_device(mesh, arrays: dict) -> dict:
  """The pool padded so its rows split over this process's data-parallel devices."""
  local = max(sharding_lib.batch_size_multiple(mesh) // jax.process_count(), 1)
  return {k: v if v.shape[0] % local == 0 else np.concatenate(
      [v, np.zeros((local - v.shape[0] % local,) + v.shape[1:], v.dtype)])
          for k, v in arrays.items()}


def _pool_to_global(mesh, arrays: dict) -> dict:
  # Copies: on CPU a device array may alias the numpy buffer it was made from, and the pool
  # changes in place while the asynchronous checkpoint is still writing.
  return sharding_lib.to_global(mesh, {k: np.array(v, copy=True)
                                       for k, v in _per_device(mesh, arrays).items()})


def _pool_from_local(template: dict, local: dict) -> dict:
  """This process's restored pool, cut back to `template`'s sizes (`_per_device` padded it)."""
  return {k: np.array(local[k][:v.shape[0]], v.dtype) for k, v in template.items()}


# What partial rollouts need of other keys: key -> (the value, why).
_NEEDS = {
    "env.name": ("", "episodes keep their own cache between turns; partial rollouts of "
                 "episodes are not built"),
    "grpo.dynamic_sampling": ("off", "it chooses among groups sampled together; partial "
                              "rollouts finish groups at different steps"),
    "generation.backend": ("native", "the round program is the native sampler's"),
    "grpo.num_iterations": (1, "the decoupled objective's proximal policy is then the step's "
                            "parameters, with no extra forward pass"),
    "generation.compact_stages": (0, "rows that end are refilled, not compacted"),
}


@config_checks.register(order=50)
def _check_partial(c, num_devices: int) -> None:
  """What partial rollouts compose with; each refusal says why."""
  del num_devices
  gen, g = c.generation, c.grpo
  budget = gen.max_tokens_per_step
  if not budget:
    return
  key = "generation.max_tokens_per_step"
  if budget >= gen.max_new_tokens:  # issue 63: a silent no-op before
    config_checks.fail(key, budget, f"0, or fewer than generation.max_new_tokens="
                       f"{gen.max_new_tokens}", reason="every completion ends within one "
                       "round, so no row is ever carried: partial rollouts would change "
                       "nothing")
  for name, (needed, why) in _NEEDS.items():
    section, field = name.split(".")
    if c[section][field] != needed:
      config_checks.fail(name, c[section][field],
                         f"{needed!r} ({why}) with {key}={budget}; or {key}=0")
  # A step runs at least one round, so a rollout at the length cap spans up to this many
  # steps: below that bound no group that draws one can be admitted, and such groups are
  # dropped, a bias against long answers that no error would show.
  rounds = rounds_at_cap(gen)
  if g.max_staleness < rounds - 1:
    warnings.warn(
        f"grpo.max_staleness={g.max_staleness} with {key}={budget}: a rollout of "
        f"max_new_tokens={gen.max_new_tokens} may take {rounds} rounds and so span {rounds} "
        f"steps, and a group holding a token older than {g.max_staleness} versions is "
        f"dropped: long answers may be dropped more often than short ones "
        f"(rollout/dropped_groups); grpo.max_staleness={rounds - 1} or more keeps every "
        "length: a group that could not finish in time is then re-queued, never dropped "
        "(rollout/requeued_groups)", stacklevel=2)

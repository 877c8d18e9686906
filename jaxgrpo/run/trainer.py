"""The loop: one step after another, validated, checkpointed and logged on schedule.

build.py makes the engine and the update step once; each step then runs
    data.next()                                  host    prompts_B, rows_B
    engine.sample("train", params, prompts)      device  tokens_NxT, logp_NxT, mask_NxT
    scorer(tokens, rows) (scorer.Scorer)         host    rewards_N
    update(state, batch) x num_iterations        device  advantages from rewards.reshape(B, G)
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
import warnings

import jax
import numpy as np

from jaxgrpo.run import build, checkpoint, loading
from jaxgrpo.algo import grpo
from jaxgrpo.eval import plots
from jaxgrpo.runtime import distributed, faults, metrics, trackers
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.eval import validation


def train_step(setup, engine, state, ref_params, update, batch, step, consumed=None,
               source=None):
  """One rollout, its rewards and num_iterations updates. Returns (state, metrics).

  On several hosts each process samples and scores its own prompts; the update sees the
  global batch, and the logged numbers are gathered over every process's rows.
  consumed: a list to which the global row ids of every batch the step sampled are added
  (with dynamic sampling, more than `batch`: further ones come from setup.train_batches).
  source: the run's rollout source (a rollouts.Source, build.rollouts' choice;
  built here when not given): one sampler call, dynamic sampling's generation batches,
  multi-turn episodes or partial rollouts alike.
  """
  c = setup.config
  g = c.grpo.num_generations_per_prompt
  if source is None:
    source = build.rollouts(c, setup.model_cfg, setup.tokenizer, None, engine=engine,
                            scorer=setup.scorer, train_batches=setup.train_batches).source
  policy = update.policy(state, ref_params)  # LoRA: the base with the adapters merged
  got = source.collect("train", policy, batch, samples=g, step=step, label=f"step {step}")
  if consumed is not None:
    consumed += [distributed.gather_rows(b["row_ids_B"])[0] for b in got.batches]
  scores, lengths_N, truncated_N = got.scores, got.lengths_N, got.truncated_N
  t_rollout, t_reward, generated = got.rollout_s, got.reward_s, got.generated
  extra = source.step_metrics(got)
  extra.update(got.metrics)
  rewards_N = scores.total_N
  if step == faults.nan_injection_step():  # test hook (faults.py): a poisoned update
    rewards_N = np.full_like(rewards_N, np.nan)
  # Every process's rows: whether any row was scored is the whole batch's question, and
  # every process must agree on it (a skipped update on one host only would deadlock).
  names = sorted(scores.breakdown)
  # The dict keys any process's rows returned (a key one host never saw is NaN there).
  extras = distributed.union_keys(scores.extras)
  nan_N = np.full(len(rewards_N), np.nan, np.float32)
  rows_N, correct_N, lengths_all_N, truncated_all_N, scored_N, *parts = distributed.gather_rows(
      rewards_N, scores.correct_N, lengths_N, truncated_N, scores.scored_N,
      *(scores.breakdown[k] for k in names), *(scores.errors[k] for k in names),
      *(scores.extras.get(k, nan_N) for k in extras))
  t1 = time.perf_counter()
  aux = {}
  if scored_N.any():  # no scored row: nothing to learn from, and no update (say so below)
    tokens, mask, logp, truncated = got.completion
    update_batch = {
        "prompt_tokens_BxL": got.prompt_tokens_BxL, "prompt_mask_BxL": got.prompt_mask_BxL,
        "completion_tokens_NxT": tokens, "completion_mask_NxT": mask,
        "old_logp_NxT": logp, "rewards_N": rewards_N,
        "truncated_N": truncated, "scored_N": scores.scored_N}
    if got.trained_NxT is not None:  # episodes: observation tokens leave the loss
      update_batch["trained_NxT"] = got.trained_NxT
    update_batch = sharding_lib.to_global(engine.mesh, update_batch)
    for _ in range(c.grpo.num_iterations):
      state, aux = update(state, update_batch, ref_params)
    aux = jax.device_get(aux)
  t_update = time.perf_counter() - t1
  trained_N = grpo.trained_rows(rows_N, scored_N, truncated_all_N, g,
                                c.grpo.mask_truncated_completions)
  extra["trained_rows"] = int(trained_N.sum())
  return state, _step_metrics(
      g, rows_N, correct_N, lengths_all_N, truncated_all_N, scored_N, dict(zip(names, parts)),
      dict(zip(names, parts[len(names):])), dict(zip(extras, parts[2 * len(names):])), aux,
      generated=generated, times=(t_rollout, t_reward, t_update), extra=extra)


def untrained_why(step_metrics, config) -> str:
  """Why a step's update trained no row (trained_rows 0), from its metrics, and what to
  change: the progress line's warning the first time it happens."""
  g, n = config.grpo, config.generation.max_new_tokens
  if step_metrics.get("reward_unscored_fraction") == 1.0:
    return ("no reward scored any row (reward_errors/<name> says which failed; a reward that "
            "returns None for every row scores nothing)")
  why = []
  masked = g.mask_truncated_completions and step_metrics.get("truncated_fraction", 0) > 0
  if masked and step_metrics["truncated_fraction"] == 1.0:
    why.append(f"every row was truncated at generation.max_new_tokens={n} and "
               "grpo.mask_truncated_completions=True leaves truncated rows out of the loss "
               "(raise max_new_tokens, or set mask_truncated_completions=False)")
  if step_metrics.get("zero_std_group_fraction") == 1.0:
    why.append("every group's rewards were equal, so every advantage is 0 (the task is too "
               "hard or too easy for the policy: more grpo.num_generations_per_prompt, "
               "grpo.dynamic_sampling='filter', or a reward with partial credit)")
  if not why and masked:
    why.append(f"every row of a group whose rewards differ was truncated at "
               f"generation.max_new_tokens={n}, and grpo.mask_truncated_completions=True "
               "leaves truncated rows out of the loss (raise max_new_tokens, or set "
               "mask_truncated_completions=False)")
  return "; and ".join(why) or "no row reached the loss"


def _step_metrics(g, rows_N, correct_N, lengths_N, truncated_N, scored_N, values, errors,
                  more, aux, *, generated, times, extra) -> dict:
  """A training step's logged numbers over every process's rows (gathered): the rewards,
  lengths, timings, the update's own (aux) and the rollout source's (extra)."""
  t_rollout, t_reward, t_update = times
  scored_rewards = rows_N[scored_N]
  out = {
      # Over the rows some reward scored (all of them unless a reward returned None or
      # failed: reward_unscored_fraction says how many did not count).
      "reward_mean": _mean(scored_rewards), "reward_std": _mean(scored_rewards, np.std),
      "accuracy": _mean(correct_N[~np.isnan(correct_N)]),
      "reward_unscored_fraction": float(1.0 - scored_N.mean()),
      # Equal rewards, not std == 0 (numpy's float32 std of seven 0.1s is 7.5e-9).
      "zero_std_group_fraction": float(np.mean(grpo.flat_groups(
          rows_N.reshape(-1, g), scored_N.reshape(-1, g)))),
      "completion_length_mean": float(lengths_N.mean()),
      "completion_length_max": int(lengths_N.max()),
      "truncated_fraction": float(truncated_N.mean()),
      # Every token generated: with dynamic sampling, every generation batch's.
      "rollout_tokens_per_s": float((lengths_N.sum() if generated is None else generated)
                                    / max(t_rollout, 1e-9)),
      "rollout_s": t_rollout, "reward_s": t_reward, "update_s": t_update, **extra,
  }
  out.update({k: float(v) for k, v in aux.items()})
  out.update({f"reward/{k}": _mean(v[~np.isnan(v)]) for k, v in values.items()})
  out.update({f"reward_errors/{k}": float(e.mean()) for k, e in errors.items()})
  out.update({f"reward/{k}": _mean(v[~np.isnan(v)]) for k, v in more.items()})
  # A mean over no rows (every row unscored; no correctness flag) is left out, not logged
  # as NaN: reward_unscored_fraction says why, and the progress line says "(no row scored)".
  return {k: v for k, v in out.items() if v is not None}


def _every_reward_failed(step_metrics) -> bool:
  """Every active reward lost every row of the step to an error or a timeout."""
  errors = [v for k, v in step_metrics.items() if k.startswith("reward_errors/")]
  return bool(errors) and all(v == 1.0 for v in errors)


def _mean(values, fn=np.mean) -> float | None:
  """fn over the values, None when there are none (a step whose rows all went unscored:
  the metric is left out of the step's row)."""
  return float(fn(values)) if len(values) else None


def run(setup) -> int:
  """The loop: train, validate and checkpoint on schedule; stop early, on a signal or a fault.

  Returns the exit status: 0 when the run finished, stopped early or was preempted (and
  saved), 1 on a numerical fault (nothing saved over the last good checkpoint).
  """
  r = _Run(setup)
  preemption = faults.Preemption()
  with preemption:
    r.loop(preemption)
  # Until the summary is written a second signal waits for it too (it used to end in a
  # KeyboardInterrupt traceback here); the handlers are the run's until it returns.
  with preemption, preemption.busy("writing the run's summary"):
    return r.finish(preemption)


class _Run:
  """One run's objects and its state between the loop's phases (run() drives them)."""

  def __init__(self, setup):
    self.t_start = time.time()
    setup.scorer  # pylint: disable=pointless-statement  (its workers start while jax compiles)
    setup, self.fitted = _fit(setup)
    self.setup = setup
    c = self.c = setup.config
    mesh = build.make_mesh(c)
    self.rollouts = build.rollouts(c, setup.model_cfg, setup.tokenizer, mesh,
                                   scorer=setup.scorer, train_batches=setup.train_batches,
                                   template=setup.data.template if setup.data else None)
    self.engine, self.state, self.ref_params, self.update = build.training(
        setup, mesh, engine=self.rollouts.engine)
    self.source = self.rollouts.source
    self.primary = primary = jax.process_index() == 0
    ck = c.checkpoint
    self.checkpoints = checkpoint.Checkpoints(
        os.path.join(setup.workdir, checkpoint.DIR_NAME), max_to_keep=ck.max_to_keep,
        best_metric=ck.best_metric, best_to_keep=ck.best_to_keep)
    self.start, self.resumed_from = 0, None
    self.untrained_steps = 0  # steps whose update trained no row (this process's steps)
    if setup.resume:
      self.start, self.state, self.resumed_from = _resume(setup, self.checkpoints, self.state,
                                                          self.source)
    self.prompts_log = os.path.join(setup.workdir, PROMPTS_LOG)
    if not self.resumed_from and primary:
      # A fresh start in a workdir that an interrupted start (stopped before its first
      # checkpoint) left logs in: this run redoes every step from 0, so their rows go first,
      # as a resume drops the rows after its checkpoint (else step 0's validation is logged
      # twice). A workdir with checkpoints never gets here: it resumes, or is refused.
      metrics.truncate_jsonl(self.prompts_log, 0)
    log = c.logging
    self.writer = metrics.MetricsWriter(
        setup.workdir, trackers=trackers.parse(log.trackers), plots=log.plots,
        console=log.console, total_steps=c.grpo.max_num_steps, is_primary=primary,
        resumed_step=self.start if self.resumed_from else (
            -1 if os.path.exists(os.path.join(setup.workdir, metrics.JSONL_NAME)) else None),
        project=log.project, run_name=log.run_name,
        tags=[t.strip() for t in log.tags.split(",") if t.strip()], config=c.to_dict())
    self.validator = build.make_validator(
        c, self.rollouts, setup.val_batches, self.engine.mesh,
        setup.val_sources,
        samples_dir=os.path.join(setup.workdir, "val_samples") if primary else None)
    self.val_history, self.saved, self.stop, self.fault = {}, {}, None, None
    self.step, self.preempted, self.kept = self.start, False, []
    self.previous_summary = (metrics.read_summary(setup.workdir) if self.resumed_from
                             else None)

  def validate(self, step):
    result = self.validator(self.update.policy(self.state, self.ref_params), step)
    self.val_history[step] = result
    self.writer.write(step, "val", result)
    log = self.c.logging
    if self.primary and log.plots and log.trackers:
      self.writer.images(step, "val", _validation_images(self.setup.workdir, result,
                                                         self.setup.val_sources))
    return result

  def stop_rule(self, result, step):
    g = self.c.grpo
    return validation.stop_message(result, g.stop_at_validation_metric,
                                   g.stop_at_validation_threshold, step,
                                   g.stop_at_validation_confidence)

  def save(self, preemption, step, reason, result=None):
    setup = self.setup
    meta = {"step": step, "reason": reason, "seed": self.c.seed, "time": time.time(),
            "data": setup.train_batches.get_state(),
            "model": dataclasses.asdict(setup.model_cfg), "layout": model_lib.PARAM_LAYOUT,
            "lora": loading.lora_meta(self.c)}
    with preemption.busy(f"saving checkpoint {step}"):
      carry = self.source.carry()
      if carry is not None:
        meta["partial_rollouts"] = loading.carried_meta(self.c)
      self.saved[step] = self.checkpoints.save(step, self.state, meta, result, carry)

  def loop(self, preemption) -> None:
    """Steps until the last, a stop rule, a signal or a fault; then the last save."""
    c, g, ck, setup = self.c, self.c.grpo, self.c.checkpoint, self.setup
    if self.start == 0 and g.val_at_start:
      self.stop = self.stop_rule(self.validate(0), 0)
      faults.maybe_inject_sigterm(0)  # test hook: a signal during start-up, before step 1
    elif self.start > 0:  # the validation logged at the resumed step decides as it did then
      self.stop = _logged_stop(setup.workdir, self.start, self.stop_rule)
    # A signal may reach one host only: every host must see it at the same step (or the
    # others wait forever in the next collective), so the flag is agreed on before use.
    preempted, failed_steps = False, 0
    while (self.stop is None and self.step < g.max_num_steps
           and not (preempted := distributed.any_process(preemption.requested))):
      self.step = step = self.step + 1
      # A source that pulls its own prompts (partial rollouts) gets none from here.
      batch = None if self.source.pulls_batches else next(setup.train_batches)
      consumed = []
      self.state, step_metrics = train_step(setup, self.engine, self.state, self.ref_params,
                                            self.update, batch, step, consumed, self.source)
      if self.primary:  # the global rows of every batch the step sampled, in order
        _append_jsonl(self.prompts_log,
                      {"step": step, "row_ids": np.concatenate(
                          consumed).tolist() if consumed else []})
      faults.maybe_inject_sigterm(step)  # test hook (faults.py): a preemption at step N
      if step_metrics["trained_rows"] == 0:
        self.untrained_steps += 1
        if self.untrained_steps == 1 and self.primary:  # once: the summary counts the rest
          print(f"warning: step {step} trained no row: {untrained_why(step_metrics, c)}; "
                "the final summary counts such steps (trained_rows in metrics.jsonl)",
                file=sys.stderr, flush=True)
      self.writer.write(step, "train", step_metrics)
      try:
        faults.check_finite(step_metrics, step)
      except faults.NumericalFault as e:
        self.fault = e
        break
      failed_steps = failed_steps + 1 if _every_reward_failed(step_metrics) else 0
      if failed_steps >= c.reward_max_failed_steps:
        self.fault = faults.RewardFault(
            f"every reward failed on every row for {failed_steps} steps in a row (steps "
            f"{step - failed_steps + 1}-{step}; reward_max_failed_steps="
            f"{c.reward_max_failed_steps}): a broken reward, not a learning problem (its "
            "first error is printed above)")
        break
      result = None
      if (g.val_period and step % g.val_period == 0) or (g.val_at_end and
                                                         step == g.max_num_steps):
        result = self.validate(step)
        self.stop = self.stop_rule(result, step)
      preempted = distributed.any_process(preemption.requested)
      reason = ("early_stop" if self.stop else "preempted" if preempted else
                "end" if step == g.max_num_steps else "period")
      if (reason != "period" or (ck.save_period and step % ck.save_period == 0)
          or (result and ck.best_metric)):
        self.save(preemption, step, reason, result)
    self.preempted = preempted
    if self.stop and self.primary:
      print(self.stop, flush=True)
    step = self.step
    if self.fault is None and step > self.start and step not in self.saved:
      # a signal between two checks
      self.save(preemption, step, "preempted" if preempted else "end",
                self.val_history.get(step))
    with preemption.busy(f"saving checkpoint {max(self.saved) if self.saved else step}"):
      self.checkpoints.wait()  # every pending write, also on a second signal's way out
    self.kept = self.checkpoints.steps()
    self.checkpoints.close()

  def finish(self, preemption) -> int:
    """summary.json, the plots, the last line; the exit status: 0, 1 on a fault, 128 + a
    second signal's number when one waited."""
    g, step, setup = self.c.grpo, self.step, self.setup
    # Read once, for the summary and the best checkpoint.
    logged = metrics.logged_validations(setup.workdir)
    summary = _summary(logged, g, self.stop, step, self.saved.get(step))
    compilations = {"update": self.update.compilations,
                    **{f"{name}_sampler": n for name, n in self.engine.compilations.items()}}
    if self.fitted:
      summary["auto"] = {choice.key: choice.summary() for choice in self.fitted}
    summary.update(wall_time_s=round(time.time() - self.t_start, 2), compilations=compilations,
                   peak_rss_mib=peak_rss_mib(), resumed_from=self.resumed_from,
                   resumed_step=self.start if self.resumed_from else None,
                   steps_this_run=step - self.start, preempted=preemption.name or None,
                   steps_without_training=self.untrained_steps)
    summary["history"] = _history(self.previous_summary, self.start, step, summary)
    summary.update(_best(logged, self.c.checkpoint.best_metric, self.kept))
    if self.fault:
      last_good = max(self.saved) if self.saved else None
      summary["fault"] = str(self.fault)
      message = (f"error: {self.fault}; stopped without saving it; the last good checkpoint "
                 "is " + (self.checkpoints.path(last_good) if last_good is not None else
                          (self.resumed_from or "none (no checkpoint was written)")))
    self.writer.close(summary)
    if self.primary:
      if self.c.logging.plots and (self.val_history or self.resumed_from):
        plots.validation_plot(setup.workdir)
      for line in _recompile_warnings(compilations):
        print(line, file=sys.stderr, flush=True)
      if self.fault:
        print(message, file=sys.stderr, flush=True)
      else:
        print(_summary_line(summary, setup.workdir, preemption.name), flush=True)
    setup.scorer.close()
    self.rollouts.close()
    return 1 if self.fault else preemption.exit_status or 0


def _fit(setup, mesh=None):
  """(setup with its 'auto' batch sizes chosen, [sizing.Choice]): one line each, config.json
  rewritten with the numbers, the validation batches made at the chosen size. Raises
  sizing.FitError (exit 2) when nothing fits; nothing is compiled but the search."""
  from jaxgrpo import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import sizing
  if not config_lib.any_auto(setup.config.grpo):
    return setup, []
  if mesh is None:  # (a test passes a TPU topology's devices, as the compile check has)
    mesh = sharding_lib.make_mesh(setup.config.mesh.to_dict())
  config, choices, val_batches = sizing.choose_auto(setup.config, setup.model_cfg,
                                                    setup.tokenizer, setup.data, mesh)
  val_batches = setup.val_batches if val_batches is None else val_batches
  if jax.process_index() == 0:  # config.json: the numbers, as a run given them writes it
    path = os.path.join(setup.workdir, "config.json")
    with open(path + ".tmp", "w") as f:
      f.write(config_lib.to_json(config))
    os.replace(path + ".tmp", path)
  return dataclasses.replace(setup, config=config, val_batches=val_batches), choices


def _validation_images(workdir: str, result, sources) -> dict[str, str]:
  """The plots of a validation, for the trackers: validation.png (every validation so far,
  redrawn) and plots/pass_at_k.png (this one's pass@j ladder, with k > 1)."""
  try:
    paths = {"validation": plots.validation_plot(workdir)}
    if any(k.startswith("pass@") for k in result):
      os.makedirs(os.path.join(workdir, "plots"), exist_ok=True)
      paths["pass_at_k"] = plots.save(plots.pass_at_k_figure(result, sources),
                                     os.path.join(workdir, "plots", "pass_at_k.png"))
  except Exception as e:  # pylint: disable=broad-except  (a plot never costs a run its step)
    warnings.warn(f"drawing the validation plots for the trackers failed: {e!r}")
    return {}
  return {name: path for name, path in paths.items() if path}


PROMPTS_LOG = "train_prompts.jsonl"  # per step: the training rows it sampled (resume checks)


def _resume(setup, checkpoints, state, rollout_source=None):
  """Restores the newest intact checkpoint (falling back past broken ones), the data
  iterator and the rollouts a partial-rollout run carries; sets aside newer checkpoints
  and trims the logs the resumed run will redo."""
  directory, at_most = setup.resume
  source = checkpoints if directory == checkpoints.directory else checkpoint.Checkpoints(
      directory, read_only=True)
  like = rollout_source.carry_like() if rollout_source is not None else None
  found = source.restore_latest(state, at_most=at_most, carry_like=like)
  if found is None:
    raise RuntimeError(f"no checkpoint under {directory} to resume from")
  start, state, meta = found
  setup.train_batches.set_state(meta["data"])
  if like is not None and "carry" in meta:  # (a synchronous run's checkpoint carries nothing)
    rollout_source.restore(meta.pop("carry"))
  path = source.path(start)
  if source is not checkpoints:
    source.close()
  if jax.process_index() == 0:
    checkpoint.set_aside_after(checkpoints.directory, start)
  distributed.barrier("checkpoints set aside")  # then every host sees the same steps
  checkpoints.reload()
  if jax.process_index() == 0:
    metrics.truncate_jsonl(os.path.join(setup.workdir, PROMPTS_LOG), start)
    samples = os.path.join(setup.workdir, "val_samples")
    for name in os.listdir(samples) if os.path.isdir(samples) else []:
      if name.startswith("step_") and int(name[5:].split(".")[0]) > start:
        os.remove(os.path.join(samples, name))
    print(f"resuming from {path} at step {start}", flush=True)
  return start, state, path


def _logged_stop(workdir, step, stop_rule):
  """The stop rule applied to the validation logged at `step`, if any (a resumed run that had
  stopped early stays stopped unless the rule changed)."""
  row = metrics.logged_validations(workdir).get(step)
  return stop_rule(row, step) if row else None


def _best(val, metric, steps) -> dict:
  """The kept checkpoint with the best logged value of `metric` (summary's best_checkpoint)."""
  if not metric:
    return {}
  vals = {s: r[metric] for s, r in val.items()
          if s in steps and np.isfinite(r.get(metric, np.nan))}
  if not vals:
    return {}
  best = max(vals, key=lambda s: (vals[s], -s))
  return {"best_checkpoint": {"metric": metric, "step": best, "value": vals[best]}}


def _append_jsonl(path, record) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def _summary(val, g, stop, step, saved) -> dict:
  """The run's outcome; `val` is every logged validation (metrics.logged_validations), so a resumed run's
  summary covers the whole run, not just its last leg."""
  summary = {"steps": step, "stopped_early": stop is not None, "checkpoint": saved}
  if stop:
    metric = g.stop_at_validation_metric
    summary["early_stop"] = {"step": step, "metric": metric,
                             "value": val.get(step, {}).get(metric),
                             "threshold": g.stop_at_validation_threshold, "message": stop}
    if g.stop_at_validation_confidence is not None:
      summary["early_stop"].update(confidence=g.stop_at_validation_confidence,
                                   lower_bound=val.get(step, {}).get(f"{metric}_lcb"))
  if val:
    first, last = val[min(val)]["accuracy"], val[max(val)]["accuracy"]
    summary.update(initial_val_accuracy=first, final_val_accuracy=last,
                   initial_val_step=min(val), final_val_step=max(val))
    if max(val) > min(val):  # one validation compares nothing: no gain to claim
      summary["val_accuracy_gain"] = last - first
  return summary


def _history(previous, start: int, step: int, summary) -> list[dict]:
  """Which steps each process of the run trained, oldest first: the previous summary's
  history (or, from a summary written before histories, its own process) cut at `start`,
  where this process resumed, then this process. Steps before `start` that no summary covers
  (a process killed before writing one) get an entry that says so."""
  earlier = []
  if previous:
    earlier = previous.get("history") or [{
        "first_step": (previous.get("resumed_step") or 0) + 1,
        "last_step": previous.get("steps", 0), "wall_time_s": previous.get("wall_time_s"),
        "resumed_from": previous.get("resumed_from"), "preempted": previous.get("preempted")}]
  kept = []
  for entry in earlier:
    if entry["first_step"] > start:
      continue  # every step it trained is trained again now
    if entry["last_step"] > start:
      entry = {**entry, "last_step": start, "redone_after": start}
    kept.append(entry)
  covered = max((e["last_step"] for e in kept), default=0)
  if covered < start:
    kept.append({"first_step": covered + 1, "last_step": start, "wall_time_s": None,
                 "note": "trained by a process that left no summary (killed)"})
  return kept + [{"first_step": start + 1, "last_step": step,
                  "wall_time_s": summary["wall_time_s"], "resumed_from": summary["resumed_from"],
                  "preempted": summary["preempted"]}]


def _summary_line(summary, workdir, preempted="") -> str:
  verb = ("stopped early after" if summary["stopped_early"] else
          f"preempted ({preempted}) after" if preempted else "finished")
  # `steps` is the step the run reached; a resumed process trained only the steps after its
  # checkpoint, and the time is this process's.
  trained = summary.get("steps_this_run", summary["steps"])
  line = f"{verb} {trained} steps in {summary['wall_time_s']:.0f}s"
  if summary.get("resumed_step") is not None:
    line += f" (resumed from step {summary['resumed_step']}, now at step {summary['steps']})"
  # The validations span the whole run: a resumed process says so, not as its own gain.
  whose = "the run's " if summary.get("resumed_step") is not None else ""
  if "val_accuracy_gain" in summary:
    line += (f"; {whose}val accuracy {summary['initial_val_accuracy']:.3f} -> "
             f"{summary['final_val_accuracy']:.3f} ({summary['val_accuracy_gain']:+.3f})")
  elif "final_val_accuracy" in summary:  # e.g. stopped (Ctrl-C) before a second validation
    line += (f"; {whose}val accuracy {summary['final_val_accuracy']:.3f} at step "
             f"{summary['final_val_step']}; no later validation")
  if summary.get("steps_without_training"):
    line += (f"; {summary['steps_without_training']} of them trained no row (see the "
             "warning; trained_rows in metrics.jsonl)")
  if summary["checkpoint"]:
    line += f"; checkpoint {summary['checkpoint']}"
  n = summary["compilations"]
  line += (f"; compiled: update {n['update']}, samplers train {n['train_sampler']} / "
           f"val {n['val_sampler']}; peak RSS {summary['peak_rss_mib']:.0f} MiB")
  return line + f"; results in {workdir}"


_COMPILED_NAMES = {"update": "the update step", "train_sampler": "the train sampler",
                   "val_sampler": "the validation sampler"}


def _recompile_warnings(compilations) -> list[str]:
  """One line per function compiled more than once: each recompile inside the loop is a
  performance bug (a changed shape, dtype or sharding) that only this count reveals."""
  return [f"warning: {_COMPILED_NAMES.get(k, k)} compiled {n} times in this run (expected once:"
          " an input's shape, dtype or sharding changed between calls, and each change paid a"
          " full compilation)" for k, n in compilations.items() if n > 1]


def peak_rss_mib() -> float:
  """This process's peak resident set size so far, in MiB (getrusage's ru_maxrss: KiB on
  Linux, bytes on macOS). It covers the whole process: host data, jax's compiler, and on
  CPU the device buffers too."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)

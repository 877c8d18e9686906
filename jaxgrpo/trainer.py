"""The device side of a run: build the engine and update step once, then loop.

One step (DESIGN.md's data flow):
    data.next()                                  host    prompts_B, answers_B
    engine.sample("train", params, prompts)      device  tokens_NxT, logp_NxT, mask_NxT
    detokenize -> rewards                        host    rewards_N
    update(state, batch) x num_iterations        device  advantages from rewards.reshape(B, G)
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from jaxgrpo import checkpoint, grpo, metrics, plot, sampling, validation
from jaxgrpo import rewards as rewards_lib
from jaxgrpo import sharding as sharding_lib


def build(setup):
  """Mesh, sharded params, the two sampling profiles, optimizer state and update step."""
  c = setup.config
  mesh = sharding_lib.make_mesh(c.mesh.to_dict())
  if setup.host_params is None:
    params = sharding_lib.init_sharded(setup.model_cfg, mesh, jax.random.key(c.seed))
  else:
    params = sharding_lib.shard_params(setup.host_params, setup.model_cfg, mesh)
  gen, g = c.generation, c.grpo
  engine = make_engine(c, setup.model_cfg, setup.tokenizer, mesh)
  train_sp = engine.profile("train").sampling
  total_updates = g.max_num_steps * g.num_iterations
  o = c.optim
  optimizer, lr = grpo.make_optimizer(o.learning_rate, o.warmup_steps, total_updates,
                                      o.weight_decay, o.grad_clip, o.schedule)
  # No reference policy at all when beta is 0 (no copy, no forward pass).
  ref_params = jax.tree.map(lambda x: x.copy(), params) if g.beta > 0 else None
  state = grpo.init_state(params, optimizer, mesh)
  loss_cfg = grpo.LossConfig(
      num_generations=g.num_generations_per_prompt, beta=g.beta, kl_type=g.kl_type,
      epsilon=g.epsilon, epsilon_high=g.epsilon_high, loss_agg=g.loss_agg,
      scale_rewards=g.scale_rewards, mask_truncated_completions=g.mask_truncated_completions,
      max_new_tokens=gen.max_new_tokens)
  update = grpo.compile_update(state, ref_params, cfg=setup.model_cfg, loss=loss_cfg,
                               sp=train_sp, optimizer=optimizer, lr_schedule=lr, mesh=mesh)
  return engine, state, ref_params, update


def make_engine(c, model_cfg, tokenizer, mesh, val_k: int | None = None):
  """The rollout engine with the config's two profiles (val_k overrides k, for benchmarks)."""
  gen, g = c.generation, c.grpo
  train_sp = sampling.SamplingParams(gen.temperature, gen.top_p, gen.top_k)
  # The validator resolved unset val_* keys to the training values.
  val_sp = sampling.SamplingParams(gen.val_temperature, gen.val_top_p, gen.val_top_k)
  profiles = {"train": sampling.Profile(train_sp, g.num_generations_per_prompt,
                                        gen.max_new_tokens),
              "val": sampling.Profile(val_sp, val_k or g.val_num_generations_per_prompt,
                                      gen.max_new_tokens)}
  return sampling.RolloutEngine(
      model_cfg, mesh, profiles, max_prompt_length=c.data.max_prompt_length,
      eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, seed=c.seed)


def train_step(setup, engine, state, ref_params, update, batch, step):
  """One rollout, its rewards and num_iterations updates. Returns (state, metrics)."""
  c = setup.config
  g = c.grpo.num_generations_per_prompt
  weights = c.rewards.to_dict()
  t0 = time.perf_counter()
  rollout = engine.sample("train", state.params, batch["prompt_tokens_BxL"],
                          batch["prompt_mask_BxL"], step=step)
  completions = setup.tokenizer.decode_batch(jax.device_get(rollout.tokens_NxT))
  t_rollout = time.perf_counter() - t0
  answers = [a for a in batch["answers"] for _ in range(g)]
  total, breakdown = rewards_lib.compute(weights, completions, answers)
  rewards_N = np.asarray(total, np.float32)
  t1 = time.perf_counter()
  update_batch = {
      "prompt_tokens_BxP": batch["prompt_tokens_BxL"],
      "prompt_mask_BxP": batch["prompt_mask_BxL"],
      "completion_tokens_NxT": rollout.tokens_NxT, "completion_mask_NxT": rollout.mask_NxT,
      "old_logp_NxT": rollout.logp_NxT, "rewards_N": rewards_N,
      "truncated_N": rollout.truncated_N}
  for _ in range(c.grpo.num_iterations):
    state, aux = update(state, update_batch, ref_params)
  aux = jax.device_get(aux)
  t_update = time.perf_counter() - t1
  lengths = np.asarray(rollout.lengths_N)
  groups = rewards_N.reshape(-1, g)
  out = {
      "reward_mean": float(rewards_N.mean()), "reward_std": float(rewards_N.std()),
      "accuracy": float(validation.correctness(weights, total, breakdown).mean()),
      "zero_std_group_fraction": float(np.mean(groups.std(axis=1) == 0)),
      "completion_length_mean": float(lengths.mean()),
      "completion_length_max": int(lengths.max()),
      "truncated_fraction": float(np.asarray(rollout.truncated_N).mean()),
      "rollout_tokens_per_s": float(lengths.sum() / max(t_rollout, 1e-9)),
      "rollout_s": t_rollout, "update_s": t_update,
  }
  out.update({k: float(v) for k, v in aux.items()})
  out.update({f"reward/{k}": float(np.mean(v)) for k, v in breakdown.items()})
  return state, out


def run(setup) -> int:
  """The loop: train, validate on schedule, stop early when the stop metric is reached."""
  c, g = setup.config, setup.config.grpo
  t_start = time.time()
  engine, state, ref_params, update = build(setup)
  log = c.logging
  primary = jax.process_index() == 0
  writer = metrics.MetricsWriter(setup.workdir, tensorboard=log.tensorboard, plots=log.plots,
                                 console=log.console, total_steps=g.max_num_steps,
                                 is_primary=primary)
  validator = validation.Validator(
      engine, setup.val_batches, setup.tokenizer, c.rewards.to_dict(),
      threshold=g.val_pass_threshold, seed=g.val_seed, mesh=engine.mesh,
      samples_dir=os.path.join(setup.workdir, "val_samples") if primary else None)
  checkpoints = checkpoint.Checkpoints(setup.workdir)
  val_history, stop, step = {}, None, 0

  def validate(step):
    result = validator(state.params, step)
    val_history[step] = result
    writer.write(step, "val", result)
    return validation.stop_message(result, g.stop_at_validation_metric,
                                   g.stop_at_validation_threshold, step)

  if g.val_at_start:
    stop = validate(0)
  while stop is None and step < g.max_num_steps:
    step += 1
    batch = next(setup.train_batches)
    state, step_metrics = train_step(setup, engine, state, ref_params, update, batch, step)
    writer.write(step, "train", step_metrics)
    if (g.val_period and step % g.val_period == 0) or (g.val_at_end and
                                                       step == g.max_num_steps):
      stop = validate(step)
  if stop and primary:
    print(stop, flush=True)
  saved = None
  if step > 0:  # the policy this run produced, under its step number
    saved = checkpoints.save(step, state, {"step": step, "reason": "early_stop" if stop
                                           else "end", "data": setup.train_batches.get_state()})
  checkpoints.close()
  summary = _summary(val_history, g, stop, step, saved)
  summary.update(wall_time_s=round(time.time() - t_start, 2),
                 sampler_compilations=dict(engine.compilations))
  writer.close(summary)
  if primary:
    if log.plots and val_history:
      plot.validation_plot(setup.workdir)
    print(_summary_line(summary, setup.workdir), flush=True)
  return 0


def _summary(val_history, g, stop, step, saved) -> dict:
  summary = {"steps": step, "stopped_early": stop is not None, "checkpoint": saved}
  if stop:
    metric = g.stop_at_validation_metric
    summary["early_stop"] = {"step": step, "metric": metric,
                             "value": val_history[step][metric],
                             "threshold": g.stop_at_validation_threshold, "message": stop}
  if val_history:
    first, last = min(val_history), max(val_history)
    summary.update(initial_val_accuracy=val_history[first]["accuracy"],
                   final_val_accuracy=val_history[last]["accuracy"],
                   val_accuracy_gain=(val_history[last]["accuracy"] -
                                      val_history[first]["accuracy"]))
  return summary


def _summary_line(summary, workdir) -> str:
  verb = "stopped early after" if summary["stopped_early"] else "finished"
  line = f"{verb} {summary['steps']} steps in {summary['wall_time_s']:.0f}s"
  if "final_val_accuracy" in summary:
    line += (f"; val accuracy {summary['initial_val_accuracy']:.3f} -> "
             f"{summary['final_val_accuracy']:.3f} ({summary['val_accuracy_gain']:+.3f})")
  if summary["checkpoint"]:
    line += f"; checkpoint {summary['checkpoint']}"
  return line + f"; results in {workdir}"

"""The device side of a run: build the engine and update step once, then loop.

One step (DESIGN.md's data flow):
    data.next()                                  host    prompts_B, answers_B
    engine.sample("train", params, prompts)      device  tokens_NxT, logp_NxT, mask_NxT
    detokenize -> rewards                        host    rewards_N
    update(state, batch) x num_iterations        device  advantages from rewards.reshape(B, G)
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxgrpo import grpo, metrics, sampling, validation
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
  train_sp = sampling.SamplingParams(gen.temperature, gen.top_p, gen.top_k)
  # Until grouped validation lands, validation samples once per prompt with the train
  # settings; it still has its own compiled profile and a fixed key.
  profiles = {"train": sampling.Profile(train_sp, g.num_generations_per_prompt,
                                        gen.max_new_tokens),
              "val": sampling.Profile(train_sp, 1, gen.max_new_tokens)}
  engine = sampling.RolloutEngine(
      setup.model_cfg, mesh, profiles, max_prompt_length=c.data.max_prompt_length,
      eos_id=setup.tokenizer.eos_id, pad_id=setup.tokenizer.pad_id, seed=c.seed)
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
  c, g = setup.config, setup.config.grpo
  t_start = time.time()
  engine, state, ref_params, update = build(setup)
  log = c.logging
  writer = metrics.MetricsWriter(setup.workdir, tensorboard=log.tensorboard, plots=log.plots,
                                 console=log.console, total_steps=g.max_num_steps,
                                 is_primary=jax.process_index() == 0)
  val_key = engine.key("val", 0)  # fixed: validation moves only when the policy moves
  weights = c.rewards.to_dict()
  val_history = {}

  def validate(step):
    result = validation.run(engine, state.params, setup.val_batches, setup.tokenizer,
                            weights, val_key)
    val_history[step] = result["accuracy"]
    writer.write(step, "val", result)

  if g.val_at_start:
    validate(0)
  for step in range(1, g.max_num_steps + 1):
    state, step_metrics = train_step(setup, engine, state, ref_params, update,
                                     next(setup.train_batches), step)
    writer.write(step, "train", step_metrics)
    if (g.val_period and step % g.val_period == 0) or (g.val_at_end and
                                                       step == g.max_num_steps):
      validate(step)
  summary = {"wall_time_s": round(time.time() - t_start, 2),
             "sampler_compilations": dict(engine.compilations)}
  if val_history:
    first, last = min(val_history), max(val_history)
    summary.update(initial_val_accuracy=val_history[first],
                   final_val_accuracy=val_history[last],
                   val_accuracy_gain=val_history[last] - val_history[first])
  writer.close(summary)
  if jax.process_index() == 0:
    print(_summary_line(summary, g.max_num_steps, setup.workdir), flush=True)
  return 0


def _summary_line(summary, steps, workdir) -> str:
  line = f"finished {steps} steps in {summary['wall_time_s']:.0f}s"
  if "final_val_accuracy" in summary:
    line += (f"; val accuracy {summary['initial_val_accuracy']:.3f} -> "
             f"{summary['final_val_accuracy']:.3f} ({summary['val_accuracy_gain']:+.3f})")
  return line + f"; results in {workdir}"

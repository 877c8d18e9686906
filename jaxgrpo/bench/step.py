"""The `step` benchmark (`python -m jaxgrpo.bench step`): whole GRPO steps, and the update's
roofline.

Workload (tiny, small): the GRPO part of the Tunix peer benchmark (shared/peers/tunix_bench.py),
built from the trainer's own pieces. The peer's 8 prompts as byte-level tokens, left-padded to
64 (common.prompt_batch), G=4 samples each, 64 new tokens at temperature 0.9 / top_p 1 / top_k 0
with EOS (id 2) allowed (pad 0), the trivial reward (count of 'a' and '1' characters in the
decoded completion), mu=1 (one update per step), beta=0.04 (a reference copy of the parameters
and its forward pass in every update), epsilon 0.2, the peer's loss settings (k3 KL,
per-sequence mean of the token mean, rewards scaled by the group std), AdamW lr 1e-5 with
weight decay 1e-4 (optax's default, as the peer's optax.adamw(1e-5)), constant, no grad clip;
float32, one CPU device, random init seed 0. Parts: sampling.RolloutEngine, grpo.init_state,
grpo.compile_update and the update batch trainer.train_step builds.

One step is what trainer.train_step waits for: rollout (encode the prompts, sample, block,
fetch tokens to the host, decode, rewards) + update (run it, block on the new state and fetch
its diagnostics). `first_step_s` includes both compilations; `steady_step_median_s` is the
median of steps 2..N (the peer's steady_step_median_s is its median of steps 2..N too).

The update roofline: XLA's FLOP count of the compiled update (roofline.compiled_flops; the
update has no loops, so the count is complete) over the median update time, divided by the
dense matmul rate measured in the same process (roofline.matmul_rate). The rollout's FLOPs are
counted analytically (XLA counts a while loop's body once): prefill of B x L prompt tokens, then
N rows x (decode steps run) tokens attending the whole L + T cache (the sampler masks the
unfilled slots rather than skipping them), so it is the work the sampler does, not the least
work the tokens need.

`--preset medium` (8 layers, d_model 512, 8 heads x 64, 4 KV heads, mlp 2048, vocab 1024:
32M params) times the update alone at sequence length 256: the prompt padded to 64 (as above)
+ 192 completion tokens. Its rollout would take longer than the whole bench may (minutes on 2
CPU cores), so the batch is synthetic: uniform random byte tokens, no EOS (every row is 256
long), rewards from the trivial reward, old log-probs from one forward pass of the policy (the
first update's ratios are 1, as with mu=1). One prompt x G=4 (832 token positions per forward,
~230 GFLOP per update) and 5 updates (`--steps`; the first compiles) keep it near two minutes
on a quiet machine. For every preset a `forward` figure (the policy's teacher-forced forward
over the same batch) says how the update's time splits: the update is that forward, its
backward (~2x) and the reference model's forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxgrpo.algo import grpo
from jaxgrpo.run import trainer
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.bench import common, roofline

SEED = 0
PAD, EOS = common.PAD, 2
NUM_SAMPLES = common.NUM_SAMPLES
TRAIN_SP = sampling.SamplingParams(temperature=0.9, top_p=1.0, top_k=0)
LEARNING_RATE, WEIGHT_DECAY = 1e-5, 1e-4
BETA, EPSILON = 0.04, 0.2
# Qwen3-shaped like the bench presets; heads x head_dim = d_model, half as many KV heads.
MEDIUM = dict(num_layers=8, d_model=512, mlp_dim=2048, num_heads=8, num_kv_heads=4,
              head_dim=64, vocab_size=1024)
PRESET_NAMES = ("tiny", "small", "medium")
# Per preset: new tokens and prompts when the flags leave them unset.
DEFAULT_NEW_TOKENS = {"tiny": common.NEW_TOKENS, "small": common.NEW_TOKENS, "medium": 192}
DEFAULT_PROMPTS = {"tiny": len(common.PROMPTS), "small": len(common.PROMPTS), "medium": 1}
DEFAULT_STEPS = {"tiny": 10, "small": 10, "medium": 5}
FORWARD_REPS = 3


def preset_config(name: str) -> model_lib.ModelConfig:
  if name == "medium":
    return model_lib.ModelConfig(**{**common.QWEN3, **MEDIUM})
  return common.preset_config(name)


def reward(text: str) -> float:
  """The peer's trivial reward: how many 'a' and '1' characters the completion has."""
  return float(text.count("a") + text.count("1"))


def _median(xs):
  return statistics.median(xs) if xs else None


def _rounded(xs, digits=4):
  return [round(x, digits) for x in xs]


class _Setup:
  """Parameters, reference copy, optimizer state and the compiled update, as build.training
  makes them, with a trace counter inside the update."""

  def __init__(self, cfg, prompts: int, new_tokens: int, total_updates: int,
               scan_layers: bool | None = None):
    self.cfg, self.new_tokens = cfg, new_tokens
    self.devices = jax.devices()[:1]
    self.mesh = sharding_lib.make_mesh({"data": -1}, self.devices)
    self.scan_layers = model_lib.resolve_scan_layers(scan_layers, jax.default_backend())
    params = sharding_lib.init_sharded(cfg, self.mesh, jax.random.key(SEED))
    self.n_params = model_lib.count_params(params)
    optimizer, lr = grpo.make_optimizer(LEARNING_RATE, 0, total_updates, WEIGHT_DECAY, 0.0,
                                        "constant")
    self.ref_params = jax.tree.map(lambda x: x.copy(), params)
    self.state = grpo.init_state(params, optimizer, self.mesh)
    self.traces = 0  # of the update: one per compilation

    self.loss = grpo.LossConfig(
        num_generations=NUM_SAMPLES, beta=BETA, kl_type="k3", epsilon=EPSILON,
        epsilon_high=EPSILON, loss_agg="seq_mean_token_mean", scale_rewards="group",
        mask_truncated_completions=False, max_new_tokens=new_tokens,
        scan_layers=self.scan_layers)
    self.update = grpo.compile_update(self.state, self.ref_params, cfg=cfg, loss=self.loss,
                                      sp=TRAIN_SP, optimizer=optimizer, lr_schedule=lr,
                                      mesh=self.mesh, on_trace=self._count_trace)
    tokens, mask = common.prompt_batch()  # all 8 prompts fix the width at 64
    self.prompt_tokens_BxL, self.prompt_mask_BxL = tokens[:prompts], mask[:prompts]
    self.workload = dict(
        prompts=prompts, samples=NUM_SAMPLES, prompt_len=tokens.shape[1],
        new_tokens=new_tokens, sequence_len=tokens.shape[1] + new_tokens,
        sampling=dict(temperature=TRAIN_SP.temperature, top_p=TRAIN_SP.top_p,
                      top_k=TRAIN_SP.top_k),
        eos_id=EOS, pad_id=PAD, num_iterations=1, beta=BETA, epsilon=EPSILON,
        kl_type=self.loss.kl_type, loss_agg=self.loss.loss_agg,
        scale_rewards=self.loss.scale_rewards, learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY, grad_clip=None, dtype=cfg.dtype, seed=SEED,
        completions="rollout")

  def _count_trace(self):
    self.traces += 1

  def run_update(self, batch) -> dict:
    """One update, blocked on; the new state replaces the old (donated) one."""
    self.state, aux = self.update(self.state, batch, self.ref_params)
    jax.block_until_ready(self.state)
    return {k: float(v) for k, v in jax.device_get(aux).items()}

  def update_roofline(self, batch, update_median_s: float) -> dict:
    """The compiled update's FLOPs, its rate at the measured median and the matmul rate."""
    t0 = time.perf_counter()
    compiled = self.update.lower(self.state, batch, self.ref_params).compile()
    compile_s = time.perf_counter() - t0
    # XLA's cost analysis counts a loop body once: scanned layers would count one layer.
    flops = None if self.scan_layers else roofline.compiled_flops(compiled)
    mm = roofline.matmul_rate()
    rate = flops / update_median_s if flops and update_median_s else None
    return dict(update_flops=flops, update_flops_per_s=rate,
                update_lower_compile_s=round(compile_s, 3),
                matmul_flops_per_s=mm["flops_per_s"],
                matmul=dict(n=mm["n"], ms=mm["ms"], per_size=mm["per_size"]),
                update_roofline_fraction=rate / mm["flops_per_s"] if rate else None)

  def forward(self, batch, reps: int = FORWARD_REPS):
    """One policy forward (the teacher-forced log-probs the update computes), timed: the
    update costs about this for the policy, ~2x more for its backward, and this again for
    the reference model."""
    fn = jax.jit(lambda p, b: grpo.completion_logprobs(p, self.cfg, b, NUM_SAMPLES, TRAIN_SP))
    params = self.state.params
    t0 = time.perf_counter()
    logp_NxT = jax.block_until_ready(fn(params, batch))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(params, batch))
      times.append(time.perf_counter() - t0)
    flops = roofline.compiled_flops(fn.lower(params, batch).compile())  # cached: no compile
    return logp_NxT, dict(forward_first_s=round(first, 3), forward_median_s=_median(times),
                          forward_flops=flops, forward_s=_rounded(times))

  def result(self, preset: str, loadavg_start, **fields) -> dict:
    return dict(bench="step", preset=preset, n_params=self.n_params, workload=self.workload,
                scan_layers=self.scan_layers, **fields,
                peak_rss_mib=trainer.peak_rss_mib(),
                **common.machine(self.devices, loadavg_start))


def _update_batch(prompt_tokens_BxL, prompt_mask_BxL, rollout, rewards_N) -> dict:
  """The batch trainer.train_step hands the update (same keys, same arrays)."""
  return {"prompt_tokens_BxL": prompt_tokens_BxL, "prompt_mask_BxL": prompt_mask_BxL,
          "completion_tokens_NxT": rollout.tokens_NxT, "completion_mask_NxT": rollout.mask_NxT,
          "old_logp_NxT": rollout.logp_NxT, "rewards_N": rewards_N,
          "truncated_N": rollout.truncated_N,
          "scored_N": np.ones(rollout.truncated_N.shape, bool)}


def rollout_flops(cfg, prompts: int, prompt_len: int, new_tokens: int, decode_steps: int):
  """Analytic FLOPs of one sampler call: the prefill, then `decode_steps` loop iterations of
  every row over the full L + T cache (see the module docstring)."""
  rows = prompts * NUM_SAMPLES
  return (prompts * prompt_len * roofline.model_flops_per_token(cfg, prompt_len)
          + rows * decode_steps * roofline.model_flops_per_token(cfg, prompt_len + new_tokens))


def full_steps(preset: str, steps: int, new_tokens: int, prompts: int,
               forward_reps: int = FORWARD_REPS, scan_layers: bool | None = None) -> dict:
  """`steps` whole GRPO steps (rollout + update), then the update's roofline."""
  loadavg_start = common.loadavg()
  s = _Setup(preset_config(preset), prompts, new_tokens, steps, scan_layers)
  profiles = {"train": sampling.Profile(TRAIN_SP, NUM_SAMPLES, new_tokens),
              # The engine requires a val profile; this bench never calls (so never compiles) it.
              "val": sampling.Profile(sampling.SamplingParams(0.0, 1.0, 0), 1, new_tokens)}
  engine = sampling.RolloutEngine(s.cfg, s.mesh, profiles,
                                  max_prompt_length=s.workload["prompt_len"], eos_id=EOS,
                                  pad_id=PAD, seed=SEED, scan_layers=s.scan_layers)
  step_s, rollout_s, update_s, flops_r, lengths, rewards, aux = [], [], [], [], [], [], {}
  for step in range(steps):
    t0 = time.perf_counter()
    tokens, mask = common.prompt_batch()
    tokens, mask = tokens[:prompts], mask[:prompts]
    rollout = engine.sample("train", s.state.params, tokens, mask, step=step)
    jax.block_until_ready(rollout)
    ids_NxT, lengths_N = jax.device_get((rollout.tokens_NxT, rollout.lengths_N))
    rewards_N = np.asarray([reward(common.decode(row[:n])) for row, n in zip(ids_NxT, lengths_N)],
                           np.float32)
    t1 = time.perf_counter()
    aux = s.run_update(_update_batch(tokens, mask, rollout, rewards_N))
    t2 = time.perf_counter()
    step_s.append(t2 - t0)
    rollout_s.append(t1 - t0)
    update_s.append(t2 - t1)
    flops_r.append(rollout_flops(s.cfg, prompts, tokens.shape[1], new_tokens,
                                 int(lengths_N.max()) - 1))
    lengths.append(float(lengths_N.mean()))
    rewards.append(float(rewards_N.mean()))
  update_compilations = s.traces  # before lower() below, which may trace again
  update_med = _median(update_s[1:])
  # A batch of the last step's shapes for lower(), the forward figure and nothing else.
  batch = _update_batch(tokens, mask, rollout, rewards_N)
  fwd = dict(forward_first_s=None, forward_median_s=None, forward_flops=None, forward_s=[])
  if forward_reps:
    _, fwd = s.forward(batch, forward_reps)
  roof = s.update_roofline(batch, update_med)
  rollout_rates = [f / t for f, t in zip(flops_r[1:], rollout_s[1:])]
  rollout_rate = _median(rollout_rates)
  return s.result(
      preset, loadavg_start, kind="full_step", steps=steps,
      first_step_s=round(step_s[0], 3), steady_step_median_s=_median(step_s[1:]),
      rollout_median_s=_median(rollout_s[1:]), update_median_s=update_med,
      first_rollout_s=round(rollout_s[0], 3), first_update_s=round(update_s[0], 3),
      step_s=_rounded(step_s), rollout_s=_rounded(rollout_s), update_s=_rounded(update_s),
      update_compilations=update_compilations, sampler_compilations=dict(engine.compilations),
      **roof, **fwd,
      rollout_flops_analytic=_median(flops_r[1:]), rollout_flops_per_s=rollout_rate,
      rollout_roofline_fraction=rollout_rate / roof["matmul_flops_per_s"],
      completion_length_mean=statistics.fmean(lengths), reward_mean=statistics.fmean(rewards),
      last_update={k: round(v, 6) for k, v in aux.items()})


def update_only(preset: str, steps: int, new_tokens: int, prompts: int,
                forward_reps: int = FORWARD_REPS, scan_layers: bool | None = None) -> dict:
  """`steps` updates on one synthetic full-length batch (see the module docstring)."""
  loadavg_start = common.loadavg()
  s = _Setup(preset_config(preset), prompts, new_tokens, steps, scan_layers)
  s.workload["completions"] = "synthetic: uniform random bytes, no EOS"
  rows = prompts * NUM_SAMPLES
  rng = np.random.default_rng(SEED)
  ids_NxT = rng.integers(3, 259, (rows, new_tokens), dtype=np.int32)  # bytes, never EOS
  rewards_N = np.asarray([reward(common.decode(r)) for r in ids_NxT], np.float32)
  batch = {"prompt_tokens_BxL": s.prompt_tokens_BxL, "prompt_mask_BxL": s.prompt_mask_BxL,
           "completion_tokens_NxT": ids_NxT,
           "completion_mask_NxT": np.ones((rows, new_tokens), bool),
           "old_logp_NxT": np.zeros((rows, new_tokens), np.float32), "rewards_N": rewards_N,
           "truncated_N": np.ones((rows,), bool),
           "scored_N": np.ones((rows,), bool)}
  old_logp_NxT, fwd = s.forward(batch, forward_reps)
  batch["old_logp_NxT"] = np.asarray(old_logp_NxT)
  update_s, aux = [], {}
  for _ in range(steps):
    t0 = time.perf_counter()
    aux = s.run_update(batch)
    update_s.append(time.perf_counter() - t0)
  update_compilations = s.traces
  update_med = _median(update_s[1:])
  roof = s.update_roofline(batch, update_med)
  # last_update: the diagnostics of the last of `steps` updates on the same batch, so its
  # ratios have drifted from 1 (the first update's are 1).
  return s.result(
      preset, loadavg_start, kind="update_only", steps=steps, first_step_s=None,
      steady_step_median_s=None, rollout_median_s=None, update_median_s=update_med,
      first_update_s=round(update_s[0], 3), update_s=_rounded(update_s),
      update_compilations=update_compilations, sampler_compilations=None, **roof, **fwd,
      last_update={k: round(v, 6) for k, v in aux.items()})


def run_step(args) -> list[dict]:
  """The `step` subcommand: one result line."""
  new_tokens = args.step_new_tokens or DEFAULT_NEW_TOKENS[args.preset]
  prompts = args.step_prompts or DEFAULT_PROMPTS[args.preset]
  steps = args.steps or DEFAULT_STEPS[args.preset]
  run = update_only if args.preset == "medium" else full_steps
  scan = {"auto": None, "true": True, "false": False}[args.scan_layers]
  return [run(args.preset, steps, new_tokens, prompts, args.step_forward_reps, scan)]


def add_parsers(sub) -> None:
  """Adds the `step` subcommand to the bench's subparsers (cli.py)."""
  s = sub.add_parser("step", help="time whole GRPO steps (peer workload) and the update's "
                     "roofline; medium: the update alone at sequence length 256")
  s.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
  # Steps 2..N give the steady median, so at least two.
  s.add_argument("--steps", type=common.at_least(2), default=None,
                 help="steps, the first compiles (default 10; medium: updates, default 5)")
  s.add_argument("--out", default=None, help="also append the JSON line to this file")
  s.add_argument("--scan_layers", choices=("auto", "true", "false"), default="auto",
                 help="model.scan_layers for the update and the sampler (auto: the "
                 "platform's default, unrolled on CPU); scanned runs report no update FLOPs")
  # Hidden, for tests. Own dests: bench.main compares a `new_tokens` attribute with 1, and
  # None (the preset's default) would not compare.
  s.add_argument("--new_tokens", dest="step_new_tokens", type=common.at_least(1), default=None,
                 help=argparse.SUPPRESS)
  s.add_argument("--prompts", dest="step_prompts", type=common.at_least(1), default=None,
                 help=argparse.SUPPRESS)
  # Timed policy forwards after the first; 0 skips the forward figure (tiny, small: a compile
  # less, for tests; medium still runs the one forward that gives the old log-probs).
  s.add_argument("--forward_reps", dest="step_forward_reps", type=common.at_least(0),
                 default=FORWARD_REPS, help=argparse.SUPPRESS)
  s.set_defaults(run=run_step)

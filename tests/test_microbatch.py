"""Micro-batched updates: the same update as the whole batch, with one micro-batch's memory.

Each case compiles the update twice (whole batch and micro-batched) with FAST_COMPILE and
runs both from the same state on the same batch; the parameters, the optimizer moments and
every logged diagnostic must agree to float32 rounding.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgrpo.algo import grpo, microbatch
from jaxgrpo.model import sharding
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.rollout import sampling
from numpy_params import assert_close_at_scale, random_params  # tests/numpy_params.py

CFG = model_lib.ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, mlp_dim=64)
FAST_COMPILE = {"xla_backend_optimization_level": 0}
B, G, T = 8, 2, 6  # 8 prompts x 2 samples = 16 rollouts of up to 6 tokens
# Ragged lengths: rows 0-3 (the first micro-batch of 4 on one device) hold 6+6+6+6 = 24
# tokens, rows 4-7 hold 1+2+1+2 = 6. A mean of per-micro-batch token means would weigh a
# token of rows 4-7 four times as much as one of rows 0-3.
LENGTHS = [6, 6, 6, 6, 1, 2, 1, 2, 3, 6, 5, 4, 2, 6, 1, 3]
REWARDS = [1, 0, 0, 1, 1, 1, 0.5, 0, 0, 1, 0.3, 0.3, 1, 0, 0.7, 0.2]
TRUNCATED = [True, False, False, False, False, False, False, False,
             False, True, False, False, False, True, False, False]


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  prompt_mask = np.arange(4)[None, :] >= rng.integers(0, 3, (B, 1))  # left-padded, width 4
  prompt = np.where(prompt_mask, rng.integers(1, CFG.vocab_size, (B, 4)), 0)
  mask = np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]
  tokens = np.where(mask, rng.integers(1, CFG.vocab_size, (B * G, T)), 0)
  return {"prompt_tokens_BxL": prompt.astype(np.int32), "prompt_mask_BxL": prompt_mask,
          "completion_tokens_NxT": tokens.astype(np.int32), "completion_mask_NxT": mask,
          # Sampler log-probs a little off the policy's, so ratios differ from 1 and clip.
          "old_logp_NxT": np.where(mask, -3.5 + 0.3 * rng.standard_normal((B * G, T)),
                                   0).astype(np.float32),
          "rewards_N": np.asarray(REWARDS, np.float32),
          "truncated_N": np.asarray(TRUNCATED),
          "scored_N": np.ones(len(TRUNCATED), bool)}


def test_token_mean_of_micro_batch_means_would_be_wrong_here():
  # The case below proves the normalisation: with 4-row micro-batches the token_mean of
  # per-micro-batch means differs from the batch's (rows 0-3: 24 tokens, rows 4-7: 6).
  mask = _batch()["completion_mask_NxT"]
  x = np.arange(B * G * T, dtype=np.float64).reshape(B * G, T) % 7
  whole = x[mask].mean()
  per_micro = np.mean([x[i:i + 4][mask[i:i + 4]].mean() for i in range(0, 16, 4)])
  assert abs(whole - per_micro) > 0.1


def _mesh(shape):
  if shape == {"data": 1}:
    return sharding.make_mesh(shape, devices=jax.devices()[:1])
  return sharding.make_mesh(shape)


def _update(mesh, loss, sp, params, ref):
  # SGD with momentum, not the trainer's AdamW: its state is the gradient itself, and its
  # step is proportional to it, so comparing parameters and state compares the gradients.
  # (Adam's first step is lr * g / (|g| + 1e-8): on an element whose gradient is ~1e-8 it
  # turns float rounding into a 1e-4 change of the step, whatever the accumulation.)
  lr = optax.constant_schedule(0.5)
  optimizer = optax.sgd(lr, momentum=0.9)
  state = grpo.init_state(sharding.shard_params(params, CFG, mesh), optimizer, mesh)
  ref = None if ref is None else sharding.shard_params(ref, CFG, mesh)
  step = grpo.compile_update(state, ref, cfg=CFG, loss=loss, sp=sp, optimizer=optimizer,
                             lr_schedule=lr, mesh=mesh)
  batch = _batch()
  if loss.trained_mask:  # an episode's: completion positions 2-3 an observation, not trained
    batch["trained_NxT"] = ~np.isin(np.arange(T), [2, 3])[None].repeat(B * G, axis=0)
  batch = sharding.to_global(mesh, batch)
  compiled = step.lower(state, batch, ref).compile(compiler_options=FAST_COMPILE)
  return compiled, state, batch, ref


CASES = {
    # name: (mesh, loss overrides, sampling params, updates on one batch (num_iterations))
    "token_mean": ({"data": 1}, dict(micro_batch_size=4), sampling.SamplingParams(1.0, 1.0, 0),
                   1),
    "seq_mean_beta_masked": (
        {"data": 1}, dict(micro_batch_size=4, loss_agg="seq_mean_token_mean", beta=0.1,
                          mask_truncated_completions=True),
        sampling.SamplingParams(0.8, 1.0, 0), 2),
    "sum_norm_topk_beta_chunked_remat": (
        {"data": 1}, dict(micro_batch_size=8, loss_agg="seq_mean_token_sum_norm", beta=0.1,
                          kl_type="k1", mask_truncated_completions=True,
                          logprob_chunk_size=4, remat="full", scale_rewards="batch"),
        sampling.SamplingParams(1.0, 0.9, 5), 1),
    "mesh222_token_mean_beta": (
        {"data": 2, "fsdp": 2, "tensor": 2}, dict(micro_batch_size=8, beta=0.05),
        sampling.SamplingParams(1.0, 1.0, 0), 2),
    # Sub-groups (issue 51): one completion of a group of 2 per micro-batch, its prompt
    # computed for it alone; on one device, and on 8 (one row a device).
    "subgroups_seq_mean_beta_masked": (
        {"data": 1}, dict(micro_batch_size=1, loss_agg="seq_mean_token_mean", beta=0.1,
                          mask_truncated_completions=True),
        sampling.SamplingParams(0.8, 1.0, 0), 1),
    "mesh222_subgroups": (
        {"data": 2, "fsdp": 2, "tensor": 2}, dict(micro_batch_size=4, beta=0.05),
        sampling.SamplingParams(1.0, 1.0, 0), 1),
}


def assert_update_equals_whole_batch(mesh, overrides, sp, iterations):
  """Runs the update with `overrides` (a micro-batching: micro_batch_size, or packing's
  micro_batch_tokens) and with the whole batch, from the same state on the same batch, and
  checks that the states and every diagnostic of the whole batch agree to float32 rounding.
  Returns the micro-batched update's diagnostics (one dict per iteration)."""
  values = dict(num_generations=G, beta=0.0, kl_type="k3", epsilon=0.2, epsilon_high=0.28,
                loss_agg="token_mean", scale_rewards="group", mask_truncated_completions=False,
                max_new_tokens=T)
  values.update(overrides)
  micro_loss = grpo.LossConfig(**values)
  whole_loss = grpo.LossConfig(**dict(values, micro_batch_size=0, micro_batch_tokens=0))
  params, ref = random_params(CFG, 0), (random_params(CFG, 1) if values["beta"] else None)
  results = []
  for loss in (whole_loss, micro_loss):
    compiled, state, batch, ref_on_mesh = _update(mesh, loss, sp, params, ref)
    auxes = []
    for _ in range(iterations):  # num_iterations > 1: old_logp stays the sampler's
      state, aux = compiled(state, batch, ref_on_mesh)
      auxes.append(jax.device_get(aux))
    results.append((jax.device_get(state), auxes))
  (whole, whole_aux), (micro, micro_aux) = results
  for a, b in zip(whole_aux, micro_aux):
    for key in a:  # packing adds its own (padding fractions), checked by its tests
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
  assert abs(float(whole_aux[0]["grad_norm"])) > 1e-3  # a real update, not a vacuous match
  for got, want in zip(jax.tree.leaves(micro), jax.tree.leaves(whole)):
    assert_close_at_scale(got, want, rtol=1e-5, scale_tol=1e-5)
  return micro_aux


@pytest.mark.parametrize("name", sorted(CASES))
def test_micro_batched_update_equals_whole_batch_update(name):
  mesh_shape, overrides, sp, iterations = CASES[name]
  auxes = assert_update_equals_whole_batch(_mesh(mesh_shape), overrides, sp, iterations)
  # The same diagnostics as the whole batch's (grpo.micro_batch_loss adds none).
  assert set(auxes[0]) == {"policy_loss", "clip_fraction", "ratio_mean", "advantage_abs_mean",
                           "kl", "loss", "grad_norm", "learning_rate"}


def test_split_gives_every_shard_a_slice_of_every_micro_batch():
  # 2 shards of 8 rows, 4 micro-batches: micro-batch k = rows 2k, 2k+1 of shard 0 and of
  # shard 1, i.e. rows {2k, 2k+1, 8+2k, 8+2k+1}.
  rows = jnp.arange(16)
  got = np.asarray(microbatch.split(rows, 4, 2))
  np.testing.assert_array_equal(got, [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13],
                                      [6, 7, 14, 15]])


def test_memory_is_per_micro_batch():
  # A fixed micro-batch of 16 rollouts: 4x the batch (8 -> 32 prompts x 4) must leave the
  # compiled update's temporary bytes within 25% (they hold one micro-batch's activations).
  from jaxgrpo.bench import memory as bench_memory  # pylint: disable=g-import-not-at-top
  cfg = model_lib.ModelConfig(vocab_size=4096, d_model=64, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, mlp_dim=256)
  mesh = _mesh({"data": 1})
  temp = {prompts: bench_memory.update_memory(cfg, mesh, prompts=prompts, generations=4,
                                              prompt_len=16, new_tokens=48,
                                              micro_batch_size=16)["temp_bytes"]
          for prompts in (8, 32)}
  whole = bench_memory.update_memory(cfg, mesh, prompts=32, generations=4, prompt_len=16,
                                     new_tokens=48)["temp_bytes"]
  assert temp[32] <= 1.25 * temp[8], temp
  assert temp[32] < whole / 2, (temp, whole)  # the control: the whole batch holds far more


@pytest.mark.parametrize("micro_batch_size", [0, 4], ids=["whole_batch", "micro4"])
def test_both_paths_report_the_diagnostics_of_the_formulas(micro_batch_size):
  # One loss path (grpo.loss_fn is micro_loss on the whole batch): the whole batch and 4
  # micro-batches of 4 rollouts must both give the loss and every diagnostic of the paper's
  # formulas, written out here in numpy from the same log-probs: ρ = exp(logp - old_logp),
  # the clipped surrogate -min(ρA, clip(ρ, 1-ε, 1+ε_high)A), k3 = exp(ref - logp) - (ref -
  # logp) - 1, token means over the loss's tokens (truncated rows out). A mutation of the
  # surrogate, the KL or a diagnostic fails here through both paths; the equality tests
  # above would not see it, since it moves both alike. old_logp is off the policy's, so
  # ratios differ from 1 and some clip.
  sp = sampling.SamplingParams(1.0, 1.0, 0)
  params, ref = random_params(CFG, seed=3), random_params(CFG, seed=4)
  values = dict(num_generations=G, beta=0.05, kl_type="k3", epsilon=0.2, epsilon_high=0.28,
                loss_agg="token_mean", scale_rewards="group", mask_truncated_completions=True,
                max_new_tokens=T)
  batch = _batch()
  logprobs = jax.jit(lambda p: grpo.completion_logprobs(p, CFG, batch, G, sp))
  logp, ref_logp = np.asarray(logprobs(params)), np.asarray(logprobs(ref))
  mask = batch["completion_mask_NxT"] & ~batch["truncated_N"][:, None]
  r = batch["rewards_N"].reshape(B, G).astype(np.float64)
  std = r.std(axis=1, ddof=1, keepdims=True)
  adv = np.where(std > 0, (r - r.mean(axis=1, keepdims=True)) / np.where(std > 0, std, 1),
                 0).reshape(-1, 1)
  ratio = np.exp(logp - batch["old_logp_NxT"])
  clipped_ratio = np.clip(ratio, 0.8, 1.28)
  per_token = -np.minimum(ratio * adv, clipped_ratio * adv)
  kl = np.exp(ref_logp - logp) - (ref_logp - logp) - 1
  mean = lambda x: x[mask].mean()
  want = {"policy_loss": mean(per_token), "clip_fraction": mean(clipped_ratio * adv < ratio * adv),
          "ratio_mean": mean(ratio), "kl": mean(kl),
          "loss": mean(per_token) + 0.05 * mean(kl), "advantage_abs_mean": np.abs(adv).mean()}
  assert 0 < want["clip_fraction"] < 1  # the clip is exercised
  loss = grpo.LossConfig(**values, micro_batch_size=micro_batch_size)
  if micro_batch_size:
    fn = lambda p, rp: grpo.micro_batch_loss(p, rp, batch, cfg=CFG, loss=loss, sp=sp)[0][1]
  else:
    fn = lambda p, rp: grpo.loss_fn(p, rp, batch, cfg=CFG, loss=loss, sp=sp)[1]
  got = jax.jit(fn)(params, ref)
  for name, value in want.items():
    np.testing.assert_allclose(float(got[name]), value, rtol=2e-5, atol=1e-7, err_msg=name)

"""Tests for jaxgrpo.grpo: advantages, surrogate, KL, aggregation, loss, optimizer, update.

Every number checked below is worked out by hand in the comment next to it.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxgrpo.algo import grpo
from jaxgrpo.model import sharding
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.rollout import sampling
from numpy_params import random_params  # tests/numpy_params.py

CFG = model_lib.ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8, mlp_dim=64)
SP = sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
T = 4  # max_new_tokens of every test batch
INV_SQRT2 = 1 / math.sqrt(2)  # 0.70711: the G=2 advantage of rewards {0, 1} (ddof=1)


def _loss_config(**overrides):
  values = dict(num_generations=2, beta=0.0, kl_type="k3", epsilon=0.2, epsilon_high=0.28,
                loss_agg="token_mean", scale_rewards="group", mask_truncated_completions=False,
                max_new_tokens=T)
  values.update(overrides)
  return grpo.LossConfig(**values)


def _batch(rewards, lengths, *, num_prompts, truncated=None, seed=0):
  """A rollout batch: prompts of width 3 (prompt 0 left-padded by one), N rows of T tokens.

  lengths[i] generated tokens are real in row i; old_logp is 0 (callers replace it).
  """
  n = len(rewards)
  rng = np.random.default_rng(seed)
  prompt_mask = np.ones((num_prompts, 3), bool)
  prompt_mask[0, 0] = False
  prompt_tokens = np.where(prompt_mask, rng.integers(1, CFG.vocab_size, (num_prompts, 3)), 0)
  completion_mask = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
  completion_tokens = np.where(completion_mask, rng.integers(1, CFG.vocab_size, (n, T)), 0)
  if truncated is None:
    truncated = np.zeros(n, bool)
  return {"prompt_tokens_BxL": prompt_tokens.astype(np.int32),
          "prompt_mask_BxL": prompt_mask,
          "completion_tokens_NxT": completion_tokens.astype(np.int32),
          "completion_mask_NxT": completion_mask,
          "old_logp_NxT": np.zeros((n, T), np.float32),
          "rewards_N": np.asarray(rewards, np.float32),
          "truncated_N": np.asarray(truncated, bool),
          "scored_N": np.ones(len(truncated), bool)}


BETA = 0.1  # the KL coefficient of the beta > 0 entry of _evaluate's table
# XLA's CPU backend at optimisation level 0 compiles the model's gradients about twice as fast;
# compiling dominates this file's runtime and nothing here depends on LLVM's optimisations.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _evaluate(params, ref_params, batch):
  """Everything the loss_fn tests need, from one compilation (compiles dominate the runtime):

  logp, ref_logp: completion_logprobs of params and ref_params.
  table: {(loss_agg, mask_truncated_completions, beta): (loss, aux)} for every loss_agg with
    the mask off and on (beta 0), and token_mean with beta = BETA (k3 against ref_params).
  grad: d loss / d params of token_mean, beta 0.
  """
  out = {"logp": grpo.completion_logprobs(params, CFG, batch, 2, SP),
         "ref_logp": grpo.completion_logprobs(ref_params, CFG, batch, 2, SP),
         "table": {}}
  for agg in grpo.LOSS_AGGS:
    for masked in (False, True):
      loss = _loss_config(loss_agg=agg, mask_truncated_completions=masked)
      out["table"][(agg, masked, 0.0)] = grpo.loss_fn(params, None, batch, cfg=CFG, loss=loss,
                                                      sp=SP)
  out["table"][("token_mean", False, BETA)] = grpo.loss_fn(
      params, ref_params, batch, cfg=CFG, loss=_loss_config(beta=BETA), sp=SP)
  out["grad"] = jax.grad(lambda p: grpo.loss_fn(p, None, batch, cfg=CFG, loss=_loss_config(),
                                                sp=SP)[0])(params)
  return out


def _logprobs(params, batch):
  """completion_logprobs(params) of a B=4, G=2 batch, as numpy."""
  return np.asarray(_evaluate(params, params, batch)["logp"])


def _with_old_logp(batch, params):
  """The batch with old_logp from `params` itself: the mu = 1 (on-policy) case."""
  return dict(batch, old_logp_NxT=_logprobs(params, batch))


def _host_params(seed):
  return random_params(CFG, seed)


@pytest.fixture(name="params", scope="module")
def fixture_params():
  return _host_params(0)


@pytest.fixture(name="ref_params", scope="module")
def fixture_ref_params():
  return _host_params(1)


def _max_abs_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# group_advantages.


REWARDS_8 = jnp.array([1, 0, 0, 1, 1, 1, 1, 1], jnp.float32)


def test_group_advantages_group_scaling_uses_sample_std_and_zero_for_flat_groups():
  adv = grpo.group_advantages(REWARDS_8, 4, "group")
  # Group 1 [1,0,0,1]: mean .5, deviations +-.5; ddof=1 std = sqrt(4 * .25 / 3) = 0.57735;
  # .5 / 0.57735 = 0.86603. Group 2 [1,1,1,1]: std 0, every advantage exactly 0 (no NaN).
  np.testing.assert_allclose(adv[:4], [0.86603, -0.86603, -0.86603, 0.86603], atol=1e-5)
  np.testing.assert_array_equal(adv[4:], np.zeros(4))


def test_group_advantages_batch_scaling_uses_whole_batch_std():
  adv = grpo.group_advantages(REWARDS_8, 4, "batch")
  # Centred by group: [.5,-.5,-.5,.5, 0,0,0,0]. Batch std (ddof=1) of all 8 rewards: mean .75,
  # squared deviations 6 * .25^2 + 2 * .75^2 = .375 + 1.125 = 1.5; 1.5 / 7 = .214286;
  # sqrt = 0.46291. .5 / 0.46291 = 1.08012.
  np.testing.assert_allclose(adv, [1.08012, -1.08012, -1.08012, 1.08012, 0, 0, 0, 0],
                             atol=1e-5)


def test_unscored_rows_leave_their_groups_statistics():
  # Rows no reward could score (scorer.py) get 0 and leave the mean and the std. Group 1
  # [1, 0, (9), 1]: the scored [1, 0, 1] have mean 2/3, ddof=1 std sqrt((2 * (1/3)^2 +
  # (2/3)^2) / 2) = sqrt(1/3) = 0.57735, so 1 -> (1/3) / 0.57735 = 0.57735 and
  # 0 -> -1.15470; the unscored 9 would otherwise have dominated both. Group 2 [0, 0, 0, 1],
  # all scored: mean .25, std sqrt((3 * .0625 + .5625) / 3) = .5 -> [-.5, -.5, -.5, 1.5].
  # Group 3: one scored row, nothing to compare it with: all 0.
  rewards_N = jnp.array([1, 0, 9, 1, 0, 0, 0, 1, 5, 7, 7, 7], jnp.float32)
  scored_N = jnp.array([1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0], bool)
  adv = grpo.group_advantages(rewards_N, 4, "group", scored_N)
  np.testing.assert_allclose(adv, [0.57735, -1.15470, 0, 0.57735, -0.5, -0.5, -0.5, 1.5,
                                   0, 0, 0, 0], atol=1e-5)
  # Whole groups unscored: zeros, no NaN; and the host's flat-group rule agrees.
  assert not np.isnan(grpo.group_advantages(rewards_N, 4, "batch", scored_N)).any()
  np.testing.assert_array_equal(grpo.flat_groups(np.asarray(rewards_N).reshape(3, 4),
                                                 np.asarray(scored_N).reshape(3, 4)),
                                [False, False, True])
  # All scored: bitwise what the unmasked formula (before unscored rows existed) gives.
  r = jax.random.normal(jax.random.key(0), (64, 8)) * 3 + 10
  diffs = r - r[:, :1]
  centered = jnp.where(grpo.flat_groups(r)[:, None], 0.0,
                       diffs - diffs.mean(axis=1, keepdims=True))
  floor = grpo.STD_FLOOR_ULPS * float(jnp.finfo(jnp.float32).eps)
  divisor = jnp.maximum(jnp.std(diffs, axis=1, keepdims=True, ddof=1),
                        floor * jnp.max(jnp.abs(r), axis=1, keepdims=True))
  np.testing.assert_array_equal(grpo.group_advantages(r.reshape(-1), 8, "group"),
                                (centered / divisor).reshape(-1))


def test_group_advantages_none_only_centres():
  adv = grpo.group_advantages(REWARDS_8, 4, "none")
  # Group means .5 and 1: [1-.5, 0-.5, 0-.5, 1-.5, 0, 0, 0, 0].
  np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-7)


def test_group_advantages_two_samples_document_ddof_1():
  adv = grpo.group_advantages(jnp.array([0.0, 1.0]), 2, "group")
  # Mean .5, deviations -+.5; ddof=1 std = sqrt((.25 + .25) / 1) = 0.70711;
  # -.5 / 0.70711 = -0.70711 (ddof=0 would give std .5 and +-1).
  np.testing.assert_allclose(adv, [-INV_SQRT2, INV_SQRT2], atol=1e-6)


# Values float32 cannot store (0.1, 0.3, 0.7, 1.1), tiny and large ones, and exact ones.
FLAT_VALUES = (0.1, 0.3, 0.7, 0.9, 1.1, 1e-3, 1e3, 0.0, 1.0, -0.3)


@pytest.mark.parametrize("scale_rewards", grpo.SCALE_REWARDS)
def test_equal_rewards_give_exactly_zero_advantage_for_every_group_size(scale_rewards):
  # Before the flat-group rule, eight rewards of 0.1 left a centred value and a std of ~1e-8
  # whose quotient was -0.9354 for every row (0.3 and 0.7: +0.9354; G=16 at 0.7: +0.968).
  # Each batch holds 30 flat groups, every value next to another one, so "batch" scaling
  # has a non-zero batch std to divide by: the flat groups must still get exactly 0. (One
  # batch per group size: eagerly, every new shape compiles each op again.)
  jitted = jax.jit(grpo.group_advantages, static_argnums=(1, 2))
  values = [(v, FLAT_VALUES[(i + 1) % len(FLAT_VALUES)], v) for i, v in enumerate(FLAT_VALUES)]
  for g in range(2, 17):
    rewards = np.repeat(np.float32(values).ravel(), g)
    for fn in (grpo.group_advantages, jitted):
      adv = np.asarray(fn(jnp.asarray(rewards), g, scale_rewards)).reshape(len(values), 3, g)
      assert np.all(adv == 0.0), (g, scale_rewards, np.argwhere(adv != 0)[:3])


def test_flat_groups_on_host_rewards_tests_equality_not_std():
  # The trainer's zero_std_group_fraction calls flat_groups on numpy rewards: numpy's float32
  # std of seven 0.1s is 7.45e-9, not 0, yet the group is flat.
  groups = np.array([[0.1] * 7, [0.1] * 6 + [1.1]], np.float32)
  assert groups[0].std() > 0
  flat = grpo.flat_groups(groups)
  assert isinstance(flat, np.ndarray) and flat.tolist() == [True, False]


def test_rewards_differing_by_rounding_are_not_scaled_up_to_order_one():
  # Seven rewards of 0.1 and one a single float32 step (2^-27 = 7.45e-9) above: the sample
  # std is ~2.6e-9, and dividing by it would give advantages of order 1 (+2.47 / -0.35).
  # The floor, 16 ulps of max|r| = 16 * 2^-23 * 0.1 = 1.91e-7, takes over: the largest
  # centred value 7/8 * 7.45e-9 = 6.52e-9 gives 6.52e-9 / 1.91e-7 = 0.034 (n/16 for a
  # difference of n = 0.625 ulps of 0.1's magnitude; 0.1 sits low in its binade).
  rewards = np.full(8, 0.1, np.float32)
  rewards[3] = np.nextafter(np.float32(0.1), np.float32(1))
  for mode in ("group", "batch"):
    adv = np.asarray(grpo.group_advantages(jnp.asarray(rewards), 8, mode))
    np.testing.assert_allclose(np.max(np.abs(adv)), 0.0342, rtol=0.01, err_msg=mode)


def test_a_constant_added_to_every_reward_leaves_the_advantages_alone():
  # One reward of 16 gets a 1e-3 bonus. Textbook (ddof=1): centred 15/16 * 1e-3 and
  # -1/16 * 1e-3, std = 1e-3 / 16 * sqrt((15 + 225) / 15) = 2.5e-4, so +3.75 and -0.25.
  # At offsets 0, 10 and 100 the differences from the group's first reward are exact
  # (0.999e-3 after 100.001's float32 rounding; one different reward's advantages do not
  # depend on the difference's size) and the floor, 16 ulps of 100 = 1.9e-4, stays below
  # the std. The floor of 1e-4 * max|r| used before gave 3.75, 0.937 and 0.094.
  want = np.array([-0.25] * 15 + [3.75], np.float32)
  for offset in (0.0, 10.0, 100.0):
    rewards = np.full(16, offset, np.float32)
    rewards[-1] += 1e-3
    for mode in ("group", "batch"):
      adv = grpo.group_advantages(jnp.asarray(rewards), 16, mode)
      np.testing.assert_allclose(adv, want, rtol=1e-5, err_msg=f"{mode} at {offset}")
  # Two groups: each keeps its own advantages whatever the other's offset.
  rewards = np.concatenate([np.full(16, 0.0), np.full(16, 100.0)]).astype(np.float32)
  rewards[15] += 1e-3
  rewards[31] += 1e-3
  adv = grpo.group_advantages(jnp.asarray(rewards), 16, "group")
  np.testing.assert_allclose(adv, np.concatenate([want, want]), rtol=1e-5)


def test_one_different_reward_gets_the_textbook_advantage():
  # [.1, .1, .1, 1.1]: mean .35, deviations -.25 x3 and +.75; ddof=1 std =
  # sqrt((3 * .0625 + .5625) / 3) = sqrt(.25) = .5: advantages -.5, -.5, -.5, +1.5. The
  # same differences on a 1e3 scale ([1000, 1000, 1000, 1001]) give the same advantages:
  # the floor, 16 ulps of 1001 = 1.9e-3, lies below the std .5 and changes nothing.
  for rewards in ([0.1, 0.1, 0.1, 1.1], [1000.0, 1000.0, 1000.0, 1001.0]):
    adv = grpo.group_advantages(jnp.array(rewards, jnp.float32), 4, "group")
    np.testing.assert_allclose(adv, [-0.5, -0.5, -0.5, 1.5], rtol=1e-5)


def test_group_advantages_unknown_mode_names_it():
  with pytest.raises(ValueError, match="scale_rewards='groups'"):
    grpo.group_advantages(REWARDS_8, 4, "groups")


# clipped_surrogate.


def test_clipped_surrogate_hand_examples_and_clip_mask():
  ratios = jnp.array([1.5, 0.5, 0.5, 1.5])
  adv = jnp.array([1.0, 1.0, -1.0, -1.0])
  old = jnp.full((4, 1), -2.0)
  logp = old + jnp.log(ratios)[:, None]  # exp(logp - old) = ratio
  loss, clipped, ratio = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28)
  # Clip range [1 - .2, 1 + .28] = [.8, 1.28]. loss = -min(r * A, clip(r) * A):
  #   A=+1, r=1.5: min(1.5, 1.28) = 1.28 -> -1.28, clip active.
  #   A=+1, r=0.5: min(0.5, 0.8) = 0.5 -> -0.5, unclipped (smaller) wins.
  #   A=-1, r=0.5: min(-0.5, -0.8) = -0.8 -> +0.8, clip active.
  #   A=-1, r=1.5: min(-1.5, -1.28) = -1.5 -> +1.5, unclipped wins.
  np.testing.assert_allclose(ratio[:, 0], [1.5, 0.5, 0.5, 1.5], rtol=1e-6)
  np.testing.assert_allclose(loss[:, 0], [-1.28, -0.5, 0.8, 1.5], rtol=1e-6)
  np.testing.assert_array_equal(clipped[:, 0], [True, False, True, False])


def test_clipped_surrogate_clip_stops_the_gradient():
  ratios = jnp.array([1.5, 0.5, 0.5, 1.5])
  adv = jnp.array([1.0, 1.0, -1.0, -1.0])
  old = jnp.zeros((4, 1))

  def total(logp):
    return grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28)[0].sum()

  grad = jax.grad(total)(jnp.log(ratios)[:, None])
  # d(-r * A)/d logp = -A * r where unclipped; 0 where the clipped constant is chosen:
  #   [clipped -> 0, -1 * .5 = -.5, clipped -> 0, -(-1) * 1.5 = 1.5].
  np.testing.assert_allclose(grad[:, 0], [0.0, -0.5, 0.0, 1.5], rtol=1e-6)


def test_clipped_surrogate_asymmetric_upper_bound():
  # A=+1, r=1.25: symmetric clip (eps_high=.2) caps at 1.2 -> loss -1.2, clip active;
  # eps_high=.28 allows up to 1.28, so 1.25 is unclipped -> loss -1.25.
  logp = jnp.log(jnp.array([[1.25]]))
  old, adv = jnp.zeros((1, 1)), jnp.ones(1)
  sym_loss, sym_clip, _ = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.2)
  asym_loss, asym_clip, _ = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28)
  np.testing.assert_allclose([sym_loss[0, 0], asym_loss[0, 0]], [-1.2, -1.25], rtol=1e-6)
  assert bool(sym_clip[0, 0]) and not bool(asym_clip[0, 0])


# decoupled_surrogate: partial rollouts' off-policy correction.


def test_decoupled_surrogate_hand_computed_weights_loss_and_gradient():
  # One group of 2 rows x 2 tokens whose tokens come from two parameter versions: the
  # current policy's log-probs logp, and the sampler's (behaviour) log-probs per token.
  #   row 0: token 0 sampled by this step's parameters (behav = logp: w = 1); token 1 by
  #          the previous version, behav -2.5 against logp -2.0: w = e^0.5 = 1.6487.
  #   row 1: token 0 behav -1.5 against -0.5: w = e^1 = 2.718, truncated to C = 2;
  #          token 1 on-policy, w = 1.
  logp = jnp.array([[-1.0, -2.0], [-0.5, -1.5]])
  behav = jnp.array([[-1.0, -2.5], [-1.5, -1.5]])
  adv = jnp.array([0.5, -0.5])  # rewards {1, 0}, scale_rewards='none'
  loss, clipped, ratio, weight = grpo.decoupled_surrogate(logp, behav, adv, 0.2, 0.28, 2.0)
  np.testing.assert_allclose(weight, [[1.0, math.exp(0.5)], [math.e, 1.0]], rtol=1e-6)
  # r = pi_theta / pi_prox = 1 in value (pi_prox = the step's parameters), so the clip never
  # binds and each token's loss is -min(w, C) * A: [-0.5, -0.8244], [+1.0, +0.5].
  np.testing.assert_allclose(ratio, 1.0)
  assert not np.asarray(clipped).any()
  np.testing.assert_allclose(loss, [[-0.5, -0.5 * math.exp(0.5)], [1.0, 0.5]], rtol=1e-6)
  # The gradient of the summed loss is -min(w, C) * A per token (the weight is a constant).
  grad = jax.grad(lambda lp: grpo.decoupled_surrogate(lp, behav, adv, 0.2, 0.28, 2.0)[0].sum())(
      logp)
  np.testing.assert_allclose(grad, [[-0.5, -0.5 * math.exp(0.5)], [1.0, 0.5]], rtol=1e-6)


def test_the_loss_with_partial_rollouts_weights_each_token_by_its_sampler(params):
  # loss_fn end to end: this step's log-probs from the model, the behaviour log-probs of the
  # rows shifted as if rows 0 and 3 were sampled one version earlier (by 0.3 and -1.0 nats
  # per token). token_mean loss = -sum_t min(w_t, C) A_t / tokens, ratio 1.
  batch = _on_policy_batch(params)
  logp = batch["old_logp_NxT"]
  shift = np.zeros((8, 1), np.float32)
  shift[0], shift[3] = 0.3, -1.0
  behav = dict(batch, old_logp_NxT=logp - shift, rewards_N=np.asarray(REWARDS, np.float32))
  loss_cfg = _loss_config(importance_weight_cap=2.0, scale_rewards="none")
  total, aux = jax.jit(functools.partial(grpo.loss_fn, cfg=CFG, loss=loss_cfg, sp=SP))(
      params, None, behav)
  mask = batch["completion_mask_NxT"]
  adv = np.asarray(grpo.group_advantages(jnp.asarray(REWARDS, jnp.float32), 2, "none"))
  w = np.minimum(np.exp(shift), 2.0) * np.ones_like(logp)  # e^0.3 = 1.35, e^-1 = 0.37
  want = -(w * adv[:, None])[mask].sum() / mask.sum()
  np.testing.assert_allclose(float(total), want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(float(aux["importance_weight_mean"]), w[mask].mean(), rtol=1e-5)
  assert float(aux["importance_weight_clipped_fraction"]) == 0.0
  # The cap binds where a weight exceeds it: rows 0's e^0.3 under C = 1.2.
  capped = _loss_config(importance_weight_cap=1.2, scale_rewards="none")
  _, aux = jax.jit(functools.partial(grpo.loss_fn, cfg=CFG, loss=capped, sp=SP))(
      params, None, behav)
  np.testing.assert_allclose(float(aux["importance_weight_clipped_fraction"]),
                             mask[0].sum() / mask.sum(), rtol=1e-6)
  # Off (the default, cap 0): no weights, the on-policy loss and diagnostics of before.
  _, aux = jax.jit(functools.partial(grpo.loss_fn, cfg=CFG, loss=_loss_config(), sp=SP))(
      params, None, behav)
  assert "importance_weight_mean" not in aux


# kl_penalty.


def test_kl_penalty_k1_and_k3_hand_values():
  logp = jnp.log(jnp.array([[0.5, 0.25]]))
  ref = jnp.log(jnp.array([[0.25, 0.5]]))
  # k1 = logp - ref: log(.5/.25) = log 2 = 0.69315; log(.25/.5) = -0.69315.
  np.testing.assert_allclose(grpo.kl_penalty(logp, ref, "k1")[0], [0.69315, -0.69315],
                             atol=1e-5)
  # k3 = r - log r - 1 with r = ref / pi: r = .5: .5 + 0.69315 - 1 = 0.19315;
  # r = 2: 2 - 0.69315 - 1 = 0.30685.
  np.testing.assert_allclose(grpo.kl_penalty(logp, ref, "k3")[0], [0.19315, 0.30685],
                             atol=1e-5)


def test_kl_penalty_k3_zero_when_equal_and_never_negative():
  logp = jnp.linspace(-5.0, -0.01, 11)[None, :]
  # Equal log-probs: r = 1, 1 - 0 - 1 = 0 exactly.
  np.testing.assert_array_equal(grpo.kl_penalty(logp, logp, "k3"), np.zeros((1, 11)))
  # r - log r - 1 >= 0 for every r > 0 (log r <= r - 1): all pairs of the grid.
  pairs = grpo.kl_penalty(logp.T * jnp.ones((1, 11)), logp * jnp.ones((11, 1)), "k3")
  assert float(pairs.min()) >= 0.0


def test_kl_penalty_unknown_type_names_it():
  with pytest.raises(ValueError, match="kl_type='k2'"):
    grpo.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), "k2")


# aggregate.


PER_TOKEN = jnp.array([[1.0, 2.0, 1e6], [4.0, 1e6, 1e6]])  # 1e6 only where masked
MASK = jnp.array([[True, True, False], [True, False, False]])


def test_aggregate_token_mean():
  # Real tokens 1, 2, 4: (1 + 2 + 4) / 3 = 2.33333.
  np.testing.assert_allclose(grpo.aggregate(PER_TOKEN, MASK, "token_mean", 3), 7 / 3,
                             rtol=1e-6)


def test_aggregate_seq_mean_token_mean():
  # Row means (1 + 2) / 2 = 1.5 and 4 / 1 = 4; their mean (1.5 + 4) / 2 = 2.75.
  np.testing.assert_allclose(grpo.aggregate(PER_TOKEN, MASK, "seq_mean_token_mean", 3), 2.75,
                             rtol=1e-6)


def test_aggregate_seq_mean_token_sum_norm_divides_by_rows_times_max_new_tokens():
  # (1 + 2 + 4) / (N * max_new_tokens) = 7 / (2 * 3) = 1.16667; with max_new_tokens = 7:
  # 7 / 14 = 0.5 (a constant denominator, independent of the lengths).
  np.testing.assert_allclose(grpo.aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", 3),
                             7 / 6, rtol=1e-6)
  np.testing.assert_allclose(grpo.aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", 7),
                             0.5, rtol=1e-6)


def test_aggregate_modes_differ_and_masked_entries_never_count():
  values = [float(grpo.aggregate(PER_TOKEN, MASK, agg, 3)) for agg in grpo.LOSS_AGGS]
  # 2.33333, 2.75, 1.16667 (above): three different numbers.
  assert len({round(v, 4) for v in values}) == 3
  # Changing the masked entries from 1e6 to -1e9 changes nothing.
  other = jnp.where(MASK, PER_TOKEN, -1e9)
  for agg, value in zip(grpo.LOSS_AGGS, values):
    assert float(grpo.aggregate(other, MASK, agg, 3)) == value


def test_aggregate_ignores_inf_and_nan_in_masked_positions():
  # A masked position may hold anything (a -69 floor's overflow, a padded NaN): multiplying by
  # the mask would turn inf * 0 into NaN. Same values as with 1e6 there (above).
  for bad in (np.inf, -np.inf, np.nan):
    poisoned = jnp.where(MASK, PER_TOKEN, bad)
    for agg, want in zip(grpo.LOSS_AGGS, (7 / 3, 2.75, 7 / 6)):
      np.testing.assert_allclose(grpo.aggregate(poisoned, MASK, agg, 3), want, rtol=1e-6)


def test_aggregate_rows_without_tokens_leave_every_denominator():
  # Three kept rows of per-token loss 1 (2, 1 and 3 tokens) and a fourth row masked whole
  # (a truncated row under mask_truncated_completions), max_new_tokens 3:
  #   token_mean: 6 tokens / 6 = 1;  seq_mean_token_mean: row means 1, 1, 1 over 3 rows = 1
  #   (counting the masked row in the 1/N would give 3 / 4 = .75);
  #   seq_mean_token_sum_norm: 6 / (3 rows * 3) = .66667 (with 4 rows: .5).
  per_token = jnp.ones((4, 3))
  kept = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], bool)
  with_masked_row = jnp.concatenate([kept, jnp.zeros((1, 3), bool)])
  for agg, want in zip(grpo.LOSS_AGGS, (1.0, 1.0, 2 / 3)):
    alone = grpo.aggregate(per_token[:3], kept, agg, 3)
    np.testing.assert_allclose(alone, want, rtol=1e-6, err_msg=agg)
    np.testing.assert_allclose(grpo.aggregate(per_token, with_masked_row, agg, 3), want,
                               rtol=1e-6, err_msg=agg)


def test_aggregate_unknown_mode_names_it():
  with pytest.raises(ValueError, match="loss_agg='seq_mean'"):
    grpo.aggregate(PER_TOKEN, MASK, "seq_mean", 3)


# loss_fn on a tiny model. Every batch has the same shapes (B=4 prompts, G=2, T=4), so each
# jitted helper compiles once.


REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
LENGTHS = [4, 2, 3, 4, 4, 4, 1, 4]
# Group by group (G=2, ddof=1, see the group_advantages tests): [1,0] -> +-.70711,
# [0,1] -> -+.70711, [1,1] -> 0, [0,1] -> -+.70711.
ADVANTAGES = INV_SQRT2 * np.array([1, -1, -1, 1, 0, 0, -1, 1], np.float32)
# At ratio 1 the per-token loss is -A_i on row i's real tokens; sum over all real tokens:
# -.70711 * (4 - 2 - 3 + 4 + 0 - 1 + 4) = -.70711 * 6 = -4.24264, over 26 tokens:
POLICY_LOSS_MU1 = -0.16318  # token_mean: -4.24264 / 26


def _on_policy_batch(params, rewards=REWARDS, lengths=LENGTHS, truncated=None):
  """B=4, G=2 rows with old_logp from `params` itself (mu = 1)."""
  return _with_old_logp(_batch(rewards, lengths, num_prompts=4, truncated=truncated), params)


def test_mask_truncated_completions_drops_truncated_rows(params):
  # Row 0 hit max_new_tokens without EOS (truncated).
  batch = _on_policy_batch(params, truncated=[True] + [False] * 7)
  # Only row 0's old log-probs move: its ratios become e^1 = 2.718 (clipped to 1.28). Its
  # reward, hence every advantage, is unchanged.
  shift = np.zeros((8, 1), np.float32)
  shift[0] = 1.0
  changed = dict(batch, old_logp_NxT=batch["old_logp_NxT"] - shift)
  before = _evaluate(params, params, batch)["table"]
  after = _evaluate(params, params, changed)["table"]
  for agg in grpo.LOSS_AGGS:
    (a, aux_a), (b, aux_b) = before[(agg, True, 0.0)], after[(agg, True, 0.0)]
    assert float(a) == float(b), agg
    assert float(aux_a["clip_fraction"]) == float(aux_b["clip_fraction"]) == 0.0, agg
    # Control: without the flag the same change lowers the loss (row 0 has A = +.70711; its
    # per-token loss goes from -.70711 to -1.28 * .70711 = -.90510) and clips row 0's 4
    # tokens out of 26.
    (a, _), (b, aux_b) = before[(agg, False, 0.0)], after[(agg, False, 0.0)]
    assert float(b) < float(a) - 1e-3, agg
    np.testing.assert_allclose(aux_b["clip_fraction"], 4 / 26, rtol=1e-6)


def test_masked_truncated_row_leaves_the_loss_for_every_loss_agg(params):
  # Row 0 (A = +.70711, 4 tokens) truncated and masked; at ratio 1 the per-token loss is -A_i.
  # Rows 1..7: A = .70711 * [-1, -1, 1, 0, 0, -1, 1], lengths [2, 3, 4, 4, 4, 1, 4] (22 tokens).
  #   token_mean: -.70711 * (-2 - 3 + 4 - 1 + 4) / 22 = -1.41421 / 22 = -0.064282
  #   seq_mean_token_mean: row means -A_i, sum -.70711 * (-1) = .70711, over 7 rows = 0.101015
  #     (over all 8 rows, as before the fix: 0.088388)
  #   seq_mean_token_sum_norm: -1.41421 / (7 rows * T=4) = -0.050508 (over 8 rows: -0.044194)
  batch = _on_policy_batch(params, truncated=[True] + [False] * 7)
  table = _evaluate(params, params, batch)["table"]
  for agg, want in (("token_mean", -0.064282), ("seq_mean_token_mean", 0.101015),
                    ("seq_mean_token_sum_norm", -0.050508)):
    np.testing.assert_allclose(table[(agg, True, 0.0)][0], want, atol=1e-5, err_msg=agg)


def test_mu_1_ratio_is_one_and_loss_is_policy_gradient_form(params):
  batch = _on_policy_batch(params)
  table = _evaluate(params, params, batch)["table"]
  # Every ratio is 1, so the per-token loss is -A_i on row i's real tokens:
  #   token_mean: -4.24264 / 26 = -0.16318
  #   seq_mean_token_mean: row means -A_i, whose mean is -.70711 * (1-1-1+1+0+0-1+1) / 8 = 0
  #   seq_mean_token_sum_norm: -4.24264 / (N * T) = -4.24264 / 32 = -0.13258
  for agg, want in (("token_mean", POLICY_LOSS_MU1), ("seq_mean_token_mean", 0.0),
                    ("seq_mean_token_sum_norm", -0.13258)):
    value, aux = table[(agg, False, 0.0)]
    np.testing.assert_allclose(value, want, atol=1e-5, err_msg=agg)
    np.testing.assert_allclose(aux["ratio_mean"], 1.0, atol=1e-6)
    assert float(aux["clip_fraction"]) == 0.0


def test_mu_1_gradient_in_log_probs_is_policy_gradient(params, monkeypatch):
  # The loss as a function of the policy's token log-probs (the real model's, mu = 1): at
  # r = exp(logp - old) = 1, d(-A * r)/d logp = -A * r = -A, so for token_mean
  # dL/d logp[i, t] = -A_i * mask[i, t] / 26 (e.g. row 0: -.70711 / 26 = -0.027196), the
  # gradient of the policy-gradient form -sum(A * logp * mask) / 26.
  batch = _on_policy_batch(params)
  monkeypatch.setattr(grpo, "completion_logprobs", lambda logp, *unused, **options: logp)
  grad = jax.jit(jax.grad(lambda logp: grpo.loss_fn(logp, None, batch, cfg=CFG,
                                                    loss=_loss_config(), sp=SP)[0]))(
                                                        batch["old_logp_NxT"])
  want = -ADVANTAGES[:, None] * batch["completion_mask_NxT"] / 26
  np.testing.assert_allclose(want[0, 0], -0.027196, rtol=1e-4)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-9)


def test_mu_1_gradient_in_params_matches_policy_gradient_directions(params):
  # The same in parameter space: the GRPO gradient's projection on a direction v must equal
  # the derivative of the policy-gradient form pg(theta) = -sum(A * logp * mask) / 26 along
  # v, measured by central differences (pg(theta + h v) - pg(theta - h v)) / 2h.
  batch = _on_policy_batch(params)
  grad = _evaluate(params, params, batch)["grad"]
  mask = batch["completion_mask_NxT"]

  def pg(p):
    logp = _logprobs(p, batch).astype(np.float64)
    return -(ADVANTAGES[:, None] * logp * mask).sum() / 26

  # Flat numpy vectors: eager jnp ops on every leaf would each compile a kernel.
  leaves, treedef = jax.tree.flatten(params)
  theta = np.concatenate([np.ravel(x) for x in leaves])
  splits = np.cumsum([x.size for x in leaves])[:-1]

  def unflatten(flat):
    return treedef.unflatten([piece.reshape(x.shape)
                              for piece, x in zip(np.split(flat, splits), leaves)])

  g = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grad)])
  rng = np.random.default_rng(7)
  h = 1e-3  # measured: relative error ~1e-6 along g, absolute ~1e-5 on random directions
  for v in (g, rng.standard_normal(g.size), rng.standard_normal(g.size)):
    v = (v / np.linalg.norm(v)).astype(np.float32)  # unit length
    numeric = (pg(unflatten(theta + h * v)) - pg(unflatten(theta - h * v))) / (2 * h)
    np.testing.assert_allclose(g @ v, numeric, rtol=1e-3, atol=5e-5)
  assert np.linalg.norm(g) > 0.1  # a real gradient (|g| = 1.29 here), not a vacuous match


def test_zero_reward_batch_gives_exactly_zero_gradient(params):
  # All rewards 0: every group is flat, every advantage is 0, so every per-token loss is
  # -min(r * 0, clip(r) * 0) = 0 and so is its gradient, whatever the ratios.
  batch = _batch([0.0] * 8, LENGTHS, num_prompts=4)
  batch["old_logp_NxT"] = np.full((8, T), -3.0, np.float32)  # ratios far from 1
  out = _evaluate(params, params, batch)
  value, _ = out["table"][("token_mean", False, 0.0)]
  assert float(value) == 0.0
  grads = out["grad"]  # jax.grad of loss_fn (token_mean, beta 0)
  for g in jax.tree.leaves(grads):
    np.testing.assert_array_equal(g, np.zeros_like(g))


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _one_group_of_8_loss_and_grad(params, batch):
  """loss_fn (token_mean, beta 0) and its gradient for one prompt with G = 8 samples."""
  return jax.value_and_grad(lambda p: grpo.loss_fn(
      p, None, batch, cfg=CFG, loss=_loss_config(num_generations=8), sp=SP)[0])(params)


@pytest.mark.parametrize("value", [0.1, 0.7, 1e3])
def test_flat_rewards_group_gives_exactly_zero_gradient(params, value):
  # One prompt, G = 8, every reward the same value float32 cannot store: every advantage must
  # be exactly 0, so the loss and its gradient are 0 whatever the ratios. (The std > 0 test
  # gave every row -0.9354 at 0.1, hence a full-strength update, the loss .9354.)
  batch = _batch([value] * 8, LENGTHS, num_prompts=1)
  batch["old_logp_NxT"] = np.full((8, T), -3.0, np.float32)
  loss, grads = _one_group_of_8_loss_and_grad(params, batch)
  assert float(loss) == 0.0
  for g in jax.tree.leaves(grads):
    np.testing.assert_array_equal(g, np.zeros_like(g))


def test_kl_diagnostic_at_beta_zero_is_old_minus_new_logp(params):
  # With beta 0 and num_iterations > 1, the k1 estimate of KL(pi_old || pi_theta) over the
  # sampled tokens is mean(old_logp - logp): after an update that made the sampled tokens
  # 0.25 nats less likely than the sampler found them (old = logp + .25), kl = +0.25.
  batch = _batch(REWARDS, LENGTHS, num_prompts=4)
  logp = _logprobs(params, batch)
  batch["old_logp_NxT"] = logp + 0.25
  _, aux = _evaluate(params, params, batch)["table"][("token_mean", False, 0.0)]
  np.testing.assert_allclose(aux["kl"], 0.25, rtol=1e-5)


def test_kl_penalty_uses_untruncated_distributions_under_top_k(monkeypatch):
  # Hand-built logits (the model replaced by one logit row per policy), V = 4, top-k 2, T=1:
  #   policy    [2, 1, 0, -1]: top-2 {0, 1}
  #   reference [-1, 0, 1, 2]: top-2 {3, 2}
  # Both rows sampled token 1: outside the reference's kept set, so under the truncated
  # profiles its reference log-prob is the -69 floor and k3 = e^(-69-lp) + 69 + lp - 1 ~ 67.
  # Untruncated (temperature 1), both logsumexps are the same (same logits, permuted), so
  # log(p_ref / p_pol) = 0 - 1 = -1 and k3 = e^-1 + 1 - 1 = 0.36788.
  # The ratio stays on the sampling profile: old_logp is token 1's truncated log-prob
  # log(e / (e^2 + e)) = -log(1 + e) = -1.31326, so the ratio is 1 (untruncated it would be
  # e^(log .23688 + 1.31326) = .8808).
  v = 4
  monkeypatch.setattr(
      grpo.model_lib, "score_groups",
      lambda p, cfg, pt, pm, comp_BxGxT, cm, **unused: jnp.broadcast_to(
          p["logits"], comp_BxGxT.shape + (v,)))
  policy = {"logits": jnp.array([2.0, 1.0, 0.0, -1.0])}
  reference = {"logits": jnp.array([-1.0, 0.0, 1.0, 2.0])}
  batch = {"prompt_tokens_BxL": np.ones((1, 1), np.int32),
           "prompt_mask_BxL": np.ones((1, 1), bool),
           "completion_tokens_NxT": np.ones((2, 1), np.int32),
           "completion_mask_NxT": np.ones((2, 1), bool),
           "old_logp_NxT": np.full((2, 1), -math.log(1 + math.e), np.float32),
           "rewards_N": np.array([1.0, 0.0], np.float32),
           "truncated_N": np.zeros(2, bool),
           "scored_N": np.ones(2, bool)}
  sp = sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=2)
  total, aux = grpo.loss_fn(policy, reference, batch, cfg=CFG, loss=_loss_config(beta=BETA),
                            sp=sp)
  np.testing.assert_allclose(aux["kl"], math.exp(-1), rtol=1e-5)
  np.testing.assert_allclose(aux["ratio_mean"], 1.0, rtol=1e-6)
  # Advantages +-.70711 at ratio 1 cancel in the token mean: the total is .1 * .36788.
  np.testing.assert_allclose(total, BETA * math.exp(-1), rtol=1e-5)
  grad = jax.grad(lambda p: grpo.loss_fn(p, reference, batch, cfg=CFG,
                                         loss=_loss_config(beta=BETA), sp=sp)[0])(policy)
  assert np.all(np.isfinite(grad["logits"]))


def test_beta_zero_has_no_reference_forward(params, ref_params, monkeypatch):
  calls = []
  original = grpo.completion_logprobs

  def counting(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(grpo, "completion_logprobs", counting)
  batch = _batch(REWARDS, LENGTHS, num_prompts=4)
  for beta, ref, want in ((0.0, None, 1), (0.1, ref_params, 2)):
    calls.clear()
    fn = functools.partial(grpo.loss_fn, cfg=CFG, loss=_loss_config(beta=beta), sp=SP)
    jax.eval_shape(fn, params, ref, batch)  # one trace; ref None is fine with beta = 0
    assert len(calls) == want, beta


def test_beta_positive_adds_k3_penalty_against_reference(params, ref_params):
  batch = _on_policy_batch(params)
  out = _evaluate(params, ref_params, batch)
  value, aux = out["table"][("token_mean", False, BETA)]
  logp, ref = out["logp"], out["ref_logp"]
  mask = batch["completion_mask_NxT"]
  k3 = jnp.exp(ref - logp) - (ref - logp) - 1.0
  kl = float(k3[mask].mean())
  assert kl > 1e-3  # different initialisations: a real divergence
  np.testing.assert_allclose(aux["kl"], kl, rtol=1e-5)
  # token_mean: total = policy (-0.16318, as in the mu=1 test) + .1 * kl.
  np.testing.assert_allclose(aux["policy_loss"], POLICY_LOSS_MU1, atol=1e-5)
  np.testing.assert_allclose(value, POLICY_LOSS_MU1 + BETA * kl, atol=1e-5)
  # A reference equal to the policy: k3 = 1 - 0 - 1 = 0, so the loss is the policy loss.
  same, aux_same = _evaluate(params, params, batch)["table"][("token_mean", False, BETA)]
  assert float(aux_same["kl"]) == 0.0 and float(same) == float(aux_same["policy_loss"])


# make_optimizer.


def test_cosine_schedule_warmup_peak_and_floor():
  _, lr = grpo.make_optimizer(1e-3, 10, 110, 0.0, 1.0, "cosine")
  # Linear warmup 0 -> 1e-3 over 10 steps (step 5: 5e-4); cosine over the remaining 100 steps
  # to 0.1 * 1e-3: halfway (step 60) 1e-4 + (1e-3 - 1e-4) * (1 + cos(pi/2)) / 2 = 5.5e-4;
  # step 110 and after: 1e-4.
  for step, want in ((0, 0.0), (5, 5e-4), (10, 1e-3), (60, 5.5e-4), (110, 1e-4),
                     (500, 1e-4)):
    np.testing.assert_allclose(lr(step), want, rtol=1e-5, atol=1e-12, err_msg=str(step))


def test_constant_schedule_stays_at_peak():
  _, lr = grpo.make_optimizer(1e-3, 10, 110, 0.0, 1.0, "constant")
  # Warmup 0 -> 1e-3 (step 5: 5e-4), then 1e-3 for ever.
  for step, want in ((0, 0.0), (5, 5e-4), (10, 1e-3), (110, 1e-3), (10_000, 1e-3)):
    np.testing.assert_allclose(lr(step), want, rtol=1e-5, atol=1e-12, err_msg=str(step))


def test_unknown_schedule_names_it():
  with pytest.raises(ValueError, match="schedule='linear'"):
    grpo.make_optimizer(1e-3, 10, 110, 0.0, 1.0, "linear")


def test_optimizer_follows_schedule_with_decoupled_weight_decay():
  opt, _ = grpo.make_optimizer(0.1, 2, 100, 0.5, 0.0, "constant")
  update = jax.jit(opt.update)
  params = {"w": jnp.ones(2)}
  grad = {"w": jnp.array([3.0, -4.0])}
  state = opt.init(params)
  got = []
  for _ in range(3):
    u, state = update(grad, state, params)
    got.append(np.asarray(u["w"]))
  # A constant gradient g gives m_hat = g and v_hat = g^2, so Adam's direction is
  # g / |g| = [1, -1]; AdamW adds weight_decay * w = .5 * [1, 1]: [1.5, -.5] in all.
  # Warmup 0 -> .1 over 2 steps: lr .0, .05, .1, so the updates are -lr * [1.5, -.5]:
  #   step 0: [0, 0];  step 1: [-.075, .025];  step 2: [-.15, .05].
  np.testing.assert_allclose(got, [[0.0, 0.0], [-0.075, 0.025], [-0.15, 0.05]], rtol=1e-5,
                             atol=1e-6)


def test_grad_clip_clips_global_norm_before_adam():
  params = {"w": jnp.zeros(2)}
  clip, _ = grpo.make_optimizer(0.1, 0, 100, 0.0, 1.0, "constant")
  no_clip, _ = grpo.make_optimizer(0.1, 0, 100, 0.0, 0.0, "constant")
  # Jitted: one compilation each instead of one per eager op.
  clip = optax.GradientTransformation(jax.jit(clip.init), jax.jit(clip.update))
  no_clip = optax.GradientTransformation(jax.jit(no_clip.init), jax.jit(no_clip.update))
  big = {"w": jnp.array([60.0, 80.0])}  # norm sqrt(3600 + 6400) = 100 -> clipped to [.6, .8]
  pre = {"w": jnp.array([0.6, 0.8])}
  small = {"w": jnp.array([0.3, 0.4])}  # norm .5 < 1: untouched by the clip
  s_clip, s_pre, s_raw = clip.init(params), no_clip.init(params), no_clip.init(params)
  u_clip, s_clip = clip.update(big, s_clip, params)
  u_pre, s_pre = no_clip.update(pre, s_pre, params)
  _, s_raw = no_clip.update(big, s_raw, params)
  # Adam's first moment after one step is (1 - .9) * g: [.06, .08] with the clip, [6, 8]
  # without it.
  np.testing.assert_allclose(optax.tree_utils.tree_get(s_clip, "mu")["w"], [0.06, 0.08],
                             rtol=1e-6)
  np.testing.assert_allclose(optax.tree_utils.tree_get(s_raw, "mu")["w"], [6.0, 8.0],
                             rtol=1e-6)
  np.testing.assert_allclose(u_clip["w"], u_pre["w"], rtol=1e-6)
  u_clip, _ = clip.update(small, s_clip, params)
  u_pre, _ = no_clip.update(small, s_pre, params)
  np.testing.assert_allclose(u_clip["w"], u_pre["w"], rtol=1e-6)
  # Second step by hand (both coordinates are proportional to [3, 4], so one ratio):
  #   m = .9 * .1 * .6 + .1 * .3 = .084;  m_hat = .084 / (1 - .9^2) = .084 / .19 = .44211
  #   v = .999 * .001 * .36 + .001 * .09 = .00044964;  v_hat = v / (1 - .999^2) = .22493
  #   update = -.1 * .44211 / sqrt(.22493) = -.1 * .44211 / .47427 = -.093219
  # (without the clip the ratio would be .67376, not .93219).
  np.testing.assert_allclose(u_clip["w"], [-0.093219, -0.093219], rtol=1e-4)


# update_step / compile_update.


UPDATE_LOSS = _loss_config(beta=0.04)
METRICS = ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm", "learning_rate")


def _optimizer():
  # Cosine without warmup over 10 steps: the first update uses lr(0) = 1e-3 (and lr(1) =
  # 1e-4 + .9e-3 * (1 + cos(pi / 10)) / 2 = .978e-3, so reporting the wrong step shows).
  # grad_clip 10 is above the gradients' norm here (~1.3): Adam's first moment after one
  # step is then exactly (1 - .9) * g.
  return grpo.make_optimizer(1e-3, 0, 10, 0.01, 10.0, "cosine")


def _fresh_state(mesh, host_params):
  """A new TrainState on `mesh` (compile_update donates the one it is given)."""
  return grpo.init_state(sharding.shard_params(host_params, CFG, mesh), _optimizer()[0], mesh)


def _compile(mesh, host_params, host_ref, batch):
  """compile_update's jitted step, lowered as it is (shardings, donation) and compiled with
  FAST_COMPILE; and the reference parameters placed on `mesh`."""
  optimizer, lr = _optimizer()
  ref = sharding.shard_params(host_ref, CFG, mesh)
  state = _fresh_state(mesh, host_params)
  update = grpo.compile_update(state, ref, cfg=CFG, loss=UPDATE_LOSS, sp=SP,
                               optimizer=optimizer, lr_schedule=lr, mesh=mesh)
  return update.lower(state, batch, ref).compile(compiler_options=FAST_COMPILE), ref


@pytest.fixture(name="update_batch", scope="module")
def fixture_update_batch(params):
  return _on_policy_batch(params)


@pytest.fixture(name="single_device", scope="module")
def fixture_single_device(params, ref_params, update_batch):
  """(mesh, compiled update, ref, first update's (state, aux)) on a one-device mesh."""
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  update, ref = _compile(mesh, params, ref_params, update_batch)
  first = jax.device_get(update(_fresh_state(mesh, params), update_batch, ref))
  return mesh, update, ref, first


def _check_first_update(state, aux, params):
  assert set(METRICS) <= set(aux)
  assert int(state.step) == 1
  assert _max_abs_diff(state.params, params) > 1e-4  # the update moved the weights
  # Ratios 1 on the REWARDS / LENGTHS batch: -4.24264 / 26 = -0.16318 (see POLICY_LOSS_MU1).
  np.testing.assert_allclose(aux["policy_loss"], POLICY_LOSS_MU1, atol=1e-5)
  # token_mean KL aggregate == the kl metric, so loss = policy + .04 * kl.
  np.testing.assert_allclose(aux["loss"], aux["policy_loss"] + 0.04 * aux["kl"], atol=1e-6)
  assert float(aux["kl"]) > 1e-3  # against a different reference initialisation
  assert float(aux["clip_fraction"]) == 0.0  # ratio 1 lies inside [.8, 1.28]
  np.testing.assert_allclose(aux["learning_rate"], 1e-3, rtol=1e-6)  # lr(0), see _optimizer
  # grad_norm is |g| of the loss gradient: mu = .1 * g after the first step, so |mu| = .1 * |g|.
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")
  mu_norm = np.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(mu)))
  assert float(aux["grad_norm"]) > 0.1
  np.testing.assert_allclose(aux["grad_norm"], 10 * mu_norm, rtol=1e-5)


def test_update_step_single_device(params, single_device):
  _, _, _, (state, aux) = single_device
  _check_first_update(state, aux, params)


def test_init_state_shards_optimizer_moments_like_params(params):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sharded = sharding.shard_params(params, CFG, mesh)
  state = grpo.init_state(sharded, _optimizer()[0], mesh)
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")
  for p, m in zip(jax.tree.leaves(sharded), jax.tree.leaves(mu)):
    assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (m.sharding, p.sharding)


def test_update_step_sharded_matches_single_device(params, ref_params, update_batch,
                                                   single_device):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  update, ref = _compile(mesh, params, ref_params, update_batch)
  state, aux = jax.device_get(update(_fresh_state(mesh, params), update_batch, ref))
  _check_first_update(state, aux, params)
  _, _, _, (single, aux_single) = single_device
  for name in METRICS:
    np.testing.assert_allclose(aux[name], aux_single[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  assert _max_abs_diff(state.params, single.params) < 1e-5


def test_repeated_updates_move_policy_toward_rewarded_completion(params, single_device):
  # One fixed batch (B=4, G=2, every completion 4 tokens) in which exactly one completion per
  # group has reward 1: rows 0, 3, 4, 7. old_logp stays the initial policy's (mu > 1 reuse);
  # the fixture's loss also carries .04 * KL to ref_params.
  batch = _on_policy_batch(params, rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0],
                           lengths=[4] * 8)
  mesh, update, ref, _ = single_device
  state = _fresh_state(mesh, params)
  losses = []
  for _ in range(8):
    state, aux = update(state, batch, ref)
    losses.append(float(aux["policy_loss"]))

  def seq_logp(p):
    return _logprobs(p, batch).sum(axis=1)

  delta = seq_logp(jax.device_get(state.params)) - seq_logp(params)
  assert np.all(delta[[0, 3, 4, 7]] > 0), delta  # rewarded completions became more likely
  assert np.all(delta[[1, 2, 5, 6]] < 0), delta  # the others less likely
  # Step 0 at ratio 1: per-token loss -A_i, A = .70711 * [1,-1, -1,1, 1,-1, -1,1], 4 tokens
  # each: -.70711 * 4 * (1 - 1 - 1 + 1 + 1 - 1 - 1 + 1) / 32 = 0. The surrogate must then go
  # negative (the policy improves on this batch).
  np.testing.assert_allclose(losses[0], 0.0, atol=1e-6)
  assert losses[-1] < losses[0] - 1e-3, losses


def test_compile_update_on_trace_counts_compilations(params):
  # The trainer counts recompiles with this hook: it must fire per trace, not per call.
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  optimizer, lr = _optimizer()
  traces = []
  state = _fresh_state(mesh, params)
  update = grpo.compile_update(state, None, cfg=CFG, loss=_loss_config(), sp=SP,
                               optimizer=optimizer, lr_schedule=lr, mesh=mesh,
                               on_trace=lambda: traces.append(1))
  assert not traces  # nothing traced before the first call
  batch = _batch(REWARDS, LENGTHS, num_prompts=4)
  for _ in range(2):  # same shapes: the second call reuses the first compilation
    state, _ = update(state, batch, None)
  assert len(traces) == 1 and int(state.step) == 2
  # N 8 -> 4 rows: a new shape traces again. trace() shares the calls' trace cache and skips
  # XLA's compilation (~15 s here), which a call would add without testing anything more.
  update.trace(state, _batch(REWARDS[:4], LENGTHS[:4], num_prompts=2), None)
  assert len(traces) == 2


def test_observation_tokens_get_no_gradient(params):
  # A multi-turn batch (episodes.py): positions 1 and 2 of every row are an environment's
  # observation, attended to (completion_mask) but not sampled (trained_NxT False). Their
  # old log-probs moved by 5 (a ratio of e^-5, far outside the clip) leave the gradient
  # bitwise unchanged, also micro-batched; the same move on a sampled position changes it
  # (so the comparison is not vacuous).
  batch = _with_old_logp(_batch([1, 0, 0, 1], [4, 4, 4, 3], num_prompts=2), params)
  trained = np.ones((4, T), bool)
  trained[:, 1:3] = False
  batch = dict(batch, trained_NxT=trained)

  @functools.partial(jax.jit, static_argnums=2, compiler_options=FAST_COMPILE)
  def grad(p, b, micro):
    loss = _loss_config(trained_mask=True, micro_batch_size=micro)
    if micro:
      return grpo.micro_batch_loss(p, None, b, cfg=CFG, loss=loss, sp=SP)[1]
    return jax.grad(lambda q: grpo.loss_fn(q, None, b, cfg=CFG, loss=loss, sp=SP)[0])(p)

  moved = lambda mask: dict(batch, old_logp_NxT=batch["old_logp_NxT"] + 5.0 * mask)
  for micro in (0, 2):
    base = grad(params, batch, micro)
    same = grad(params, moved(~trained), micro)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(same)):
      np.testing.assert_array_equal(a, b)
  first = np.zeros((4, T), bool)
  first[:, 0] = True
  assert _max_abs_diff(grad(params, batch, 0), grad(params, moved(first), 0)) > 1e-4


def test_router_load_balancing_loss_by_hand():
  # A mixture with every router weight 0: each token's probabilities are uniform, 1/E, and
  # top-k ties go to the lowest ids, so every token picks experts 0 and 1 (K = 2 of E = 4).
  # f = [K x share of assignments] = [1, 1, 0, 0], P = [1/4] * 4: E * sum f P = 4 * 2/4 = 2.
  # The loss adds coef * 2 (and the same whole or in 2 micro-batches: each has the same
  # routing, weighted by its half of the rows); the diagnostic reports 2; coef 0 reports none.
  cfg = model_lib.ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                              num_experts=4, num_experts_per_tok=2, moe_mlp_dim=16)
  params = random_params(cfg, 0)
  params["layers"]["mlp"]["router"] = np.zeros_like(params["layers"]["mlp"]["router"])
  batch = _batch([0.0, 1.0, 1.0, 0.0], [4, 2, 3, 1], num_prompts=2)
  off, aux_off = grpo.loss_fn(params, None, batch, cfg=cfg, loss=_loss_config(), sp=SP)
  assert "router_aux_loss" not in aux_off
  for micro in (0, 2):
    on, aux = grpo.micro_batch_loss(params, None, batch, cfg=cfg, sp=SP, loss=_loss_config(
        router_aux_loss_coef=0.5, micro_batch_size=micro))[0] if micro else grpo.loss_fn(
            params, None, batch, cfg=cfg, loss=_loss_config(router_aux_loss_coef=0.5), sp=SP)
    assert float(aux["router_aux_loss"]) == pytest.approx(2.0, abs=1e-6)
    assert float(on) == pytest.approx(float(off) + 0.5 * 2.0, abs=1e-5)

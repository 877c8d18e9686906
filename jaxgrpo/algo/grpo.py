"""GRPO: group-relative advantages, the clipped surrogate loss, and the update step.

The objective (Shao et al. 2024, DeepSeekMath, eq. 3), for a prompt q with G sampled
completions o_1..o_G:

    J(θ) = E[ 1/G Σ_i 1/|o_i| Σ_t min(ρ_it Â_i, clip(ρ_it, 1-ε, 1+ε) Â_i) - β D_KL(π_θ || π_ref) ]
    ρ_it = π_θ(o_it | q, o_i<t) / π_old(o_it | q, o_i<t),   Â_i = (r_i - mean(r)) / std(r)

Where jaxgrpo deviates from the paper, on purpose:
  * std convention: `scale_rewards="group"` divides by the group's sample std with ddof=1
    (Bessel's correction, as torch.std, TRL and tunix do), so G=2 rewards {0, 1} give
    advantages ±0.707. "batch" uses the std of the whole batch (ddof=1), "none" skips the
    division (Dr. GRPO, Liu et al. 2025).
  * Flat groups: a group whose G rewards are all equal (tested on the rewards themselves,
    exactly) gets advantage 0 exactly in every mode: it carries no signal. Testing `std > 0`
    after the subtraction is not enough: float32 cannot store 0.1, so eight rewards of 0.1
    leave centred values and a std of ~1e-8 whose quotient is ±0.94 for every row.
  * Near-flat groups: the divisor is max(std, 16 ulp), ulp = float32's epsilon (2^-23) x
    max|r| over the rows the std is taken over (the group, or the batch): the floor is what
    it guards against, float32 rounding of rewards that size. Rewards that differ by n
    ulps get advantages of about n/16 at most, never O(1) from rounding alone; a group
    whose std exceeds 16 ulps gets the textbook advantage exactly. The differences are
    taken from the group's first reward before anything else (r_i - r_0 is exact for
    rewards within a factor of 2 of each other, Sterbenz), so adding a constant to every
    reward leaves the advantages as they were until the constant makes the differences
    themselves rounding-level: a 1e-3 bonus among 16 rewards keeps its textbook 3.75 at
    offsets 0, 10 and 100 (the floor 1e-4 x max|r| used before gave 0.094 at 100).
    (TRL adds 1e-4 to the std instead: an absolute floor that also shrinks every real
    advantage slightly and does not scale with the rewards.)
  * Asymmetric clipping: ratios are clipped to [1 - epsilon, 1 + epsilon_high] (DAPO, Yu et
    al. 2025); epsilon_high = epsilon gives the paper's symmetric clip.
  * Aggregation is chosen by `loss_agg`: "seq_mean_token_mean" is the paper's 1/G Σ 1/|o_i| Σ_t;
    "token_mean" (DAPO) averages over all completion tokens of the batch;
    "seq_mean_token_sum_norm" (Dr. GRPO) sums each completion's tokens and divides by
    N * max_new_tokens, a constant, so length does not rescale the gradient.
  * KL: `kl_type` "k3" is the paper's unbiased estimator π_ref/π_θ - log(π_ref/π_θ) - 1; "k1"
    is log(π_θ/π_ref). With beta = 0 no reference policy exists at all. Both policies' log-probs
    for the penalty come from the untruncated distributions at the training temperature
    (`kl_sampling_params`: top-k and top-p off), as TRL and verl compute them: under a
    truncated profile a token outside the reference's kept set would get the -69 floor and a
    k3 of ~67 where the models differ by a few hundredths. The importance ratio stays on the
    sampling profile (the distribution the tokens were drawn from).
  * π_old is the sampling-time distribution returned by the rollout engine (same temperature
    and truncation as the training profile), so with num_iterations (μ) = 1 every ratio is 1
    up to float rounding and the loss reduces to the policy-gradient form.
  * Optional `mask_truncated_completions` (DAPO's overlong filtering): rows that hit
    max_new_tokens without EOS are dropped from the loss, as if they had not been sampled:
    they leave every numerator and denominator of every `loss_agg` (the token count of
    "token_mean", the 1/N of "seq_mean_token_mean", the N of "seq_mean_token_sum_norm"), so
    the gradient does not shrink with the share of truncated rows. Their rewards still take
    part in their group's mean and std (the advantages of the other rows do not change).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgrpo.algo import microbatch, packing
from jaxgrpo.runtime import compile_options
from jaxgrpo.model import distribution, logprobs
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import lora
from jaxgrpo.model import moe as moe_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.algo.options import KL_TYPES, LOSS_AGGS, SCALE_REWARDS  # jax-free, for config


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Static settings of the loss (hashable: part of the compiled update step)."""

  num_generations: int
  beta: float
  kl_type: str
  epsilon: float
  epsilon_high: float
  loss_agg: str
  scale_rewards: str
  mask_truncated_completions: bool
  max_new_tokens: int
  # How the update is computed, not what: the same loss and gradient either way.
  micro_batch_size: int = 0    # rollouts per forward and backward pass; 0 = the whole batch
  micro_batch_tokens: int = 0  # > 0: packed micro-batches of that many tokens a chip (packing)
  logprob_chunk_size: int = 0  # completion positions per output projection; 0 = all at once
  remat: str = "none"          # what each layer keeps for the backward (model.REMAT_POLICIES)
  scan_layers: bool | None = None  # layers as one compiled loop body; None: by backend
  attention: str | None = None  # attention.ATTENTION; None: by backend
  # LoRA (model/lora.py): rank 0 = full fine-tuning. With a rank, the trained `params` are
  # the adapters and `ref_params` is the frozen base (also the KL's reference policy).
  lora_rank: int = 0
  lora_scale: float = 0.0      # alpha / rank
  lora_targets: tuple = ()
  # Multi-turn episodes (episodes.py): the batch carries trained_NxT, the sampled tokens;
  # observation tokens are attended to (completion_mask_NxT) but leave the loss.
  trained_mask: bool = False
  # Partial rollouts (generation.max_tokens_per_step > 0): the off-policy correction's
  # truncation C of the behaviour weight (`decoupled_surrogate`); 0 = on-policy (today's).
  importance_weight_cap: float = 0.0
  # A mixture of experts' router load-balancing loss (moe.balance_loss), added with this
  # weight; 0 = off (the default: RL recipes train without it).
  router_aux_loss_coef: float = 0.0
  # The update's mesh, passed to the model explicitly: a Pallas kernel (splash) runs under
  # shard_map on it, compiled for its devices. None: one device.
  mesh: Any = None


class TrainState(NamedTuple):
  step: jax.Array  # optimizer updates so far
  params: Any
  opt_state: Any


# A group's std counts as this many float32 ulps of its largest |reward| at least (see the
# docstring): the rounding the floor guards against, with room for the mean's own.
STD_FLOOR_ULPS = 16


def _scored_or_reference(rewards_BxG, scored_BxG):
  """(rewards with each unscored row replaced by its group's first scored reward, that
  reference [B, 1]): an unscored row then neither breaks a flat group nor moves a
  difference. Array methods and `np`/`jnp` by input, for the host and the device alike."""
  xp = np if isinstance(rewards_BxG, np.ndarray) else jnp
  first_Bx1 = xp.argmax(scored_BxG, axis=1)[:, None]
  reference_Bx1 = xp.take_along_axis(rewards_BxG, first_Bx1, axis=1)
  return xp.where(scored_BxG, rewards_BxG, reference_Bx1), reference_Bx1


def flat_groups(rewards_BxG, scored_BxG=None):
  """True for each group whose (scored) rewards are all equal (bitwise): no signal to learn
  from. A group with at most one scored row is flat.

  numpy rewards give a numpy answer: the trainer's `zero_std_group_fraction` uses the same
  rule on the host.
  """
  if scored_BxG is not None:
    rewards_BxG = _scored_or_reference(rewards_BxG, scored_BxG)[0]
  return (rewards_BxG == rewards_BxG[:, :1]).all(axis=1)


def trained_rows(rewards_N, scored_N, truncated_N, group_size: int,
                 mask_truncated: bool) -> np.ndarray:
  """Host-side, numpy: the rows whose policy-gradient term the update trains, bool [N]: in
  the loss (scored, and not truncated under mask_truncated_completions: `loss_mask`) and
  in a group whose scored rewards differ (a flat group's advantages are all 0). A row whose
  reward equals its group's mean exactly counts too: it is in the loss, with advantage 0."""
  rewards_N, scored_N = np.asarray(rewards_N), np.asarray(scored_N, bool)
  signal_N = ~np.repeat(flat_groups(rewards_N.reshape(-1, group_size),
                                    scored_N.reshape(-1, group_size)), group_size)
  in_loss_N = scored_N & ~(np.asarray(truncated_N, bool) & mask_truncated)
  return in_loss_N & signal_N


def group_advantages(rewards_N, group_size: int, scale_rewards: str, scored_N=None):
  """Â_i = (r_i - mean_group(r)) / std, rewards reshaped to (B, G) on device (rows b*G+g).

  Flat groups get exactly 0; the divisor is max(std, STD_FLOOR_ULPS ulps of max|r|) (module
  docstring). Means and stds are taken of differences from a reference reward (the group's
  first scored one; the batch's first for the batch std), exact for nearby rewards, so a
  constant added to every reward does not change them.

  scored_N (default all True): rows that no reward could score (scorer.py) get advantage 0
  and leave their group's mean, std and largest |r|, as if they had not been sampled. While
  every row is scored the unmasked statistics are used, whose float rounding is the one
  runs had before rows could go unscored (a masked reduction rounds differently).
  """
  rewards_BxG = rewards_N.reshape(-1, group_size).astype(jnp.float32)
  plain = _advantages_BxG(rewards_BxG, None, scale_rewards)
  if scored_N is None:
    return plain.reshape(-1)
  scored_BxG = scored_N.reshape(-1, group_size)
  masked = _advantages_BxG(rewards_BxG, scored_BxG, scale_rewards)
  return jnp.where(scored_BxG.all(), plain, masked).reshape(-1)


def _advantages_BxG(rewards_BxG, scored_BxG, scale_rewards: str):
  """group_advantages on [B, G] rewards; scored_BxG None: every row scored."""
  if scored_BxG is None:
    reference_Bx1, where, masked = rewards_BxG[:, :1], None, {}
  else:
    rewards_BxG, reference_Bx1 = _scored_or_reference(rewards_BxG, scored_BxG)
    where = scored_BxG
    masked = {"where": where}  # absent, not None, unmasked: numpy's mean takes no None
  flat_Bx1 = flat_groups(rewards_BxG)[:, None]
  diffs_BxG = rewards_BxG - reference_Bx1
  mean_Bx1 = diffs_BxG.mean(axis=1, keepdims=True, **masked)
  dropped_BxG = flat_Bx1 if where is None else flat_Bx1 | ~where
  centered_BxG = jnp.where(dropped_BxG, 0.0, diffs_BxG - mean_Bx1)
  if scale_rewards == "group":
    std = jnp.std(diffs_BxG, axis=1, keepdims=True, ddof=1, **masked)
    magnitude = jnp.max(jnp.abs(rewards_BxG), axis=1, keepdims=True)
  elif scale_rewards == "batch":
    # The batch's first scored reward is the reference (any scored row: the std is the same).
    batch_ref = (rewards_BxG[0, 0] if where is None
                 else rewards_BxG.reshape(-1)[jnp.argmax(where.reshape(-1))])
    std = jnp.std(rewards_BxG - batch_ref, ddof=1, **masked)
    magnitude = jnp.max(jnp.abs(rewards_BxG))
  elif scale_rewards == "none":
    return centered_BxG
  else:
    raise ValueError(f"scale_rewards={scale_rewards!r}: allowed {list(SCALE_REWARDS)}")
  if where is not None:  # fewer than two scored rows: no std (NaN), every value is 0 already
    std = jnp.where(jnp.isnan(std), 0.0, std)
  divisor = jnp.maximum(std, STD_FLOOR_ULPS * float(jnp.finfo(jnp.float32).eps) * magnitude)
  # A zero divisor means every reward it covers is 0, so every centred value is 0 already.
  return centered_BxG / jnp.where(divisor > 0, divisor, 1.0)


def clipped_surrogate(logp_NxT, old_logp_NxT, advantages_N, epsilon, epsilon_high):
  """Per-token loss -min(ρÂ, clip(ρ, 1-ε, 1+ε_high)Â) and where the clip was active."""
  ratio = jnp.exp(logp_NxT - old_logp_NxT)
  # [N] per row, or already one per token (packed rows: algo/packing.py)
  adv = advantages_N[:, None] if advantages_N.ndim == 1 else advantages_N
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * adv
  return -jnp.minimum(unclipped, clipped), (clipped < unclipped), ratio


def decoupled_surrogate(logp_NxT, behav_logp_NxT, advantages_N, epsilon, epsilon_high,
                        cap: float):
  """The off-policy loss of partial rollouts, per token: AReaL's decoupled objective
  (Fu et al. 2025, eq. 5) with the behaviour weight truncated at `cap` as truncated
  importance sampling does (verl's TIS):

      -min(w, C) * min(r Â, clip(r, 1-ε, 1+ε_high) Â),
      w = π_prox / π_behav,   r = π_θ / π_prox,

  π_behav the sampler's log-probs (each token's own parameter version), π_prox the step's
  parameters. With one update per rollout batch (num_iterations = 1, required) π_prox is
  π_θ itself before the step, so π_prox = stop_gradient(π_θ): r is 1 in value (the clip
  never binds) and the gradient is min(w, C) Â ∇log π_θ, no extra forward pass.
  Returns (per-token loss, clip active, r, w before truncation)."""
  prox_NxT = jax.lax.stop_gradient(logp_NxT)
  weight_NxT = jnp.exp(prox_NxT - behav_logp_NxT)
  per_token, clipped, ratio = clipped_surrogate(logp_NxT, prox_NxT, advantages_N, epsilon,
                                                epsilon_high)
  return jnp.minimum(weight_NxT, cap) * per_token, clipped, ratio, weight_NxT


def kl_penalty(logp_NxT, ref_logp_NxT, kl_type: str):
  """Per-token KL(π_θ || π_ref) estimate from the sampled tokens."""
  if kl_type == "k1":
    return logp_NxT - ref_logp_NxT
  if kl_type == "k3":
    log_r = ref_logp_NxT - logp_NxT
    return jnp.exp(log_r) - log_r - 1.0
  raise ValueError(f"kl_type={kl_type!r}: allowed {list(KL_TYPES)}")


def _kept_rows(mask_NxT):
  """Rows with at least one token in the mask (at least 1): the N of the row-based aggs."""
  return jnp.maximum(jnp.any(mask_NxT, axis=1).astype(jnp.float32).sum(), 1.0)


def aggregate(per_token_NxT, mask_NxT, loss_agg: str, max_new_tokens: int):
  """Reduces per-token losses to a scalar; masked tokens never count.

  A row with no token in the mask (a truncated row under mask_truncated_completions) is not
  in the batch: it leaves the 1/N of "seq_mean_token_mean" and the N of
  "seq_mean_token_sum_norm" too ("token_mean" counts tokens, so it never counted).
  """
  mask = mask_NxT.astype(jnp.float32)
  masked = jnp.where(mask_NxT, per_token_NxT, 0.0)  # where, not *: inf * 0 would be NaN
  rows = _kept_rows(mask_NxT)
  if loss_agg == "token_mean":
    return masked.sum() / jnp.maximum(mask.sum(), 1.0)
  if loss_agg == "seq_mean_token_mean":
    per_seq = masked.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
    return per_seq.sum() / rows
  if loss_agg == "seq_mean_token_sum_norm":
    return masked.sum() / (rows * max_new_tokens)
  raise ValueError(f"loss_agg={loss_agg!r}: allowed {list(LOSS_AGGS)}")


def token_weights(mask_NxT, loss_agg: str, max_new_tokens: int):
  """w [N, T] with aggregate(x, mask) == Σ w * x over the masked tokens: the same rule (rows
  without tokens leave the counts), as weights computed once on the whole batch, so a
  micro-batch's Σ w * x is its exact share of the whole batch's loss."""
  mask = mask_NxT.astype(jnp.float32)
  rows = _kept_rows(mask_NxT)
  if loss_agg == "token_mean":
    return mask / jnp.maximum(mask.sum(), 1.0)
  if loss_agg == "seq_mean_token_mean":
    return mask / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0) / rows
  if loss_agg == "seq_mean_token_sum_norm":
    return mask / (rows * max_new_tokens)
  raise ValueError(f"loss_agg={loss_agg!r}: allowed {list(LOSS_AGGS)}")


def kl_sampling_params(sp: sampling.SamplingParams) -> sampling.SamplingParams:
  """The distribution the KL penalty compares: the training temperature, nothing truncated."""
  return dataclasses.replace(sp, top_p=1.0, top_k=0)


def completion_logprobs(params, cfg: model_lib.ModelConfig, batch, group_size: int, sp, *,
                        chunk: int = 0, remat: str = "none",
                        scan_layers: bool | None = None, attention: str | None = None,
                        with_router_stats: bool = False, mesh=None):
  """log π_θ of each completion token, teacher-forced; each prompt is computed once and
  shared by its G completions (model.score_groups), as in sampling.

  sp: one SamplingParams, or a tuple of them: one forward then serves every profile, and the
  result is a tuple of [N, T] arrays in the same order.
  chunk > 0: project `chunk` positions at a time, never holding the [N, T, V] logits
  (logprobs.chunked_logprobs). remat: what each layer keeps for the backward pass;
  scan_layers, attention, mesh: model.Decoder's; with a mesh (the update step's) the
  activations are pinned on it (Decoder.pin). with_router_stats: (log-probs, a mixture's
  router statistics over the batch's tokens, decoder.router_stats).
  """
  if "segments_RxS" in batch:  # packed rows (algo/packing.py)
    if with_router_stats:  # refused at startup (grpo.router_aux_loss_coef's check)
      raise ValueError("router statistics of packed rows are not built")
    return _packed_logprobs(params, cfg, batch, sp, chunk=chunk, remat=remat,
                            scan_layers=scan_layers, attention=attention, mesh=mesh)
  n, t = batch["completion_tokens_NxT"].shape
  b = n // group_size
  completion_BxGxT = batch["completion_tokens_NxT"].reshape(b, group_size, t)
  sps = sp if isinstance(sp, tuple) else (sp,)
  args = (params, cfg, batch["prompt_tokens_BxL"], batch["prompt_mask_BxL"], completion_BxGxT,
          batch["completion_mask_NxT"].reshape(b, group_size, t))
  opts = dict(remat=remat, scan_layers=scan_layers, attention=attention,
              with_router_stats=with_router_stats, mesh=mesh, pin=mesh is not None)
  stats = None
  if chunk:
    hidden = model_lib.score_hidden(*args, **opts)
    (hidden_BxGxTxD, head_DxV), stats = hidden if with_router_stats else (hidden, None)
    out = logprobs.chunked_logprobs(hidden_BxGxTxD.reshape(n, t, -1), head_DxV,
                                   batch["completion_tokens_NxT"], sps, chunk, mesh=mesh)
  else:
    logits_BxGxTxV = model_lib.score_groups(*args, **opts)
    if with_router_stats:
      logits_BxGxTxV, stats = logits_BxGxTxV
    out = tuple(distribution.token_logprobs(logits_BxGxTxV, completion_BxGxT, p).reshape(n, t)
                for p in sps)
  out = out if isinstance(sp, tuple) else out[0]
  return (out, stats) if with_router_stats else out


def _packed_logprobs(params, cfg, batch, sp, *, chunk, remat, scan_layers, attention, mesh):
  """completion_logprobs of packed rows: log π_θ of targets_RxS, the token each position
  predicts (0 where it predicts none: the loss's mask leaves those)."""
  hidden_RxSxD, head_DxV = model_lib.score_packed(
      params, cfg, batch["tokens_RxS"], batch["positions_RxS"], batch["segments_RxS"],
      remat=remat, scan_layers=scan_layers, attention=attention, mesh=mesh,
      pin=mesh is not None)
  sps = sp if isinstance(sp, tuple) else (sp,)
  targets = batch["targets_RxS"]
  if chunk:
    out = logprobs.chunked_logprobs(hidden_RxSxD, head_DxV, targets, sps, chunk, mesh=mesh)
  else:
    logits = jnp.einsum("rsd,dv->rsv", hidden_RxSxD, head_DxV).astype(jnp.float32)
    out = tuple(distribution.token_logprobs(logits, targets, p) for p in sps)
  return out if isinstance(sp, tuple) else out[0]


def loss_mask(batch, loss: LossConfig):
  """The completion tokens the loss counts: rows that no reward scored leave (scorer.py),
  truncated rows under mask_truncated_completions, and in multi-turn episodes every token
  the policy did not sample (observations)."""
  mask = batch["completion_mask_NxT"] & batch["scored_N"][:, None]
  if loss.trained_mask:
    mask = mask & batch["trained_NxT"]
  if loss.mask_truncated_completions:
    mask = mask & ~batch["truncated_N"][:, None]
  return mask


def _policy_logprobs(params, cfg, batch, loss: LossConfig, sp):
  """(log-probs under the sampling profile, for the ratio; under the KL's untruncated
  profile, for the penalty; a mixture's router load-balancing loss when
  router_aux_loss_coef > 0, else None), from one forward: the two log-probs the same array
  when the profiles coincide or beta is 0."""
  kl_sp = kl_sampling_params(sp)
  both = loss.beta > 0 and kl_sp != sp
  stats = bool(loss.router_aux_loss_coef)
  out = completion_logprobs(params, cfg, batch, loss.num_generations, (sp, kl_sp) if both else sp,
                            with_router_stats=stats, **_forward_options(loss))
  balance = None
  if stats:
    out, (f_E, p_E) = out
    balance = moe_lib.balance_loss(f_E, p_E, cfg.num_experts)
  logp, kl_logp = out if both else (out, out)
  return logp, kl_logp, balance


def _reference_logprobs(ref_params, cfg, batch, loss: LossConfig, sp):
  """log π_ref of each completion token under the KL's untruncated profile (no gradient)."""
  return jax.lax.stop_gradient(completion_logprobs(
      ref_params, cfg, batch, loss.num_generations, kl_sampling_params(sp),
      **_forward_options(loss)))


def _forward_options(loss: LossConfig) -> dict:
  """How `completion_logprobs` computes (memory and compile time, not the result)."""
  return dict(chunk=loss.logprob_chunk_size, remat=loss.remat, scan_layers=loss.scan_layers,
              attention=loss.attention, mesh=loss.mesh)


def loss_fn(params, ref_params, batch, *, cfg: model_lib.ModelConfig, loss: LossConfig,
            sp: sampling.SamplingParams):
  """The GRPO loss and its diagnostics. batch: see `update_step`.

  One loss path: the whole batch is `micro_loss` on the whole batch, prepared as
  `micro_batch_loss` prepares it (advantages, mask, token weights), so a change to the
  surrogate, the KL or a diagnostic reaches both the whole-batch and the micro-batched update.
  """
  rows, mask, advantages = _prepare_rows(batch, loss)
  total, sums = micro_loss(params, ref_params, rows, cfg=cfg, loss=loss, sp=sp)
  return total, _diagnostics(total, sums, mask, advantages)


def _prepare_rows(batch, loss: LossConfig):
  """What only the whole batch can give, computed once: (rows for `micro_loss`, the loss
  mask, the advantages)."""
  mask = loss_mask(batch, loss)
  advantages = group_advantages(batch["rewards_N"], loss.num_generations, loss.scale_rewards,
                                batch["scored_N"])
  rows = dict(batch, advantages_N=advantages, mask_NxT=mask,
              weights_NxT=token_weights(mask, loss.loss_agg, loss.max_new_tokens))
  if loss.router_aux_loss_coef:  # each micro-batch's share of the balance loss: its rows'
    n = mask.shape[0]
    rows["balance_share_N"] = jnp.full((n,), 1.0 / n, jnp.float32)
  del rows["rewards_N"], rows["truncated_N"], rows["scored_N"]
  rows.pop("trained_NxT", None)  # in the mask now
  return rows, mask, advantages


def _diagnostics(total, sums, mask, advantages) -> dict:
  """The logged diagnostics from `micro_loss`'s sums over the whole batch: per-token means
  over the loss's tokens (clip fraction, ratio, KL), the policy loss, |advantage|."""
  denom = jnp.maximum(mask.astype(jnp.float32).sum(), 1.0)
  out = {"policy_loss": sums["policy_loss"], "clip_fraction": sums["clipped"] / denom,
         "ratio_mean": sums["ratio"] / denom, "advantage_abs_mean": jnp.abs(advantages).mean(),
         "kl": sums["kl"] / denom, "loss": total}
  if "router_aux_loss" in sums:  # a mixture's load-balancing loss (mean over micro-batches)
    out["router_aux_loss"] = sums["router_aux_loss"]
  if "importance_weight" in sums:  # partial rollouts: the truncated behaviour weights
    out["importance_weight_mean"] = sums["importance_weight"] / denom
    out["importance_weight_clipped_fraction"] = sums["importance_clipped"] / denom
  return out


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int,
                   weight_decay: float, grad_clip: float, schedule: str = "cosine"):
  """AdamW with linear warmup, then cosine decay to 10% (or constant), global-norm clip."""
  if schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1),
        end_value=0.1 * learning_rate)
  elif schedule == "constant":
    lr = optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps),
                               optax.constant_schedule(learning_rate)], [warmup_steps])
  else:
    raise ValueError(f"optim.schedule={schedule!r}: allowed ['cosine', 'constant']")
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  parts.append(optax.adamw(lr, b1=0.9, b2=0.999, weight_decay=weight_decay))
  return optax.chain(*parts), lr


def micro_loss(params, ref_params, micro, *, cfg: model_lib.ModelConfig, loss: LossConfig,
               sp: sampling.SamplingParams):
  """One micro-batch's share of the whole batch's loss, and its shares of the diagnostics'
  sums. `micro` carries what only the whole batch can give (`micro_batch_loss`): advantages_N,
  mask_NxT (truncated rows already removed) and weights_NxT (token_weights)."""
  # Packed rows (packed_loss) carry the same per-token values laid out as [R, S].
  suffix = "_RxS" if "segments_RxS" in micro else "_NxT"
  mask, weights, old_logp = (micro[k + suffix] for k in ("mask", "weights", "old_logp"))
  advantages = micro.get("advantages_RxS", micro.get("advantages_N"))
  policy_params = lora.merge(ref_params, params, loss.lora_scale) if loss.lora_rank else params
  logp, kl_logp, balance = _policy_logprobs(policy_params, cfg, micro, loss, sp)
  total = lambda x: jnp.where(mask, x, 0.0).sum()  # where, not *: see aggregate
  if balance is not None:  # this micro-batch's share of the batch's rows (mean over them)
    share = jnp.sum(micro["balance_share_N"])
    extra_loss = loss.router_aux_loss_coef * balance * share
    extra = {"router_aux_loss": balance * share}
  else:
    extra_loss, extra = 0.0, {}
  if loss.importance_weight_cap:  # partial rollouts: old_logp is each token's sampler's
    per_token, clipped, ratio, weight = decoupled_surrogate(
        logp, old_logp, advantages, loss.epsilon, loss.epsilon_high, loss.importance_weight_cap)
    extra |= {"importance_weight": total(jnp.minimum(weight, loss.importance_weight_cap)),
              "importance_clipped": total((weight > loss.importance_weight_cap).astype(
                  jnp.float32))}
  else:
    per_token, clipped, ratio = clipped_surrogate(logp, old_logp, advantages, loss.epsilon,
                                                  loss.epsilon_high)
  policy = total(per_token * weights) + extra_loss
  sums = {"policy_loss": policy, "clipped": total(clipped.astype(jnp.float32)),
          "ratio": total(ratio), **extra}
  if loss.beta > 0:
    ref_logp = _reference_logprobs(ref_params, cfg, micro, loss, sp)
    kl = kl_penalty(kl_logp, ref_logp, loss.kl_type)
    sums["kl_loss"], sums["kl"] = total(kl * weights), total(kl)
    return policy + loss.beta * sums["kl_loss"], sums
  sums["kl"] = total(old_logp - logp)
  return policy, sums


def _trained_shardings(cfg, loss: LossConfig, mesh):
  """Where the trained parameters (LoRA: the adapters) lie, for the gradient's running sum
  (microbatch.accumulate); None on one device."""
  if mesh is None:
    return None
  if loss.lora_rank:
    return sharding_lib.adapter_shardings(cfg, mesh, loss.lora_targets)
  return sharding_lib.param_shardings(cfg, mesh)


def micro_batch_loss(params, ref_params, batch, *, cfg, loss: LossConfig, sp, mesh=None):
  """((loss, aux), grads) of the whole batch, computed micro_batch_size rollouts at a time:
  advantages, the loss mask and every normaliser come from the whole batch first, then
  microbatch.accumulate sums the micro-batches' shares. Equal to value_and_grad(loss_fn)
  up to float rounding, with one micro-batch's activations alive at a time."""
  n = batch["rewards_N"].shape[0]
  rows, mask, advantages = _prepare_rows(batch, loss)
  shards = 1 if mesh is None else sharding_lib.batch_size_multiple(mesh)
  # Fewer rows on a device than a group (microbatch.subgroup): each prompt is repeated for
  # its sub-groups, which then run as groups of that size (advantages, the mask and the
  # weights came from the whole groups above).
  sub = microbatch.subgroup(loss.micro_batch_size, loss.num_generations, shards)
  if sub < loss.num_generations:
    for key in ("prompt_tokens_BxL", "prompt_mask_BxL"):
      rows[key] = jnp.repeat(rows[key], loss.num_generations // sub, axis=0)
    loss = dataclasses.replace(loss, num_generations=sub)
  micro = microbatch.split(rows, n // loss.micro_batch_size, shards, mesh)
  fn = lambda p, m: micro_loss(p, ref_params, m, cfg=cfg, loss=loss, sp=sp)
  shardings = _trained_shardings(cfg, loss, mesh)
  (total, sums), grads = microbatch.accumulate(fn, params, micro, shardings)
  return (total, _diagnostics(total, sums, mask, advantages)), grads


def packed_loss(params, ref_params, batch, *, cfg, loss: LossConfig, sp, mesh=None):
  """((loss, aux), grads) of the whole batch through packed micro-batches of
  loss.micro_batch_tokens tokens a device (algo/packing.py's layout), the micro-batches
  actually used run one after another. Advantages, the mask and the token weights come
  from the whole batch first, as in micro_batch_loss: the same loss and gradients as the
  whole-batch update. aux also has packing.Packed's padding fractions and micro-batch
  count."""
  rows, mask, advantages = _prepare_rows(batch, loss)
  shards = 1 if mesh is None else sharding_lib.batch_size_multiple(mesh)
  packed = packing.pack(rows, loss.num_generations, loss.micro_batch_tokens, shards, mesh)
  fn = lambda p, m: micro_loss(p, ref_params, m, cfg=cfg, loss=loss, sp=sp)
  shardings = _trained_shardings(cfg, loss, mesh)
  (total, sums), grads = microbatch.accumulate_dynamic(fn, params, packed.micro_batch,
                                                       packed.count, packed.limit, shardings)
  aux = _diagnostics(total, sums, mask, advantages)
  aux.update(packed.metrics)
  return (total, aux), grads


def update_step(state: TrainState, batch, ref_params, *, cfg, loss: LossConfig, sp,
                optimizer, lr_schedule, mesh=None):
  """One optimizer update on one rollout batch (pure; jit it with `compile_update`).

  batch: prompt_tokens_BxL, prompt_mask_BxL, completion_tokens_NxT, completion_mask_NxT,
  old_logp_NxT, rewards_N, truncated_N, scored_N (N = B * G, prompt-major rows).
  With loss.micro_batch_size < N the gradient is accumulated over micro-batches
  (`micro_batch_loss`); mesh: where their rows go (None: one device).
  """
  n = batch["rewards_N"].shape[0]
  if loss.micro_batch_tokens:
    (_, aux), grads = packed_loss(state.params, ref_params, batch, cfg=cfg, loss=loss, sp=sp,
                                  mesh=mesh)
  elif loss.micro_batch_size and loss.micro_batch_size < n:
    (_, aux), grads = micro_batch_loss(state.params, ref_params, batch, cfg=cfg, loss=loss,
                                       sp=sp, mesh=mesh)
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, aux), grads = grad_fn(state.params, ref_params, batch, cfg=cfg, loss=loss, sp=sp)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  aux["grad_norm"] = optax.global_norm(grads)
  aux["learning_rate"] = lr_schedule(state.step)
  return TrainState(state.step + 1, params, opt_state), aux


def opt_state_shardings(params, optimizer, mesh):
  """Shardings of optimizer.init(params): moments (mu, nu) take their parameters' shardings,
  so FSDP splits them too; scalars such as Adam's step count are replicated over the mesh.
  `params` may be arrays or ShapeDtypeStructs carrying shardings (launch/compile_check.py)."""
  replicated = sharding_lib.replicated(mesh)
  return optax.tree_map_params(
      optimizer, lambda _, p: p.sharding, jax.eval_shape(optimizer.init, params), params,
      transform_non_params=lambda _: replicated)


def init_state(params, optimizer, mesh) -> TrainState:
  """Optimizer state created on device, sharded like the parameters it mirrors."""
  replicated = sharding_lib.replicated(mesh)
  state_sh = opt_state_shardings(params, optimizer, mesh)
  opt_state = jax.jit(optimizer.init, out_shardings=state_sh)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  return TrainState(step, params, opt_state)


def compile_update(state: TrainState, ref_params, *, cfg, loss: LossConfig, sp, optimizer,
                   lr_schedule, mesh, on_trace=None):
  """jit(update_step) with explicit shardings: state as it lies, batch rows over data axes,
  the old state donated so params and optimizer moments are updated in place.

  on_trace: called with no arguments each time jax traces the step, i.e. once per
  compilation, so a caller can count recompiles (a new batch shape, dtype or sharding).
  """

  if loss.mesh is None:  # the model's forward gets the step's mesh: it pins rows on it
    loss = dataclasses.replace(loss, mesh=mesh)

  def step_fn(state, batch, ref):
    if on_trace is not None:
      on_trace()  # Python side effect: runs while tracing, never in the compiled step
    return update_step(state, batch, ref, cfg=cfg, loss=loss, sp=sp, optimizer=optimizer,
                       lr_schedule=lr_schedule, mesh=mesh)

  state_sh = jax.tree.map(lambda x: x.sharding, state)
  ref_sh = None if ref_params is None else jax.tree.map(lambda x: x.sharding, ref_params)
  rows = {k: sharding_lib.batch_sharding(mesh, n) for k, n in batch_ranks(loss).items()}
  return jax.jit(step_fn, in_shardings=(state_sh, rows, ref_sh),
                 out_shardings=(state_sh, sharding_lib.replicated(mesh)), donate_argnums=0,
                 compiler_options=compile_options.compiler_options(mesh))


BATCH_RANKS = {"prompt_tokens_BxL": 2, "prompt_mask_BxL": 2, "completion_tokens_NxT": 2,
               "completion_mask_NxT": 2, "old_logp_NxT": 2, "rewards_N": 1, "truncated_N": 1,
               "scored_N": 1}


def batch_ranks(loss: LossConfig) -> dict[str, int]:
  """The update batch's keys and their ranks: BATCH_RANKS, and trained_NxT for episodes."""
  return {**BATCH_RANKS, "trained_NxT": 2} if loss.trained_mask else BATCH_RANKS

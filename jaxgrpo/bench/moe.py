"""`python -m jaxgrpo.bench moe`: a mixture of experts' rollout and update with the experts
as grouped matmuls (`ragged_dot`) against the dense reference (every expert on every
token), side by side in one process (model/moe.py).

The rollout is the sampler (`sampling.sample`, --prompts x --samples rows, --new_tokens
tokens); the update is the forward and backward of the update's log-probs
(`grpo.completion_logprobs`, each prompt once for its G completions) over the same rows.
Randomly initialised weights: the routing is then spread over the experts as a trained
router's would be (no expert idle), which is all the matmuls' cost depends on.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.algo import grpo
from jaxgrpo.bench import common
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.rollout import sampling

# "fixture": tests/fixtures/hf/qwen3_moe's shape (4 experts of 32, 2 a token); "small": 16
# experts of 128, 4 a token (Qwen3-30B-A3B's ratios: 128 experts of 768, 8 a token, are
# 1/16 active and F = d / 2.7; here 1/4 active and F = d / 2).
SHAPES = {
    "fixture": dict(vocab_size=384, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, qk_norm=True, tie_embeddings=False,
                    num_experts=4, num_experts_per_tok=2, moe_mlp_dim=32),
    "small": dict(vocab_size=1024, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=32, mlp_dim=512, qk_norm=True, tie_embeddings=False,
                  num_experts=16, num_experts_per_tok=4, moe_mlp_dim=128),
}


def run_moe(args) -> list[dict]:
  loadavg_start = common.loadavg()
  base = model_lib.ModelConfig(**SHAPES[args.shape])
  params = nn.unbox(model_lib.init_params(base, jax.random.key(0)))
  rng = np.random.RandomState(0)
  prompts = rng.randint(3, base.vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
  mask = np.ones_like(prompts, bool)
  sp = common.MODES["pure"]
  timings, tokens = {}, None
  for matmul in ("dense", "ragged"):
    cfg = dataclasses.replace(base, moe_matmul=matmul)
    rollout = jax.jit(functools.partial(
        sampling.sample, cfg=cfg, eos_id=None, pad_id=0,
        profile=sampling.Profile(sp, args.samples, args.new_tokens)))
    out = rollout(params, prompts, mask, jax.random.key(1))
    if tokens is None:  # both paths train on the same completions
      tokens = np.asarray(out.tokens_NxT)
    batch = {"prompt_tokens_BxL": prompts, "prompt_mask_BxL": mask,
             "completion_tokens_NxT": tokens, "completion_mask_NxT": np.ones_like(tokens, bool)}
    update = jax.jit(jax.grad(lambda p, cfg=cfg: jnp.sum(
        grpo.completion_logprobs(p, cfg, batch, args.samples, sp))))
    _, timings[f"rollout_{matmul}"] = common.timed(
        lambda: jax.block_until_ready(rollout(params, prompts, mask, jax.random.key(1))),
        args.reps)
    _, timings[f"update_{matmul}"] = common.timed(
        lambda: jax.block_until_ready(update(params)), args.reps)
  med = {k: statistics.median(v) for k, v in timings.items()}
  return [dict(
      bench="moe", shape=args.shape, experts=base.num_experts,
      experts_per_token=base.num_experts_per_tok, prompts=args.prompts,
      samples=args.samples, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
      reps=args.reps, **{f"{k}_s": round(v, 4) for k, v in med.items()},
      rollout_ragged_over_dense=round(med["rollout_ragged"] / med["rollout_dense"], 3),
      update_ragged_over_dense=round(med["update_ragged"] / med["update_dense"], 3),
      **common.machine(jax.devices(), loadavg_start))]


def add_parsers(sub) -> None:
  m = sub.add_parser("moe", help="a mixture of experts' rollout and update: grouped "
                     "(ragged_dot) against dense experts")
  m.add_argument("--shape", choices=sorted(SHAPES), default="fixture")
  m.add_argument("--prompts", type=common.at_least(1), default=8)
  m.add_argument("--samples", type=common.at_least(1), default=8, help="G per prompt")
  m.add_argument("--prompt_len", type=common.at_least(1), default=16)
  m.add_argument("--new_tokens", type=common.at_least(1), default=64)
  m.add_argument("--reps", type=common.at_least(1), default=3, help="timed calls")
  m.add_argument("--out", default=None, help="also append the JSON lines to this file")
  m.set_defaults(run=run_moe)

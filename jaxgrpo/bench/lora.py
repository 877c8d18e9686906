"""`python -m jaxgrpo.bench lora -- --config=configs/math.py --config.model.lora_rank=16`:
what LoRA costs the samplers and the update, beside full fine-tuning, on the same batches.

The run is set up as `python -m jaxgrpo.train` sets it up, from the arguments after `--`,
twice: as given (LoRA, rank > 0) and with `model.lora_rank=0` (every weight trained). Each
of --reps steps takes one training batch and times, for both: the policy the samplers run
(`update.policy`: with LoRA the base with the adapters merged, one compiled function per
step), the train-profile rollout, and the update. The samplers run merged weights, so a
LoRA rollout costs the full model's plus the merge; the first step (compilation) is left
out and figures are medians.

`python -m jaxgrpo.bench lora-decode --shape qwen2.5-0.5b` weighs that choice at a real
model's shape: the merge once per step against the adapter path (x W + s x A B at every
token, no merged copy), beside a real rollout on the merged weights (run_lora_decode).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.run import build, setup as setup_lib, trainer
from jaxgrpo.bench import common
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import lora as lora_lib
from jaxgrpo.rollout import sampling


def run_lora(args) -> list[dict]:
  loadavg_start = common.loadavg()
  with tempfile.TemporaryDirectory() as workdir:
    setup = setup_lib.prepare(["train", *args.train_args, f"--workdir={workdir}"])
  if not setup.config.model.lora_rank:
    raise SystemExit("bench lora: give --config.model.lora_rank=R (> 0) after --")
  import dataclasses  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  full = ml_collections.ConfigDict(setup.config.to_dict())
  full.model.lora_rank = 0
  times = {}
  for name, config in (("lora", setup.config), ("full", full)):
    run = dataclasses.replace(setup, config=config)
    engine, state, ref_params, update = build.training(run)
    times[name] = {k: [] for k in ("policy", "rollout", "tokens", "update")}
    for rep in range(args.reps + 1):
      batch = next(run.train_batches)
      t0 = time.perf_counter()
      policy = jax.block_until_ready(update.policy(state, ref_params))
      t_policy = time.perf_counter() - t0
      t0 = time.perf_counter()
      rollout = engine.sample("train", policy, batch["prompt_tokens_BxL"],
                              batch["prompt_mask_BxL"], step=rep + 1)
      tokens = int(jax.device_get(rollout.lengths_N).sum())
      t_rollout = time.perf_counter() - t0
      state, metrics = trainer.train_step(run, engine, state, ref_params, update, batch,
                                          rep + 1)
      if rep:  # the first step compiles
        for key, value in (("policy", t_policy), ("rollout", t_rollout), ("tokens", tokens),
                           ("update", metrics["update_s"])):
          times[name][key].append(value)
  med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
  per_s = lambda m: m["tokens"] / (m["policy"] + m["rollout"])
  c = setup.config.model
  return [dict(
      bench="lora", args=list(args.train_args), lora_rank=c.lora_rank,
      lora_targets=c.lora_targets, reps=args.reps,
      **{f"{name}_{k}_s": round(v, 5) for name, m in med.items() for k, v in m.items()
         if k != "tokens"},
      lora_rollout_tokens_per_s=round(per_s(med["lora"]), 1),
      full_rollout_tokens_per_s=round(per_s(med["full"]), 1),
      rollout_tokens_per_s_ratio=round(per_s(med["lora"]) / per_s(med["full"]), 3),
      update_ratio=round(med["lora"]["update"] / med["full"]["update"], 3),
      **common.machine(jax.devices(), loadavg_start))]


# Real shapes (the published config.json of each), for `bench lora-decode`.
SHAPES = {
    "tiny": dict(vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32, mlp_dim=512),  # the tests' (common.PRESETS["tiny"])
    "qwen2.5-0.5b": dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, mlp_dim=4864, rope_theta=1e6,
                         qkv_bias=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, d_model=1536, num_layers=28, num_heads=12,
                         num_kv_heads=2, head_dim=128, mlp_dim=8960, rope_theta=1e6,
                         qkv_bias=True),
}


def _projections(x_BxD, layer, adapters, scale):
  """One layer's seven projections for a decode step's rows (x [B, d_model]), chained so
  none is dead code: with `adapters` each is x @ W + scale * (x @ A) @ B, the adapter path
  a sampler without the merge would run at every token; without, x @ W on merged weights."""
  def proj(x, name, section, n_in=1):
    w = layer[section][name]
    y = model_lib.dense(x, w, n_in)
    if adapters is not None and name in adapters:
      a, b = adapters[name]["a"], adapters[name]["b"]
      y = y + scale * model_lib.dense(model_lib.dense(x, a.astype(x.dtype), n_in),
                                      b.astype(x.dtype), 1)
    return y
  q, k, v = proj(x_BxD, "q", "attn"), proj(x_BxD, "k", "attn"), proj(x_BxD, "v", "attn")
  o = proj(q, "o", "attn", 2)  # q's heads x head_dim stand in for attention's output
  h = x_BxD + o + jnp.mean(k) + jnp.mean(v)
  m = proj(jax.nn.silu(proj(h, "gate", "mlp")) * proj(h, "up", "mlp"), "down", "mlp")
  return h + m


def run_lora_decode(args) -> list[dict]:
  """Merge per step against the adapter path, at a real model's shape: what the samplers'
  choice costs a rollout of --new_tokens tokens. Times (medians of --reps) the merge of
  every adapted weight (`lora.merge`, once per step), one decode step's projections over
  the layers for --rows rows on merged weights, the same with the adapters beside the
  weights (x W + s x A B), and a real rollout (`sampling.sample`) of --rows x --new_tokens
  on the merged weights. Merge per step costs merge + rollout; the adapter path costs the
  rollout plus new_tokens x (its projections' extra time per step)."""
  loadavg_start = common.loadavg()
  cfg = model_lib.ModelConfig(**SHAPES[args.shape], dtype=args.dtype, param_dtype=args.dtype)
  targets = lora_lib.parse_targets(args.targets)
  scale = 2.0  # alpha / rank; any number costs the same
  base = nn.unbox(model_lib.init_params(cfg, jax.random.key(0)))
  adapters = lora_lib.init(cfg, args.rank, targets, jax.random.key(1))
  # B random, not 0: the merge and the adapter path then compute what they would mid-run.
  adapters = {t: {"a": ad["a"], "b": 0.01 * jax.random.normal(jax.random.key(2), ad["b"].shape)}
              for t, ad in adapters.items()}
  merge = jax.jit(lambda b, a: lora_lib.merge(b, a, scale))
  merged = jax.block_until_ready(merge(base, adapters))
  x_BxD = jax.random.normal(jax.random.key(3), (args.rows, cfg.d_model)).astype(
      model_lib.DTYPES[cfg.dtype])

  def step_fn(with_adapters):
    def run(layers, ads, x):
      def body(x, per_layer):
        layer, ad = per_layer
        return _projections(x, layer, ad if with_adapters else None, scale), None
      x, _ = jax.lax.scan(body, x, (layers, ads))
      return x
    return jax.jit(run)

  steps = {"merged": step_fn(False), "adapter": step_fn(True)}
  rollout = jax.jit(functools.partial(
      sampling.sample, cfg=cfg, eos_id=None, pad_id=0,
      profile=sampling.Profile(common.MODES["pure"], 1, args.new_tokens)))
  prompts = np.random.RandomState(0).randint(3, 1000, (args.rows, args.prompt_len))
  mask = np.ones_like(prompts, bool)
  timings = {}
  _, timings["merge"] = common.timed(
      lambda: jax.block_until_ready(merge(base, adapters)), args.reps)
  for name, fn in steps.items():
    _, timings[f"step_{name}"] = common.timed(
        lambda fn=fn: jax.block_until_ready(fn(merged["layers"], adapters, x_BxD)), args.reps)
  _, timings["rollout"] = common.timed(
      lambda: jax.block_until_ready(rollout(merged, prompts, mask, jax.random.key(4))),
      args.reps)
  med = {k: statistics.median(v) for k, v in timings.items()}
  extra = max(med["step_adapter"] - med["step_merged"], 0.0)
  merge_total = med["merge"] + med["rollout"]
  adapter_total = med["rollout"] + args.new_tokens * extra
  return [dict(
      bench="lora-decode", shape=args.shape, dtype=args.dtype, rank=args.rank,
      targets=",".join(targets), rows=args.rows, prompt_len=args.prompt_len,
      new_tokens=args.new_tokens, reps=args.reps,
      params=model_lib.count_params(base), adapter_params=model_lib.count_params(adapters),
      **{f"{k}_s": round(v, 5) for k, v in med.items()},
      merge_share_of_step=round(med["merge"] / merge_total, 4),
      adapter_extra_per_token_s=round(extra, 6),
      merge_per_step_s=round(merge_total, 4), adapter_path_s=round(adapter_total, 4),
      faster="merge per step" if merge_total <= adapter_total else "adapter path",
      **common.machine(jax.devices(), loadavg_start))]


def add_parsers(sub) -> None:
  r = sub.add_parser("lora", help="LoRA's rollout (merge + sampler) and update beside full")
  r.add_argument("--reps", type=common.at_least(1), default=5, help="timed steps")
  r.add_argument("--out", default=None, help="also append the JSON lines to this file")
  r.add_argument("train_args", nargs="*", default=["--config=configs/math.py",
                                                   "--config.model.lora_rank=16"],
                 help="after --: python -m jaxgrpo.train's arguments (a config, overrides)")
  r.set_defaults(run=run_lora)
  d = sub.add_parser("lora-decode", help="merge per step against the adapter path at a real "
                     "model's shape")
  d.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
  d.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="weights and compute (bfloat16 as on an accelerator; CPU has no fast "
                      "bfloat16 matmul)")
  d.add_argument("--rank", type=common.at_least(1), default=16)
  d.add_argument("--targets", default="all-linear")
  d.add_argument("--rows", type=common.at_least(1), default=64, help="decode batch rows")
  d.add_argument("--prompt_len", type=common.at_least(1), default=16)
  d.add_argument("--new_tokens", type=common.at_least(1), default=64)
  d.add_argument("--reps", type=common.at_least(1), default=3, help="timed calls")
  d.add_argument("--out", default=None, help="also append the JSON lines to this file")
  d.set_defaults(run=run_lora_decode)

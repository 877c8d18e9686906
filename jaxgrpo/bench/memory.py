"""`python -m jaxgrpo.bench memory`: what the compiled update holds, as the compiler says.

Memory is a compiler fact: each point lowers and compiles the GRPO update exactly as the
trainer builds it (`grpo.compile_update`, its shardings and donation) on abstract inputs, and
reads `compiled.memory_analysis()`. Nothing runs, so a grid of shapes costs compile time
only. One JSON line per point: temporary bytes (activations, logits, gradients in flight:
what micro-batching, chunking and remat shrink), argument bytes (parameters, optimizer
state, the batch) and output bytes, all per device.

Default grid: the medium preset (8 layers, d_model 512, 8 / 4 heads x 64, MLP 2048) with a
32,768-token vocabulary, G = 8, 64-token prompts and 192 new tokens, on one CPU device;
batches of 8 and 32 prompts (--batch_prompts) x micro-batches 0 (whole batch), 16 and 64 rollouts x remat none
and full x chunks None and 32 positions.
"""

from __future__ import annotations

import dataclasses
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgrpo.algo import grpo
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.bench import step as bench_step

SP = sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def batch_shapes(prompts: int, generations: int, prompt_len: int, new_tokens: int):
  """The update's batch as ShapeDtypeStructs (grpo.BATCH_RANKS' keys)."""
  n = prompts * generations
  s = jax.ShapeDtypeStruct
  return {"prompt_tokens_BxL": s((prompts, prompt_len), jnp.int32),
          "prompt_mask_BxL": s((prompts, prompt_len), jnp.bool_),
          "completion_tokens_NxT": s((n, new_tokens), jnp.int32),
          "completion_mask_NxT": s((n, new_tokens), jnp.bool_),
          "old_logp_NxT": s((n, new_tokens), jnp.float32), "rewards_N": s((n,), jnp.float32),
          "truncated_N": s((n,), jnp.bool_), "scored_N": s((n,), jnp.bool_)}


def update_memory(cfg: model_lib.ModelConfig, mesh, *, prompts: int, generations: int,
                  prompt_len: int, new_tokens: int, micro_batch_size: int = 0,
                  logprob_chunk_size: int = 0, remat: str = "none", beta: float = 0.0,
                  scan_layers: bool | None = None):
  """Per-device bytes of the compiled update: {temp_bytes, argument_bytes, output_bytes}."""
  params = _abstract(nn.unbox(jax.eval_shape(lambda r: model_lib.init_params(cfg, r),
                                             jax.random.key(0))),
                     sharding_lib.param_shardings(cfg, mesh))
  optimizer, lr = grpo.make_optimizer(1e-5, 0, 10, 0.0, 1.0)
  opt_state = _abstract(jax.eval_shape(optimizer.init, params),
                        grpo.opt_state_shardings(params, optimizer, mesh))
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding_lib.replicated(mesh))
  state = grpo.TrainState(step, params, opt_state)
  loss = grpo.LossConfig(
      num_generations=generations, beta=beta, kl_type="k3", epsilon=0.2, epsilon_high=0.28,
      loss_agg="token_mean", scale_rewards="group", mask_truncated_completions=False,
      max_new_tokens=new_tokens, micro_batch_size=micro_batch_size,
      logprob_chunk_size=logprob_chunk_size, remat=remat, scan_layers=scan_layers)
  ref = params if beta > 0 else None
  update = grpo.compile_update(state, ref, cfg=cfg, loss=loss, sp=SP, optimizer=optimizer,
                               lr_schedule=lr, mesh=mesh)
  batch = batch_shapes(prompts, generations, prompt_len, new_tokens)
  m = update.lower(state, batch, ref).compile().memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes),
          "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes)}


def run_memory(args) -> list[dict]:
  cfg = dataclasses.replace(bench_step.preset_config(args.preset), vocab_size=args.vocab)
  mesh = sharding_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  results = []
  grid = itertools.product(args.batch_prompts, args.micro_batch_sizes, args.remat, args.chunks)
  for prompts, micro, remat, chunk in grid:
    rollouts = prompts * args.generations
    if micro and (micro >= rollouts or rollouts % micro or micro % args.generations):
      continue  # not a micro-batching of this batch
    point = dict(bench="memory", preset=args.preset, vocab=args.vocab, prompts=prompts,
                 generations=args.generations, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens, micro_batch_size=micro, remat=remat,
                 logprob_chunk_size=chunk or None)
    point.update(update_memory(cfg, mesh, prompts=prompts, generations=args.generations,
                               prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                               micro_batch_size=micro, logprob_chunk_size=chunk, remat=remat))
    point["temp_mib"] = round(point["temp_bytes"] / 2**20, 1)
    # Compiler facts do not depend on the load; the machine fields say what compiled them.
    point.update(jax=jax.__version__, platform=mesh.devices.flat[0].platform)
    results.append(point)
  return results


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(","))


def add_parsers(sub) -> None:
  """Adds the `memory` subcommand to the bench's subparsers (cli.py)."""
  m = sub.add_parser("memory", help="the compiled update's bytes per device (memory_analysis) "
                     "over batch x micro-batch x remat x chunk")
  m.add_argument("--preset", choices=bench_step.PRESET_NAMES, default="medium")
  m.add_argument("--vocab", type=int, default=32768)
  m.add_argument("--batch_prompts", type=_ints, default=(8, 32),
                 help="prompts per batch, e.g. 8,32")
  m.add_argument("--generations", type=int, default=8)
  m.add_argument("--prompt_len", type=int, default=64)
  m.add_argument("--new_tokens", type=int, default=192)
  m.add_argument("--micro_batch_sizes", type=_ints, default=(0, 16, 64),
                 help="rollouts per micro-batch; 0 = the whole batch")
  m.add_argument("--remat", type=lambda s: tuple(s.split(",")), default=("none", "full"))
  m.add_argument("--chunks", type=_ints, default=(0, 32), help="logprob_chunk_size; 0 = none")
  m.add_argument("--out", default=None, help="also append the JSON lines to this file")
  m.set_defaults(run=run_memory)

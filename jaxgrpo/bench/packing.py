"""`python -m jaxgrpo.bench packing`: the update with packed micro-batches against the padded
one, on a long-tailed length distribution (issue 51).

One batch of rollouts is made once: B prompts of random real lengths (left-padded to
--prompt_len) and G completions each whose lengths are drawn from a named shape or read
from a file (one integer a line, cycled). The same update (grpo.compile_update, one device,
the trainer's loss settings) then runs on it as
  * padded: the whole batch (micro_batch_size 0) and, with --micro_batch_size, micro-batches
    of rows, each row padded to the batch's width;
  * packed: grpo.micro_batch_tokens for each of --budgets (multiples of the longest
    sequence, prompt width + completion width),
side by side in one process, each timed after a warm-up call. Each line: the median update
time, its ratio to the padded whole batch, the padding fraction the update logged, the
micro-batches run, and the loss (the same for every layout, to float rounding).

Shapes (lengths of completions, capped at --new_tokens):
  longtail: log-normal, median new_tokens / 8, sigma 1 (reasoning-like: most rows short, a
    few at the cap);
  grouped: long-tailed and correlated within a group, as GRPO's are (a hard prompt's G
    answers are all long): each prompt draws a scale (log-normal, median new_tokens / 8,
    sigma 1) and its answers are log-normal around it (sigma 0.3);
  uniform: uniform in [1, new_tokens].

--chips P: each line also says how the rollouts' tokens would spread over P data-parallel
chips (the update here runs on one): `chip_imbalance`, max over chips / mean of the packed
micro-batches each chip's rows need, with the rollouts dealt by tokens first as the update
does (packing.balance), and `chip_imbalance_contiguous`, the same for the contiguous split
the batch sharding gives (the layout before issue 63). Every chip runs as many micro-batches
as the fullest, so 1.37 means the others idle 27% of the loop. Padded layouts compute the
same rows on every chip: 1.0.

--context C: each line also says how a packed row's causal attention work spreads over the
C chips of a context group (`context_imbalance`, max over the C chips / mean of the
query-key pairs each one's positions attend to, counted from the packed rows' segments and
causality): the contiguous split the update uses today (chip c the c-th C-th of the row).
A load-balanced layout (chunk i with chunk 2C-1-i) is issue 63's, not built yet. Padded
layouts: 1.0 (not computed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgrpo.algo import grpo, packing
from jaxgrpo.bench import common
from jaxgrpo.bench import step as bench_step
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling

SP = sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)


def completion_lengths(shape: str, n: int, new_tokens: int, seed: int,
                       generations: int = 1) -> np.ndarray:
  """n completion lengths in [1, new_tokens]: a named shape, or a file of integers
  (`generations`: the group size, for the grouped shape)."""
  rng = np.random.default_rng(seed)
  if shape == "longtail":
    drawn = rng.lognormal(np.log(new_tokens / 8), 1.0, n)
  elif shape == "grouped":
    scale = rng.lognormal(np.log(new_tokens / 8), 1.0, -(-n // generations))
    drawn = rng.lognormal(np.log(np.repeat(scale, generations)[:n]), 0.3)
  elif shape == "uniform":
    drawn = rng.uniform(1, new_tokens, n)
  else:
    with open(shape) as f:
      values = [int(line) for line in f if line.strip()]
    if not values:
      raise SystemExit(f"--lengths {shape}: no lengths in the file")
    drawn = np.resize(np.asarray(values), n)
  return np.clip(np.round(drawn), 1, new_tokens).astype(np.int32)


def make_batch(cfg, prompts: int, generations: int, prompt_len: int, new_tokens: int,
               lengths_N: np.ndarray, seed: int) -> dict:
  """The update's batch (grpo.BATCH_RANKS) with these completion lengths."""
  rng = np.random.default_rng(seed)
  n = prompts * generations
  prompt_real = rng.integers(prompt_len // 4, prompt_len + 1, prompts)
  prompt_mask = np.arange(prompt_len)[None] >= (prompt_len - prompt_real)[:, None]
  mask = np.arange(new_tokens)[None] < lengths_N[:, None]
  return {"prompt_tokens_BxL": np.where(prompt_mask, rng.integers(3, cfg.vocab_size,
                                                                 prompt_mask.shape), 0).astype(np.int32),
          "prompt_mask_BxL": prompt_mask,
          "completion_tokens_NxT": np.where(mask, rng.integers(3, cfg.vocab_size, mask.shape),
                                            0).astype(np.int32),
          "completion_mask_NxT": mask,
          "old_logp_NxT": np.where(mask, -np.log(cfg.vocab_size), 0).astype(np.float32),
          "rewards_N": rng.integers(0, 2, n).astype(np.float32),
          "truncated_N": lengths_N >= new_tokens, "scored_N": np.ones(n, bool)}


def run_packing(args) -> list[dict]:
  start_load = common.loadavg()
  cfg = bench_step.preset_config(args.preset)
  mesh = sharding_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  n = args.prompts * args.generations
  lengths = completion_lengths(args.lengths, n, args.new_tokens, args.seed, args.generations)
  if n % args.chips:
    raise SystemExit(f"--chips {args.chips}: must divide the {n} rollouts (--prompts x "
                     "--generations)")
  batch = make_batch(cfg, args.prompts, args.generations, args.prompt_len, args.new_tokens,
                     lengths, args.seed)
  params = sharding_lib.shard_params(
      model_lib.init_params(cfg, jax.random.key(args.seed)), cfg, mesh)
  optimizer = optax.sgd(1e-3)
  lr = optax.constant_schedule(1e-3)
  width = args.prompt_len + args.new_tokens
  layouts = [("padded", dict(micro_batch_size=0))]
  if args.micro_batch_size:
    layouts.append(("padded", dict(micro_batch_size=args.micro_batch_size)))
  layouts += [("packed", dict(micro_batch_tokens=k * width)) for k in args.budgets]
  base = grpo.LossConfig(num_generations=args.generations, beta=0.0, kl_type="k3",
                         epsilon=0.2, epsilon_high=0.28, loss_agg="token_mean",
                         scale_rewards="group", mask_truncated_completions=False,
                         max_new_tokens=args.new_tokens, remat=args.remat)
  shape = {"lengths": args.lengths, "completion_median": float(np.median(lengths)),
           "completion_p90": float(np.percentile(lengths, 90)),
           "completion_max": int(lengths.max()), "prompt_width": args.prompt_len,
           "new_tokens": args.new_tokens, "rollouts": n}
  results, whole_s = [], None
  for layout, values in layouts:
    loss = dataclasses.replace(base, **values)
    state = grpo.init_state(params, optimizer, mesh)
    update = grpo.compile_update(state, None, cfg=cfg, loss=loss, sp=SP, optimizer=optimizer,
                                 lr_schedule=lr, mesh=mesh)
    on_device = sharding_lib.to_global(mesh, batch)
    # Every call starts from the same state: the update donates it, so a fresh copy each.
    fresh = lambda: jax.tree.map(lambda x: x.copy(), state)
    out = {}

    def call():
      out["aux"] = jax.block_until_ready(update(fresh(), on_device, None)[1])

    first, times = common.timed(call, args.reps)
    aux = jax.device_get(out["aux"])
    median = float(np.median(times))
    whole_s = median if whole_s is None else whole_s
    spread = (chip_spread(batch, lengths, args.chips, width, values["micro_batch_tokens"])
              if "micro_batch_tokens" in values else (1.0, 1.0))
    context = (context_spread(batch, lengths, args.context, values["micro_batch_tokens"])
               if "micro_batch_tokens" in values and args.context > 1 else 1.0)
    real = float(batch["prompt_mask_BxL"].sum() + batch["completion_mask_NxT"].sum())
    padded = 1 - real / (args.prompts * args.prompt_len + n * args.new_tokens)
    results.append({
        "bench": "packing", "preset": args.preset, "layout": layout, **values, **shape,
        "update_s": median, "first_call_s": first, "ratio_to_padded_whole": median / whole_s,
        "padding_fraction": float(aux.get("padding_fraction_packed", padded)),
        "micro_batches": int(aux.get("packed_micro_batches", 1 if not values.get(
            "micro_batch_size") else n // values["micro_batch_size"])),
        "chips": args.chips, "chip_imbalance": spread[0],
        "chip_imbalance_contiguous": spread[1], "context": args.context,
        "context_imbalance": context,
        "loss": float(aux["loss"]), **common.machine(jax.devices(), start_load)})
  return results


def context_spread(batch, completion_N, context: int, budget: int) -> float:
  """max / mean over the `context` chips of a context group of the causal query-key pairs
  their positions attend to, summed over the packed rows of one device holding every
  rollout (first fit, as the update packs): a position j of a sequence attends to j + 1
  keys, and chip c holds positions [c S / C, (c + 1) S / C) of each row."""
  generations = len(completion_N) // len(batch["prompt_mask_BxL"])
  seq_N = (np.repeat(batch["prompt_mask_BxL"].sum(axis=1), generations)
           + completion_N).astype(np.int32)
  bins = packing.max_micro_batches(len(seq_N), int(seq_N.max()), budget)
  bin_N, offset_N, _ = jax.device_get(packing.first_fit(jnp.asarray(seq_N), budget, bins))
  work_C = np.zeros(context)
  share = -(-budget // context)
  for length, offset in zip(seq_N, offset_N):
    positions = offset + np.arange(length)  # the sequence's slots in its packed row
    np.add.at(work_C, positions // share, np.arange(1, length + 1))
  return float(work_C.max() / work_C.mean())


def chip_spread(batch, completion_N, chips: int, width: int, budget: int):
  """(dealt, contiguous): max / mean over `chips` of the packed micro-batches each chip's
  rollouts need, dealt by tokens (packing.balance, as the update does) and split in
  contiguous blocks (as the batch sharding gives them)."""
  generations = len(completion_N) // len(batch["prompt_mask_BxL"])
  seq_N = jnp.asarray(np.repeat(batch["prompt_mask_BxL"].sum(axis=1), generations)
                      + completion_N, jnp.int32)
  per = len(completion_N) // chips
  bins = packing.max_micro_batches(per, width, budget)

  def used(seq):
    return jax.vmap(lambda n_: packing.index_map(jnp.zeros_like(n_), n_, width, budget,
                                                 bins)[1])(seq.reshape(chips, per))

  src, _ = packing.balance(seq_N, chips)
  return (float(packing.imbalance(used(seq_N[src]))), float(packing.imbalance(used(seq_N))))


def add_parsers(sub) -> None:
  """Adds the `packing` subcommand to the bench's subparsers (cli.py)."""
  p = sub.add_parser("packing", help="the update with packed micro-batches against the "
                     "padded one, on a long-tailed length distribution")
  p.add_argument("--preset", choices=bench_step.PRESET_NAMES, default="tiny")
  p.add_argument("--prompts", type=common.at_least(1), default=8)
  p.add_argument("--generations", type=common.at_least(1), default=8)
  p.add_argument("--prompt_len", type=common.at_least(1), default=64)
  p.add_argument("--new_tokens", type=common.at_least(1), default=1024)
  p.add_argument("--lengths", default="longtail",
                 help="longtail, grouped, uniform, or a file of completion lengths (one a "
                 "line)")
  p.add_argument("--chips", type=common.at_least(1), default=8,
                 help="data-parallel chips the lines' chip_imbalance spreads the rollouts "
                 "over")
  p.add_argument("--budgets", type=lambda s: tuple(int(x) for x in s.split(",")),
                 default=(1, 2), help="packed budgets, in longest sequences (prompt_len + "
                 "new_tokens), e.g. 1,2")
  p.add_argument("--micro_batch_size", type=common.at_least(0), default=0,
                 help="also the padded update in micro-batches of this many rollouts")
  p.add_argument("--context", type=common.at_least(1), default=1,
                 help="also the causal attention work's spread over this many context chips "
                 "of a packed row (context_imbalance)")
  p.add_argument("--remat", choices=tuple(model_lib.REMAT_POLICIES), default="none")
  p.add_argument("--reps", type=common.at_least(1), default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="also append the JSON lines to this file")
  p.set_defaults(run=run_packing)

"""A run's TPU programs against their floors: the line launch/compile_check.py prints for
each compiled program (kernels aside) and what `python -m jaxgrpo.bench decode-bytes`
reports. The costs come from runtime/tpu_cost.py (the compiled HLO's own estimates); the
floors from the run's config:

  * the update: 6 x params x tokens of the step (each prompt once, each completion; 4x with
    LoRA, whose base weights get no gradient; + 2x for a reference forward when beta > 0;
    a mixture's active params), over the chips, at the MXU peak;
  * a decode token-step: the weights a chip reads once (compute dtype, split over tensor,
    a mixture's experts over expert) and the K/V of its rows when every slot is live (the
    last token-step; a whole-cache read touches them all every step), at HBM bandwidth.
"""

from __future__ import annotations

import jax

from jaxgrpo.model import decode
from jaxgrpo.model import decoder
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import turns
from jaxgrpo.run import build
from jaxgrpo.runtime import tpu_cost


def seconds(s: float) -> str:
  return (f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else
          f"{s * 1e6:.1f} us")


def program_line(hlo: str, name: str, chip, config, model_cfg, mesh) -> str:
  """`predicted <time>` and the floor for one program (module docstring)."""
  cost = tpu_cost.program_cost(hlo, chip)
  flags_ = []
  if cost.bounded_loops:
    flags_.append(f"{cost.bounded_loops} data-dependent loop(s) at their bound")
  if cost.unknown_loops:
    flags_.append(f"{cost.unknown_loops} loop(s) of unknown count taken once")
  if cost.roofline_ops:
    flags_.append(f"{cost.roofline_ops} op(s) without estimated_cycles by bytes/HBM")
  out = (f"predicted {seconds(cost.serial_s)} a "
         f"{'step' if name == 'update step' else 'call'} (>= {seconds(cost.overlapped_s)} "
         f"overlapped; collectives {seconds(cost.collective_s)})")
  if name == "update step":
    floor = update_floor_flops(config, model_cfg) / mesh.size / chip.peak_flops
    out += f", {100 * floor / cost.serial_s:.1f}% of the matmul floor ({seconds(floor)})"
  else:
    step = tpu_cost.decode_step_cost(hlo, chip)
    if step is not None:
      step_cost, bound = step
      floor = decode_floor_bytes(config, model_cfg, mesh, name)
      out += (f", {seconds(step_cost.serial_s)} a token-step ({bound} at most); decode step "
              f"{step_cost.bytes / 1e9:.2f} GB = {step_cost.bytes / floor:.2f}x the floor's "
              f"{floor / 1e9:.2f} GB, {100 * floor / chip.hbm_bytes_s / step_cost.serial_s:.1f}% "
              "of the HBM floor")
  return out + (f" [{'; '.join(flags_)}]" if flags_ else "")


def update_floor_flops(config, model_cfg) -> float:
  """6 x params x tokens (forward and backward of every token of the step: each prompt once,
  each completion), 4x with LoRA (no base-weight gradients), + 2x for a reference forward.
  A mixture's params are those a token uses: its k of E experts' share of the experts'."""
  params = sum(x.size for x in jax.tree.leaves(decoder.param_structure(model_cfg)))
  c = model_cfg
  if c.num_experts:
    experts = c.num_layers * c.num_experts * 3 * c.d_model * c.moe_mlp_dim
    params -= experts * (1 - c.num_experts_per_tok / c.num_experts)
  g = config.grpo
  n = g.num_prompts_per_step * g.num_generations_per_prompt
  tokens = g.num_prompts_per_step * config.data.max_prompt_length + n * (
      build.completion_width(config))
  per_token = (4 if config.model.lora_rank else 6) + (2 if g.beta > 0 else 0)
  return per_token * params * tokens


def decode_floor_bytes(config, model_cfg, mesh, name: str) -> float:
  """The weights and the live K/V (every slot: the last token-step) a chip reads once."""
  g, gen = config.grpo, config.generation
  train = name.startswith("train")
  prompts = g.num_prompts_per_step if train else g.val_batch_size
  samples = g.num_generations_per_prompt if train else g.val_num_generations_per_prompt
  prompt_len, slots = config.data.max_prompt_length, decode.gen_slots(
      gen.max_new_tokens, gen.decode_block_size)
  kind = build.kind_of(config)
  if kind.episodes:  # an episode's turn: one row an episode, its slots after the prompt
    prompts, samples = prompts * samples, 1
    slots = turns.slots(prompt_len, gen.max_episode_tokens)
  elif train and kind.partial:  # partial rollouts' rounds: a row a rollout
    prompts, samples, slots = prompts * samples, 1, gen.max_new_tokens
  ways = sharding_lib.batch_size_multiple(mesh)
  tensor, expert = mesh.shape["tensor"], mesh.shape["expert"]
  return (tpu_cost.decode_weight_bytes(model_cfg, tensor, expert)
          + tpu_cost.decode_kv_bytes(model_cfg, prompts=-(-prompts // ways), samples=samples,
                                     prompt_len=prompt_len, slots=slots, tensor=tensor))

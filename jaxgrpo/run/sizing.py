"""Batch sizes that fit the chips, read from the compiler: `micro_batch_size='auto'` and
`val_batch_size='auto'`.

A program's memory is a compiler fact, known before anything runs: `jit(f).lower(abstract
inputs with the run's shardings).compile().memory_analysis()` gives its arguments, outputs,
temporaries and code per chip. This module builds the run's update step and samplers from
abstract values (the same functions `build.training` uses, nothing allocated), and chooses

  * the micro-batch: the largest valid `grpo.micro_batch_size` (whole groups whose prompts
    split over the data axes, dividing the batch) whose update step fits the memory limit.
    The update's arguments hold the parameters, the optimizer state, the reference policy
    and the rollouts, so its total is the chip's peak while it runs;
  * the validation batch: the largest `grpo.val_batch_size` among doubling multiples of
    the data axes and the processes, and the whole validation set, whose val sampler fits
    beside the train state it does not take as an argument (optimizer moments, reference
    policy), which stays on the chips all run. A size whose generated keys and values
    alone (`val_cache_bytes`, a floor of its memory) overflow is not compiled: at 16k
    tokens the whole validation set's sampler needed 886 GiB a chip and took 26 minutes
    to compile only to be refused.

The limit is `mesh.memory_limit_gib` when set, else the device's own (`memory_stats()`'s
`bytes_limit`, which TPUs and GPUs report); CPU reports none, and without a limit `auto` is
the whole batch (and the whole validation set), with nothing compiled.

The search (`choose`). Memory is close to affine in the batch size, so the largest and the
smallest valid sizes are compiled first (the whole batch fitting ends it at one), the line
through the two nearest measured sizes that bracket the limit predicts the largest fitting
size, and that prediction and its next larger size are compiled to confirm it: the answer is
always a size that was compiled and fits next to one that was compiled and does not (or the
largest). When memory is far from affine (the val sampler's, with compaction's stages, is
not even monotone), each miss narrows the bracket and the line is drawn again; three
overshoots in a row halve it instead, so the count stays logarithmic. One to five compiles
for the shipped configs (BENCHMARKS.md); the count and seconds are printed and kept in
summary.json. `launch/compile_check.py` chooses with the same function, for a TPU topology.

The choice changes memory and speed only: the micro-batched update equals the whole-batch
update, and validation's numbers do not depend on its batch size (tests/test_microbatch.py,
tests/test_validation.py), so a resumed run may re-choose.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo import config as config_lib
from jaxgrpo.run import build
from jaxgrpo.algo import grpo
from jaxgrpo.algo import microbatch
from jaxgrpo.model import attention as attention_lib
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import lora
from jaxgrpo.model import sharding as sharding_lib

GIB = 2**30
AUTO = "auto"
KEYS = config_lib.AUTO_KEYS  # grpo.<key> that may be 'auto'


class FitError(ValueError):
  """No valid size fits: one line with the sizes tried and the bytes they need."""


@dataclasses.dataclass
class Memory:
  """One program's per-chip bytes (CompiledMemoryStats), and the train state it does not
  take as an argument but shares the chips with.

  When the compiler refuses a program that overflows HBM and cannot be made to report its
  breakdown, only `needs` (the total its error message names) is known.
  """

  arguments: int | None = None
  outputs: int | None = None
  alias: int | None = None
  temporaries: int | None = None
  code: int | None = None
  needs: int | None = None
  resident: int = 0
  seconds: float = 0.0  # compilation time (with the retry of an overflowing program)
  # The compiled program's HLO text (runtime/tpu_cost reads its kernels, bytes and time);
  # None when the compiler refused it.
  hlo: str | None = dataclasses.field(default=None, repr=False)

  @property
  def total(self) -> int:
    if self.needs is not None:
      return self.needs
    return self.arguments + self.outputs - self.alias + self.temporaries + self.code

  @property
  def peak(self) -> int:
    return self.total + self.resident


@dataclasses.dataclass
class Choice:
  """What a search chose for `grpo.<key>`: the size, every size it compiled, its cost."""

  key: str
  program: str            # "update step" or "val sampler"
  size: int | None        # None: not even the smallest fits
  limit: int | None       # bytes per chip planned against; None: no limit (nothing compiled)
  tried: dict             # size -> Memory, in the order compiled
  seconds: float = 0.0

  def line(self) -> str:
    """The start-up line: `micro_batch_size=auto -> 256 (update step 11.1 GiB of 16.0 GiB
    per chip; 4 compiles, 41 s)`."""
    if self.limit is None:
      whole = {"micro_batch_size": "the whole batch", "val_batch_size": "the whole "
               "validation set", "micro_batch_tokens": "the largest candidate"}
      return (f"{self.key}=auto -> {self.size} ({whole[self.key]}: no memory "
              "limit to plan against; set mesh.memory_limit_gib to choose)")
    m = self.tried[self.size]
    state = " with the train state" if m.resident else ""
    return (f"{self.key}=auto -> {self.size} ({self.program} {gib(m.peak)}{state} of "
            f"{gib(self.limit)} per chip; {len(self.tried)} compile"
            f"{'s' * (len(self.tried) != 1)}, {self.seconds:.0f} s)")

  def failure(self) -> str:
    tried = ", ".join(f"{s}: {gib(m.peak)}" for s, m in sorted(self.tried.items()))
    return (f"config.grpo.{self.key}=auto: no valid size fits the {self.program} in "
            f"{gib(self.limit)} per chip (tried {tried}); allowed: more chips, model.remat="
            "full, a smaller grpo.logprob_chunk_size or max_new_tokens, or a larger "
            "mesh.memory_limit_gib")

  def summary(self) -> dict:
    return {"size": self.size, "limit_bytes": self.limit, "compiles": len(self.tried),
            "seconds": round(self.seconds, 2),
            "peak_bytes": {str(s): m.peak for s, m in self.tried.items()}}


def memory_limit(config, mesh) -> int | None:
  """Bytes per chip to plan against: mesh.memory_limit_gib, else the device's own limit
  (None where the platform reports none: CPU)."""
  gib_limit = config.mesh.memory_limit_gib
  if gib_limit is not None:
    return int(gib_limit * GIB)
  try:
    stats = mesh.devices.flat[0].memory_stats()
  except Exception:  # pylint: disable=broad-except  (a compile-only TPU description)
    stats = None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def micro_batch_sizes(config, mesh) -> list[int]:
  """Every valid grpo.micro_batch_size, smallest first: whole groups or one sub-group on each
  device, dividing the batch (algo/microbatch.py's rule)."""
  g = config.grpo
  return microbatch.valid_sizes(g.num_generations_per_prompt,
                                sharding_lib.batch_size_multiple(mesh),
                                g.num_prompts_per_step * g.num_generations_per_prompt)


# The most tokens a chip's packed micro-batch holds under 'auto' (unless the longest
# sequence is longer), with a flash kernel (splash, cuDNN): verl's default
# ppo_max_token_len_per_gpu. Past it the matmuls gain nothing, and causal attention over a
# packed row costs more per token as the row grows. With "xla" attention, which holds a
# packed row's [S, S] scores, 'auto' packs one longest sequence's worth: no row's attention
# then costs more than a padded row's (measured on CPU, cpu,long: 10,240 tokens took 150 s
# an update and 22 GiB).
AUTO_MAX_TOKENS = 16384


def micro_batch_token_sizes(config, mesh) -> list[int]:
  """The grpo.micro_batch_tokens to choose from, smallest first: room for 1, 2, 4, ...
  longest sequences, up to a chip's rollouts at full length and to AUTO_MAX_TOKENS (xla
  attention: one longest sequence). Doubling, as for val_batch_sizes: the packed update's memory is
  close to affine in the budget, and a finer grid costs compiles for little."""
  g = config.grpo
  width = microbatch.sequence_width(config)
  rows = (g.num_prompts_per_step * g.num_generations_per_prompt
          // sharding_lib.batch_size_multiple(mesh))
  cap = AUTO_MAX_TOKENS if build.attention(config, mesh) != "xla" else width
  counts = [1]
  while counts[-1] * 2 <= rows and width * counts[-1] * 2 <= cap:
    counts.append(counts[-1] * 2)
  # Each chip of a context group an equal share of the row, and with splash a whole number
  # of its blocks (issue 63: a budget off the block was padded and resharded each layer).
  unit = attention_lib.packed_row_multiple(build.attention(config, mesh), mesh.shape["context"])
  return list(dict.fromkeys(-(-width * k // unit) * unit for k in counts))


def val_batch_sizes(mesh, num_val_prompts: int) -> list[int]:
  """The validation batches to choose from, smallest first: the data axes' multiple (with
  the processes) times 1, 2, 4, ..., then the whole validation set rounded up to it (a
  larger batch is padding). Doubling, not every multiple: validation's numbers do not
  depend on its batch, and the val sampler's memory is not affine in it (compaction's
  stages, measured for Qwen2.5-1.5B on v5e: 17.9 GiB at 1320 prompts, 18.0 at 1144), so a
  fine grid cost many 75-second compiles for nothing."""
  step = math.lcm(sharding_lib.batch_size_multiple(mesh), jax.process_count())
  whole = -(-max(num_val_prompts, 1) // step) * step
  sizes = [step]
  while sizes[-1] * 2 < whole:
    sizes.append(sizes[-1] * 2)
  return sizes + ([whole] if whole > sizes[-1] else [])


def val_cache_bytes(config, model_cfg, prompts: int) -> int:
  """A floor of the val sampler's bytes per chip for `prompts` prompts: the generated
  tokens' keys and values (prompts x k samples x the generated tokens, every layer, in the
  compute dtype), whose rows split over the data axes only (a context axis's chips repeat
  their rows while sampling) and whose KV heads split over `tensor` at most."""
  g, gen = config.grpo, config.generation
  slots = (max(0, gen.max_episode_tokens - config.data.max_prompt_length)
           if gen.max_episode_tokens else gen.max_new_tokens)
  per_token = (2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim *
               jnp.dtype(model_lib.DTYPES[model_cfg.dtype]).itemsize)
  shards = sharding_lib.data_parallel_rows(config.mesh) * config.mesh.tensor
  return prompts * g.val_num_generations_per_prompt * slots * per_token // shards


def choose(sizes: Sequence[int], measure: Callable[[int], Memory], limit: int,
           report: Callable[[int, Memory], None] | None = None):
  """(the largest size whose measured peak fits `limit`, or None; {size: Memory} compiled).

  Sizes ascending. See the module docstring: the ends first, then the affine prediction
  between the nearest fitting and failing sizes, confirmed by compiling it and its next
  larger size, until they are adjacent; after three overshoots in a row, one bisection."""
  tried = {}

  def at(size):
    if size not in tried:
      tried[size] = measure(size)
      if report:
        report(size, tried[size])
    return tried[size]

  # The whole batch first: it is the usual answer on a roomy chip, and it can need less
  # than a micro-batch of it (no gradient accumulator: measured on CPU for a tiny model).
  if at(sizes[-1]).peak <= limit:
    return sizes[-1], tried
  if at(sizes[0]).peak > limit:
    return None, tried
  overshoots = 0  # predictions in a row that did not fit
  while True:
    fit = max(s for s, m in tried.items() if m.peak <= limit)
    over = min(s for s, m in tried.items() if m.peak > limit)
    between = [s for s in sizes if fit < s < over]
    if not between:
      return fit, tried
    if overshoots >= 3:  # the line keeps overshooting (memory far from affine): halve
      guess = between[(len(between) - 1) // 2]
    else:  # the line through the bracket's ends (regula falsi)
      lo, hi = tried[fit].peak, tried[over].peak
      slope = (hi - lo) / (over - fit)
      predicted = [s for s in between if lo + slope * (s - fit) <= limit]
      guess = predicted[-1] if predicted else between[0]
    if at(guess).peak > limit:
      overshoots += 1
    else:  # confirm it from above: its next larger size
      overshoots = 0
      at(sizes[sizes.index(guess) + 1])


# grpo.<key> -> (the program it sizes, the name fit.programs builds it by).
PROGRAMS = {"micro_batch_size": ("update step", "update"),
            "micro_batch_tokens": ("update step", "update"),
            "val_batch_size": ("val sampler", "val")}


def choose_size(key: str, sizes, config, model_cfg, tokenizer, mesh, limit: int | None,
                report=None) -> Choice:
  """grpo.<key>='auto': the largest of `sizes` whose program (PROGRAMS[key]) fits `limit`:
  the update step for micro_batch_size (micro_batch_sizes), the val sampler beside the
  train state for val_batch_size (val_batch_sizes). No limit: the largest, nothing
  compiled."""
  program, which = PROGRAMS[key]
  if limit is None:
    return Choice(key, program, sizes[-1], None, {})
  start = time.perf_counter()

  def measure(size):
    # The program's memory; with episodes the larger of a turn and the start that makes
    # its cache (fit.programs yields both).
    return max((compile_memory(lowered, resident) for _, lowered, resident in programs(
        _with(config, **{key: size}), model_cfg, tokenizer, mesh, [which])),
               key=lambda m: m.peak)

  size, tried = choose(sizes, measure, limit,
                       report and (lambda s, m: report(key, program, s, m, limit)))
  return Choice(key, program, size, limit, tried, time.perf_counter() - start)


def report_line(key: str, program: str, size: int, memory: Memory, limit: int) -> str:
  """One compile of a search: `micro_batch_size=256: update step needs 11.1 GiB per chip
  (fits; compiled in 20 s)`."""
  state = " with the train state" if memory.resident else ""
  verdict = "fits" if memory.peak <= limit else "does not fit"
  return (f"{key}={size}: {program} needs {gib(memory.peak)} per chip{state} ({verdict}; "
          f"compiled in {memory.seconds:.0f} s)")


def resolve(config, model_cfg, tokenizer, mesh, num_val_prompts: int, limit=None,
            report=None, keys=KEYS):
  """(config with every 'auto' of KEYS chosen, [Choice]); raises FitError when nothing fits.
  The config comes back as a new locked ConfigDict (ConfigDict keeps a key's type). The
  trainer and launch/compile_check.py both choose here; `limit` None: memory_limit's.
  report(key, program, size, Memory, limit), if given, sees each compile as it ends; keys:
  which of KEYS to choose (evaluate chooses only the validation batch)."""
  g = config.grpo
  choices = []
  if g.micro_batch_tokens and g.micro_batch_size == AUTO:
    # Packed micro-batches replace micro-batches of rows: nothing to choose for the latter.
    config = _with(config, micro_batch_size=0)
    g = config.grpo
  if config_lib.any_auto(g) and limit is None:
    limit = memory_limit(config, mesh)
  if g.val_batch_size == AUTO and "val_batch_size" in keys:
    sizes = val_batch_sizes(mesh, num_val_prompts)
    if limit is not None:  # sizes whose cache alone overflows are not compiled (the smallest is)
      sizes = sizes[:1] + [s for s in sizes[1:]
                           if val_cache_bytes(config, model_cfg, s) < limit]
    choices.append(choose_size("val_batch_size", sizes, config, model_cfg, tokenizer, mesh,
                               limit, report))
  if g.micro_batch_size == AUTO and "micro_batch_size" in keys:
    choices.append(choose_size("micro_batch_size", micro_batch_sizes(config, mesh), config,
                               model_cfg, tokenizer, mesh, limit, report))
  if g.micro_batch_tokens == AUTO and "micro_batch_tokens" in keys:
    choices.append(choose_size("micro_batch_tokens", micro_batch_token_sizes(config, mesh),
                               config, model_cfg, tokenizer, mesh, limit, report))
  for choice in choices:
    if choice.size is None:
      raise FitError(choice.failure())
  return _with(config, **{c.key: c.size for c in choices}), choices


def choose_auto(config, model_cfg, tokenizer, data, mesh, keys=KEYS):
  """The trainer's and evaluate's one sizing step: every 'auto' of `keys` chosen (`resolve`),
  one line each on process 0's stderr, and the validation batches made again at the chosen
  size. Returns (config, [Choice], the validation batches, or None when the validation
  batch was not chosen here). Raises FitError when nothing fits."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  chosen_val = config.grpo.val_batch_size == AUTO and "val_batch_size" in keys
  config, choices = resolve(config, model_cfg, tokenizer, mesh, len(data.val_rows), keys=keys)
  if jax.process_index() == 0:
    for choice in choices:
      print(choice.line(), file=sys.stderr, flush=True)
  return (config, choices,
          loading.validation_batches(config, tokenizer, data) if chosen_val else None)


def _with(config, **grpo_values):
  """A locked copy of `config` with grpo values replaced (any type)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  values = config.to_dict()
  values["grpo"].update(grpo_values)
  out = ml_collections.ConfigDict(values)
  out.lock()
  return out


def programs(c, model_cfg, tokenizer, mesh, which):
  """(name, jax Lowered, bytes of train state resident beside it) for the programs named in
  `which` (update, train, val), built as build.training builds them, from abstract values."""
  g = c.grpo
  optimizer, lr = build.make_optimizer(c)
  params = abstract_params(model_cfg, mesh)
  # An abstract copy is the value itself: the same shapes and shardings.
  state, ref_params = build.state_and_reference(
      c, params, optimizer, mesh, adapters=lambda: abstract_adapters(c, model_cfg, mesh),
      init_state=abstract_state, copy=lambda p: p)
  engine = build.make_engine(c, model_cfg, tokenizer, mesh)
  b, p, t = g.num_prompts_per_step, c.data.max_prompt_length, build.completion_width(c)
  n = b * g.num_generations_per_prompt
  loss = build.loss_config(c, mesh, model_cfg)
  sds = jax.ShapeDtypeStruct
  if "update" in which:
    update = grpo.compile_update(state, ref_params, cfg=model_cfg,
                                 loss=loss,
                                 sp=engine.profile("train").sampling, optimizer=optimizer,
                                 lr_schedule=lr, mesh=mesh)
    batch = {"prompt_tokens_BxL": sds((b, p), jnp.int32),
             "prompt_mask_BxL": sds((b, p), bool),
             "completion_tokens_NxT": sds((n, t), jnp.int32),
             "completion_mask_NxT": sds((n, t), bool),
             "old_logp_NxT": sds((n, t), jnp.float32), "rewards_N": sds((n,), jnp.float32),
             "truncated_N": sds((n,), bool), "scored_N": sds((n,), bool)}
    if loss.trained_mask:
      batch["trained_NxT"] = sds((n, t), bool)
    assert set(batch) == set(grpo.batch_ranks(loss)), "grpo's update batch changed its keys"
    yield "update step", update.lower(state, batch, ref_params), 0
  # While sampling, the optimizer state and the reference policy stay on the chips; with
  # LoRA the samplers run merged weights, beside the base and the adapters.
  resident = bytes_per_chip((state.step, state.opt_state, ref_params) + (
      (state.params,) if c.model.lora_rank else ()))
  key = jax.eval_shape(lambda: jax.random.key(0))
  for name, rows in (("train", b), ("val", g.val_batch_size)):
    if name not in which:
      continue
    samples = (g.num_generations_per_prompt if name == "train"
               else g.val_num_generations_per_prompt)
    # The engine describes its own programs (a sampler call, partial rounds, episode turns).
    for label, lowered in engine.programs(name, params, rows, key, samples):
      yield label, lowered, resident


def abstract_params(model_cfg, mesh):
  """The parameter tree as ShapeDtypeStructs carrying the run's shardings."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  shapes = jax.eval_shape(lambda r: nn.unbox(model_lib.init_params(model_cfg, r)),
                          jax.random.key(0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, sharding_lib.param_shardings(model_cfg, mesh))


def abstract_adapters(c, model_cfg, mesh):
  """LoRA adapters (build.place_adapters) as ShapeDtypeStructs with their shardings."""
  targets = lora.parse_targets(c.model.lora_targets)
  shapes = jax.eval_shape(lambda k: lora.init(model_cfg, c.model.lora_rank, targets, k),
                          jax.random.key(0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, sharding_lib.adapter_shardings(model_cfg, mesh, targets))


def abstract_state(params, optimizer, mesh):
  """grpo.init_state's TrainState, abstract: the same shardings (moments like their
  parameters, scalars replicated), with nothing allocated."""
  replicated = sharding_lib.replicated(mesh)
  shapes = jax.eval_shape(optimizer.init, params)
  shardings = grpo.opt_state_shardings(params, optimizer, mesh)
  opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                           shapes, shardings)
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  return grpo.TrainState(step, params, opt_state)


def bytes_per_chip(tree) -> int:
  """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (its largest shard)."""
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def compile_memory(lowered, resident: int) -> Memory:
  """The compiled program's per-chip bytes; a program the compiler refuses for overflowing
  the chip's memory is measured by `overflow` instead. Other compile errors raise."""
  start = time.perf_counter()
  try:
    memory = _compile(lowered, resident)
  except Exception as e:  # pylint: disable=broad-except  # XLA's errors are untyped
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    memory = overflow(lowered, resident, e)
  memory.seconds = time.perf_counter() - start
  return memory


def _compile(lowered, resident: int, options=None) -> Memory:
  compiled = lowered.compile(compiler_options=options)
  stats = compiled.memory_analysis()
  return Memory(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                alias=stats.alias_size_in_bytes, temporaries=stats.temp_size_in_bytes,
                code=stats.generated_code_size_in_bytes, resident=resident,
                hlo=compiled.as_text())


def overflow(lowered, resident: int, error: Exception) -> Memory:
  """What a program the compiler refused for overflowing HBM needs.

  Compiled again with the overflow check off, the compiler reports the full breakdown; for
  some programs (tens of GiB over) that compile fails too ("Invalid TPU program"), and the
  total the first error names is what is left, e.g. "the total memory required for HLO
  temporaries (65.01G) exceeds available HBM (15.75G)" (G: GiB).
  """
  try:
    return _compile(lowered, resident, {"xla_tpu_no_crash_on_oom": True})
  except Exception:  # pylint: disable=broad-except
    pass
  sizes = re.findall(r"(\d+(?:\.\d+)?)([KMGT])\b", str(error))
  if not sizes:
    raise error
  number, unit = sizes[0]
  return Memory(needs=int(float(number) * 1024 ** " KMGT".index(unit)), resident=resident)


def gib(n: int) -> str:
  """Bytes in the unit that reads best (the table mixes tiny and huge programs)."""
  for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}" if unit != "GiB" else f"{n / size:.1f} GiB"
  return f"{n} B"

"""jaxgrpo/run/sizing.py: 'auto' batch sizes, chosen from the compiler's memory figures."""

import importlib.util
import os

import jax
import ml_collections
import pytest

from jaxgrpo import config as config_lib
from jaxgrpo.run import sizing, loading
from jaxgrpo.model import sharding as sharding_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def affine(base, per_row):
  return lambda size: sizing.Memory(needs=base + per_row * size)


def test_choose_compiles_the_ends_then_confirms_the_affine_prediction():
  # peak = 100 + 10 s; limit 800: s <= 70 fits. The whole batch (256: 2660) does not, the
  # smallest (16: 260) does; the line through them predicts 64 (740), which is compiled and
  # fits, then its next size 128 (1380), which does not: 64 after four compiles.
  seen = []
  size, tried = sizing.choose([16, 32, 64, 128, 256], affine(100, 10), 800,
                           report=lambda s, m: seen.append(s))
  assert size == 64 and seen == [256, 16, 64, 128] and list(tried) == seen


@pytest.mark.parametrize("limit", [300, 500, 900, 1700, 2500, 3000])
def test_the_choice_fits_and_the_next_larger_size_was_compiled_and_does_not(limit):
  # A convex curve (not affine): whatever the limit, the answer is a compiled size that
  # fits beside a compiled next size that does not (or the whole batch).
  sizes = [16, 32, 48, 64, 96, 128, 192, 256]
  measure = lambda s: sizing.Memory(needs=int(200 + 2 * s + 0.03 * s * s))
  size, tried = sizing.choose(sizes, measure, limit)
  assert tried[size].peak <= limit
  if size != sizes[-1]:
    assert tried[sizes[sizes.index(size) + 1]].peak > limit
  assert len(tried) < len(sizes)  # never every size


def test_the_whole_batch_fitting_costs_one_compile_and_nothing_fitting_two():
  assert sizing.choose([8, 16, 32], affine(0, 1), 32) == (32, {32: sizing.Memory(needs=32)})
  size, tried = sizing.choose([8, 16, 32], affine(100, 1), 50)
  assert size is None and list(tried) == [32, 8]


def test_refused_program_falls_back_to_the_compilers_total():
  """When even the retry with the overflow check off fails, the total comes from the
  compiler's first error message (its G are GiB)."""

  class Refused:
    def compile(self, compiler_options=None):
      raise RuntimeError("INVALID_ARGUMENT: Invalid TPU program.")

  error = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                       "required for HLO temporaries (65.01G) exceeds available HBM (15.75G).")
  memory = sizing.overflow(Refused(), 2**30, error)
  assert memory.needs == int(65.01 * 2**30) and memory.arguments is None
  assert memory.peak == memory.needs + 2**30
  with pytest.raises(RuntimeError, match="no sizes"):
    sizing.overflow(Refused(), 0, RuntimeError("RESOURCE_EXHAUSTED: no sizes"))


def _setup(**grpo):
  spec = importlib.util.spec_from_file_location("math_cfg", os.path.join(ROOT, "configs",
                                                                         "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  # 64 prompts x 4 rollouts of 64 tokens on 8 devices: micro-batches of 8 and 16 (one
  # sub-group of 1 or 2 rollouts a device, issue 51), 32, 64, 128, 256, whose update steps
  # need 24.9 (32), 39.0, 65.1, 117.2 MB per device (CPU, jax 0.10.2).
  c.grpo.num_prompts_per_step, c.generation.max_new_tokens = 64, 64
  c.data.max_prompt_length, c.mesh.data = 64, 8
  for key, value in grpo.items():
    c.grpo[key] = value
  config = config_lib.validate(c, jax.device_count())
  model_cfg, _, tokenizer = loading.load_policy(config)
  return config, model_cfg, tokenizer, sharding_lib.make_mesh(config.mesh.to_dict())


def test_auto_picks_the_largest_micro_batch_whose_compiled_update_fits():
  config, model_cfg, tokenizer, mesh = _setup()
  config = sizing._with(config, micro_batch_size="auto")
  limit = 50 * 10**6
  # No limit (CPU reports none): the whole batch, nothing compiled.
  assert sizing.memory_limit(config, mesh) is None
  config_none, (whole,) = sizing.resolve(config, model_cfg, tokenizer, mesh, 32)
  assert (whole.size, whole.tried, config_none.grpo.micro_batch_size) == (256, {}, 256)
  # 50 MB: the config comes back with the number; both sizes read from memory_analysis().
  resolved, (choice,) = sizing.resolve(config, model_cfg, tokenizer, mesh, 32, limit=limit)
  assert resolved.grpo.micro_batch_size == choice.size == 64
  assert choice.tried[64].peak <= limit < choice.tried[128].peak  # 64 fits, 128 does not
  assert choice.tried[64].temporaries > 0 and list(choice.tried) == [256, 8, 64, 128]
  assert choice.line().startswith("micro_batch_size=auto -> 64 (update step ")
  # Too small a limit is one line naming the sizes tried.
  with pytest.raises(sizing.FitError, match=r"config.grpo.micro_batch_size=auto: no valid size "
                     r"fits the update step in 9.54 MiB per chip \(tried 8: .*, 256: "):
    sizing.resolve(config, model_cfg, tokenizer, mesh, 32, limit=10 * 10**6)


def test_val_batch_sizes_stop_at_the_validation_set():
  _, _, _, mesh = _setup()
  assert sizing.val_batch_sizes(mesh, 20) == [8, 16, 24]  # doubling, then the whole set
  assert sizing.val_batch_sizes(mesh, 32) == [8, 16, 32]
  assert sizing.val_batch_sizes(mesh, 1319) == [8, 16, 32, 64, 128, 256, 512, 1024, 1320]


def test_a_validation_batch_whose_cache_alone_overflows_is_not_compiled(monkeypatch):
  """Issue 60: at 16k tokens the 'auto' search compiled the whole validation set's sampler
  first (26 minutes, to learn it needed 886 GiB a chip). The generated keys and values are a
  floor of its memory: arith3 has 2 layers x 4 KV heads x 32 dims, K and V in float32, so
  2 x 2 x 4 x 32 x 4 = 2048 bytes a token; 2 samples x 64 tokens a prompt = 256 KiB, over
  8 data shards = 32 KiB a prompt a chip."""
  config, model_cfg, tokenizer, mesh = _setup()
  config = sizing._with(config, val_batch_size="auto")
  assert sizing.val_cache_bytes(config, model_cfg, 32) == 32 * 32 * 1024
  offered = []

  def choose_size(key, sizes, *args, **kwargs):  # what the search is offered, no compiles
    offered.append(list(sizes))
    return sizing.Choice(key, "val sampler", sizes[-1], None, {})

  monkeypatch.setattr(sizing, "choose_size", choose_size)
  limit = 20 * 10**6  # 512 prompts' cache is 16.8 MB, 1024's 33.6: 1024 and 1320 are skipped
  sizing.resolve(config, model_cfg, tokenizer, mesh, 1319, limit=limit, keys=("val_batch_size",))
  assert offered == [[8, 16, 32, 64, 128, 256, 512]]
  # The smallest size stays even when its cache alone overflows: its compile says by how much.
  sizing.resolve(config, model_cfg, tokenizer, mesh, 1319, limit=10**5, keys=("val_batch_size",))
  assert offered[-1] == [8]


@pytest.mark.parametrize("sizes, gib, chosen, order", [
    # The val sampler of configs/gsm8k.py on v5e (16 GiB), GiB per chip as launch/
    # compile_check.py measured them: Qwen2.5-1.5B on 2x4 is not even monotone (1024 prompts
    # need 39.0, all 1320 need 17.9), Llama 3.2 3B on 4x4 is. Each miss draws the line
    # again through the narrower bracket.
    ([8, 16, 32, 64, 128, 256, 512, 1024, 1320],
     {1320: 17.9, 8: 3.5, 1024: 39.0, 256: 16.4, 128: 5.2}, 128, [1320, 8, 1024, 256, 128]),
    ([16, 32, 64, 128, 256, 512, 1024, 1328],
     {1328: 33.4, 16: 4.3, 512: 18.2, 256: 14.5}, 256, [1328, 16, 512, 256]),
])
def test_the_search_on_measured_tpu_curves(sizes, gib, chosen, order):
  seen = []
  size, _ = sizing.choose(sizes, lambda s: sizing.Memory(needs=int(gib[s] * 2**30)), 16 * 2**30,
                       report=lambda s, m: seen.append(s))
  assert (size, seen) == (chosen, order)


def test_an_environments_samplers_are_its_turn_and_start_programs():
  # With an environment the samplers are the episode programs (rollout/turns.py): a turn,
  # whose arguments hold the episodes' KV cache, and the start that makes the cache (the
  # prompts' prefill), per profile; both compile, and 'auto' sizes by the larger.
  spec = importlib.util.spec_from_file_location("calc_cfg", os.path.join(
      ROOT, "configs", "calculator.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  c.mesh.data, c.grpo.num_prompts_per_step = 8, 8
  config = config_lib.validate(c, jax.device_count())
  model_cfg, _, tokenizer = loading.load_policy(config)
  mesh = sharding_lib.make_mesh(config.mesh.to_dict())
  got = {name: sizing.compile_memory(lowered, resident)
         for name, lowered, resident in sizing.programs(config, model_cfg, tokenizer, mesh,
                                                    ["train", "val"])}
  assert list(got) == ["train sampler", "train episode start", "val sampler",
                       "val episode start"]
  # The start's output is the cache the turn takes, donated: aliased to the turn's output
  # (the start's output size also counts its tuple's table of 9 buffer pointers, 72 bytes).
  for name in ("train", "val"):
    start, turn = got[f"{name} episode start"], got[f"{name} sampler"]
    assert 0 < start.outputs < turn.arguments and turn.alias > 0.99 * start.outputs


def test_partial_rollouts_train_sampler_is_the_round_program_with_the_rows_caches():
  # Issue 52: with generation.max_tokens_per_step the train sampler the compile check and
  # 'auto' measure is the round program (rollout/partial.py), whose state argument (every
  # sampler row's KV cache, tokens and draws) is donated: aliased to its output.
  from jaxgrpo.rollout import partial  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("math_cfg", os.path.join(ROOT, "configs",
                                                                         "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("smoke")
  c.generation.max_tokens_per_step = 2
  config = config_lib.validate(c, jax.device_count())
  model_cfg, _, tokenizer = loading.load_policy(config)
  mesh = sharding_lib.make_mesh(config.mesh.to_dict())
  (name, lowered, resident), = sizing.programs(config, model_cfg, tokenizer, mesh, ["train"])
  got = sizing.compile_memory(lowered, resident)
  # The state of the smoke preset's 8 x 4 rows: each layer's K and V over 9 prompt + 5
  # generated slots, the tokens, log-probs and draws [32, 5], the counts.
  state = jax.eval_shape(lambda: partial.init_state(model_cfg, 32, 9, 5, False))
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  # Per device: the rows split over the 8 data-parallel devices (mesh data=-1).
  per_device = state_bytes / jax.device_count()
  assert name == "train sampler" and got.arguments > per_device
  assert got.alias == pytest.approx(per_device, rel=0.01)


def test_auto_token_budget_packs_one_longest_sequence_with_xla_and_searches_with_a_limit():
  # Issue 51's packing: sequences of 64 + 64 = 128 tokens, 32 rollouts a device. With xla
  # attention (CPU), whose packed row holds [S, S] scores, the only candidate is one longest
  # sequence; with a flash kernel, 1, 2, 4, ... of them up to 16,384 tokens and the 32 rows.
  config, model_cfg, tokenizer, mesh = _setup()
  config = sizing._with(config, micro_batch_tokens="auto")
  assert sizing.micro_batch_token_sizes(config, mesh) == [128]
  values = config.to_dict()
  values["model"]["attention"] = "splash"
  splash = ml_collections.ConfigDict(values)
  assert sizing.micro_batch_token_sizes(splash, mesh) == [128 * k for k in (1, 2, 4, 8, 16, 32)]
  # Issue 63: sequences of 64 + 36 = 100 tokens. xla takes a budget of one (100); splash a
  # whole number of its 128-token blocks (128, 256 for 200, 512 for 400, ...), and over a
  # context pair (mesh data 4 x context 2, 64 rollouts a shard) each chip's half a whole
  # number of blocks too: multiples of 256 (100 and 200 -> 256, once; 400 -> 512, ...).
  values["generation"]["max_new_tokens"] = 36
  odd_xla = ml_collections.ConfigDict({**values, "model": {**values["model"], "attention": None}})
  assert sizing.micro_batch_token_sizes(odd_xla, mesh) == [100]
  odd = ml_collections.ConfigDict(values)
  assert sizing.micro_batch_token_sizes(odd, mesh) == [128, 256, 512, 896, 1664, 3200]
  pairs = sharding_lib.make_mesh({"data": 4, "context": 2})
  assert sizing.micro_batch_token_sizes(odd, pairs) == [256, 512, 1024, 1792, 3328, 6400]
  # micro_batch_size='auto' beside a token budget: packing replaces it (0), nothing searched.
  both = sizing._with(config, micro_batch_size="auto")
  resolved, (choice,) = sizing.resolve(both, model_cfg, tokenizer, mesh, 32)
  assert (resolved.grpo.micro_batch_size, resolved.grpo.micro_batch_tokens) == (0, 128)
  assert choice.line().startswith("micro_batch_tokens=auto -> 128 (the largest candidate: ")
  # A limit: the packed update step is compiled and measured (the one candidate fits 50 MB).
  resolved, (choice,) = sizing.resolve(config, model_cfg, tokenizer, mesh, 32,
                                       limit=50 * 10**6)
  assert resolved.grpo.micro_batch_tokens == 128 and choice.tried[128].temporaries > 0

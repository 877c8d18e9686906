"""What a run builds once, before its first step: the mesh, the policy's parameters placed on
it, the rollout engine with its two profiles, the optimizer and the compiled update step.

The trainer, the evaluator, the benchmarks and launch/compile_check.py all build from here,
so a benchmark measures the very engine and update a run uses.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxgrpo.algo import grpo, microbatch
from jaxgrpo.model import hf
from jaxgrpo.model import attention as attention_lib
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import lora
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling
from jaxgrpo.runtime import config_checks
import importlib.util


@dataclasses.dataclass(frozen=True)
class Kind:
  """How a run samples, read from its config in one place (`kind_of`): the engine that
  samples (native: sampling.RolloutEngine; jetstream; episodes: turns.EpisodeEngine;
  partial: partial.PartialEngine) and the source its training steps collect from
  (rollouts.Source: single, dynamic, episodes, partial)."""
  engine: str
  source: str

  @property
  def episodes(self) -> bool:
    return self.source == "episodes"

  @property
  def partial(self) -> bool:
    return self.source == "partial"


def kind_of(c) -> Kind:
  """The one place a run's rollout kind is read from its config (issue 61: 7 places asked
  "is this a partial run?" from 4 signals). The config checks keep the kinds apart
  (episodes and partial rollouts run on the native engine, neither with dynamic sampling)."""
  gen = c.generation
  if c.env.name:
    source = "episodes"
  elif gen.max_tokens_per_step:
    source = "partial"
  else:
    source = "dynamic" if c.grpo.dynamic_sampling != "off" else "single"
  engine = source if source in ("episodes", "partial") else "native"
  return Kind("jetstream" if gen.backend == "jetstream" else engine, source)


@dataclasses.dataclass
class Rollouts:
  """A run's rollout engine and the sources that drive it, built together (`rollouts`):
  `source` for training steps (None without train batches), `val_source` for
  validations, `runner` the episode driver (None without an environment)."""
  kind: Kind
  engine: object
  runner: object
  source: object
  val_source: object

  def close(self) -> None:
    """Stops the episode runner's environment workers, if any."""
    if self.runner is not None:
      self.runner.close()


def rollouts(c, model_cfg, tokenizer, mesh, *, scorer=None, train_batches=None,
             template=None, engine=None) -> Rollouts:
  """Decides the rollout kind from the config (kind_of) and builds the engine and its
  sources for it: the one function a run's rollouts come from (trainer and evaluate).
  engine: one already made for this config (a test's train_step), used as it is."""
  from jaxgrpo.run import partial_rollouts  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import rollouts as rollouts_lib  # pylint: disable=g-import-not-at-top
  kind = kind_of(c)
  if engine is None:
    engine = make_engine(c, model_cfg, tokenizer, mesh)
  runner = _runner(c, engine, tokenizer, template) if kind.episodes else None
  val_source = (rollouts_lib.EpisodeRollouts(engine, scorer, runner) if kind.episodes
                else rollouts_lib.SingleTurn(engine, scorer))
  source = None
  if train_batches is not None:
    source = {"single": lambda: rollouts_lib.SingleTurn(engine, scorer),
              "dynamic": lambda: rollouts_lib.DynamicSampling(c, engine, scorer,
                                                              lambda: next(train_batches)),
              "episodes": lambda: val_source,
              "partial": lambda: partial_rollouts.PartialRollouts(c, engine, scorer,
                                                                  train_batches)}[kind.source]()
  return Rollouts(kind, engine, runner, source, val_source)


def make_mesh(c):
  return sharding_lib.make_mesh(c.mesh.to_dict())


def training(setup, mesh=None, engine=None):
  """Mesh, sharded params, the two sampling profiles, optimizer state and update step.
  engine: the run's (rollouts(...).engine), else one is made.

  The update step is a CountedUpdate: its `compilations`, like engine.compilations for the
  samplers, count traces, so the run can show that nothing recompiled inside the loop.
  """
  c = setup.config
  # A caller may pass its own mesh (a benchmark on fewer devices than the host has).
  mesh = make_mesh(c) if mesh is None else mesh
  params = place_params(c, setup.model_cfg, setup.host_params, mesh)
  if engine is None:
    engine = make_engine(c, setup.model_cfg, setup.tokenizer, mesh)
  train_sp = engine.profile("train").sampling
  optimizer, lr = make_optimizer(c)
  loss = loss_config(c, mesh, setup.model_cfg)
  state, ref_params = state_and_reference(
      c, params, optimizer, mesh, adapters=lambda: place_adapters(c, setup.model_cfg, mesh),
      init_state=grpo.init_state, copy=lambda p: jax.tree.map(lambda x: x.copy(), p))
  update = CountedUpdate(state, ref_params, cfg=setup.model_cfg, loss=loss,
                         sp=train_sp, optimizer=optimizer, lr_schedule=lr, mesh=mesh)
  return engine, state, ref_params, update


def make_optimizer(c):
  """(optax optimizer, learning-rate schedule) of the config, over every update it makes."""
  g, o = c.grpo, c.optim
  return grpo.make_optimizer(o.learning_rate, o.warmup_steps,
                             g.max_num_steps * g.num_iterations, o.weight_decay, o.grad_clip,
                             o.schedule)


def state_and_reference(c, params, optimizer, mesh, *, adapters, init_state, copy):
  """(train state, reference policy): the one rule build.training places and run/sizing.py
  lowers from abstract values (adapters, init_state and copy make each kind of value).
  LoRA: the state trains the adapters only, and the frozen base rides in the reference slot
  (it is the KL's reference policy too: adapters off, no second copy). Otherwise the state
  trains `params` and the reference is a copy of them, or None when beta is 0 (no copy, no
  forward pass)."""
  if c.model.lora_rank:
    return init_state(adapters(), optimizer, mesh), params
  return init_state(params, optimizer, mesh), copy(params) if c.grpo.beta > 0 else None


def place_adapters(c, model_cfg, mesh):
  """LoRA adapters (lora.init: B = 0) created on the mesh with their base weights' shardings,
  from the run seed."""
  targets = lora.parse_targets(c.model.lora_targets)
  shardings = sharding_lib.adapter_shardings(model_cfg, mesh, targets)
  key = jax.random.fold_in(jax.random.key(c.seed), 0x10A)  # not the init's own key
  return jax.jit(lambda k: lora.init(model_cfg, c.model.lora_rank, targets, k),
                 out_shardings=shardings)(key)


def place_params(c, model_cfg, host_params, mesh):
  """The starting policy on the mesh: a Hugging Face folder streamed tensor by tensor (checked
  in train.prepare), a loaded jaxgrpo checkpoint (host_params), or the seeded random init."""
  if c.model.hf_checkpoint:
    return hf.load_hf(c.model.hf_checkpoint, dtype=c.model.param_dtype, mesh=mesh)[1]
  if host_params is None:
    return sharding_lib.init_sharded(model_cfg, mesh, jax.random.key(c.seed))
  return sharding_lib.shard_params(host_params, model_cfg, mesh)


def scan_layers(c, mesh) -> bool:
  """model.scan_layers, with None resolved by the mesh's platform (model.resolve_scan_layers)."""
  return model_lib.resolve_scan_layers(c.model.scan_layers, mesh.devices.flat[0].platform)


def attention(c, mesh, model_cfg=None) -> str:
  """model.attention, with None resolved by the mesh's platform and the compute dtype (and
  the model: sliding-window layers take no splash kernel)."""
  windowed = bool(model_cfg is not None and model_cfg.sliding_window)
  return attention_lib.resolve_attention(c.model.attention, mesh.devices.flat[0].platform,
                                         c.model.dtype, windowed)


def loss_config(c, mesh, model_cfg=None) -> grpo.LossConfig:
  """The GRPO loss settings of a run config, on `mesh`."""
  g, kind = c.grpo, kind_of(c)
  return grpo.LossConfig(
      num_generations=g.num_generations_per_prompt, beta=g.beta, kl_type=g.kl_type,
      epsilon=g.epsilon, epsilon_high=g.epsilon_high, loss_agg=g.loss_agg,
      scale_rewards=g.scale_rewards, mask_truncated_completions=g.mask_truncated_completions,
      max_new_tokens=completion_width(c), micro_batch_size=g.micro_batch_size,
      micro_batch_tokens=g.micro_batch_tokens,
      logprob_chunk_size=g.logprob_chunk_size or 0, remat=c.model.remat,
      scan_layers=scan_layers(c, mesh), attention=attention(c, mesh, model_cfg),
      lora_rank=c.model.lora_rank,
      lora_scale=c.model.lora_alpha / c.model.lora_rank if c.model.lora_rank else 0.0,
      lora_targets=lora.parse_targets(c.model.lora_targets) if c.model.lora_rank else (),
      trained_mask=kind.episodes,
      importance_weight_cap=g.importance_weight_cap if kind.partial else 0.0,
      router_aux_loss_coef=g.router_aux_loss_coef, mesh=mesh)


def completion_width(c) -> int:
  """T of the update's [N, T] completions: max_new_tokens, or for multi-turn episodes the
  tokens after the prompt (every turn and observation: episodes.py); the longest sequence
  (microbatch.sequence_width) less the prompt."""
  return microbatch.sequence_width(c) - c.data.max_prompt_length


def stop_ids(c, tokenizer) -> tuple[int, ...]:
  """The ids that end a sampled turn: the tokenizer's end ids, and for episodes the stop
  strings' (env.stop_strings and the environment's own; checked by loading.check_env)."""
  if not kind_of(c).episodes:
    return tokenizer.stop_ids
  from jaxgrpo import envs  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import episodes  # pylint: disable=g-import-not-at-top
  strings = [s for s in c.env.stop_strings.split(",") if s] + list(
      envs.stop_strings(c.env.name, c.env.kwargs))
  return tuple(dict.fromkeys(tokenizer.stop_ids + episodes.stop_ids(tokenizer, strings)))


class CountedUpdate:
  """compile_update's jitted step, called as it is, and how many times jax traced it.

  A trace happens once per compilation, so `compilations` above 1 after a run means an input's
  shape, dtype or sharding changed between steps: each such step paid a full compilation.
  """

  def __init__(self, state, ref_params, **kwargs):  # compile_update's arguments
    self.compilations = 0
    self.fn = grpo.compile_update(state, ref_params, **kwargs, on_trace=self._count)
    loss, cfg, mesh = kwargs["loss"], kwargs["cfg"], kwargs["mesh"]
    self._merge = None
    if loss.lora_rank:  # one compiled merge per step for the samplers
      self._merge = jax.jit(lambda base, adapters: lora.merge(base, adapters, loss.lora_scale),
                            out_shardings=sharding_lib.param_shardings(cfg, mesh))

  def policy(self, state, ref_params):
    """The parameters the samplers run: the trained ones, or with LoRA the base with the
    adapters merged (W + alpha/r A B), computed once per call."""
    return state.params if self._merge is None else self._merge(ref_params, state.params)

  def _count(self):
    self.compilations += 1

  def __call__(self, state, batch, ref_params):
    return self.fn(state, batch, ref_params)


def _runner(c, engine, tokenizer, template=None):
  """The episode runner of a run with an environment (episodes.py). template: the run's
  prompt template (loading.Data.template): a ChatPrompt's chat template and tools render
  the observations that are chat messages, and its add_bos is the prompts' own."""
  from jaxgrpo import scorer  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import episodes  # pylint: disable=g-import-not-at-top
  e = c.env
  return episodes.Runner(
      engine, tokenizer, env_name=e.name, env_kwargs=e.kwargs, max_turns=e.max_turns,
      max_episode_tokens=c.generation.max_episode_tokens,
      max_prompt_length=c.data.max_prompt_length,
      max_observation_tokens=e.max_observation_tokens,
      workers=scorer.resolve_workers(e.workers), timeout_s=e.timeout_s,
      user_modules=c.user_modules, seed=c.seed, add_bos=getattr(template, "add_bos", True),
      chat=getattr(template, "chat", None), tools=getattr(template, "tools", None),
      truncation_side=e.observation_truncation_side)


def make_validator(c, made: Rollouts, val_batches, mesh, sources=(), *,
                   samples_dir: str | None = None, collect: bool = False):
  """The run's Validator, built here for the trainer and for evaluate alike (so a run's
  checkpoint evaluates to the run's own validation row): the validation seam (`made`'s
  val_source: one sampler call per batch, or k episodes per prompt), the val profile's k,
  val_seed, the threshold, the sources and the stop rule's lower bound."""
  from jaxgrpo.eval import validation  # pylint: disable=g-import-not-at-top
  g = c.grpo
  return validation.Validator(
      made.val_source, val_batches,
      k=g.val_num_generations_per_prompt if made.kind.episodes else None,
      threshold=g.val_pass_threshold, seed=g.val_seed, mesh=mesh, samples_dir=samples_dir,
      sources=sources, stop_metric=g.stop_at_validation_metric,
      confidence=g.stop_at_validation_confidence, collect=collect)


def make_engine(c, model_cfg, tokenizer, mesh, val_k: int | None = None):
  """The rollout engine with the config's two profiles (val_k overrides k, for benchmarks)."""
  gen, g = c.generation, c.grpo
  train_sp = sampling.SamplingParams(gen.temperature, gen.top_p, gen.top_k)
  # The validator resolved unset val_* keys to the training values.
  val_sp = sampling.SamplingParams(gen.val_temperature, gen.val_top_p, gen.val_top_k)
  kind = kind_of(c)
  # Episodes (episodes.py, turns.py) sample one turn per row: the G episodes of a prompt
  # share its prefill, but part after their first turn, so each is its own row.
  episodes = kind.episodes
  profiles = {"train": sampling.Profile(train_sp, 1 if episodes else g.num_generations_per_prompt,
                                        gen.max_new_tokens),
              "val": sampling.Profile(val_sp, 1 if episodes else (
                  val_k or g.val_num_generations_per_prompt), gen.max_new_tokens)}
  common = dict(max_prompt_length=c.data.max_prompt_length, eos_id=stop_ids(c, tokenizer),
                pad_id=tokenizer.pad_id, seed=c.seed)
  if kind.engine == "jetstream":
    # Imported here and only here: it imports JetStream and, through it, TensorFlow.
    from jaxgrpo.rollout import jetstream_rollouts  # pylint: disable=g-import-not-at-top
    # Default: one slot per row of this process's rollout, so a call is one wave.
    prompts = {"train": g.num_prompts_per_step, "val": g.val_batch_size}
    slots = {name: gen.max_concurrent_decodes
             or profiles[name].num_samples * prompts[name] // jax.process_count()
             for name in profiles}
    return jetstream_rollouts.JetStreamRolloutEngine(model_cfg, mesh, profiles,
                                                     tokenizer=tokenizer, slots=slots, **common)
  # The native engines' decode weights, whole on each chip once per call (decode.prepare).
  common["gather_weights"] = gen.gather_weights
  if kind.engine == "episodes":  # the turns' programs, on a KV cache kept between turns
    from jaxgrpo.rollout import turns  # pylint: disable=g-import-not-at-top
    return turns.EpisodeEngine(model_cfg, mesh, profiles, scan_layers=scan_layers(c, mesh),
                               max_episode_tokens=gen.max_episode_tokens,
                               max_append_tokens=c.env.max_observation_tokens + 1,
                               compact_stages=gen.compact_stages,
                               attention=attention(c, mesh, model_cfg), **common)
  if kind.engine == "partial":  # partial rollouts: training rows decode in rounds
    from jaxgrpo.rollout import partial  # pylint: disable=g-import-not-at-top
    profiles["train"] = dataclasses.replace(profiles["train"], num_samples=1)
    return partial.PartialEngine(
        model_cfg, mesh, profiles, scan_layers=scan_layers(c, mesh),
        rows=g.num_prompts_per_step * g.num_generations_per_prompt // jax.process_count(),
        decode_block=gen.decode_block_size, attention=attention(c, mesh, model_cfg), **common)
  return sampling.RolloutEngine(model_cfg, mesh, profiles, scan_layers=scan_layers(c, mesh),
                                decode_block=gen.decode_block_size,
                                compact_stages=gen.compact_stages,
                                attention=attention(c, mesh, model_cfg), **common)


@config_checks.register(order=34)
def _check_backend(c, num_devices: int) -> None:
  """The jetstream backend: its extra installed (found, not imported: it imports
  TensorFlow), one process, and decode slots that split over the data axes."""
  del num_devices
  gen, m = c.generation, c.mesh
  rows = sharding_lib.data_parallel_rows(m)
  if gen.backend != "jetstream":
    if gen.max_concurrent_decodes:
      config_checks.fail("generation.max_concurrent_decodes", gen.max_concurrent_decodes,
            f"0 with generation.backend={gen.backend!r} (only 'jetstream' has decode slots)")
    return
  if gen.decode_block_size:
    config_checks.fail("generation.decode_block_size", gen.decode_block_size,
          "0 with generation.backend='jetstream' (its slots decode at their own steps and "
          "read the whole cache); or generation.backend='native'")
  if gen.compact_stages:
    config_checks.fail("generation.compact_stages", gen.compact_stages,
          "0 with generation.backend='jetstream' (it refills finished slots instead); or "
          "generation.backend='native'")
  if importlib.util.find_spec("jetstream") is None:
    config_checks.fail("generation.backend", gen.backend, "'native', or 'jetstream' after "
          "pip install 'jaxgrpo[jetstream]' (google-jetstream is not installed)")
  if jax.process_count() > 1:
    config_checks.fail("generation.backend", gen.backend, f"'native' on {jax.process_count()} processes "
          "(the jetstream backend runs on one)")
  if gen.max_concurrent_decodes % rows:
    config_checks.fail("generation.max_concurrent_decodes", gen.max_concurrent_decodes,
          f"0 (one slot per rollout row) or a multiple of {rows} (mesh data x fsdp x expert)")


@config_checks.register(order=22)
def _check_auto_val_batch(c, num_devices: int) -> None:
  """'auto' validation batches are measured on the native sampler (run/sizing.py)."""
  del num_devices
  if c.grpo.val_batch_size == "auto" and c.generation.backend != "native":
    config_checks.fail("grpo.val_batch_size", "auto", "a number with generation.backend="
                       f"{c.generation.backend!r} ('auto' measures the native sampler)")

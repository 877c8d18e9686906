"""`validate(config)`: the one check of a run's config, before any device work.

Every error is a `ConfigError` whose message is one line naming the key, the bad value and
what is allowed, e.g.

    config.grpo.num_generations_per_prompt=1: GRPO compares samples within a group; allowed: an integer >= 2

The validator knows every key (an unknown key is an error, never silently ignored), checks
types and ranges, then cross-field rules (a batch must divide over the data-parallel devices,
and so on), resolves derived values (`mesh` sizes with -1 filled in) and returns a locked
copy. `num_devices` is passed in, so validation needs no device.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

import ml_collections

from jaxgrpo import plugins, rewards
from jaxgrpo.algo import options
from jaxgrpo.runtime import trackers

# The loss options' names (algo/grpo.py implements them; algo/options.py needs no jax).
SCALE_REWARDS, KL_TYPES, LOSS_AGGS = options.SCALE_REWARDS, options.KL_TYPES, options.LOSS_AGGS


class ConfigError(ValueError):
  """A config problem, explained in one line."""


def _int(lo=None):
  def check(v):
    if isinstance(v, bool) or not isinstance(v, int):
      return "an integer" + (f" >= {lo}" if lo is not None else "")
    if lo is not None and v < lo:
      return f"an integer >= {lo}"
  return check


def _num(lo=None, hi=None, lo_open=False, hi_open=False):
  def check(v):
    lo_s = "" if lo is None else (f" > {lo}" if lo_open else f" >= {lo}")
    hi_s = "" if hi is None else (f" < {hi}" if hi_open else f" <= {hi}")
    want = "a number" + lo_s + (" and" if lo_s and hi_s else "") + hi_s
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      return want
    if lo is not None and (v <= lo if lo_open else v < lo):
      return want
    if hi is not None and (v >= hi if hi_open else v > hi):
      return want
  return check


def _choice(*options):
  def check(v):
    if v not in options:
      return "one of " + ", ".join(repr(o) for o in options)
  return check


def _str(v):
  if not isinstance(v, str):
    return "a string"


def _bool(v):
  if not isinstance(v, bool):
    return "True or False"


def _or_auto(check):
  """'auto' (chosen at start-up from the compiler's memory figures) or a value `check`
  accepts."""
  def or_auto(v):
    if v != "auto":
      problem = check(v)
      return problem and f"'auto' or {problem}"
  return or_auto


def _nonempty(v):
  if not isinstance(v, str) or not v.strip():
    return "a non-empty string"


def _trackers(v):
  try:
    trackers.parse(v)
  except trackers.TrackerError:
    return (f"a comma-separated list among {', '.join(trackers.NAMES)} ('' for "
            "metrics.jsonl only)")


def _dtype(v):
  return _choice("float32", "bfloat16")(v)


def _optional(check):
  """None (unset) or a value `check` accepts."""
  def optional(v):
    if v is not None:
      problem = check(v)
      return problem and f"None or {problem}"
  return optional


# Each validation sampling key and the training key it follows while unset (None).
VAL_FOLLOWS = {"val_temperature": "temperature", "val_top_p": "top_p", "val_top_k": "top_k"}

# What each rollout backend cannot do: backend -> {generation key: why}. The native sampler
# honours every setting; an adapter (issue 10's JetStream) lists its limits here, and the
# validator refuses them at startup instead of ignoring them.
# The JetStream adapter (jaxgrpo/rollout/jetstream_engine.py) draws tokens with the native
# sampler's own function and random streams, so it too honours every sampling setting; what
# it cannot do (several processes) is checked in _check_backend.
BACKEND_LIMITS: dict[str, dict[str, Callable[[Any], str | None]]] = {"native": {},
                                                                     "jetstream": {}}


SCHEMA: dict[str, Any] = {
    "seed": _int(0),
    "compilation_cache_dir": _str,
    "user_modules": _str,
    "reward_workers": _int(-1), "reward_timeout_s": _num(0, lo_open=True),
    "reward_max_failed_steps": _int(1),
    # Architecture keys may be None: then the checkpoint says (and a random init refuses).
    "model": {
        "checkpoint": _str, "hf_checkpoint": _str,
        "vocab_size": _optional(_int(1)), "d_model": _optional(_int(1)),
        "num_layers": _optional(_int(1)), "num_heads": _optional(_int(1)),
        "num_kv_heads": _optional(_int(1)), "head_dim": _optional(_int(1)),
        "mlp_dim": _optional(_int(1)), "rope_theta": _optional(_num(0, lo_open=True)),
        "norm_eps": _optional(_num(0)), "tie_embeddings": _optional(_bool),
        "qk_norm": _optional(_bool), "qkv_bias": _optional(_bool),
        "rope_scaling_factor": _optional(_num(0)), "rope_low_freq_factor": _optional(_num(0)),
        "rope_high_freq_factor": _optional(_num(0)),
        "rope_original_max_positions": _optional(_int(1)),
        "param_dtype": _dtype, "dtype": _dtype,
        # Not architecture: what each layer keeps for the update's backward pass.
        "remat": _choice("none", "full", "save_dots"),
        # Not architecture: the layers as one compiled loop body or unrolled (None: by platform).
        "scan_layers": _optional(_bool),
        # Not architecture: the attention kernel (None: cudnn on GPU with bfloat16, else xla).
        "attention": _optional(_choice("xla", "cudnn")),
        # LoRA (model/lora.py): 0 = full fine-tuning; else adapters of this rank on the
        # targets (all-linear, or q,k,v,o,gate,up,down / HF's q_proj,...), scaled alpha/rank.
        "lora_rank": _int(0), "lora_alpha": _num(0, lo_open=True), "lora_targets": _str},
    # memory_limit_gib: bytes per chip that 'auto' batch sizes plan against (run/sizing.py); None:
    # the device's own limit (none on CPU).
    "mesh": {"data": _int(-1), "fsdp": _int(-1), "tensor": _int(-1), "dcn_data": _int(1),
             "memory_limit_gib": _optional(_num(0, lo_open=True))},
    "data": {
        "source": _choice("arithmetic", "jsonl"), "train_path": _str, "val_path": _str,
        "question_key": _str, "answer_key": _str, "prompt_template": _str,
        "use_chat_template": _bool,
        "max_prompt_length": _int(1), "num_digits": _int(1), "num_train_examples": _int(0),
        "num_val_examples": _int(0)},
    "rewards": None,  # name -> weight, checked against the reward registry below
    "generation": {
        "temperature": _num(0, lo_open=True), "top_p": _num(0, 1, lo_open=True),
        "top_k": _int(0), "max_new_tokens": _int(1), "backend": _choice(*BACKEND_LIMITS),
        "max_concurrent_decodes": _int(0), "decode_block_size": _int(0),
        "compact_stages": _int(0),
        # None follows the training value (resolved by `validate`); 0 is greedy.
        "val_temperature": _optional(_num(0)), "val_top_p": _optional(_num(0, 1, lo_open=True)),
        "val_top_k": _optional(_int(0)),
        # Multi-turn (env.name): prompt + turns + observations; 0 with no environment.
        "max_episode_tokens": _int(0)},
    # Multi-turn episodes (envs.py, episodes.py); name '' = single-turn rollouts.
    "env": {"name": _str, "kwargs": _str, "max_turns": _int(1),
            "max_observation_tokens": _int(1), "stop_strings": _str,
            "timeout_s": _num(0, lo_open=True), "workers": _int(0)},
    "grpo": {
        "num_prompts_per_step": _int(1), "num_generations_per_prompt": _int(2),
        "num_iterations": _int(1), "beta": _num(0), "kl_type": _choice(*KL_TYPES),
        "epsilon": _num(0, 1, lo_open=True, hi_open=True),
        "epsilon_high": _num(0, lo_open=True),
        "loss_agg": _choice(*LOSS_AGGS),
        "scale_rewards": _choice(*SCALE_REWARDS),
        "mask_truncated_completions": _bool,
        # Dynamic sampling (run/dynamic.py): 'filter' keeps the groups whose rewards differ.
        "dynamic_sampling": _choice("off", "filter"), "oversample_factor": _num(1),
        "max_generation_batches": _int(1), "dynamic_sampling_metric": _optional(_str),
        # How the update is computed (the same result): rollouts per forward and backward
        # pass (0: the whole batch), completion positions per output projection (None: all).
        # 'auto': the largest that fits the chips' memory, chosen at start-up (run/sizing.py).
        "micro_batch_size": _or_auto(_int(0)), "logprob_chunk_size": _optional(_int(1)),
        "max_num_steps": _int(1), "val_period": _int(0),
        "val_at_start": _bool, "val_at_end": _bool, "val_batch_size": _or_auto(_int(1)),
        "max_val_samples": _int(0), "val_num_generations_per_prompt": _int(1),
        "val_pass_threshold": _num(), "val_seed": _int(0),
        "stop_at_validation_metric": _optional(_str),
        "stop_at_validation_threshold": _optional(_num()),
        # None: stop when the metric reaches the threshold; c in (0, 1): when its one-sided
        # lower confidence bound at level c does.
        "stop_at_validation_confidence": _optional(_num(0, 1, lo_open=True, hi_open=True))},
    "optim": {
        "learning_rate": _num(0, lo_open=True), "warmup_steps": _int(0),
        "weight_decay": _num(0), "grad_clip": _num(0),
        "schedule": _choice("cosine", "constant")},
    "checkpoint": {
        "save_period": _int(0), "max_to_keep": _int(1), "resume": _str,
        "best_metric": _optional(_str), "best_to_keep": _int(1)},
    # Where metrics go beside metrics.jsonl (runtime/trackers.py), and the tracker run's
    # project, name ('' = the workdir's name) and tags (comma-separated).
    "logging": {"trackers": _trackers, "project": _nonempty, "run_name": _str, "tags": _str,
                "plots": _bool, "console": _bool},
}

# Keys that were replaced: an old config names its key's successor, not just "unknown".
_REPLACED = {"logging.tensorboard": "logging.trackers ('tensorboard' is in its default list; "
                                    "--config.logging.trackers='' writes metrics.jsonl only)"}

# Why a value is refused, where the bare range would not say it.
_REASONS = {
    "grpo.num_generations_per_prompt": "GRPO compares samples within a group",
    "generation.temperature": "training samples must come from a distribution (0 is greedy)",
    "grpo.val_num_generations_per_prompt": "each validation prompt is sampled k times",
    "model.hf_checkpoint": "name the Hugging Face model folder to train, e.g. "
                           "--config.model.hf_checkpoint=/path/to/Qwen2.5-1.5B-Instruct",
}


def _fail(key: str, value: Any, allowed: str):
  reason = _REASONS.get(key)
  why = f"{reason}; " if reason else ""
  raise ConfigError(f"config.{key}={value!r}: {why}allowed: {allowed}")


def _check_keys(prefix: str, section: Any, schema: dict[str, Any]):
  """Unknown, missing and bad keys of one level; dict schemas recurse, None is checked
  elsewhere. prefix is "" for the top level, else "grpo." and so on."""
  where = f"config.{prefix}".rstrip(".")
  if not isinstance(section, ml_collections.ConfigDict):
    raise ConfigError(f"{where}: expected a section with keys {sorted(schema)}")
  for key in section.keys():
    if f"{prefix}{key}" in _REPLACED:
      raise ConfigError(f"config.{prefix}{key}: replaced by "
                        f"config.{_REPLACED[prefix + key]}")
    if key not in schema:
      raise ConfigError(f"config.{prefix}{key}: unknown key; allowed: "
                        f"{', '.join(sorted(schema))}")
  for key, check in schema.items():
    if key not in section:
      raise ConfigError(f"config.{prefix}{key}: missing; every key of {where} must be set")
    if isinstance(check, dict):
      _check_keys(f"{prefix}{key}.", section[key], check)
    elif check is not None:
      problem = check(section[key])
      if problem:
        _fail(f"{prefix}{key}", section[key], problem)


def validate(config: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
  """Checks and resolves a run config; returns a locked copy. Raises ConfigError."""
  values = config.to_dict()  # a copy: the caller's stays as is
  for key in ("micro_batch_size", "val_batch_size"):
    # A config that ships 'auto' types the key as a string, so a command-line number
    # arrives as one ("256"): it means the number.
    value = values.get("grpo", {}).get(key)
    if isinstance(value, str) and value.strip().isdigit():
      values["grpo"][key] = int(value)
  config = ml_collections.ConfigDict(values)
  _check_keys("", config, SCHEMA)
  _resolve_val_profile(config.generation)
  try:  # before the reward names are checked: these register the user's rewards
    plugins.import_modules(config.user_modules)
  except plugins.PluginError as e:
    raise ConfigError(str(e)) from None
  _check_rewards(config.rewards, config.env.name)
  _check_cross_fields(config, num_devices)
  config.lock()
  return config


def _check_rewards(weights, env_name: str = ""):
  """Registered names with weights >= 0, one of them positive; with an environment every
  weight may be 0 (its step rewards are the episode's reward: episodes.py)."""
  if not isinstance(weights, ml_collections.ConfigDict) or not weights.keys():
    raise ConfigError("config.rewards: expected name -> weight, e.g. {'math': 1.0}; "
                      f"names: {', '.join(sorted(rewards.REGISTRY))}")
  for name, weight in weights.items():
    if name not in rewards.REGISTRY:
      raise ConfigError(f"config.rewards.{name}: unknown reward; registered rewards: "
                        f"{', '.join(sorted(rewards.REGISTRY))} (config.user_modules "
                        "registers your own)")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
      _fail(f"rewards.{name}", weight, "a number >= 0")
  if not any(w > 0 for w in weights.values()) and not env_name:
    raise ConfigError("config.rewards: every weight is 0; give at least one reward a "
                      "positive weight (or config.env.name an environment whose step rewards "
                      "are the reward)")


def _resolve_val_profile(gen):
  """Unset validation sampling keys take the training value; set ones never move it."""
  for val_key, train_key in VAL_FOLLOWS.items():
    if gen[val_key] is None:
      gen[val_key] = gen[train_key]
  for key, limit in BACKEND_LIMITS[gen.backend].items():
    problem = limit(gen[key])
    if problem:
      raise ConfigError(f"config.generation.{key}={gen[key]!r}: the {gen.backend!r} rollout "
                        f"backend cannot honour it ({problem}); change the key or "
                        "config.generation.backend")


def _check_stop_rule(g, weights):
  """The stop metric must be one validation reports with this k (or such a metric of one
  source, `pass@4/gsm8k`: the source is checked against the data at startup), and come
  with a threshold."""
  from jaxgrpo.eval import validation  # pylint: disable=g-import-not-at-top
  metric, threshold = g.stop_at_validation_metric, g.stop_at_validation_threshold
  k = g.val_num_generations_per_prompt
  names = validation.stop_metric_names(k, rewards.majority_reward(weights) is not None)
  if g.stop_at_validation_confidence is not None and metric is None:
    _fail("grpo.stop_at_validation_confidence", g.stop_at_validation_confidence,
          "None while grpo.stop_at_validation_metric is None (it qualifies that rule)")
  if metric is None:
    if threshold is not None:
      raise ConfigError(
          f"config.grpo.stop_at_validation_metric=None: stop_at_validation_threshold="
          f"{threshold} is set but names no metric; allowed: {', '.join(names)} (or unset "
          "the threshold)")
    return
  base, _, source = metric.partition("/")
  if "/" in metric and not source:
    _fail("grpo.stop_at_validation_metric", metric, "a metric, or a metric/source")
  if base not in names:
    j = base[len("pass@"):] if base.startswith("pass@") else ""
    if base.startswith("maj@") and rewards.majority_reward(weights) is None:
      why = ("needs a correctness reward with an answer extractor (math or exact_match) "
             "to vote on")
    elif base == "pass_k":
      why = f"reported only when val_num_generations_per_prompt > 1 (it is {k})"
    elif j.isdigit() and int(j) > k:
      why = f"needs {j} samples per prompt but val_num_generations_per_prompt={k}"
    else:
      why = "validation does not report this metric"
    raise ConfigError(f"config.grpo.stop_at_validation_metric={metric!r}: {why}; allowed: "
                      f"{', '.join(names)} (with val_num_generations_per_prompt={k})")
  if threshold is None:
    raise ConfigError(
        f"config.grpo.stop_at_validation_threshold=None: stop_at_validation_metric={metric!r} "
        f"needs a threshold; allowed: a number, the value of {metric} at which the run stops")


def _check_checkpoint(ck, g, weights):
  from jaxgrpo.eval import validation  # pylint: disable=g-import-not-at-top
  if not ck.resume:
    _fail("checkpoint.resume", ck.resume, "'auto', 'never' or a checkpoint folder")
  names = validation.stop_metric_names(g.val_num_generations_per_prompt,
                                       rewards.majority_reward(weights) is not None)
  if ck.best_metric is not None and ck.best_metric.partition("/")[0] not in names:
    raise ConfigError(
        f"config.checkpoint.best_metric={ck.best_metric!r}: validation does not report it "
        f"with val_num_generations_per_prompt={g.val_num_generations_per_prompt}; allowed: "
        f"{', '.join(names)}")
  if ck.best_metric is not None and not g.val_period:
    _fail("checkpoint.best_metric", ck.best_metric,
          "None while grpo.val_period=0 (best checkpoints are saved at validations)")


def _check_micro_batch(g, rows: int):
  """A micro-batch holds whole groups (a group's advantages and its prompt's single forward
  need all G rows), its prompts split evenly over the data axes, and divides the batch."""
  m, gen = g.micro_batch_size, g.num_generations_per_prompt
  if m == "auto":  # chosen at start-up among the sizes this rule allows (run/sizing.py)
    return
  if not m:
    return
  batch = g.num_prompts_per_step * gen
  if m % gen:
    _fail("grpo.micro_batch_size", m, f"a multiple of num_generations_per_prompt={gen} (a "
          "group is never split), or 0 for the whole batch")
  if (m // gen) % rows:
    _fail("grpo.micro_batch_size", m, f"a multiple of {gen * rows} (num_generations_per_prompt="
          f"{gen} x mesh data x fsdp={rows}: each micro-batch's prompts split evenly over "
          "the devices), or 0")
  if batch % m:
    _fail("grpo.micro_batch_size", m, f"a divisor of the batch's {batch} rollouts "
          f"(num_prompts_per_step x num_generations_per_prompt), or 0")


def _check_cross_fields(c, num_devices: int):
  from jaxgrpo.model import sharding
  try:
    sizes = sharding.resolve_mesh_shape(c.mesh.to_dict(), num_devices)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  # Stored per slice, as given: resolving the stored sizes again gives the same mesh.
  for axis, size in zip(sharding.MESH_AXES, sizes):
    c.mesh[axis] = size // c.mesh.dcn_data if axis == "data" else size
  rows = sizes[0] * sizes[1]
  g = c.grpo
  if g.num_prompts_per_step % rows:
    _fail("grpo.num_prompts_per_step", g.num_prompts_per_step,
          f"a multiple of {rows} (mesh data x fsdp), so prompts split evenly over devices")
  _check_micro_batch(g, rows)
  if g.val_batch_size == "auto" and c.generation.backend != "native":
    _fail("grpo.val_batch_size", "auto", "a number with generation.backend="
          f"{c.generation.backend!r} ('auto' measures the native sampler)")
  if g.val_batch_size != "auto" and g.val_batch_size % rows:
    _fail("grpo.val_batch_size", g.val_batch_size,
          f"a multiple of {rows} (mesh data x fsdp)")
  if g.epsilon_high < g.epsilon:
    _fail("grpo.epsilon_high", g.epsilon_high,
          f"a number >= grpo.epsilon={g.epsilon} (the upper clip is at least the lower)")
  m = c.model
  if m.checkpoint and m.hf_checkpoint:
    _fail("model.hf_checkpoint", m.hf_checkpoint,
          f"'' while model.checkpoint={m.checkpoint!r} is set (one source of weights)")
  if not m.checkpoint and not m.hf_checkpoint:
    for key, value in m.items():
      if value is None and key not in ("scan_layers", "attention"):  # None: by platform
        _fail(f"model.{key}", value, "a value, or a checkpoint to take it from "
              "(model.hf_checkpoint=/path/to/hf/model or model.checkpoint)")
  _check_model_shapes(c, m, sizes)
  _check_lora(m)
  _check_attention(m)
  _check_backend(c.generation, rows)
  _check_dynamic_sampling(c)
  _check_env(c)
  _check_stop_rule(g, c.rewards)
  _check_checkpoint(c.checkpoint, g, c.rewards)
  d = c.data
  if d.source == "jsonl" and not d.train_path:
    _fail("data.train_path", d.train_path, "a JSONL file path when data.source='jsonl'")
  if d.use_chat_template and not m.hf_checkpoint:
    _fail("data.use_chat_template", True, "False unless model.hf_checkpoint names a Hugging "
          "Face folder (its tokenizer_config.json holds the chat template)")
  if "{question}" not in d.prompt_template:
    _fail("data.prompt_template", d.prompt_template, "a template containing {question}")
  _check_no_backslash_n(d.prompt_template)


def _check_env(c):
  """An environment that exists and can be made with its kwargs, and a token budget that
  holds the prompt (the stop strings are checked against the tokenizer by loading)."""
  e, gen = c.env, c.generation
  if not e.name:
    if gen.max_episode_tokens:
      _fail("generation.max_episode_tokens", gen.max_episode_tokens,
            "0 without an environment (env.name='' samples one completion per prompt)")
    return
  from jaxgrpo import envs  # pylint: disable=g-import-not-at-top  (no jax)
  try:
    envs.get(e.name)
  except envs.EnvError as err:
    raise ConfigError(f"config.env.name={e.name!r}: {err}") from None
  try:
    envs.parse_kwargs(e.kwargs)
  except envs.EnvError as err:
    raise ConfigError(f"config.env.kwargs={e.kwargs!r}: {err}") from None
  try:
    envs.instance(e.name, e.kwargs)
  except Exception as err:  # pylint: disable=broad-except  (the user's constructor)
    raise ConfigError(f"config.env.kwargs={e.kwargs!r}: environment {e.name!r} cannot be made "
                      f"with them: {type(err).__name__}: {err}") from None
  if gen.max_episode_tokens <= c.data.max_prompt_length:
    _fail("generation.max_episode_tokens", gen.max_episode_tokens,
          f"more than data.max_prompt_length={c.data.max_prompt_length} (an episode is the "
          "prompt and every turn and observation after it)")
  if gen.backend != "native":
    _fail("env.name", e.name, f"'' with generation.backend={gen.backend!r} (episodes run on "
          "the native sampler)")
  # An episode's turns run on its KV cache, each row at its own slot (rollout/turns.py):
  # the decode's key blocks read one slot range for every row.
  if gen.decode_block_size:
    _fail("generation.decode_block_size", gen.decode_block_size, "0 with an environment "
          "(episode turns decode each row at its own slot of the KV cache they keep)")
  if c.grpo.dynamic_sampling != "off":
    _fail("grpo.dynamic_sampling", c.grpo.dynamic_sampling,
          "'off' with an environment (dynamic sampling of episodes is not built yet)")


def _check_lora(m):
  if not m.lora_rank:
    return
  from jaxgrpo.model import lora  # pylint: disable=g-import-not-at-top  (imports jax)
  try:
    lora.parse_targets(m.lora_targets)
  except ValueError as e:
    _fail("model.lora_targets", m.lora_targets, str(e).split("; allowed: ")[-1])


def _check_no_backslash_n(template: str):
  """A shell passes "\\n" inside double quotes as a backslash and an n, and a prompt with
  those two characters trains on the wrong text without a word. Escapes are not interpreted
  instead, because math prompts carry LaTeX (\\text, \\times, \\neq) that would then turn
  into tabs and newlines just as silently: the template is refused, with the quoting that
  gives a newline."""
  if "\\n" not in template:
    return
  # The same text for bash's $'...', where every other backslash and ' must be escaped
  # (and real newlines and tabs may be, which keeps the message on one line).
  quoted = (re.sub(r"\\(?!n)", r"\\\\", template).replace("'", "\\'")
            .replace("\n", "\\n").replace("\t", "\\t"))
  shown = template.replace("\n", "\\n")  # one line, as the shell user typed it
  raise ConfigError(
      f'config.data.prompt_template="{shown}": holds a backslash followed by n, not a '
      "newline (a shell passes \\n inside quotes as two characters); allowed: real "
      f"newlines, e.g. --config.data.prompt_template=$'{quoted}' in bash or zsh, or "
      '"\\n" in a Python config file')


def _check_attention(m):
  """cuDNN's fused attention: a GPU and half-precision compute (else jax fails deep inside
  the first compilation)."""
  if m.attention != "cudnn":
    return
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    _fail("model.attention", m.attention, f"None or 'xla' on {jax.default_backend()} "
          "(cuDNN's fused attention needs a GPU)")
  if m.dtype != "bfloat16":
    _fail("model.attention", m.attention, f"None or 'xla' with model.dtype={m.dtype!r} "
          "(cuDNN's flash attention takes bfloat16)")


def _check_dynamic_sampling(c):
  """grpo.dynamic_sampling's keys: a metric that names an active reward, and the native
  sampler (it draws each generation batch with its own key)."""
  g = c.grpo
  if g.dynamic_sampling == "off":
    return
  active = sorted(k for k, w in c.rewards.items() if w > 0)
  if g.dynamic_sampling_metric is not None and g.dynamic_sampling_metric not in active:
    _fail("grpo.dynamic_sampling_metric", g.dynamic_sampling_metric,
          f"None (the total reward) or a reward with a weight > 0: {', '.join(active)}")
  if c.generation.backend != "native":
    _fail("grpo.dynamic_sampling", g.dynamic_sampling,
          f"'off' with generation.backend={c.generation.backend!r} (only the native "
          "sampler draws generation batches of their own)")


def _check_backend(gen, rows: int):
  """The jetstream backend: its extra installed (found, not imported: it imports
  TensorFlow), one process, and decode slots that split over the data axes."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  if gen.backend != "jetstream":
    if gen.max_concurrent_decodes:
      _fail("generation.max_concurrent_decodes", gen.max_concurrent_decodes,
            f"0 with generation.backend={gen.backend!r} (only 'jetstream' has decode slots)")
    return
  if gen.decode_block_size:
    _fail("generation.decode_block_size", gen.decode_block_size,
          "0 with generation.backend='jetstream' (its slots decode at their own steps and "
          "read the whole cache); or generation.backend='native'")
  if gen.compact_stages:
    _fail("generation.compact_stages", gen.compact_stages,
          "0 with generation.backend='jetstream' (it refills finished slots instead); or "
          "generation.backend='native'")
  if importlib.util.find_spec("jetstream") is None:
    _fail("generation.backend", gen.backend, "'native', or 'jetstream' after "
          "pip install 'jaxgrpo[jetstream]' (google-jetstream is not installed)")
  if jax.process_count() > 1:
    _fail("generation.backend", gen.backend, f"'native' on {jax.process_count()} processes "
          "(the jetstream backend runs on one)")
  if gen.max_concurrent_decodes % rows:
    _fail("generation.max_concurrent_decodes", gen.max_concurrent_decodes,
          f"0 (one slot per rollout row) or a multiple of {rows} (mesh data x fsdp)")


def _check_model_shapes(c, m, sizes):
  """Divisibility rules for the architecture keys that are set (a checkpoint's own values are
  checked again once it is read)."""
  if m.num_heads and m.num_kv_heads and m.num_heads % m.num_kv_heads:
    _fail("model.num_heads", m.num_heads, f"a multiple of model.num_kv_heads={m.num_kv_heads}")
  if sizes[2] > 1:
    for key in ("num_kv_heads", "num_heads", "mlp_dim", "vocab_size"):
      if m[key] is not None and m[key] % sizes[2]:
        _fail(f"model.{key}", m[key], f"a multiple of mesh.tensor={sizes[2]}")
  if sizes[1] > 1 and m.d_model is not None and m.d_model % sizes[1]:
    _fail("model.d_model", m.d_model, f"a multiple of mesh.fsdp={sizes[1]}")
  for key in ("top_k", "val_top_k"):
    if m.vocab_size is not None and c.generation[key] > m.vocab_size:
      _fail(f"generation.{key}", c.generation[key], f"0 (off) or at most model.vocab_size="
            f"{m.vocab_size}")


def _never_validates(c) -> str | None:
  g = c.grpo
  if not (g.val_period or g.val_at_start or g.val_at_end):
    return "grpo.val_period=0, val_at_start=False and val_at_end=False (no validation runs)"
  return None


def _while(key: str, idle: Callable[[Any], bool]) -> Callable[[Any], str | None]:
  """A rule's test: `key=value` (why the key does nothing) when `idle(value)`, else None."""
  def test(c):
    value = c
    for part in key.split("."):
      value = value[part]
    return f"{key}={value!r}" if idle(value) else None
  return test


def _no_tracker_run(c) -> str | None:
  names = [n.strip() for n in str(c.logging.trackers).split(",") if n.strip()]
  if not {"wandb", "trackio"} & set(names):
    return (f"logging.trackers={c.logging.trackers!r} (only wandb and trackio runs have a "
            "project, a name and tags)")
  return None


def _no_auto(c) -> str | None:
  g = c.grpo
  if "auto" not in (g.micro_batch_size, g.val_batch_size):
    return ("grpo.micro_batch_size and grpo.val_batch_size are numbers (only 'auto' plans "
            "against a memory limit)")
  return None


# Keys that act only in one mode of a run: (keys, why they do nothing now (None: they act),
# the override that makes them act). A command-line override of one of them while its mode
# is off would do nothing at all, silently: `check_overrides` refuses it before jax loads.
# Config files stay free to set them (a preset serves several modes).
MODE_KEYS: tuple[tuple[tuple[str, ...], Callable[[Any], str | None], str], ...] = (
    (("data.train_path", "data.val_path", "data.question_key", "data.answer_key"),
     _while("data.source", lambda v: v != "jsonl"), "--config.data.source=jsonl"),
    (("data.num_digits",), _while("data.source", lambda v: v != "arithmetic"),
     "--config.data.source=arithmetic (it sizes the generated additions), or drop it"),
    (("env.kwargs", "env.max_turns", "env.max_observation_tokens", "env.stop_strings",
      "env.timeout_s", "env.workers"),
     _while("env.name", lambda v: not v), "--config.env.name=tools (or your environment)"),
    (("grpo.oversample_factor", "grpo.max_generation_batches",
      "grpo.dynamic_sampling_metric"),
     _while("grpo.dynamic_sampling", lambda v: v == "off"),
     "--config.grpo.dynamic_sampling=filter"),
    (("grpo.kl_type",), _while("grpo.beta", lambda v: not v),
     "--config.grpo.beta=0.04 (a KL penalty's weight; kl_type picks its estimator)"),
    (("reward_timeout_s",), _while("reward_workers", lambda v: v == 0),
     "--config.reward_workers=-1 (rewards in worker processes, where calls have a time "
     "limit)"),
    (("checkpoint.best_to_keep",), _while("checkpoint.best_metric", lambda v: v is None),
     "--config.checkpoint.best_metric=accuracy"),
    (("model.lora_alpha", "model.lora_targets"), _while("model.lora_rank", lambda v: not v),
     "--config.model.lora_rank=16"),
    (("logging.project", "logging.run_name", "logging.tags"), _no_tracker_run,
     "--config.logging.trackers=tensorboard,wandb (or trackio)"),
    (("mesh.memory_limit_gib",), _no_auto, "--config.grpo.micro_batch_size=auto"),
    (("generation.val_temperature", "generation.val_top_p", "generation.val_top_k",
      *(f"grpo.{k}" for k in ("val_num_generations_per_prompt", "val_batch_size",
                              "max_val_samples", "val_pass_threshold", "val_seed"))),
     _never_validates, "--config.grpo.val_period=N or --config.grpo.val_at_end=True"),
)


def overridden_keys(argv) -> set[str]:
  """The config keys a command line sets: `--config.KEY=V`, `--config.KEY V`, and absl's
  `--noconfig.KEY` for a boolean."""
  keys = set()
  for arg in argv[1:]:
    for prefix in ("--config.", "--noconfig."):
      if arg.startswith(prefix):
        keys.add(arg[len(prefix):].split("=", 1)[0])
  return keys


def check_overrides(config, given: set[str]) -> list[str]:
  """Refuses a command-line override that would do nothing under `config` (the file with
  every override applied): MODE_KEYS says which keys act only in which mode. One override's
  intent is unambiguous and is applied: a `data.train_path` given while data.source is
  'arithmetic' (and data.source not given) switches the source to 'jsonl'. Returns the
  lines that say what was applied; raises ConfigError naming the key, why it does nothing
  and what makes it act. Needs no jax (train checks it before jax loads)."""
  notes = []
  try:
    source = config.data.source
  except (AttributeError, KeyError):
    return notes  # a config without the section: the validator names what is missing
  if "data.train_path" in given and source == "arithmetic" and "data.source" not in given:
    config.data.source = "jsonl"
    notes.append("data.source='jsonl' (the config file's 'arithmetic' generates its data; "
                 "--config.data.train_path names a file to read instead)")
  for keys, idle, fix in MODE_KEYS:
    for key in keys:
      if key not in given:
        continue
      try:
        why = idle(config)
      except (AttributeError, KeyError):
        continue  # a missing section or key: the validator says so
      if why:
        raise ConfigError(f"config.{key}: ignored while {why}; add {fix}")
  return notes


def to_json(config: ml_collections.ConfigDict) -> str:
  return json.dumps(config.to_dict(), indent=2, sort_keys=True)

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

import datetime
import json
import math
import re
from typing import Any, Callable

import ml_collections

from jaxgrpo.algo import options
from jaxgrpo.runtime import config_checks

# The loss options' names (algo/grpo.py implements them; algo/options.py needs no jax).
SCALE_REWARDS, KL_TYPES, LOSS_AGGS = options.SCALE_REWARDS, options.KL_TYPES, options.LOSS_AGGS


# A config problem, explained in one line (raised by every check, here and registered).
ConfigError = config_checks.ConfigError


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


def _dtype(v):
  return _choice("float32", "bfloat16")(v)


def _date(v):
  """'' (the run's start, resolved then: run/loading.chat_template_date) or YYYY-MM-DD."""
  if v == "":
    return None
  try:
    datetime.date.fromisoformat(v)
  except (TypeError, ValueError):
    return "'' (the day the run starts) or a date, YYYY-MM-DD"
  return None


def _optional(check):
  """None (unset) or a value `check` accepts. On the command line None is typed as `none`
  (config_flags hands a string key `=None` over as the text; _check_keys reads it)."""
  def optional(v):
    if v is not None:
      problem = check(v)
      return problem and f"None or {problem}"
  optional.takes_none = True
  return optional


# Each validation sampling key and the training key it follows while unset (None).
VAL_FOLLOWS = {"val_temperature": "temperature", "val_top_p": "top_p", "val_top_k": "top_k"}

# The rollout backends. Both honour every sampling setting (the JetStream adapter draws with
# the native sampler's own function and random streams); what a backend cannot do is
# refused by the checks run/build.py registers (`_check_backend`), beside the code.
BACKENDS = ("native", "jetstream")


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
        # Mixture of experts (Qwen3-MoE): 0 experts = a dense MLP.
        "num_experts": _optional(_int(0)), "num_experts_per_tok": _optional(_int(0)),
        "moe_mlp_dim": _optional(_int(0)), "norm_topk_prob": _optional(_bool),
        # Gemma 3's departures from the Llama layout (model/decoder.py's ModelConfig).
        "hidden_act": _optional(_choice("silu", "gelu_tanh")),
        "norm_plus_one": _optional(_bool), "post_norms": _optional(_bool),
        "embed_scale": _optional(_bool), "query_pre_attn_scalar": _optional(_num(0)),
        "sliding_window": _optional(_int(0)), "sliding_window_pattern": _optional(_int(0)),
        "rope_local_theta": _optional(_num(0)),
        "rope_scaling_type": _optional(_choice("llama3", "linear")),
        # Not architecture: the experts' matmuls (model/moe.py; auto: dense on CPU, else ragged).
        "moe_matmul": _choice("auto", "ragged", "dense"),
        # Not architecture: the router's logits' dtype (model/moe.py route).
        "router_dtype": _choice("float32", "bfloat16", "compute"),
        "param_dtype": _dtype, "dtype": _dtype,
        # Not architecture: what each layer keeps for the update's backward pass.
        "remat": _choice("none", "full", "save_dots"),
        # Not architecture: the layers as one compiled loop body or unrolled (None: by platform).
        "scan_layers": _optional(_bool),
        # Not architecture: the attention kernel (None: cudnn on GPU with bfloat16, else xla).
        "attention": _optional(_choice("xla", "cudnn", "splash")),
        # LoRA (model/lora.py): 0 = full fine-tuning; else adapters of this rank on the
        # targets (all-linear, or q,k,v,o,gate,up,down / HF's q_proj,...), scaled alpha/rank.
        "lora_rank": _int(0), "lora_alpha": _num(0, lo_open=True), "lora_targets": _str},
    # memory_limit_gib: bytes per chip that 'auto' batch sizes plan against (run/sizing.py); None:
    # the device's own limit (none on CPU).
    "mesh": {"data": _int(-1), "fsdp": _int(-1), "expert": _int(-1), "context": _int(-1),
             "tensor": _int(-1),
             "dcn_data": _int(1),
             "memory_limit_gib": _optional(_num(0, lo_open=True))},
    "data": {
        "source": _choice("arithmetic", "jsonl"), "train_path": _str, "val_path": _str,
        "question_key": _str, "answer_key": _str, "prompt_template": _str,
        "use_chat_template": _bool, "chat_template_date": _date,
        "max_prompt_length": _int(1), "num_digits": _int(1), "num_train_examples": _int(0),
        "num_val_examples": _int(0)},
    "rewards": None,  # name -> weight, checked against the reward registry below
    "generation": {
        "temperature": _num(0, lo_open=True), "top_p": _num(0, 1, lo_open=True),
        "top_k": _int(0), "max_new_tokens": _int(1), "backend": _choice(*BACKENDS),
        "max_concurrent_decodes": _int(0), "decode_block_size": _int(0),
        "compact_stages": _int(0), "max_tokens_per_step": _int(0),
        "gather_weights": _bool,
        # None follows the training value (resolved by `validate`); 0 is greedy.
        "val_temperature": _optional(_num(0)), "val_top_p": _optional(_num(0, 1, lo_open=True)),
        "val_top_k": _optional(_int(0)),
        # Multi-turn (env.name): prompt + turns + observations; 0 with no environment.
        "max_episode_tokens": _int(0)},
    # Multi-turn episodes (envs.py, episodes.py); name '' = single-turn rollouts.
    "env": {"name": _str, "kwargs": _str, "max_turns": _int(1),
            "max_observation_tokens": _int(1), "stop_strings": _str,
            "observation_truncation_side": _choice("right", "left", "middle"),
            # timeout_s 0: no limit, only with workers=0 (envs.py's check says why).
            "timeout_s": _num(0), "workers": _int(0)},
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
        # Or packed micro-batches of that many tokens a chip (0: off; algo/packing.py).
        "micro_batch_tokens": _or_auto(_int(0)),
        # Partial rollouts (generation.max_tokens_per_step > 0; run/partial_rollouts.py).
        "max_staleness": _int(0), "importance_weight_cap": _num(1),
        # A mixture of experts' router load-balancing loss weight (model/moe.py); 0 = off.
        "router_aux_loss_coef": _num(0),
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
    "logging": {"trackers": _str, "project": _nonempty, "run_name": _str, "tags": _str,
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
      if (getattr(check, "takes_none", False) and isinstance(section[key], str)
          and section[key].strip().lower() == "none"):
        section[key] = None  # --config.checkpoint.best_metric=none
      problem = check(section[key])
      if problem:
        _fail(f"{prefix}{key}", section[key], problem)


# grpo.<key> that may be 'auto': chosen at start-up from the compiler's memory figures
# (run/sizing.py). Every reader of that question asks `any_auto`.
AUTO_KEYS = ("micro_batch_size", "val_batch_size", "micro_batch_tokens")


def any_auto(grpo) -> bool:
  """Whether any of AUTO_KEYS is 'auto' in this grpo section."""
  return any(grpo[k] == "auto" for k in AUTO_KEYS)


def validate(config: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
  """Checks and resolves a run config; returns a locked copy. Raises ConfigError."""
  values = config.to_dict()  # a copy: the caller's stays as is
  for key in AUTO_KEYS:
    # A config that ships 'auto' types the key as a string, so a command-line number
    # arrives as one ("256"): it means the number.
    value = values.get("grpo", {}).get(key)
    if isinstance(value, str) and value.strip().isdigit():
      values["grpo"][key] = int(value)
  config = ml_collections.ConfigDict(values)
  _check_keys("", config, SCHEMA)
  _resolve_val_profile(config.generation)
  # Then each subsystem's own keys (runtime/config_checks.py: registered by the modules
  # that own them, in order; the mesh first, whose resolved sizes later checks read).
  config_checks.run(config, num_devices)
  config.lock()
  return config


def _resolve_val_profile(gen):
  """Unset validation sampling keys take the training value; set ones never move it."""
  for val_key, train_key in VAL_FOLLOWS.items():
    if gen[val_key] is None:
      gen[val_key] = gen[train_key]


@config_checks.register(order=30)
def _check_model_source(c, num_devices: int) -> None:
  """The clip bounds, and one source of weights (or every architecture key set)."""
  del num_devices
  g, m = c.grpo, c.model
  if g.epsilon_high < g.epsilon:
    _fail("grpo.epsilon_high", g.epsilon_high,
          f"a number >= grpo.epsilon={g.epsilon} (the upper clip is at least the lower)")
  if m.checkpoint and m.hf_checkpoint:
    _fail("model.hf_checkpoint", m.hf_checkpoint,
          f"'' while model.checkpoint={m.checkpoint!r} is set (one source of weights)")
  if not m.checkpoint and not m.hf_checkpoint:
    for key, value in m.items():
      if value is None and key not in ("scan_layers", "attention"):  # None: by platform
        _fail(f"model.{key}", value, "a value, or a checkpoint to take it from "
              "(model.hf_checkpoint=/path/to/hf/model or model.checkpoint)")


@config_checks.register(order=38)
def _check_data(c, num_devices: int) -> None:
  """checkpoint.resume, and the data keys: a file for jsonl, a chat template's folder, a
  template with {question} and no backslash-n."""
  del num_devices
  if not c.checkpoint.resume:
    _fail("checkpoint.resume", c.checkpoint.resume, "'auto', 'never' or a checkpoint folder")
  d = c.data
  if d.source == "jsonl" and not d.train_path:
    _fail("data.train_path", d.train_path, "a JSONL file path when data.source='jsonl'")
  if d.use_chat_template and not c.model.hf_checkpoint:
    _fail("data.use_chat_template", True, "False unless model.hf_checkpoint names a Hugging "
          "Face folder (its tokenizer_config.json holds the chat template)")
  if "{question}" not in d.prompt_template:
    _fail("data.prompt_template", d.prompt_template, "a template containing {question}")
  _check_no_backslash_n(d.prompt_template)


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


def _packs(value) -> bool:
  """grpo.micro_batch_tokens packs: 'auto' or a number > 0. A config that ships 'auto'
  types the key as text, so a command-line 0 arrives as '0' (validate reads it as 0)."""
  if isinstance(value, str) and value.strip().isdigit():
    return int(value) > 0
  return bool(value)


def _weights_whole(c) -> str | None:
  """Why generation.gather_weights does nothing: no native decode, or weights that a mesh
  splits otherwise than by rows (tensor, expert keep their split), or none split (fsdp 1)."""
  if c.generation.backend != "native":
    return f"generation.backend={c.generation.backend!r} (its decode prepares its own weights)"
  for axis in ("tensor", "expert"):
    if c.mesh[axis] > 1:
      return f"mesh.{axis}={c.mesh[axis]} (split weights keep their split)"
  if c.mesh.fsdp == 1:
    return "mesh.fsdp=1 (the weights are whole on every chip already)"
  return None


def _no_tracker_run(c) -> str | None:
  names = [n.strip() for n in str(c.logging.trackers).split(",") if n.strip()]
  if not {"wandb", "trackio"} & set(names):
    return (f"logging.trackers={c.logging.trackers!r} (only wandb and trackio runs have a "
            "project, a name and tags)")
  return None


def _no_auto(c) -> str | None:
  if not any_auto(c.grpo):
    return ("grpo.micro_batch_size, val_batch_size and micro_batch_tokens are numbers (only "
            "'auto' plans against a memory limit)")
  return None


# Keys that act only in one mode of a run: (keys, why they do nothing now (None: they act),
# the override that makes them act). A command-line override of one of them while its mode
# is off would do nothing at all, silently: `check_overrides` refuses it before jax loads.
# Config files stay free to set them (a preset serves several modes).
MODE_KEYS: tuple[tuple[tuple[str, ...], Callable[[Any], str | None], str], ...] = (
    (("data.train_path", "data.val_path", "data.question_key", "data.answer_key"),
     _while("data.source", lambda v: v != "jsonl"), "--config.data.source=jsonl"),
    (("data.chat_template_date",), _while("data.use_chat_template", lambda v: not v),
     "--config.data.use_chat_template=True (with a model.hf_checkpoint: its template)"),
    (("data.num_digits",), _while("data.source", lambda v: v != "arithmetic"),
     "--config.data.source=arithmetic (it sizes the generated additions), or drop it"),
    (("env.kwargs", "env.max_turns", "env.max_observation_tokens", "env.stop_strings",
      "env.observation_truncation_side",
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
    (("generation.gather_weights",), _weights_whole,
     "--config.mesh.fsdp=-1 with generation.backend='native' and mesh.tensor=mesh.expert=1"),
    (("grpo.max_staleness", "grpo.importance_weight_cap"),
     _while("generation.max_tokens_per_step", lambda v: not v),
     "--config.generation.max_tokens_per_step=512 (partial rollouts)"),
    # Packing replaces micro-batches of rows (a number for both is refused by algo/
    # microbatch.py; an 'auto' one would step aside unseen).
    (("grpo.micro_batch_size",), _while("grpo.micro_batch_tokens", _packs),
     "--config.grpo.micro_batch_tokens=0 (packing replaces micro-batches of rows)"),
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
  ck, g = config.get("checkpoint"), config.get("grpo")
  if ("grpo.val_period" in given and g is not None and not g.get("val_period")
      and ck is not None and ck.get("best_metric") not in (None, "none", "None")
      and "checkpoint.best_metric" not in given):
    notes.append(f"checkpoint.best_metric=None (the config file's {ck.best_metric!r}: best "
                 "checkpoints are kept at validations, and grpo.val_period=0 runs none "
                 "during training)")
    ck.best_metric = None
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

"""A run's set-up, host-side, before any device work: the command line parsed (absl flags and
config_flags' overrides), the config validated, the policy, tokenizer and data loaded, the
resume point found, config.json written. `prepare(argv) -> Setup` is what `python -m
jaxgrpo.train` (train.py), the benches and launch/compile_check.py build a run from; any
bad input ends here with a ConfigError (or loading.USER_ERRORS): one line, exit status 2,
before compilation.

Then run/build.py places the parameters and makes the programs, and run/trainer.py runs the
loop.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import sys
import time

from typing import TYPE_CHECKING, Any

from absl import flags
import ml_collections
from ml_collections import config_flags

# Light imports only (no jax, grain or flax): the start-up line is printed before jax loads,
# and flag errors answer without it. The host-side loading (loading.py) is imported after.
from jaxgrpo import config as config_lib
from jaxgrpo.runtime import distributed

if TYPE_CHECKING:  # the annotations only: these import jax, which must wait (above)
  from jaxgrpo import data as data_lib
  from jaxgrpo.model import decoder as model_lib
  from jaxgrpo.model import tokenizer as tokenizer_lib
  from jaxgrpo.run import loading

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (configs/*.py[:arg]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the run writes (default: ./runs/<time>).")
# A multi-host rehearsal on one machine names its peers; on a TPU pod they come from the
# environment and these stay unset (see jaxgrpo/runtime/distributed.py).
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (multi-process rehearsal)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the run")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's id, 0..num_processes-1")

class NothingToTrain(Exception):
  """The workdir's run already ended where this command would end it: its message is the one
  line to print, the exit status 0, and no file is touched."""


@dataclasses.dataclass
class Setup:
  """Everything a run is built from, checked on the host."""
  config: ml_collections.ConfigDict  # validated and locked
  workdir: str
  model_cfg: "model_lib.ModelConfig"
  host_params: Any  # a jaxgrpo checkpoint's host arrays; None: random init or streamed (HF)
  tokenizer: "tokenizer_lib.Tokenizer"
  train_batches: "data_lib.PromptBatches"
  val_batches: list[dict]
  resume: tuple[str, int | None] | None = None  # (checkpoints folder, step; None: newest)
  val_sources: list[str] = dataclasses.field(default_factory=list)  # [] for one source
  data: "loading.Data | None" = None  # the rows, for batches made once 'auto' is chosen

  @functools.cached_property
  def scorer(self):
    """The run's one scoring seam (scorer.Scorer), for its training steps and validations;
    its reward workers start on first use."""
    from jaxgrpo import scorer  # pylint: disable=g-import-not-at-top
    return scorer.from_config(self.config, self.tokenizer)


def parse_config(argv, announce=None):
  """The config file with its command-line overrides (not yet validated); joins the other
  processes of a multi-host run first. Raises ConfigError. `announce(raw config)`, if given,
  runs once the flags are read, before jax is imported."""
  # Reward weights are set here, not by config_flags, which refuses a key the config file
  # lacks: a reward of config.user_modules is registered only once the config is read.
  weights = [a for a in argv[1:] if a.startswith("--config.rewards.")]
  argv, autos = split_auto([a for a in argv if a not in weights])
  saved_argv, sys.argv = sys.argv, list(argv)  # config_flags finds overrides in sys.argv
  try:
    flags.FLAGS(argv)
    if _CONFIG.value is not None:
      _CONFIG.value.to_dict()  # config_flags reports a failed file load only on first use
  except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    raise config_lib.ConfigError(flag_error(e, argv)) from None
  finally:
    sys.argv = saved_argv
  if _CONFIG.value is None:
    raise config_lib.ConfigError("--config is required, e.g. --config=configs/math.py")
  for arg in weights:
    name, _, value = arg[len("--config.rewards."):].partition("=")
    try:
      with _CONFIG.value.unlocked():  # config_flags locks it; a new name is a new key
        _CONFIG.value.rewards[name] = float(value)
    except ValueError:
      raise config_lib.ConfigError(f"config.rewards.{name}={value}: allowed: a number (the "
                                   "reward's weight)") from None
  config = apply_auto(_CONFIG.value, autos)
  if announce is not None:
    announce(config)
  try:  # before any other JAX call, so every later call sees the whole pod
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None
  return config


# Every module that registers config checks of its own keys (runtime/config_checks.py):
# config.py imports none of them, so the run layer imports them all before validating.
CHECKING_MODULES = (
    "jaxgrpo.rewards",            # config.user_modules imported; reward names and weights
    "jaxgrpo.envs",               # the environment and its token budget
    "jaxgrpo.runtime.trackers",   # logging.trackers
    "jaxgrpo.model.sharding",     # the mesh and what must split over it; model shapes
    "jaxgrpo.model.lora",         # LoRA targets
    "jaxgrpo.model.attention",    # cuDNN attention: a GPU and bfloat16; splash and windows
    "jaxgrpo.model.moe",          # what needs a mixture of experts (the loaded model)
    "jaxgrpo.algo.microbatch",    # micro-batches of whole groups
    "jaxgrpo.algo.dynamic",       # dynamic sampling's metric and sampler
    "jaxgrpo.run.partial_rollouts",  # what partial rollouts compose with
    "jaxgrpo.eval.validation",    # the stop rule and the best checkpoint's metric
    "jaxgrpo.run.build",          # the rollout backend
)


def register_checks() -> None:
  """Imports every module of CHECKING_MODULES (they register their config checks) and
  marks the registry complete, so config.validate runs them all. Imports jax."""
  import importlib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.runtime import config_checks  # pylint: disable=g-import-not-at-top
  for module in CHECKING_MODULES:
    importlib.import_module(module)
  config_checks.mark_complete()


def validate(raw, num_devices: int):
  """config.validate with every subsystem's checks registered: what a command runs."""
  register_checks()
  return config_lib.validate(raw, num_devices)


AUTO_KEYS = tuple(f"grpo.{k}" for k in config_lib.AUTO_KEYS)  # may be 'auto' (sizing.py)


def split_auto(argv):
  """(argv without `--config.<key>=auto` of AUTO_KEYS, those keys). config_flags parses an
  override with the type the config file gave the key, and 'auto' is no integer, so these
  are applied after it (apply_auto); a config that ships 'auto' takes numbers as usual."""
  autos = [a for a in argv[1:] if a.startswith("--config.") and a.endswith("=auto")
           and a[len("--config."):-len("=auto")] in AUTO_KEYS]
  return [a for a in argv if a not in autos], [a[len("--config."):-len("=auto")] for a in autos]


def apply_auto(config, keys):
  """`config` with each dotted key of `keys` set to 'auto' (a new ConfigDict: a ConfigDict
  keeps each key's type)."""
  if not keys:
    return config
  import ml_collections  # pylint: disable=g-import-not-at-top
  values = config.to_dict()
  for key in keys:
    section, name = key.split(".")
    values[section][name] = "auto"
  return ml_collections.ConfigDict(values)


def prepare(argv) -> Setup:
  """Host-side: everything that can be wrong with the user's input is found here."""
  default = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))  # flags are parsed below

  def announce(raw):
    _startup_line(raw, _WORKDIR.value or default)
    # An override that would do nothing is refused (or, where its intent is plain, applied)
    # before jax loads; config files may set keys for modes they do not use.
    for note in config_lib.check_overrides(raw, config_lib.overridden_keys(argv)):
      if not _PROCESS_ID.value:
        print(f"jaxgrpo.train: {note}", file=sys.stderr, flush=True)
  raw = parse_config(argv, announce=announce)
  workdir = _WORKDIR.value or default
  import jax  # imported here so that flag errors answer fast; no compilation happens below
  from jaxgrpo import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.algo import dynamic
  from jaxgrpo.run import loading
  config = validate(_with_chat_template_date(raw, workdir), jax.device_count())
  _check_trackers(config)
  if jax.process_index() == 0:
    m = config.mesh
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform} in "
          f"{jax.process_count()} process{'es' * (jax.process_count() > 1)}; mesh data={m.data} "
          f"fsdp={m.fsdp}" + (f" expert={m.expert}" if m.expert > 1 else "") +
          (f" context={m.context}" if m.context > 1 else "") +
          f" tensor={m.tensor}" + (f" dcn_data={m.dcn_data}" if m.dcn_data > 1 else ""),
          file=sys.stderr, flush=True)
  model_cfg, host_params, tokenizer = loading.load_policy(config)
  loading.check_env(config, tokenizer)
  data = loading.load_data(config, tokenizer)
  loading.per_process(config, "num_prompts_per_step")
  # Global batches: each process keeps its slice, so the run does not depend on the hosts.
  train_batches = data_lib.PromptBatches(
      data.train_rows, tokenizer, dynamic.batch_prompts(config),
      config.data.max_prompt_length, template=data.template, seed=config.seed)
  # An 'auto' validation batch is chosen at start-up (sizing.py); its batches are made then.
  val_batches = ([] if config.grpo.val_batch_size == "auto" else
                 loading.validation_batches(config, tokenizer, data))
  if "://" in workdir:  # logs and plots are written with plain file I/O
    raise config_lib.ConfigError(
        f"--workdir={workdir}: a URL is not supported; allowed: a local or mounted path "
        "(on a pod, mount the bucket with GCS FUSE, e.g. xpk storage attach --type=gcsfuse, "
        "and pass the mount path, so every host writes to the same folder)")
  resume = loading.resume_point(config, workdir, model_cfg, train_batches)
  _check_trains_something(config, workdir, resume)
  text = config_lib.to_json(config)
  resumed_at, changes = _config_changes(config, workdir, resume, text)
  os.makedirs(workdir, exist_ok=True)
  # A resume with no changed key keeps config.json (an 'auto' key differs from the number it
  # chose, which the trainer writes again once it has chosen).
  if jax.process_index() == 0 and (resumed_at is None or changes):
    kept = _write_config(workdir, text, resumed_at)
    if changes:
      print(f"resuming {workdir} at step {resumed_at} with {len(changes)} changed "
            f"key{'s' * (len(changes) > 1)}: {', '.join(changes)} (the earlier config is "
            f"kept as {kept})", flush=True)
  return Setup(config, workdir, model_cfg, host_params, tokenizer, train_batches, val_batches,
               resume, data.val_sources, data)


def _with_chat_template_date(raw, workdir: str):
  """raw with data.chat_template_date fixed (loading.chat_template_date): a resumed run's
  recorded date, else process 0's today (every host renders the same prompts, even when a
  pod starts across midnight)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  from jaxgrpo.runtime import distributed  # pylint: disable=g-import-not-at-top
  saved, path = None, os.path.join(workdir, "config.json")
  if (raw.get("checkpoint") or {}).get("resume") == "auto" and os.path.isfile(path):
    try:
      with open(path) as f:
        saved = json.load(f)
    except (OSError, ValueError):
      saved = None  # the resume's own reading of the folder reports it
  values = loading.chat_template_date(raw.to_dict(), saved)
  date = values.get("data", {}).get("chat_template_date")
  if date is not None:
    values["data"]["chat_template_date"] = distributed.gather_objects(date)[0]
  return ml_collections.ConfigDict(values)


def _check_trackers(config) -> None:
  """A tracker that is not installed (or wandb without an account) is one line now, not a
  warning after the first compilation."""
  from jaxgrpo.runtime import trackers  # pylint: disable=g-import-not-at-top
  try:
    trackers.check_available(trackers.parse(config.logging.trackers))
  except trackers.TrackerError as e:
    raise config_lib.ConfigError(str(e)) from None


def _startup_line(raw, workdir: str) -> None:
  """What this run is, on stderr, within a second of the command (before jax loads): the
  workdir, the config file and preset, the steps. Process 0 only (a rehearsal's others are
  told by --process_id; on a pod every host prints it to its own log)."""
  if _PROCESS_ID.value:
    return
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  preset = ""
  if ":" in path:
    path, preset = path.split(":", 1)
    preset = f", preset {preset}"
  try:
    steps = f"{raw.grpo.max_num_steps} steps"
  except (AttributeError, KeyError):
    steps = "steps unknown"
  print(f"jaxgrpo.train: workdir {workdir} | config {path}{preset} | {steps}",
        file=sys.stderr, flush=True)


def _check_trains_something(config, workdir: str, resume) -> None:
  """A rerun of a run that already ended must not rewrite its results (summary.json, the
  plots, config.json) with those of a process that trains nothing.

  Resuming this workdir's own checkpoints at step S (the newest): max_num_steps < S is a
  config error (the run is past it); max_num_steps == S with a summary.json for step S, or
  an early stop that the logged validation at S still triggers, raises NothingToTrain.
  """
  from jaxgrpo.run import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxgrpo.runtime import metrics
  own = os.path.join(workdir, checkpoint.DIR_NAME)
  if resume is None or resume[0] != own or resume[1] is not None:
    return  # a fresh run, another run's checkpoints, or a chosen step: it trains from there
  saved = max(checkpoint.step_dirs(own))
  g = config.grpo
  if g.max_num_steps < saved:
    raise config_lib.ConfigError(
        f"config.grpo.max_num_steps={g.max_num_steps}: the run in {workdir} is already at "
        f"step {saved} (its newest checkpoint); allowed: {saved} or more to continue it, or "
        "another --workdir")
  summary = metrics.read_summary(workdir)
  if summary is None or summary.get("steps") != saved:
    return  # no summary of that step yet (killed after saving it): finishing writes it
  if g.max_num_steps == saved:
    raise NothingToTrain(
        f"{workdir} already finished at step {saved}; --config.grpo.max_num_steps=N (N > "
        f"{saved}) to train further, or another --workdir")
  from jaxgrpo.eval import validation  # pylint: disable=g-import-not-at-top
  logged = metrics.logged_validations(workdir).get(saved)
  try:
    stops = summary.get("stopped_early") and logged and validation.stop_message(
        logged, g.stop_at_validation_metric, g.stop_at_validation_threshold, saved,
        g.stop_at_validation_confidence)
  except KeyError:  # a stop metric that step did not report: the trainer's own check says so
    stops = False
  if stops:
    raise NothingToTrain(
        f"{workdir} already stopped early at step {saved} ({g.stop_at_validation_metric} "
        "reached its threshold); change grpo.stop_at_validation_threshold to train further, "
        "or another --workdir")


# Keys a resumed run cannot change: each group's G rollouts are what its advantages compare,
# and the data iterator and checkpoints were built for them. (The architecture is checked
# against the checkpoint itself, in loading.resume_point; the mesh may change: orbax reshards.)
FIXED_ON_RESUME = ("grpo.num_generations_per_prompt",)


def _flat(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _config_changes(config, workdir: str, resume, text: str):
  """(the step resumed at, ['key old -> new', ...]) for a resume of this workdir's own run
  whose config.json differs; (None, []) otherwise. A key of FIXED_ON_RESUME that changed is
  a ConfigError."""
  from jaxgrpo.run import checkpoint  # pylint: disable=g-import-not-at-top
  own = os.path.join(workdir, checkpoint.DIR_NAME)
  path = os.path.join(workdir, "config.json")
  if resume is None or resume[0] != own or not os.path.exists(path):
    return None, []
  step = resume[1] if resume[1] is not None else max(checkpoint.step_dirs(own))
  try:
    with open(path) as f:
      old = _flat(json.load(f))
  except (OSError, ValueError):
    return step, []  # unreadable: kept aside by _write_config, nothing to compare
  new = _flat(json.loads(text))
  # config.json holds what 'auto' chose; a resume with 'auto' chooses again (sizing.py).
  changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
             and not (k in AUTO_KEYS and new.get(k) == "auto")]
  for key in FIXED_ON_RESUME:
    if key in changed:
      raise config_lib.ConfigError(
          f"config.{key}={new.get(key)!r}: the run in {workdir} (step {step}) was trained with "
          f"{old.get(key)!r}, which a resume cannot change; allowed: {old.get(key)!r}, or "
          "another --workdir")
  fmt = lambda v: json.dumps(v) if v is not None else "None"
  return step, [f"{k} {fmt(old.get(k))} -> {fmt(new.get(k))}" for k in changed]


def _write_config(workdir: str, text: str, resumed_at: int | None = None) -> str | None:
  """config.json of this run. A different one already there is kept, never overwritten:
  as config.until_step_<S>.json when this process resumes that run at step S (it trained
  the steps up to S), else as config.<n>.json. Returns the kept file's path, or None."""
  path = os.path.join(workdir, "config.json")
  kept = None
  if os.path.exists(path):
    with open(path) as f:
      old = f.read()
    if old != text:
      stem = f"config.until_step_{resumed_at}" if resumed_at is not None else "config"
      names = itertools.chain([f"{stem}.json"] if resumed_at is not None else [],
                              (f"{stem}.{n}.json" for n in itertools.count(1)))
      kept = next(p for p in (os.path.join(workdir, n) for n in names) if not os.path.exists(p))
      os.replace(path, kept)
  with open(path, "w") as f:
    f.write(text)
  return kept


def flag_error(e: Exception, argv) -> str:
  """One line for a config file or override that absl / config_flags could not take."""
  text = str(e).replace("\\n", "\n")
  if isinstance(e, (AttributeError, KeyError)):  # an override names a key that is not there
    key = re.sub(r"[\\'\"]", "", text.splitlines()[0]).strip()
    flag = next((a.split("=")[0][2:] for a in argv if a.startswith("--config.")
                 and key in a.split("=")[0].split(".")), f"config.{key}")
    hint = re.search(r'Did you mean "(\w+)"', text)
    return f"{flag}: unknown key" + (f" (did you mean {hint.group(1)}?)" if hint else "")
  boolean = re.search(r"Non-boolean argument to boolean flag', '([^']*)'", text)
  if boolean:  # absl's message is a tuple: ('Non-boolean argument to boolean flag', 'maybe')
    flag = next((a.split("=")[0][2:] for a in argv if a.startswith("--config.")
                 and a.split("=", 1)[-1] == boolean.group(1)), "a boolean flag")
    return (f"{flag}={boolean.group(1)}: allowed: true or false (also True/False, t/f, 1/0)")
  missing = re.search(r"\[Errno \d+\] ([^\n]*)", text)
  if isinstance(e, OSError) and missing:
    return f"--config: cannot load the config file: {missing.group(1)}"
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if "Traceback" in text:  # an exception inside the config file: its last line says what
    return f"--config: {lines[-1]}"
  return " ".join(lines)

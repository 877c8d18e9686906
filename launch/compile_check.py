"""python launch/compile_check.py --topology=v5p:4x4x4 --config=configs/math.py [--config.K=V]

Compiles the run's three device programs (the GRPO update step and the train and val
samplers) ahead of time for a TPU topology, on a machine without TPUs, and prints what each
needs per chip beside the chip's HBM. A config that would not fit a pod slice is then found
in a minute on a laptop, not after the slice was reserved and the checkpoint streamed in.

Why this works without chips: libtpu (`pip install 'jax[tpu]'`) describes any topology
(`jax.experimental.topologies.get_topology_desc`), and `jit(...).lower(...).compile()` for
those device descriptions runs the real TPU compiler. Nothing is downloaded or read besides
the config (and, for a checkpoint, its architecture and tokenizer files: a Hugging Face
folder needs only config.json and the tokenizer's files, no weights): parameters,
optimizer state and batches are abstract (`jax.ShapeDtypeStruct`s with their shardings),
built by the same functions a run uses, so the programs are the ones the run compiles.

Reading the table: a program's total is what it holds on one chip while it runs (arguments,
outputs less what aliases donated arguments, temporaries, code). The train state lives on
the chips for the whole run, so the part of it a sampler does not take as an argument
(optimizer moments, the reference policy) is added to the sampler's total: that is the
chip's peak while sampling. HBM is the chip's nominal capacity; the runtime keeps a little
of it for itself (the compiler allows 15.75 of v5e's 16 GiB).

After the table, one line per program (jaxgrpo/runtime/tpu_cost.py reads the compiled HLO):
the Pallas kernels it contains (`tpu_custom_call`s by kernel name and count), its
predicted time (per step; a sampler's per rollout batch, its decode loop at its bound, and
per token-step) from the compiler's own per-op cycle estimates, loops times their trip
counts, collectives by a ring model, kernels by their flops; the lower bound if all
communication overlapped; and the fraction of the floor (the update: 6 x params x tokens
at the MXU peak; decoding: the bytes of the weights and the live K/V once a token-step at
HBM bandwidth), with a decode step's bytes against that floor.

Exit status: 0 when every program checked compiles and fits; 1 when one fails to compile,
does not fit, or contains a Pallas kernel in interpret mode (it would crawl on the chip;
one line each on stderr, saying by how much or which); 2 for a bad flag, config or
topology (one line).

Flags:
  --topology=NAME     a TPU topology: v4:2x2x1, v5e:2x2, v5p:4x4x4, v6e:16x16, ...
  --num_slices=N      N such slices joined by the data-centre network (multi-slice); the
                      config's mesh.dcn_data follows it when left at 1
  --programs=LIST     which to compile, of update,train,val (default: all three)
  --hbm_gib=X         the per-chip HBM to check against (default: the chip's, from a table)
  --dump_hlo=DIR      write each compiled program's HLO text as DIR/<program>.txt (the
                      program's name as printed, spaces as underscores)
  --suggest_micro_batch  the same as --config.grpo.micro_batch_size=auto: first find the
                      largest micro-batch whose update step fits (jaxgrpo/run/sizing.py, the
                      trainer's own choice), then check every program with it. A config
                      whose micro_batch_size or val_batch_size is 'auto' is chosen the same
                      way, against this topology's HBM (or --hbm_gib)
  --config=FILE[:ARG] and --config.KEY=VALUE as for `python -m jaxgrpo.train`
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

# The check needs no local accelerator, and jax must not grab (or, without one, probe for) a
# TPU when libtpu is installed: the topology's devices are compile-only descriptions.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # noqa: E402  (after the environment above)
from ml_collections import config_flags  # noqa: E402

from jaxgrpo import config as config_lib  # noqa: E402
from jaxgrpo.model import hf  # noqa: E402
from jaxgrpo.run import loading  # noqa: E402
from jaxgrpo.run import setup  # noqa: E402
from jaxgrpo.runtime import compile_options  # noqa: E402

GIB = 2**30

# Nominal HBM per JAX device, by device_kind. One device is one chip, except v2 and v3,
# whose two TensorCores are separate devices sharing the chip's HBM half and half. Google
# quotes v5e / v6e / v5p as 16 / 32 / 95 "GB"; the chips' stacks are GiB (v5e reports
# 15.75 GiB usable, v5p 95.74).
HBM_GIB = {"TPU v2": 8, "TPU v3": 16, "TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95,
           "TPU v6 lite": 32}


# With an environment, each sampler is an episode's turn program, and the start program
# that prefills the prompts into the episodes' KV cache is checked beside it.
PROGRAMS = ("update step", "train sampler", "train episode start", "val sampler",
            "val episode start")

_FV = flags.FlagValues()  # not absl's global FLAGS, where jaxgrpo.train defines --config
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Run config file (configs/*.py[:arg]).", flag_values=_FV)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:4x4x4.",
                                flag_values=_FV)
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices joined by DCN.", flag_values=_FV)
_PROGRAMS = flags.DEFINE_list("programs", ["update", "train", "val"],
                              "Which to compile: update, train, val.", flag_values=_FV)
_HBM_GIB = flags.DEFINE_float("hbm_gib", None, "Per-chip HBM to check against, in GiB.",
                              flag_values=_FV)
_DUMP_HLO = flags.DEFINE_string("dump_hlo", None, "Write each program's HLO to this folder.",
                                flag_values=_FV)
_SUGGEST = flags.DEFINE_bool("suggest_micro_batch", False,
                             "Find the largest grpo.micro_batch_size whose update fits.",
                             flag_values=_FV)


class CheckError(ValueError):
  """Bad input (flag, config or topology), explained in one line: exit status 2."""


def main(argv=None) -> int:
  argv = sys.argv if argv is None else argv
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(__doc__.strip())
    return 0
  try:
    config = _parse(argv)
    devices, label = _topology(_TOPOLOGY.value, _NUM_SLICES.value)
    config = _validate(config, len(devices), _NUM_SLICES.value)
    model_cfg, tokenizer = _architecture(config)
    hbm = _hbm_bytes(devices[0].device_kind, label)
  except (CheckError, config_lib.ConfigError, hf.PretrainedError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  with compile_options.as_tpu_host():
    return _check(config, devices, label, model_cfg, tokenizer, hbm)


def _check(config, devices, label, model_cfg, tokenizer, hbm) -> int:
  """Compiles and measures the programs (main, after the inputs were checked)."""
  from jaxgrpo.run import sizing  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  mesh = sharding_lib.make_mesh(config.mesh.to_dict(), devices)
  chips = len(devices)
  sizes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items()
                    if k not in ("expert", "context") or v > 1)
  if _NUM_SLICES.value > 1:  # the data axis spans the slices (mesh.dcn_data)
    slices = _NUM_SLICES.value
    sizes = sizes.replace(f"data={mesh.shape['data']}",
                          f"data={mesh.shape['data']} ({slices} slices x "
                          f"{mesh.shape['data'] // slices})", 1)
  print(f"{label}: {chips} x {devices[0].device_kind}, {sizing.gib(hbm)} HBM each; mesh {sizes}; "
        f"params {model_cfg.param_dtype}, compute {model_cfg.dtype}", flush=True)
  known = {}  # program name -> Memory already measured (a search's winning program)
  autos = ["grpo.micro_batch_size"] if _SUGGEST.value else []
  config = setup.apply_auto(config, autos)
  if config_lib.any_auto(config.grpo):
    # The trainer's own choice (jaxgrpo/run/sizing.py), against this topology's HBM per chip.
    num_val = 0
    if config.grpo.val_batch_size == sizing.AUTO:
      num_val = len(loading.load_data(config, tokenizer).val_rows)
    try:
      # mesh.memory_limit_gib, when the config sets it, as the trainer plans against it.
      limit = (int(config.mesh.memory_limit_gib * GIB) if config.mesh.memory_limit_gib
               and _HBM_GIB.value is None else hbm)
      config, choices = sizing.resolve(
          config, model_cfg, tokenizer, mesh, num_val, limit=limit,
          report=lambda *a: print(sizing.report_line(*a), flush=True))
    except sizing.FitError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
    for choice in choices:
      print(choice.line(), flush=True)
      known[choice.program] = choice.tried[choice.size]
  g = config.grpo
  rollouts = g.num_prompts_per_step * g.num_generations_per_prompt
  micro = g.micro_batch_size or rollouts
  layout = (f"packed micro-batches of {g.micro_batch_tokens} tokens a chip "
            f"(grpo.micro_batch_tokens)" if g.micro_batch_tokens else
            f"micro-batches of {micro} ({rollouts // micro} per step; "
            f"grpo.micro_batch_size={g.micro_batch_size})")
  print(f"update: {rollouts} rollouts in {layout}, logprob_chunk_size="
        f"{g.logprob_chunk_size}, remat={config.model.remat}, scan_layers="
        f"{_build().scan_layers(config, mesh)}, attention="
        f"{_build().attention(config, mesh, model_cfg)}",
        flush=True)
  chip = _TOPOLOGY.value.split(":")[0]  # "v5e's 16 GiB", as the chip is called
  memory, failures = {}, []
  for name, lowered, resident in sizing.programs(config, model_cfg, tokenizer, mesh,
                                              _PROGRAMS.value):
    if name in known:  # compiled during the search, with the same size
      memory[name] = known[name]
      continue
    try:
      memory[name] = sizing.compile_memory(lowered, resident)
    except Exception as e:  # pylint: disable=broad-except  # XLA's errors are untyped
      failures.append(f"error: the {name} failed to compile for {label}: {_first_line(e)}")
  print(_table(memory, hbm), flush=True)
  failures += _programs_report(memory, config, model_cfg, mesh, devices[0].device_kind, label)
  for name, m in memory.items():
    if m.peak > hbm:
      with_state = " with the train state" if m.resident else ""
      failures.append(f"error: {name} needs {sizing.gib(m.peak)} per chip{with_state}, "
                      f"{sizing.gib(m.peak - hbm)} more than {chip}'s {sizing.gib(hbm)} HBM")
  for line in failures:
    print(line, file=sys.stderr)
  if not failures:
    print(f"ok: {', '.join(memory)} compile for {label} and fit its {sizing.gib(hbm)} HBM per chip")
  return 1 if failures else 0


def _parse(argv):
  """The config from --config and its overrides (as jaxgrpo.train parses them)."""
  argv, autos = setup.split_auto(argv)  # 'auto' for an integer key (setup.parse_config)
  saved_argv, sys.argv = sys.argv, list(argv)  # config_flags finds overrides in sys.argv
  try:
    _FV(argv)
    if _CONFIG.value is not None:
      _CONFIG.value.to_dict()  # config_flags reports a failed file load only on first use
  except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    message = setup.flag_error(e, argv)
    raise config_lib.ConfigError(message) from None
  finally:
    sys.argv = saved_argv
  if _CONFIG.value is None:
    raise CheckError("--config is required, e.g. --config=configs/math.py")
  if not _TOPOLOGY.value:
    raise CheckError("--topology is required, e.g. --topology=v5e:2x2 or v5p:4x4x4")
  unknown = sorted(set(_PROGRAMS.value) - {"update", "train", "val"})
  if unknown or not _PROGRAMS.value:
    raise CheckError(f"--programs={','.join(_PROGRAMS.value)}: allowed: a comma-separated "
                     "subset of update, train, val")
  if _NUM_SLICES.value < 1:
    raise CheckError(f"--num_slices={_NUM_SLICES.value}: allowed: an integer >= 1")
  config = setup.apply_auto(_CONFIG.value, autos)
  # The training command's own reading of the overrides (an idle one refused, a file's
  # best-checkpoint rule stepping aside for val_period=0): the same config it would run.
  for note in config_lib.check_overrides(config, config_lib.overridden_keys(argv)):
    print(f"compile_check: {note}", file=sys.stderr, flush=True)
  return config


def _topology(name: str, num_slices: int):
  """(compile-only TPU devices, a label such as 'v5e:2x2' or '2 x v5e:2x2')."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
    raise CheckError(f"compiling for --topology={name} needs libtpu, which is not installed: "
                     f"pip install 'jax[tpu]=={jax.__version__}'")
  generation = name.split(":")[0]
  kwargs = dict(compile_options.TOPOLOGY_KWARGS.get(generation, {}))
  if num_slices > 1:
    kwargs["num_slices"] = num_slices
  try:
    # libtpu writes warnings about the TPU environment it did not find to fd 2 while it
    # loads; they do not apply to compile-only devices and would bury a one-line error.
    with _quiet_stderr():
      devices = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                             **kwargs).devices
  except RuntimeError as e:  # JaxRuntimeError, or "JAX TPU support not installed"
    why = _first_line(e).replace("INVALID_ARGUMENT: ", "")
    raise CheckError(f"--topology={name}: {why} (e.g. v4:2x2x1, v5e:2x2, v5p:4x4x4, "
                     "v6e:16x16)") from None
  return list(devices), (f"{num_slices} x {name}" if num_slices > 1 else name)


@contextlib.contextmanager
def _quiet_stderr():
  """Sends what C++ code writes to fd 2 to a scratch file for the duration."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as scratch:
    os.dup2(scratch.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def _validate(config, num_devices: int, num_slices: int):
  """config.validate for the topology's device count; mesh.dcn_data follows --num_slices."""
  mesh = config.mesh
  if "dcn_data" in mesh:  # a config without the key (older) gets one flat data axis
    if num_slices > 1 and mesh.dcn_data == 1:
      mesh.dcn_data = num_slices
    elif mesh.dcn_data != num_slices:
      raise config_lib.ConfigError(
          f"config.mesh.dcn_data={mesh.dcn_data}: the topology has {num_slices} slice(s) "
          f"(--num_slices={num_slices}); allowed: {num_slices}")
  return setup.validate(config, num_devices)


def _architecture(config):
  """(ModelConfig, Tokenizer) as the run would have them, without reading any weights."""
  m = config.model
  if m.hf_checkpoint:  # config.json and the tokenizer: a fit is checked before a download
    cfg, tokenizer = hf.inspect_hf(m.hf_checkpoint, dtype=m.param_dtype, need_weights=False)
    cfg = loading.with_execution(cfg, m)
    loading.check_architecture(config, cfg)
    return cfg, tokenizer
  if not m.checkpoint:  # random init
    model_cfg, _, tokenizer = loading.load_policy(config)
    return model_cfg, tokenizer
  # A jaxgrpo checkpoint: its model.json and tokenizer only.
  cfg, tokenizer = hf.inspect_pretrained(m.checkpoint, need_weights=False)
  cfg = loading.with_execution(cfg, m, param_dtype=True)
  loading.check_architecture(config, cfg)
  return cfg, tokenizer


def _hbm_bytes(device_kind: str, label: str) -> int:
  if _HBM_GIB.value is not None:
    if _HBM_GIB.value <= 0:
      raise CheckError(f"--hbm_gib={_HBM_GIB.value}: allowed: a number > 0")
    return int(_HBM_GIB.value * GIB)
  if device_kind not in HBM_GIB:
    raise CheckError(f"--topology={label}: no HBM figure for {device_kind!r} chips; pass "
                     "--hbm_gib=<GiB per chip>")
  return HBM_GIB[device_kind] * GIB


def _table(memory: dict, hbm: int) -> str:
  """program -> sizing.Memory, as a table of bytes per chip."""
  from jaxgrpo.run import sizing  # pylint: disable=g-import-not-at-top
  head = ("program", "arguments", "outputs", "-alias", "temporaries", "code", "total",
          "+state", "peak", "of HBM", "compile")
  rows = [head]
  for name in PROGRAMS:
    if name not in memory and (name.split()[0] not in _PROGRAMS.value or "episode" in name):
      continue
    if name not in memory:
      rows.append((name, "did not compile") + ("",) * (len(head) - 2))
      continue
    m = memory[name]
    parts = (m.arguments, m.outputs, m.alias, m.temporaries, m.code)
    rows.append((name, *("?" if x is None else sizing.gib(x) for x in parts), sizing.gib(m.total),
                 sizing.gib(m.resident), sizing.gib(m.peak), f"{100 * m.peak / hbm:.1f}%",
                 f"{m.seconds:.1f} s"))
  widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
  lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                     for i, (cell, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
  lines.insert(1, "-" * len(lines[0]))
  notes = ["+state: the train state a sampler does not take as an argument (optimizer "
           "moments, reference policy), resident all run"]
  if any(m.needs is not None for m in memory.values()):
    notes.append("?: the compiler refused the program and named only its total")
  return "per chip:\n" + "\n".join(lines + notes)


def _programs_report(memory: dict, config, model_cfg, mesh, device_kind: str,
                     label: str) -> list:
  """Prints each compiled program's kernels, predicted time and floor (tpu_cost); writes
  --dump_hlo's files. Returns the failures: programs with an interpreted Pallas kernel."""
  from jaxgrpo.run import predict  # pylint: disable=g-import-not-at-top
  from jaxgrpo.runtime import tpu_cost  # pylint: disable=g-import-not-at-top
  chip = tpu_cost.chip_for(device_kind)
  failures = []
  if _DUMP_HLO.value:
    os.makedirs(_DUMP_HLO.value, exist_ok=True)
  if chip is None:
    print(f"no chip figures for {device_kind!r}: kernels listed, no predicted time")
  else:
    print(f"predicted per chip ({device_kind}: {chip.clock_hz / 1e9:g} GHz, "
          f"{chip.peak_flops / 1e12:g} TFLOP/s, HBM {chip.hbm_bytes_s / 1e12:g} TB/s, ICI "
          f"{chip.ici_link_bytes_s / 1e9:g} GB/s a link each way; serial sum of the compiler's "
          "estimates, no overlap or host time):", flush=True)
  for name, m in memory.items():
    if m.hlo is None:
      continue
    if _DUMP_HLO.value:
      with open(os.path.join(_DUMP_HLO.value, name.replace(" ", "_") + ".txt"), "w") as f:
        f.write(m.hlo)
    found = tpu_cost.kernels(m.hlo)
    interpreted = tpu_cost.interpreted_kernels(m.hlo)
    if interpreted:
      failures.append(f"error: the {name} compiled for {label} contains a Pallas kernel in "
                      f"interpret mode ({interpreted} ops from a pallas_call that is no "
                      "tpu_custom_call): it would run in Pallas' interpreter on the chips")
    line = f"{name}: kernels {tpu_cost.describe_kernels(found)}"
    if chip is not None:
      line += "; " + predict.program_line(m.hlo, name, chip, config, model_cfg, mesh)
    print(line, flush=True)
  return failures


def _build():
  """jaxgrpo.run.build, imported once jax is configured (as in _programs)."""
  from jaxgrpo.run import build  # pylint: disable=g-import-not-at-top
  return build


def _first_line(e: Exception) -> str:
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return re.sub(r"\s+", " ", lines[0]) if lines else type(e).__name__


if __name__ == "__main__":
  sys.exit(main())

"""Running `python -m jaxgrpo.train` as a user does, in subprocesses (shared by CLI tests).

The subprocesses inherit the session's JAX persistent compilation cache (conftest.py), so
the runs after the first load their compiled sampler and update step from disk (about
25 s -> 10 s for a smoke run on 2 cores). JAX_LOG_COMPILES makes jax log each compilation,
so "no compilation before the error" is checked, not assumed.

`ARGS` is the end-to-end run several test files share: the smoke preset for 8 steps
(validation and a checkpoint every 2), a best-checkpoint metric, and a training
temperature override that the unset validation temperature must follow; `STRAIGHT` is
ARGS logging to wandb too, as conftest.py's straight run does.
"""

import glob
import json
import os
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = os.path.join(ROOT, "configs", "math.py")
# With a user's reward file (tests/fixtures/user_rewards.py, scoring 0): every run, resumed
# and interrupted one of the fault tests imports it, and the smoke test reads what it logs.
USER = ("--config.user_modules=tests/fixtures/user_rewards.py",
        "--config.rewards.fixture_columns=1.0")
# micro_batch_size 'auto', which on CPU (no memory limit) is the whole batch, as 0 was.
ARGS = (f"--config={MATH}:smoke", "--config.grpo.max_num_steps=8",
        "--config.generation.temperature=0.9", "--config.checkpoint.best_metric=accuracy",
        "--config.grpo.micro_batch_size=auto", *USER)
# conftest.py's straight run of ARGS logs to wandb too (offline: conftest.py), and so does
# every run that continues a copy of it, so a resumed run continues its wandb run. Fresh
# runs of ARGS (the fault tests') log to TensorBoard only: wandb's service costs a run
# about 3.5 s on this machine (8.7 -> 12.2 s for ARGS), and they never read it.
STRAIGHT = (*ARGS, "--config.logging.trackers=tensorboard,wandb")


# Tests compile for speed of compiling, not of running: the suite is mostly CPU compilation
# of programs that then run for milliseconds. Two XLA CPU options, measured on 2 cores:
#   --xla_backend_optimization_level=0  LLVM does not optimise the elementwise loops'
#       machine code (tests/test_model.py alone: 52 s -> 36 s);
#   --xla_cpu_use_fusion_emitters=false  fusions are emitted by XLA's older elemental
#       emitter, not the MLIR fusion emitters (test_model.py: 36 s -> 20 s; the FSDP memory
#       check's 8 compiles: 17.7 s -> 9.5 s).
# Neither changes what a test checks: XLA's HLO passes (fusion decisions, SPMD partitioning)
# and the matmul library calls are the same; the compiler's memory figures move by ~1% (the
# FSDP check's single-device update: 2,770 -> 2,802 MiB), and the memory tests compare
# sizes with margins far wider than that; values are compared between two programs built
# alike. The programs run slower, which only benchmarks measure, and benchmarks are not
# tests. jaxgrpo compiles its own programs at level 2 on CPU unless XLA_FLAGS names the
# option (compile_options.py), so the test flag reaches them too. The test session's own
# process gets the same flags (conftest.py); TPU compile checks do not (test_compile_check.py).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices."""
  return f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}"


def env(**extra):
  out = dict(os.environ, JAX_LOG_COMPILES="1", JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
  out.update(extra)
  return out


def command(*args, workdir):
  return [sys.executable, "-m", "jaxgrpo.train", f"--workdir={workdir}", *args]


def run_train(*args, workdir, **extra_env):
  return subprocess.run(command(*args, workdir=workdir), capture_output=True, text=True,
                        env=env(**extra_env), cwd=ROOT, timeout=600)


def start_train(*args, workdir, **extra_env):
  """The CLI in the background (for signals); stdout and stderr are pipes."""
  return subprocess.Popen(command(*args, workdir=workdir), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env(**extra_env), cwd=ROOT)


STARTUP = ("jaxgrpo.train: ", "devices: ")  # what the run is, a setting it applied; devices


def assert_clean_error(proc, *fragments):
  """Exit status 2, one stderr line holding every fragment, no traceback, nothing compiled."""
  err = proc.stderr.strip()
  assert proc.returncode == 2, (proc.returncode, err[-2000:])
  assert "Traceback" not in err, err
  lines = [l for l in err.splitlines() if l.strip()]
  # JAX_LOG_COMPILES also logs tracing (shape checks use jax.eval_shape, which compiles
  # nothing); what must never appear before the error is a compilation.
  assert not any("Compiling" in l or "compil" in l.lower() for l in lines), lines
  lines = [l for l in lines if "Finished tracing" not in l]
  # The trainer's start-up lines (what the run is, then its devices) come before any check
  # that needs them; the error is the one line after them.
  lines = [l for l in lines if not l.startswith(STARTUP)]
  assert len(lines) == 1, lines
  for fragment in fragments:
    assert fragment in lines[0], lines[0]



# Imports a run must never make: the jetstream extra and what it pulls in.
HEAVY = ("jetstream", "tensorflow", "seqio")


def run_recording_imports(*args, workdir):
  """Runs `jaxgrpo.train` in a subprocess that records every import statement for HEAVY (and
  refuses it, as if not installed: so even where the extra is installed nothing loads, and
  where it is not, an attempt is still seen). Returns (process, attempted, loaded)."""
  script = f"""
import json, sys
HEAVY = {HEAVY!r}
attempts = []
class Recorder:
  def find_spec(self, name, path=None, target=None):
    # An import statement, not a probe: importlib.util.find_spec("tensorflow") (etils asks,
    # to pick a gs:// backend) loads nothing and is let through.
    importing = sys._getframe(2).f_code.co_name == "_find_and_load_unlocked"
    if importing and name.split(".")[0] in HEAVY:
      attempts.append(name)
      raise ModuleNotFoundError(name)
    return None
sys.meta_path.insert(0, Recorder())
from jaxgrpo import train
rc = train.main(["train", "--workdir={workdir}", *{list(args)!r}])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
print("IMPORTS " + json.dumps({{"attempted": attempts, "loaded": loaded}}))
sys.exit(rc)
"""
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=env(), cwd=ROOT, timeout=600)
  line = [l for l in proc.stdout.splitlines() if l.startswith("IMPORTS ")]
  record = json.loads(line[-1][len("IMPORTS "):]) if line else {}
  return proc, record.get("attempted"), record.get("loaded")


def assert_smoke_run_imports_nothing_heavy(workdir):
  """A one-step smoke run of the default config neither tries to import HEAVY nor loads it."""
  proc, attempted, loaded = run_recording_imports(f"--config={MATH}:smoke",
                                                  "--config.grpo.max_num_steps=1",
                                                  workdir=workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert attempted == [] and loaded == [], (attempted, loaded)


def tb_scalars(event_dir):
  """(tag, step, value) of every scalar in event_dir, read by TensorBoard's own reader (the
  `tensorboard` package the README's command runs), which also drops the events a resumed
  run purged."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  events = event_accumulator.EventAccumulator(event_dir, size_guidance={"scalars": 0,
                                                                         "images": 0})
  events.Reload()
  return [(tag, e.step, e.value) for tag in events.Tags()["scalars"]
          for e in events.Scalars(tag)]


def wandb_runs(workdir):
  """Every offline wandb run under workdir/wandb, oldest first, as dicts with its `id`,
  `config`, `history` (the logged rows) and `summary`. Read from its run-<id>.wandb file:
  wandb's own protobuf records (wandb.proto) in the LevelDB log framing the file uses
  (wandb 0.31 ships no Python reader for it)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  runs = []
  paths = glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))
  for path in sorted(paths, key=os.path.getmtime):  # the names have whole seconds
    run = {"id": os.path.basename(path)[4:-6], "config": {}, "history": [], "summary": {}}
    # wandb's service writes the file behind the run's finish() (seen once in ~20 runs on
    # a loaded machine: a run read without its history): wait for the exit record.
    records = []
    for _ in range(100):
      try:
        records = [wandb_internal_pb2.Record.FromString(r) for r in _leveldb_records(path)]
      except Exception:  # pylint: disable=broad-except  (a record still being written)
        records = []
      if any(r.WhichOneof("record_type") == "exit" for r in records):
        break
      time.sleep(0.1)
    for record in records:
      kind = record.WhichOneof("record_type")
      items = lambda update: _nest((list(i.nested_key) or [i.key], json.loads(i.value_json))
                                   for i in update)
      if kind == "run":
        run["config"].update(items(record.run.config.update))
      elif kind == "config":
        run["config"].update(items(record.config.update))
      elif kind == "history":
        run["history"].append(items(record.history.item))
      elif kind == "summary":
        run["summary"].update(items(record.summary.update))
    runs.append(run)
  return runs


def _nest(pairs):
  """{key: value}, a nested key (an image's fields) becoming nested dicts."""
  out = {}
  for keys, value in pairs:
    node = out
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = value
  return out


def _leveldb_records(path):
  """The records of a wandb transaction log: a 7-byte header (":W&B", magic, version), then
  32 KiB blocks of chunks, each a u32 crc, u16 length and u8 type (1 whole, 2 first,
  3 middle, 4 last) before its bytes; a block's tail shorter than a chunk header is padding."""
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B", path
  pos, block, parts = 7, 32768, []
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0:  # zero padding up to the block's end
      pos += left
      continue
    parts = [] if kind in (1, 2) else parts
    parts.append(data[pos + 7:pos + 7 + length])
    pos += 7 + length
    if kind in (1, 4):
      yield b"".join(parts)


def free_port() -> int:
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two_processes(*args, workdir, devices: int):
  """Both processes of a 2-process run on localhost (gloo collectives), `devices` CPU
  devices each, started together; asserts both exit 0 and returns their (stdout, stderr)."""
  port = free_port()
  procs = [subprocess.Popen(
      command(*args, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
              f"--process_id={i}", workdir=workdir),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
      env=env(XLA_FLAGS=xla_flags(devices))) for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=600))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return outs

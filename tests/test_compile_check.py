"""launch/compile_check.py: AOT compilation for a TPU topology on this CPU-only machine.

The CLI tests need libtpu (`pip install -e '.[tpu]'`, kept out of the test venv: see
pyproject.toml), in the Python named by $JAXGRPO_TPU_PYTHON or this one, and skip without it. They run the
check in subprocesses, as a user does: libtpu then loads in a process of its own, never in
the test worker, and exit status and stderr are what is checked. Compilation for a topology
works with JAX_PLATFORMS=cpu (conftest.py sets it): the devices are compile-only
descriptions, no TPU backend is started.

Sizes: v5e:2x2 is 4 chips of 16 GiB. The model that does not fit is one layer whose MLP is
1M wide (3.2B float32 parameters, 12 GiB): its update step holds the parameters, both Adam
moments and the gradients, about 49 GiB per chip, since data parallelism replicates them.
Only the update step is compiled there (--programs=update): the samplers would add ~30 s.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "compile_check.py")
SMOKE = f"--config={os.path.join(ROOT, 'configs', 'math.py')}:smoke"
PROGRAMS = ("update step", "train sampler", "val sampler")
# The widest MLP that compiles in seconds and needs tens of GiB (see the docstring).
TOO_BIG = ("--config.model.checkpoint=", "--config.model.d_model=1024",
           "--config.model.mlp_dim=1048576", "--config.model.num_heads=8",
           "--config.model.num_kv_heads=8", "--config.model.head_dim=128",
           "--config.model.num_layers=1")


@pytest.fixture(name="check")
def check_fixture():
  """Runs the CLI with a Python that has libtpu ($JAXGRPO_TPU_PYTHON, else this one);
  skips the test where there is none."""
  python = os.environ.get("JAXGRPO_TPU_PYTHON") or sys.executable
  found = subprocess.run([python, "-c", "import libtpu"], capture_output=True).returncode == 0
  if not found:
    pytest.skip("needs jax[tpu] (libtpu) to compile for a TPU topology: pip install "
                "-e '.[tpu]' in a venv and set JAXGRPO_TPU_PYTHON to its python")

  def run(*args):
    return subprocess.run([python, SCRIPT, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return run


def table_rows(stdout):
  """program name -> the table's cells after it."""
  rows = {}
  for line in stdout.splitlines():
    for name in PROGRAMS:
      if line.startswith(name):
        rows[name] = re.split(r"\s{2,}", line[len(name):].strip())
  return rows


def to_bytes(cell):
  number, unit = cell.split()
  return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_smoke_config_compiles_for_v5e(check):
  proc = check("--topology=v5e:2x2", SMOKE)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "v5e:2x2: 4 x TPU v5 lite, 16.0 GiB HBM each; mesh data=4" in proc.stdout
  rows = table_rows(proc.stdout)
  assert sorted(rows) == sorted(PROGRAMS), proc.stdout
  for name, cells in rows.items():
    arguments, total, peak = to_bytes(cells[0]), to_bytes(cells[5]), to_bytes(cells[7])
    assert 0 < arguments < total <= peak < 2**30, (name, cells)
  # The samplers share the chips with the optimizer moments (2x the float32 params).
  assert to_bytes(rows["train sampler"][6]) > 2 * to_bytes(rows["train sampler"][0]) * 0.9
  assert "ok: update step, train sampler, val sampler compile for v5e:2x2" in proc.stdout
  assert proc.stderr.strip() == "", proc.stderr


def test_model_that_does_not_fit_says_by_how_much(check):
  proc = check("--topology=v5e:2x2", SMOKE, "--programs=update", *TOO_BIG)
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, lines
  found = re.fullmatch(r"error: update step needs ([\d.]+) GiB per chip, ([\d.]+) GiB more "
                       r"than v5e's 16\.0 GiB HBM", lines[0])
  assert found, lines[0]
  needs, more = float(found[1]), float(found[2])
  assert 30 < needs < 100 and abs(needs - 16 - more) < 0.11, lines[0]
  assert list(table_rows(proc.stdout)) == ["update step"], proc.stdout


@pytest.mark.parametrize("args, fragment", [
    (("--topology=v9:2x2", SMOKE), "--topology=v9:2x2: Invalid TPU external name"),
    (("--topology=v5e:2x2", "--num_slices=2", SMOKE, "--config.mesh.dcn_data=3"),
     "config.mesh.dcn_data=3: the topology has 2 slice(s)"),
])
def test_bad_input_is_one_line_and_exit_2(check, args, fragment):
  proc = check(*args)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and fragment in lines[0], lines
  assert proc.stdout == ""


def test_two_slices_split_the_data_axis(check):
  # The train sampler alone: the cheapest program, enough to show the multi-slice mesh.
  proc = check("--topology=v5e:2x2", "--num_slices=2", "--programs=train", SMOKE)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "2 x v5e:2x2: 8 x TPU v5 lite" in proc.stdout
  assert "mesh data=8 (2 slices x 4), fsdp=1, tensor=1" in proc.stdout
  assert list(table_rows(proc.stdout)) == ["train sampler"], proc.stdout


def test_refused_program_falls_back_to_the_compilers_total():
  """Without libtpu: when even the retry with the overflow check off fails, the total comes
  from the compiler's first error message (its G are GiB)."""
  spec = importlib.util.spec_from_file_location("compile_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)

  class Refused:
    def compile(self, compiler_options=None):
      raise RuntimeError("INVALID_ARGUMENT: Invalid TPU program.")

  error = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                       "required for HLO temporaries (65.01G) exceeds available HBM (15.75G).")
  memory = module._overflow(Refused(), 2**30, error)
  assert memory.needs == int(65.01 * 2**30) and memory.arguments is None
  assert memory.peak == memory.needs + 2**30
  with pytest.raises(RuntimeError, match="no sizes"):
    module._overflow(Refused(), 0, RuntimeError("RESOURCE_EXHAUSTED: no sizes"))

"""launch/xpk.py: the xpk command it builds, its one-line refusals, and, when an xpk is
installed, that xpk itself accepts the command (its offline dry run) and agrees on TPU types.

The launcher lives outside the package (`launch/`), so it is loaded from its file rather
than imported: no sys.path edits, and no clash with the real `xpk` package's name. The CLI
tests run it as users do, `python launch/xpk.py`, in subprocesses; it needs no jax, so each
takes a fraction of a second.

xpk is found as the launcher finds it: $XPK, else beside this Python (same venv), else PATH;
the xpk tests skip when there is none (`pip install xpk==1.16.0` to run them).
"""

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "xpk.py")


def _load_launcher():
  spec = importlib.util.spec_from_file_location("jaxgrpo_launch_xpk", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
  spec.loader.exec_module(module)
  return module


launch = _load_launcher()

FLAGS = ["--cluster=grpo-cluster", "--project=my-project", "--zone=us-east5-a",
         "--workload=grpo-math-1", "--tpu_type=v5p-128", "--num_slices=2",
         "--docker_image=gcr.io/my-project/jaxgrpo:v1", "--config=configs/math.py:smoke",
         "--workdir=gs://my-bucket/runs/math-1"]
# Two slices: the launcher adds the mesh's slice axis (mesh.dcn_data) to match.
TRAIN = ["python", "-m", "jaxgrpo.train", "--config=configs/math.py:smoke",
         "--config.mesh.dcn_data=2", "--workdir=gs://my-bucket/runs/math-1"]
XPK_HEAD = ["xpk", "workload", "create", "--cluster=grpo-cluster", "--project=my-project",
            "--zone=us-east5-a", "--workload=grpo-math-1", "--tpu-type=v5p-128",
            "--num-slices=2"]


def _with(*changes):
  """FLAGS with each `--flag=value` in `changes` replacing the same flag (or appended)."""
  out = list(FLAGS)
  for change in changes:
    name = change.split("=", 1)[0]
    same = [i for i, f in enumerate(out) if f.split("=", 1)[0] == name]
    if same:
      out[same[0]] = change
    else:
      out.append(change)
  return out


def _command(argv):
  return launch.build_command(launch.parse_args(argv))


def _train_argv(cmd):
  """The workload's argv as bash will split xpk's --command string."""
  value, = [a[len("--command="):] for a in cmd if a.startswith("--command=")]
  return shlex.split(value)


def _cli(*argv, **env):
  return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                        cwd=ROOT, env=dict(os.environ, **env), timeout=120)


# ---------------------------------------------------------------------------------------------
# The command.


def test_command_for_a_prebuilt_image():
  assert _command(FLAGS) == XPK_HEAD + [
      "--docker-image=gcr.io/my-project/jaxgrpo:v1", "--command=" + shlex.join(TRAIN)]


def test_base_image_mode_adds_this_working_tree():
  flags = [f for f in FLAGS if not f.startswith("--docker_image")]
  cmd = _command(flags + ["--base_docker_image=gcr.io/my-project/jaxgrpo:deps"])
  assert cmd == XPK_HEAD + ["--base-docker-image=gcr.io/my-project/jaxgrpo:deps",
                            f"--script-dir={ROOT}", "--command=" + shlex.join(TRAIN)]


def test_overrides_keep_their_order_and_survive_the_shell():
  awkward = "Q: {question}\nit's \"quoted\" $HOME A:"
  cmd = _command(FLAGS + ["--config.grpo.max_num_steps=8",
                          f"--config.data.prompt_template={awkward}",
                          "--config.grpo.max_num_steps=9"])
  assert _train_argv(cmd) == TRAIN[:5] + [
      "--config.grpo.max_num_steps=8", f"--config.data.prompt_template={awkward}",
      "--config.grpo.max_num_steps=9"] + TRAIN[5:]


def test_slice_count_reaches_the_mesh():
  assert _train_argv(_command(_with("--num_slices=1"))) == [
      a for a in TRAIN if not a.startswith("--config.mesh")]
  # An override that agrees is kept where it was, not repeated.
  argv = _train_argv(_command(_with("--num_slices=4") + ["--config.grpo.max_num_steps=8",
                                                         "--config.mesh.dcn_data=4"]))
  assert argv[4:6] == ["--config.grpo.max_num_steps=8", "--config.mesh.dcn_data=4"]
  assert sum(a.startswith("--config.mesh.dcn_data") for a in argv) == 1


def test_dry_run_and_flags_for_xpk_go_last():
  cmd = _command(FLAGS + ["--dry-run", "--", "--priority=high", "--max-restarts=2"])
  assert cmd[-3:] == ["--priority=high", "--max-restarts=2", "--dry-run"]
  assert "--dry-run" not in _command(FLAGS)


def test_dashed_flag_spellings_are_accepted():
  dashed = [f.replace("_", "-", 1) if f.startswith(("--tpu_", "--num_", "--docker_")) else f
            for f in FLAGS]
  assert dashed != FLAGS and _command(dashed) == _command(FLAGS)


def test_config_path_inside_the_repo_is_made_relative():
  absolute = os.path.join(ROOT, "configs", "math.py") + ":smoke"
  assert _train_argv(_command(_with(f"--config={absolute}")))[3] == "--config=configs/math.py:smoke"


@pytest.mark.parametrize("tpu_type", [
    "v5p-8", "v5p-128", "v5p-17920", "v5p-4x4x4", "v4-8", "v4-8x4x4", "v6e-1", "v6e-256",
    "v6e-8x16", "v5litepod-16", "v5litepod-16x16", "tpu7x-2", "tpu7x-128", "tpu7-512"])
def test_known_tpu_types(tpu_type):
  launch.check_tpu_type(tpu_type)


def test_tpu_sizes():
  # v5p counts TensorCores (2 per chip): slices below one 4x4x4 cube are 2x2x1 .. 2x4x4, then
  # whole cubes up to 140 of them; 67 cubes (8576 cores) has no AxBxC with sides <= 64 cubes.
  v5p = launch.tpu_sizes("v5p")
  assert v5p[:7] == (8, 16, 32, 64, 128, 256, 384) and v5p[-1] == 128 * 140
  assert 128 * 66 in v5p and 128 * 67 not in v5p
  assert launch.tpu_sizes("v5litepod") == (8, 16, 32, 64, 128, 256)  # chips
  assert launch.tpu_sizes("v6e") == (1, 4, 8, 16, 32, 64, 128, 256)


# ---------------------------------------------------------------------------------------------
# The CLI: prints the command; refuses in one line with exit status 2.


def test_cli_prints_a_command_that_pastes_back():
  out = _cli(*FLAGS, "--config.grpo.max_num_steps=8", "--config.data.prompt_template=Q: {q}")
  assert out.returncode == 0, out.stderr
  assert shlex.split(out.stdout) == _command(
      FLAGS + ["--config.grpo.max_num_steps=8", "--config.data.prompt_template=Q: {q}"])


@pytest.mark.parametrize("change, expected", [
    ("--tpu_type=v5p-12", "--tpu_type=v5p-12: not a v5p size"),
    ("--tpu_type=v9-8", "--tpu_type=v9-8: unknown TPU family 'v9'"),
    ("--tpu_type=v5e-16", "allowed: --tpu_type=v5litepod-16"),
    ("--tpu_type=v5p", "--tpu_type=v5p: expected FAMILY-N"),
    ("--tpu_type=v5p-4x4x6", "--tpu_type=v5p-4x4x6: not a v5p topology"),
    ("--tpu_type=h100-80gb-8", "--tpu_type=h100-80gb-8: expected FAMILY-N"),
    ("--workload=Grpo_Run", "--workload=Grpo_Run: allowed: 1-40 lowercase"),
    ("--workload=1run", "--workload=1run: allowed"),
    ("--workload=run-", "--workload=run-: allowed"),
    ("--workload=" + "a" * 41, "allowed: 1-40 lowercase"),
    ("--cluster=my_cluster", "--cluster=my_cluster: allowed"),
    ("--num_slices=0", "--num_slices=0: allowed: an integer >= 1"),
    ("--num_slices=two", "--num_slices"),
    ("--config=configs/nope.py", "--config=configs/nope.py: no such file"),
    ("--config.grpo.max_num_steps", "--config.grpo.max_num_steps: write a config override"),
    ("--frobnicate=1", "unknown argument --frobnicate=1"),
    ("--config.mesh.dcn_data=1", "--config.mesh.dcn_data=1: the workload has --num_slices=2"),
])
def test_cli_refuses_in_one_line(change, expected):
  _refused(_with(change), expected)


def test_cli_refuses_two_modes():
  _refused(FLAGS + ["--dry-run", "--run"], "--run: not allowed with argument --dry-run")


def _refused(argv, expected):
  out = _cli(*argv)
  assert (out.returncode, out.stdout) == (2, ""), out.stderr
  line, = out.stderr.strip().splitlines()  # one line, no traceback
  assert line.startswith("error: ") and expected in line, line


def test_cli_names_every_missing_flag():
  out = _cli("--cluster=grpo-cluster", "--tpu_type=v5p-8")
  assert out.returncode == 2
  line, = out.stderr.strip().splitlines()
  for flag in ("--project", "--zone", "--workload", "--config", "--workdir"):
    assert flag in line, line


def test_cli_refuses_an_xpk_flag_it_sets_itself():
  out = _cli(*FLAGS, "--", "--num-slices=4")
  assert out.returncode == 2 and "--num-slices=4 after --" in out.stderr


# ---------------------------------------------------------------------------------------------
# xpk itself (skipped without an xpk).


def _find_xpk():
  for path in (os.environ.get("XPK"), os.path.join(os.path.dirname(sys.executable), "xpk"),
               shutil.which("xpk")):
    if path and os.access(path, os.X_OK):
      return path
  return None


@pytest.fixture(scope="module")
def xpk():
  path = _find_xpk()
  if path is None:
    pytest.skip("no xpk executable ($XPK, beside sys.executable, PATH): pip install xpk==1.16.0")
  return path


def _xpk_python(xpk_path):
  """The interpreter xpk runs under (its venv may not be this one)."""
  beside = os.path.join(os.path.dirname(xpk_path), "python")
  if os.access(beside, os.X_OK):
    return beside
  with open(xpk_path, "rb") as f:
    first = f.readline().decode(errors="replace")
  if first.startswith("#!") and "python" in first:
    return shlex.split(first[2:])[0]
  pytest.skip(f"cannot tell which Python runs {xpk_path}")


@pytest.mark.parametrize("image", ["--docker_image=gcr.io/my-project/jaxgrpo:v1",
                                   "--base_docker_image=gcr.io/my-project/jaxgrpo:deps"])
def test_xpk_dry_run_accepts_the_command(xpk, image, tmp_path):
  """xpk parses every flag, resolves the TPU type and prints the JobSet, talking to nobody.

  PATH is emptied to show that the dry run needs no gcloud, kubectl or docker; HOME is a
  fresh folder so a developer's ~/.config/xpk cannot change the outcome.
  """
  flags = [f for f in FLAGS if not f.startswith("--docker_image")] + [image]
  out = _cli(*flags, "--config.grpo.max_num_steps=8", "--config.data.prompt_template=Q: {q}",
             "--dry-run", XPK=xpk, HOME=str(tmp_path), PATH="/nonexistent")
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert out.stdout.startswith("TELEMETRY_ENABLED=false xpk workload create ")
  train = shlex.join(TRAIN[:5] + ["--config.grpo.max_num_steps=8",
                                  "--config.data.prompt_template=Q: {q}"] + TRAIN[5:])
  assert f"({train}) & PID=$!;" in out.stdout  # the line each container's bash runs
  for manifest_line in ("name: grpo-math-1", "replicas: 2",
                        "cloud.google.com/gke-tpu-accelerator: tpu-v5p-slice",
                        "cloud.google.com/gke-tpu-topology: 4x4x4"):
    assert manifest_line in out.stdout
  assert "Exiting XPK cleanly" in out.stdout


def test_tpu_table_matches_xpk(xpk):
  """Every TPU type xpk knows is accepted here, and nothing else on a grid of near misses."""
  dump = ("import json\n"
          "from xpk.core.system_characteristics import AcceleratorType, "
          "UserFacingNameToSystemCharacteristics as table\n"
          "print(json.dumps(sorted(k for k, v in table.items() "
          "if v.accelerator_type == AcceleratorType.TPU)))\n")
  out = subprocess.run([_xpk_python(xpk), "-c", dump], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, TELEMETRY_ENABLED="false"))
  assert out.returncode == 0, out.stderr
  theirs = set(json.loads(out.stdout))
  sizes = {}
  for name in theirs:
    family, size = name.rsplit("-", 1)
    if "x" not in size:
      sizes.setdefault(family, set()).add(int(size))
  assert sizes.keys() == launch._FAMILIES.keys()  # pylint: disable=protected-access
  for family, their_sizes in sizes.items():
    assert launch.tpu_sizes(family) == tuple(sorted(their_sizes)), family
  for name in theirs:
    launch.check_tpu_type(name)
  sides = (1, 2, 3, 4, 8, 12, 16, 24, 32, 64, 68, 128, 252, 256, 260)
  for family in sizes:
    grid = [f"{family}-{a}x{b}" for a in sides for b in sides]
    grid += [f"{family}-{a}x{b}x{c}" for a in sides for b in sides for c in sides]
    for name in grid:
      try:
        launch.check_tpu_type(name)
        ours = True
      except launch.LaunchError:
        ours = False
      assert ours == (name in theirs), name

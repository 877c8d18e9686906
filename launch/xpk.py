"""python launch/xpk.py --cluster=C --project=P --zone=Z --workload=NAME --tpu_type=v5p-128
     --docker_image=IMAGE --config=configs/math.py --workdir=DIR [--config.KEY=VALUE ...]
     [--num_slices=N] [--dry-run | --run] [-- XPK_FLAG ...]

Builds the `xpk workload create` command that runs `python -m jaxgrpo.train` on every host
of one or more TPU slices, and prints it, shell-quoted, ready to paste. `--dry-run` also runs
xpk's own dry run of it (xpk parses and checks every flag and prints the JobSet it would
submit, offline); `--run` submits it.

Why a builder rather than a recipe in the README:
  - The train command travels inside xpk's `--command`, a shell string that xpk pastes into a
    bash script inside a YAML manifest. Hand-quoting `--config.KEY=VALUE` overrides there is
    where launches break; here every token is quoted once, by shlex.
  - xpk checks a TPU type and a workload name itself, but only where it is installed, and
    some mistakes pass it (`--num-slices=0` passes its dry run). Its rules are mirrored here
    and checked first, each refusal one line naming the flag and what is allowed, exit
    status 2: the project's convention for user errors (jaxgrpo/config.py).
  - Config overrides use the train CLI's own spelling (`--config.grpo.max_num_steps=50`), so
    a command tried on a laptop moves to a pod by putting this launcher in front of it.

With --num_slices=N > 1 the workload command also gets --config.mesh.dcn_data=N (unless an
override sets it, to N): each slice then holds a copy of the model and a share of the batch,
and fsdp and tensor parallelism stay inside a slice's fast links (jaxgrpo/model/sharding.py).

Nothing in the workload command names a coordinator: on a GKE TPU slice every host gets the
TPU environment variables (and, across slices, xpk's MEGASCALE_* ones), from which
`jax.distributed.initialize()` with no arguments finds its peers (jaxgrpo/runtime/distributed.py).

Flags after a bare `--` go to xpk unchanged (e.g. `-- --priority=high --max-restarts=3`).

Standard library only, so it runs in any Python that has xpk, with or without jax.
`build_command(parse_args(argv))` is the pure part that tests call.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys

# The image (launch/Dockerfile) holds the repository at /app and xpk's base-image mode adds
# the working tree there too, so repo-relative paths mean the same inside the workload.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XPK_VERSION = "1.16.0"  # the xpk whose rules are mirrored below


class LaunchError(ValueError):
  """A launch flag problem, explained in one line."""


# ---------------------------------------------------------------------------------------------
# TPU types: what xpk 1.16.0 accepts for --tpu-type (xpk/core/system_characteristics.py,
# UserFacingNameToSystemCharacteristics). xpk accepts FAMILY-N and FAMILY-TOPOLOGY. N counts
# TensorCores on the 2-core-per-chip families (v4, v5p, tpu7x, tpu7: v5p-128 is 64 chips) and
# chips on v5litepod and v6e (v6e-256 is 256 chips). tests/test_launch_xpk.py compares this
# with xpk's own table whenever an xpk is installed.


@dataclasses.dataclass(frozen=True)
class _Family:
  cores_per_chip: int
  # 3-D families: xpk lists 2x2x1, 2x2x2, 2x2x4, 2x4x4 and every AxBxC of whole 4x4x4 cubes
  # (each side 4..256, a multiple of 4) with at most `max_cubes` cubes, sides non-decreasing
  # unless `any_order`.
  max_cubes: int = 0
  any_order: bool = False
  single_chip: bool = False  # 1x1x1 is listed too
  planar: tuple[str, ...] = ()  # 2-D families: the topologies xpk lists


_FAMILIES = {
    "v4": _Family(2, max_cubes=64, any_order=True),
    "v5p": _Family(2, max_cubes=140),
    "v5litepod": _Family(1, planar=("2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    "v6e": _Family(1, planar=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    "tpu7x": _Family(2, max_cubes=144, single_chip=True),
    "tpu7": _Family(2, max_cubes=4, single_chip=True),
}
# Names people use that xpk spells differently.
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "v7x": "tpu7x"}
_SMALL_3D = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
_EXAMPLES = "e.g. v5p-128, v6e-256, v5litepod-16, v5p-4x4x4"


def _topology_ok(family: _Family, dims: tuple[int, ...]) -> bool:
  if family.planar:
    return "x".join(map(str, dims)) in family.planar
  if len(dims) != 3:
    return False
  if dims in _SMALL_3D or (family.single_chip and dims == (1, 1, 1)):
    return True
  if not all(4 <= d <= 256 and d % 4 == 0 for d in dims):
    return False
  if not family.any_order and list(dims) != sorted(dims):
    return False
  a, b, c = (d // 4 for d in dims)
  return a * b * c <= family.max_cubes


@functools.lru_cache(maxsize=None)
def tpu_sizes(family_name: str) -> tuple[int, ...]:
  """The N of every FAMILY-N that xpk accepts, ascending."""
  family = _FAMILIES[family_name]
  if family.planar:
    chips = {int(a) * int(b) for a, b in (t.split("x") for t in family.planar)}
  else:
    chips = {a * b * c for a, b, c in _SMALL_3D} | ({1} if family.single_chip else set())
    # A slice of n cubes exists when n = p*q*r with each side at most 256 / 4 = 64 cubes.
    chips |= {64 * n for n in range(1, family.max_cubes + 1)
              if any(n % (p * q) == 0 and n // (p * q) <= 64
                     for p in range(1, 65) for q in range(1, 65))}
  return tuple(sorted(c * family.cores_per_chip for c in chips))


def check_tpu_type(value: str) -> None:
  """Raises LaunchError unless xpk accepts `value` as a --tpu-type."""
  flag = f"--tpu_type={value}"
  known = ", ".join(_FAMILIES)
  m = re.fullmatch(r"([a-z0-9]+)-(\d+(?:x\d+){0,2})", value)
  if not m:
    raise LaunchError(f"{flag}: expected FAMILY-N or FAMILY-TOPOLOGY with FAMILY one of "
                      f"{known} ({_EXAMPLES})")
  name, size = m.groups()
  if name in _ALIASES:
    real = f"{_ALIASES[name]}-{size}"
    try:
      check_tpu_type(real)
    except LaunchError as e:
      raise LaunchError(f"{flag}: xpk calls {name} '{_ALIASES[name]}'; {e}") from None
    raise LaunchError(f"{flag}: xpk calls {name} '{_ALIASES[name]}'; allowed: "
                      f"--tpu_type={real}")
  if name not in _FAMILIES:
    raise LaunchError(f"{flag}: unknown TPU family '{name}'; allowed: {known} ({_EXAMPLES})")
  family = _FAMILIES[name]
  if "x" in size:
    if not _topology_ok(family, tuple(int(d) for d in size.split("x"))):
      shapes = ("one of " + ", ".join(family.planar) if family.planar else
                "AxBxC from 2x2x1, 2x2x2, 2x2x4, 2x4x4 or whole 4x4x4 cubes (sides multiples "
                f"of 4{'' if family.any_order else ', non-decreasing'}, at most "
                f"{family.max_cubes} cubes)")
      raise LaunchError(f"{flag}: not a {name} topology xpk {XPK_VERSION} knows; allowed: "
                        f"{name}-TOPOLOGY with TOPOLOGY {shapes}")
    return
  sizes = tpu_sizes(name)
  n = int(size)
  if n in sizes:
    return
  unit = "TensorCores, 2 per chip" if family.cores_per_chip == 2 else "chips"
  i = bisect.bisect(sizes, n)
  nearest = " or ".join(f"{name}-{s}" for s in sizes[max(i - 1, 0):i + 1])
  listed = ", ".join(map(str, sizes[:8])) + (f", ... {sizes[-1]}" if len(sizes) > 8 else "")
  raise LaunchError(f"{flag}: not a {name} size xpk {XPK_VERSION} knows; allowed: {name}-N "
                    f"with N ({unit}) in {listed}; nearest: {nearest}")


# ---------------------------------------------------------------------------------------------
# Names: xpk's rule for --workload (xpk/parser/validators.py name_type), which its cluster
# commands apply to --cluster too (and GKE to cluster names): at most 40 characters, lowercase
# letters, digits and '-', starting with a letter and ending with a letter or digit. The
# JobSet, its pods and its Kubernetes labels are named after the workload.
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_NAME_MAX = 40


def check_name(flag: str, value: str) -> None:
  if _NAME.fullmatch(value) and len(value) <= _NAME_MAX:
    return
  fixed = re.sub(r"[^a-z0-9]+", "-", value.lower()).strip("-")
  fixed = re.sub(r"^[^a-z]+", "", fixed)[:_NAME_MAX].rstrip("-")
  hint = f", e.g. {fixed}" if fixed else ""
  raise LaunchError(f"--{flag}={value}: allowed: 1-{_NAME_MAX} lowercase letters, digits and "
                    f"'-', starting with a letter and ending with a letter or digit{hint}")


# ---------------------------------------------------------------------------------------------
# Flags.

_OVERRIDE = re.compile(r"--config\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)=(.*)", re.DOTALL)
# The xpk flags this launcher sets itself: passing them after `--` too would leave xpk to pick
# one of the two silently (argparse keeps the last).
_OWN_XPK_FLAGS = ("--cluster", "--project", "--zone", "--workload", "--tpu-type",
                  "--device-type", "--num-slices", "--docker-image", "--base-docker-image",
                  "--script-dir", "--command", "--dry-run", "--no-dry-run")


class _Parser(argparse.ArgumentParser):
  """argparse, except that an error is a LaunchError (one line, no usage block)."""

  def error(self, message):
    raise LaunchError(message)


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python launch/xpk.py", allow_abbrev=False,
              description="Build (print), dry-run or run the xpk command that trains jaxgrpo "
              "on TPU slices. Config overrides: --config.KEY=VALUE (as for jaxgrpo.train). "
              "Flags after a bare -- go to xpk unchanged.")

  def flag(name, **kw):
    # Accept xpk's dashed spelling too: commands get pasted between the two tools.
    names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    p.add_argument(*names, dest=name, **kw)

  flag("cluster", required=True, help="GKE cluster name (xpk cluster create --cluster)")
  flag("project", required=True, help="Google Cloud project")
  flag("zone", required=True, help="zone of the cluster, e.g. us-east5-a")
  flag("workload", required=True, help="workload (JobSet) name, at most 40 characters")
  flag("tpu_type", required=True, help=f"TPU slice type, {_EXAMPLES}")
  flag("num_slices", type=int, default=1, help="number of slices (default 1)")
  flag("config", required=True,
       help="run config, a repo-relative path with an optional :ARG, e.g. configs/math.py")
  flag("workdir", required=True,
       help="--workdir of jaxgrpo.train: where the run writes; it must outlive the pods "
       "and be the same for every host (e.g. a bucket mounted with xpk storage attach)")
  image = p.add_mutually_exclusive_group(required=True)
  image.add_argument("--docker_image", "--docker-image", dest="docker_image",
                     help="image built from launch/Dockerfile, used as is")
  image.add_argument("--base_docker_image", "--base-docker-image", dest="base_docker_image",
                     help="image built from launch/Dockerfile; xpk adds this working tree "
                     "to /app on top, so code edits need no rebuild")
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                    help="run xpk's own dry run (offline, TELEMETRY_ENABLED=false)")
  mode.add_argument("--run", dest="run", action="store_true", help="submit the workload")
  return p


def _check_config(value: str) -> str:
  """The --config value as the workload will see it: repo-relative, checked to exist."""
  path, sep, arg = value.partition(":")
  if not path:
    raise LaunchError(f"--config={value}: allowed: a config file such as configs/math.py")
  if os.path.isabs(path):
    rel = os.path.relpath(path, REPO_ROOT)
    if rel.startswith(os.pardir):
      return value  # a path inside the image: nothing here to check it against
    path = rel
  if not os.path.isfile(os.path.join(REPO_ROOT, path)):
    raise LaunchError(f"--config={value}: no such file in the repository (the workload runs "
                      f"from a copy of it); allowed: a repo-relative path, e.g. configs/math.py")
  return path + sep + arg


def parse_args(argv: list[str]) -> argparse.Namespace:
  """Parses and checks the launcher's flags (argv without the program name).

  Raises LaunchError, one line, on anything xpk or the workload would reject.
  """
  argv = list(argv)
  xpk_extra = []
  if "--" in argv:
    i = argv.index("--")
    argv, xpk_extra = argv[:i], argv[i + 1:]
  # Overrides are taken out before argparse sees them: they keep their order (a later one
  # wins in config_flags too) and argparse never guesses what they are.
  overrides = []
  for a in argv:
    if a.startswith("--config."):
      m = _OVERRIDE.fullmatch(a)
      if not m:
        raise LaunchError(f"{a}: write a config override as one token, --config.KEY=VALUE")
      overrides.append((m.group(1), m.group(2)))
  args, rest = _parser().parse_known_args([a for a in argv if not a.startswith("--config.")])
  if rest:
    raise LaunchError(f"unknown argument {rest[0]}; allowed: this launcher's flags (--help), "
                      "--config.KEY=VALUE overrides, and xpk flags after a bare --")
  args.overrides = overrides
  for a in xpk_extra:
    if a.split("=", 1)[0] in _OWN_XPK_FLAGS:
      raise LaunchError(f"{a} after --: this launcher sets it; use its own flag (--help)")
  args.xpk_extra = xpk_extra
  check_name("cluster", args.cluster)
  check_name("workload", args.workload)
  check_tpu_type(args.tpu_type)
  if args.num_slices < 1:
    raise LaunchError(f"--num_slices={args.num_slices}: allowed: an integer >= 1")
  for name in ("project", "zone", "workdir", "docker_image", "base_docker_image"):
    value = getattr(args, name)
    if value is not None and not value.strip():
      raise LaunchError(f"--{name} is empty; allowed: a non-empty value")
  args.config = _check_config(args.config)
  # Several slices: the mesh puts them on its outer data axis (mesh.dcn_data, see
  # jaxgrpo/model/sharding.py), so the config must agree with the slice count; train_command sets
  # it when no override does (as launch/compile_check.py does).
  dcn = [v for k, v in overrides if k == "mesh.dcn_data"]
  if dcn and dcn[-1].strip() != str(args.num_slices):
    raise LaunchError(f"--config.mesh.dcn_data={dcn[-1]}: the workload has "
                      f"--num_slices={args.num_slices} slice(s); allowed: {args.num_slices}")
  return args


# ---------------------------------------------------------------------------------------------
# Commands.


def train_command(args: argparse.Namespace) -> list[str]:
  """The argv every host of the workload runs (from /app, the image's copy of the repo)."""
  overrides = list(args.overrides)
  if args.num_slices > 1 and all(k != "mesh.dcn_data" for k, _ in overrides):
    overrides.insert(0, ("mesh.dcn_data", str(args.num_slices)))
  return (["python", "-m", "jaxgrpo.train", f"--config={args.config}"]
          + [f"--config.{k}={v}" for k, v in overrides]
          + [f"--workdir={args.workdir}"])


def build_command(args: argparse.Namespace) -> list[str]:
  """The `xpk workload create` argv for checked `args` (from parse_args); no side effects.

  `--flag=value` throughout, so no value can be mistaken for a flag by xpk's parser.
  """
  cmd = ["xpk", "workload", "create",
         f"--cluster={args.cluster}", f"--project={args.project}", f"--zone={args.zone}",
         f"--workload={args.workload}", f"--tpu-type={args.tpu_type}",
         f"--num-slices={args.num_slices}"]
  if args.docker_image is not None:
    cmd.append(f"--docker-image={args.docker_image}")
  else:
    # xpk layers --script-dir onto the base image at /app (its working directory there).
    cmd += [f"--base-docker-image={args.base_docker_image}", f"--script-dir={REPO_ROOT}"]
  # Quoted once here; xpk pastes the string into the bash script each container runs.
  cmd.append(f"--command={shlex.join(train_command(args))}")
  cmd += args.xpk_extra
  if args.dry_run:
    cmd.append("--dry-run")
  return cmd


def find_xpk() -> str | None:
  """The xpk executable: $XPK, else the one beside this Python (same venv), else PATH."""
  if os.environ.get("XPK"):
    return os.environ["XPK"]
  beside = os.path.join(os.path.dirname(sys.executable), "xpk")
  if os.access(beside, os.X_OK):
    return beside
  return shutil.which("xpk")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    args = parse_args(argv)
  except LaunchError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  cmd = build_command(args)
  # xpk's dry run talks to nobody, and its usage telemetry would be the one network call.
  env_prefix = {"TELEMETRY_ENABLED": "false"} if args.dry_run else {}
  print(shlex.join([f"{k}={v}" for k, v in env_prefix.items()] + cmd), flush=True)
  if not (args.dry_run or args.run):
    return 0
  xpk = find_xpk()
  if xpk is None or not os.access(xpk, os.X_OK):
    print(f"error: no xpk executable (looked at $XPK, beside {sys.executable}, PATH); "
          f"allowed: pip install xpk=={XPK_VERSION}, or XPK=/path/to/xpk", file=sys.stderr)
    return 2
  try:
    return subprocess.run([xpk] + cmd[1:], env=dict(os.environ, **env_prefix),
                          check=False).returncode
  except KeyboardInterrupt:  # xpk got the Ctrl-C too and reports for itself
    return 130


if __name__ == "__main__":
  sys.exit(main())

"""What README.md and docs/ print runs as written (issue 60).

Every command the documentation prints (in a code block or a code span) is extracted and
checked the way the program it names would check it, up to the point where it would need
devices, weights or a run folder: a training, evaluation, compile-check or xpk command's
config is parsed from its flags and validated for the device count it names (a topology's
chips, a TPU type's, the processes of a rehearsal, else one), and a Hugging Face folder
named as /path/to/<model>, /models/<model> or /gcs/models/<model> is stood in for by that model's config.json
(tests/fixtures/arch/<model>.json) and a fixture tokenizer, so its architecture is checked
against the mesh too. A benchmark command's arguments are parsed by its own parser. So a
documented command cannot fail on a config rule, as the 32k command once did
(`val_batch_size=8: allowed: a multiple of 16`).
"""

import contextlib
import glob
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import sys

import pytest

from jaxgrpo import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "launch/README.md", *sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
ARCH = os.path.join(ROOT, "tests", "fixtures", "arch")
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2")
PROGRAMS = ("python -m jaxgrpo.", "python launch/")
# Names a command uses for "yours": a folder the reader has; a cluster, project or zone
# (xpk's flags) in capitals.
PLACEHOLDER_MODEL = re.compile(r"^(?:/path/to|/models|/gcs/models)/([^/]+)$")
PLACEHOLDER_NAME = re.compile(r"^(--(?:cluster|project|zone)=)([A-Z]+)$")



def _import(name: str, path: str):
  """A launch/ script as a module (registered: its dataclasses look themselves up)."""
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


def _compile_check():
  return _import("compile_check", os.path.join(ROOT, "launch", "compile_check.py"))


def _ansi_c(text: str) -> str:
  """bash's $'...' quoting, as the shell hands it to the program (shlex does not know it)."""
  return re.sub(r"\$'((?:[^'\\]|\\.)*)'",
                lambda m: shlex.quote(m.group(1).encode().decode("unicode_escape")), text)


def documented_commands():
  """(file:line, argv) for every jaxgrpo or launch command the docs print, whole (its
  continuation lines joined); a command with an elided part ('...') is left out."""
  out = []
  for doc in DOCS:
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().splitlines()
    in_block = False
    i = 0
    while i < len(lines):
      line = lines[i]
      start = i
      if line.lstrip().startswith("```"):
        in_block = not in_block
        i += 1
        continue
      texts = []
      if in_block or line.startswith("    "):  # fenced or indented code: whole lines
        text = line
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
          i += 1
          text = text.rstrip()[:-1] + " " + lines[i].strip()
        texts.append(text.split(" #")[0])
      else:  # code spans in prose
        texts += re.findall(r"`([^`]+)`", line)
      i += 1
      for text in texts:
        for part in re.split(r"&&|;|\|", text):
          part = part.strip()
          if part.startswith("for ") or part.startswith("do "):
            part = part.split(" ", 1)[1] if part.startswith("do ") else ""
          if not part.startswith(PROGRAMS) or "..." in part or "<" in part:
            continue
          argv = shlex.split(_ansi_c(part.replace("$HOME", "/home/user")))
          argv = [a for a in argv if a != "&"]
          if len(argv) > 3:  # else a program named in prose, without arguments
            out.append((f"{doc}:{start + 1}", argv))
  return out


def _stand_in(argv, tmp_path):
  """argv with each /path/to/<model> replaced by a folder holding that model's config.json
  and a fixture tokenizer (the compile check reads no weights either)."""
  out = []
  for arg in argv:
    arg = PLACEHOLDER_NAME.sub(lambda m: m.group(1) + m.group(2).lower(), arg)
    flag, eq, value = arg.partition("=")
    m = PLACEHOLDER_MODEL.match(value) if eq else None
    if m:
      arch = os.path.join(ARCH, m.group(1) + ".json")
      assert os.path.exists(arch), (
          f"a documented command names {value}: add its config.json as {arch}")
      folder = tmp_path / m.group(1)
      if not folder.exists():
        shutil.copytree(TOKENIZER, folder, ignore=shutil.ignore_patterns(
            "*.safetensors", "*.npz", "reference.json", "legacy_config.json"))
        shutil.copy(arch, folder / "config.json")
      arg = f"{flag}={folder}"
    out.append(arg)
  return out


def _chips(topology: str) -> int:
  """v5p:4x4x4 -> 64 (one device a chip on every generation the docs name)."""
  dims = topology.split(":")[1].split("x")
  n = 1
  for d in dims:
    n *= int(d)
  return n


def _flag(argv, name, default=None):
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      return a.split("=", 1)[1]
    if a == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return default


def _check_train_argv(argv, devices, program="jaxgrpo.train"):
  """Parses argv as the training (or evaluation) command does and validates the config
  for `devices` devices, with a Hugging Face architecture checked against it."""
  from jaxgrpo.run import setup  # pylint: disable=g-import-not-at-top
  rehearsal = ("--coordinator_address", "--num_processes", "--process_id")
  argv = [a for a in argv if not a.startswith(rehearsal)]
  if program == "jaxgrpo.evaluate":
    from jaxgrpo.run import evaluator  # pylint: disable=g-import-not-at-top
    _, argv = evaluator._parse_args([program, *argv])  # pylint: disable=protected-access
    argv = argv[1:] if argv and not argv[0].startswith("--") else argv
  try:
    config = setup.validate(setup.parse_config([program, *argv]), devices)
  finally:  # config_flags defines a flag per override; the next command defines its own
    from absl import flags  # pylint: disable=g-import-not-at-top
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
      delattr(flags.FLAGS, name)
  _compile_check()._architecture(config)  # pylint: disable=protected-access
  return config


COMMANDS = documented_commands()


def test_the_docs_print_the_commands_this_test_checks():
  """The extraction finds what it should (so the checks below are not vacuous): the README's
  main command, the 32k compile check, an xpk launch, a benchmark."""
  text = [" ".join(argv) for _, argv in COMMANDS]
  assert "python -m jaxgrpo.train --config=configs/math.py" in text
  assert any("compile_check.py" in t and "max_new_tokens=32768" in t for t in text)
  assert any(t.startswith("python launch/xpk.py") for t in text)
  assert any(t.startswith("python -m jaxgrpo.bench long-tail") for t in text)
  assert len(COMMANDS) > 25


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_passes_its_config_checks(where, argv, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  argv = _stand_in(argv, tmp_path)
  if "--config.generation.backend=jetstream" in argv:  # an extra this venv need not have
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: True if name == "jetstream" else find_spec(name, *a))
  if argv[:2] == ["python", "-m"]:
    program, args = argv[2], argv[3:]
  else:
    program, args = argv[1], argv[2:]
  try:
    if program in ("jaxgrpo.train", "jaxgrpo.evaluate"):
      devices = int(_flag(args, "num_processes", 1))
      _check_train_argv(args, devices, program)
    elif program == "launch/compile_check.py":
      check = _compile_check()
      try:
        config = check._parse([program, *args])  # pylint: disable=protected-access
      finally:  # its own flags: the overrides' flags as above
        for name in [n for n in check._FV if n.startswith("config.")]:  # pylint: disable=protected-access
          delattr(check._FV, name)  # pylint: disable=protected-access
      slices = int(_flag(args, "num_slices", 1))
      topology = _flag(args, "topology")
      config = check._validate(config, _chips(topology) * slices, slices)  # pylint: disable=protected-access
      check._architecture(config)  # pylint: disable=protected-access
    elif program == "launch/xpk.py":
      xpk = _import("xpk", os.path.join(ROOT, "launch", "xpk.py"))
      parsed = xpk.parse_args(args)
      family, size = parsed.tpu_type.rsplit("-", 1)
      family = xpk._ALIASES.get(family, family)  # pylint: disable=protected-access
      chips = int(size) // xpk._FAMILIES[family].cores_per_chip  # pylint: disable=protected-access
      train = xpk.train_command(parsed)
      _check_train_argv(train[3:], chips * parsed.num_slices)
    elif program == "jaxgrpo.bench":
      from jaxgrpo.bench import cli  # pylint: disable=g-import-not-at-top
      with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
          cli.build_parser().parse_args(args)
        except SystemExit:
          pytest.fail(f"{where}: {' '.join(argv)}: {err.getvalue().strip()}")
    elif program in ("jaxgrpo.export", "jaxgrpo.serve", "jaxgrpo.plot"):
      pass  # they read a run folder the reader made; their flags are tested in their files
    else:
      pytest.fail(f"{where}: {' '.join(argv)}: a command this test does not know how to check")
  except config_lib.ConfigError as e:
    pytest.fail(f"{where}: {' '.join(argv)}: {e}")


@pytest.mark.parametrize("topology", sorted({
    t for doc in DOCS for t in re.findall(r"\b(v[4-6][a-z]*:\d+x\d+(?:x\d+)?)\b",
                                          open(os.path.join(ROOT, doc)).read())}))
def test_the_long_preset_validates_on_every_topology_the_docs_name(topology, tmp_path):
  """The long preset's batches divide the mesh on every topology the docs name (its
  validation batch is 'auto', chosen from sizes that divide it)."""
  folder = _stand_in(["--m=/path/to/Qwen2.5-7B-Instruct"], tmp_path)[0].split("=", 1)[1]
  config = _check_train_argv(["--config=configs/gsm8k.py:long",
                              f"--config.model.hf_checkpoint={folder}"], _chips(topology))
  assert config.grpo.val_batch_size == "auto"


@pytest.mark.parametrize("doc", ["docs/huggingface.md", "docs/python.md"])
def test_the_docs_name_every_architecture_the_loader_reads(doc):
  """Issue 60: docs/python.md and Policy.from_pretrained listed Qwen2, Qwen3 and Llama only,
  long after Qwen3-MoE and Gemma 3 loaded. The list is the loader's own."""
  from jaxgrpo.model import hf  # pylint: disable=g-import-not-at-top
  text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
  missing = [arch for arch in hf.ARCHITECTURES if arch not in text]
  assert not missing, f"{doc} does not name {missing}"

"""The package's shape: no import cycle between its modules, counting the imports made inside
functions too (a lazy import is still a dependency), and names used across modules public."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxgrpo")


def _modules() -> dict[str, str]:
  """module name -> path, for every .py file under jaxgrpo/."""
  out = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return out


def _imports(path: str, modules) -> set[str]:
  """The package's modules that `path` imports anywhere in it. `from pkg import sub` depends
  on the submodule `pkg.sub`, `from mod import name` on `mod`."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
      out |= subs or {node.module}
  return out & set(modules)


def _cycles(graph) -> list[list[str]]:
  found, state = [], {}

  def visit(m, stack):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        found.append(stack[stack.index(n):] + [n])
      elif n not in state:
        visit(n, stack)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [])
  return found


def test_the_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_no_import_cycle_in_the_package():
  # evaluate.py and evaluator.py imported each other (the file names and per-prompt metric
  # names lived in the command); jaxgrpo/bench/cli.py imported its own package for a docstring.
  modules = _modules()
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  assert _cycles(graph) == []


def test_no_private_name_is_used_across_modules():
  # train._load_policy was called from six modules under lint disables; it is now
  # loading.load_policy. A leading underscore means "this module's own".
  modules = _modules()
  aliases_of = {}
  offenders = []
  for module, path in modules.items():
    tree = ast.parse(open(path).read())
    names = {}  # local name -> package module it refers to
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        for a in node.names:
          target = f"{node.module}.{a.name}"
          if target in modules:
            names[a.asname or a.name] = target
          elif node.module in modules and a.name.startswith("_") and not a.name.startswith("__"):
            offenders.append(f"{module}: from {node.module} import {a.name}")
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.name in modules and a.asname:
            names[a.asname] = a.name
    aliases_of[module] = names
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in names and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        offenders.append(f"{module}: {names[node.value.id]}.{node.attr}")
  assert offenders == []


# The package's layers, lowest first: a module imports its own layer and those below, never
# one above. "" is the top level's data path (config, data, rewards, scorer, envs, tools,
# episodes, plugins); eval/ measures with it (its stop rule reads the rewards); run/ assembles a run from everything below it; "commands" are the
# top-level modules `python -m jaxgrpo.<name>` runs, thin mains over run/; bench/ measures.
LAYERS = ("runtime", "model", "rollout", "algo", "", "eval", "run", "commands", "bench")
COMMANDS = ("train", "evaluate", "export", "serve", "plot")


def _layer(module: str) -> str:
  parts = module.split(".")
  if len(parts) == 2 and parts[1] in COMMANDS:
    return "commands"
  return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else ""


def _upward(graph) -> list[str]:
  return sorted(f"{m} -> {n}" for m, deps in graph.items() for n in deps
                if LAYERS.index(_layer(n)) > LAYERS.index(_layer(m)))


def test_the_upward_finder_finds_an_upward_import():
  graph = {"jaxgrpo.model.decoder": {"jaxgrpo.runtime.faults", "jaxgrpo.rewards"},
           "jaxgrpo.run.trainer": {"jaxgrpo.eval.validation"},
           "jaxgrpo.run.setup": {"jaxgrpo.train"}}
  assert _upward(graph) == ["jaxgrpo.model.decoder -> jaxgrpo.rewards",
                            "jaxgrpo.run.setup -> jaxgrpo.train"]


def _script_imports() -> dict[str, set[str]]:
  """The package modules each file of jaxgrpo/, bench/, launch/ and scripts/ imports."""
  modules, top = _modules(), os.path.dirname(ROOT)
  out = {}
  for root in ("jaxgrpo", "bench", "launch", "scripts"):
    for folder, _, files in os.walk(os.path.join(top, root)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          out[os.path.relpath(path, top)] = _imports(path, modules)
  return out


def test_no_library_module_bench_or_script_imports_a_command():
  # evaluate.py, launch/compile_check.py and four benches imported the `train` command for
  # its Setup, prepare and flag parsing; those live in run/setup.py now. A command imports
  # no other command either: what two share is a library's.
  commands = {f"jaxgrpo.{c}" for c in COMMANDS}
  offenders = sorted(f"{path} -> {m}" for path, deps in _script_imports().items()
                     for m in deps & commands)
  assert offenders == []


def test_no_module_imports_from_a_layer_above_it():
  # eval/validation and eval/voting imported rewards (the top level) for the correctness
  # reward and its extractor; they are now handed a scorer.Scorer.
  modules = _modules()
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  assert set(map(_layer, modules)) == set(LAYERS)  # every folder is a known layer
  assert _upward(graph) == []


def _architecture_tree() -> dict[str, set[str]]:
  """docs/architecture.md's package tree: folder ("" for the top level) -> the .py files it
  names under it, read by indentation."""
  text = open(os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")).read()
  block = next(b for b in text.split("```")[1::2] if b.lstrip().startswith("jaxgrpo/"))
  tree, folder = {"": set()}, ""
  for line in block.splitlines()[1:]:
    name = line.split()[0] if line.strip() else ""
    if line.startswith("  ") and not line.startswith("    "):
      folder = name[:-1] if name.endswith("/") else ""
      tree.setdefault(folder, set())
      if name.endswith(".py"):
        tree[""].add(name)
    elif line.startswith("    ") and name.endswith(".py"):
      tree[folder].add(name)
  return tree


def test_the_architecture_page_names_every_module_where_it_lives():
  tree = _architecture_tree()
  on_disk = {}
  for module, path in _modules().items():
    if os.path.basename(path) in ("__init__.py", "__main__.py"):
      continue
    folder = module.split(".")[1] if module.count(".") > 1 else ""
    on_disk.setdefault(folder, set()).add(os.path.basename(path))
  assert tree == on_disk


def test_every_import_of_the_package_names_a_module_that_exists():
  # An import left pointing at a module that moved (jaxgrpo.engine.* after the folders)
  # fails only when it runs: the JetStream paths run only with that extra installed.
  modules = _modules()
  roots = [ROOT, os.path.join(os.path.dirname(ROOT), "tests"),
           os.path.join(os.path.dirname(ROOT), "bench"),
           os.path.join(os.path.dirname(ROOT), "launch")]
  stale = []
  for root in roots:
    for folder, _, files in os.walk(root):
      for name in files:
        if not name.endswith(".py"):
          continue
        path = os.path.join(folder, name)
        for node in ast.walk(ast.parse(open(path).read())):
          if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "jaxgrpo" and node.module not in modules:
              stale.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}: {node.module}")
          elif isinstance(node, ast.Import):
            stale += [f"{os.path.relpath(path, os.path.dirname(ROOT))}: {a.name}"
                      for a in node.names
                      if a.name.split(".")[0] == "jaxgrpo" and a.name not in modules]
  assert stale == []


def test_config_imports_no_subsystem():
  # config.py imported rewards, plugins, trackers, and inside functions eval/validation,
  # sharding, lora and envs, to check their keys. Each registers its own checks now
  # (runtime/config_checks.py); config.py reads the loss options' names (jax-free) and the
  # registry, nothing else of the package.
  modules = _modules()
  deps = _imports(os.path.join(ROOT, "config.py"), modules)
  assert deps == {"jaxgrpo.algo.options", "jaxgrpo.runtime.config_checks"}


def test_every_module_that_registers_config_checks_is_imported_before_validating():
  # A registering module that run/setup.py's CHECKING_MODULES misses would have its checks
  # skipped whenever nothing else imported it first.
  from jaxgrpo.run import setup  # pylint: disable=g-import-not-at-top
  registering = sorted(
      m for m, p in _modules().items() if "@config_checks.register" in open(p).read())
  assert sorted(setup.CHECKING_MODULES) == [
      m for m in registering if m not in ("jaxgrpo.config", "jaxgrpo.runtime.config_checks")]


# run/ and the rollout seam: functions a reader can hold in view. Exceptions: none.
LONG_FUNCTION_EXCEPTIONS = {}


def test_no_function_over_80_lines_in_run():
  # The episode driver is in run/ (issue 61: its Runner.run was 163 lines at the top level).
  assert "jaxgrpo.run.episodes" in _modules() and "jaxgrpo.episodes" not in _modules()
  long = []
  for module, path in _modules().items():
    if not module.startswith("jaxgrpo.run."):
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > 80 and f"{module}.{node.name}" not in LONG_FUNCTION_EXCEPTIONS:
          long.append(f"{module}.{node.name}: {lines} lines")
  assert long == []


def test_no_ambient_state_reaches_the_model():
  """Issue 61: the meshes reached the model through three ContextVars (the activations' pin
  mesh, a sampler's expert mesh, packed rows' sequence split), set around each trace, so a
  new engine that forgot the context silently lost expert parallelism. They are module
  attributes and arguments now; nothing in model/ holds a ContextVar or enters flax's
  ambient logical-rules context."""
  offenders = []
  for module, path in _modules().items():
    if not module.startswith("jaxgrpo.model."):
      continue
    text = open(path).read()
    for needle in ("ContextVar", "contextvars", "logical_axis_rules"):
      if needle in text:
        offenders.append(f"{module}: {needle}")
  assert offenders == []


def test_model_dependent_checks_are_registered_beside_their_code():
  """Issue 61: the checks that need the loaded model were hand-written in run/setup.py, a
  second system beside config_checks. They register with config_checks.register_model in
  the module whose code they protect; no run/ module checks a model_cfg by hand."""
  offenders = []
  for module, path in _modules().items():
    if not module.startswith("jaxgrpo.run."):
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      args = [a.arg for a in node.args.args] if isinstance(node, ast.FunctionDef) else []
      if (args and node.name.startswith("_check") and "model_cfg" in args
          and {"config", "c"} & set(args)):  # a config against the model
        offenders.append(f"{module}.{node.name}")
  assert offenders == []
  from jaxgrpo.run import setup  # pylint: disable=g-import-not-at-top
  from jaxgrpo.runtime import config_checks  # pylint: disable=g-import-not-at-top
  setup.register_checks()
  owners = {name.rsplit(".", 1)[0] for _, name, _ in config_checks._MODEL_CHECKS}  # pylint: disable=protected-access
  assert owners == {"jaxgrpo.model.lora", "jaxgrpo.model.attention", "jaxgrpo.model.moe",
                    "jaxgrpo.model.sharding"}


def test_attention_is_dispatched_in_attention_py_only():
  """Issue 61: splash / xla / cudnn were told apart in two files (decoder.Attention chose
  splash or the einsum masks itself). Only model/attention.py compares an implementation's
  name now; the model passes the resolved name through."""
  offenders = []
  for module, path in _modules().items():
    if module == "jaxgrpo.model.attention":
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.Compare) and all(
          isinstance(o, (ast.Eq, ast.NotEq)) for o in node.ops) and any(
              isinstance(c, ast.Constant) and c.value in ("splash", "cudnn")
              for c in [node.left, *node.comparators]):
        offenders.append(f"{module}:{node.lineno}")
  assert offenders == []


def test_the_trainer_never_asks_which_rollout_kind_it_runs():
  """Issue 61: the trainer probed its engine and source (getattr engine.partial, hasattr
  carry/carry_like, getattr pulls_batches, source.runner) to tell the kinds apart. Every
  source is a rollouts.Source with defaults; build.rollouts chooses it."""
  text = open(os.path.join(ROOT, "run", "trainer.py")).read()
  for probe in ("getattr(", "hasattr(", ".partial", "partial_rollouts.", ".runner.metrics",
                "for_training"):
    assert probe not in text, probe
  from jaxgrpo.run import partial_rollouts, rollouts  # pylint: disable=g-import-not-at-top
  for kind in (rollouts.SingleTurn, rollouts.DynamicSampling, rollouts.EpisodeRollouts,
               partial_rollouts.PartialRollouts):
    assert issubclass(kind, rollouts.Source), kind


def test_sizing_and_the_compile_check_ask_the_engine_for_its_programs():
  """Issue 61: run/sizing.py rebuilt each engine's programs by switching on engine.partial
  and engine.episodes. Each engine describes its own (`programs`); nothing in run/ or the
  launch scripts asks an engine which kind it is."""
  launch = os.path.join(os.path.dirname(ROOT), "launch")
  paths = [p for m, p in _modules().items() if m.startswith("jaxgrpo.run.")]
  paths += [os.path.join(launch, n) for n in os.listdir(launch) if n.endswith(".py")]
  offenders = [p for p in paths for probe in ("engine.partial", "engine.episodes")
               if probe in open(p).read()]
  assert offenders == []
  from jaxgrpo.rollout import partial, sampling, turns  # pylint: disable=g-import-not-at-top
  for engine in (sampling.RolloutEngine, partial.PartialEngine, turns.EpisodeEngine):
    assert "programs" in vars(engine), engine


def test_every_model_family_lives_in_its_module_and_registers_through_the_seam():
  """Issue 61: a family's keys, class, tensor names and config read/write were spread over
  model/hf.py (SUPPORTED, per-architecture ifs) and run/artifacts.py (hf_architecture,
  _gemma3_keys); Gemma 3 touched 13 package files. Each family is now one module under
  model/families/ that registers a base.Family, imported by families/__init__.py; nothing
  outside families/ names a transformers architecture in code."""
  from jaxgrpo.model import families, hf  # pylint: disable=g-import-not-at-top
  import importlib  # pylint: disable=g-import-not-at-top
  folder = os.path.join(ROOT, "model", "families")
  names = sorted(n[:-3] for n in os.listdir(folder)
                 if n.endswith(".py") and n not in ("__init__.py", "base.py"))
  registered = [importlib.import_module(f"jaxgrpo.model.families.{n}").FAMILY for n in names]
  assert sorted(f.architecture for f in registered) == sorted(families.FAMILIES)
  assert all(families.FAMILIES[f.architecture] is f for f in registered)
  assert hf.ARCHITECTURES == families.architectures()
  offenders = []
  for module, path in _modules().items():
    if module.startswith("jaxgrpo.model.families"):
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      if (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and ("ForCausalLM" in node.value or "ForConditionalGeneration" in node.value)):
        offenders.append(f"{module}:{node.lineno}: {node.value[:40]!r}")
  assert offenders == []


# The config keys that say how a run samples (build.Kind): read in branches by build.kind_of
# only, outside the config checks that keep the kinds apart.
_KIND_KEYS = ("max_tokens_per_step", "backend", "dynamic_sampling")


def _kind_branches(path: str) -> list[str]:
  """`file:line` of each if / elif / ternary / while in `path` whose test reads a rollout
  kind key of the config (_KIND_KEYS, env.name), outside functions named _check* and
  build.kind_of."""
  found = []

  def reads_kind(expr) -> bool:
    return any(isinstance(n, ast.Attribute) and (
        n.attr in _KIND_KEYS or (n.attr == "name" and isinstance(n.value, ast.Attribute)
                                 and n.value.attr == "env")) for n in ast.walk(expr))

  def visit(node, skip):
    for child in ast.iter_child_nodes(node):
      inner = skip or (isinstance(child, ast.FunctionDef)
                       and (child.name.startswith("_check") or child.name == "kind_of"))
      if (isinstance(child, (ast.If, ast.IfExp, ast.While)) and not inner
          and reads_kind(child.test)):
        found.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{child.lineno}")
      visit(child, inner)

  visit(ast.parse(open(path).read()), False)
  return found


def test_the_kind_branch_finder_finds_a_branch(tmp_path):
  path = tmp_path / "m.py"
  path.write_text("def f(c):\n  if c.generation.max_tokens_per_step:\n    return 1\n"
                  "  return 2 if c.env.name else 3\n"
                  "def _check_x(c):\n  if c.generation.backend: pass\n"
                  "def kind_of(c):\n  if c.env.name: pass\n")
  assert [p.rsplit(":", 1)[1] for p in _kind_branches(str(path))] == ["2", "4"]


def test_the_rollout_kind_is_read_from_the_config_in_one_place():
  """Issue 61: "is this a partial run?" was asked 7 times from 4 signals; the engine was
  picked in build.make_engine and the source in build.training_source and
  rollouts.for_training. build.kind_of reads the kind; build.rollouts builds the engine
  and its sources from it; every other module of run/ and launch/ asks the Kind."""
  launch = os.path.join(os.path.dirname(ROOT), "launch")
  paths = [p for m, p in _modules().items() if m.startswith("jaxgrpo.run.")]
  paths += [os.path.join(launch, n) for n in os.listdir(launch) if n.endswith(".py")]
  assert [b for p in paths for b in _kind_branches(p)] == []
  from jaxgrpo.run import rollouts  # pylint: disable=g-import-not-at-top
  assert not hasattr(rollouts, "for_training") and not hasattr(rollouts, "for_validation")


def test_attention_is_resolved_once_per_engine_run_or_model():
  """Issue 61: attention was resolved three times (build.py, decoder.py, turns.py: the
  episode turn re-decided it inside each trace). A run resolves it once (build.attention)
  and passes the name; an engine made without one resolves it once when made; the
  decoder's own resolution serves library calls (model.forward, Policy) that pass none."""
  callers = []
  for module, path in _modules().items():
    tree = ast.parse(open(path).read())
    for fn in ast.walk(tree):
      if isinstance(fn, ast.FunctionDef):
        for node in ast.walk(fn):
          if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "resolve_attention"):
            callers.append(f"{module}.{fn.name}")
  assert sorted(set(callers)) == ["jaxgrpo.model.decoder.setup",
                                  "jaxgrpo.rollout.sampling.__init__",
                                  "jaxgrpo.run.build.attention"]

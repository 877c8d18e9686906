"""The house's figures (issue 61), from the source alone: python scripts/house_figures.py
[PACKAGE_DIR] prints one JSON line.

  top_level_modules   .py modules directly in jaxgrpo/ (commands included, __init__ aside)
  floors              the layers of tests/test_package.py's LAYERS that hold modules (bench
                      aside): runtime, model, rollout, algo, the top level, eval, run, commands
  modules             .py modules on those floors (__init__ and __main__ aside), per floor
  kind_branches_raw   if / elif / ternary / while tests outside bench/, config.py and the
                      config checks (_check*) that read a raw rollout-kind signal: the
                      config's max_tokens_per_step, backend, dynamic_sampling or env.name,
                      an engine's .partial / .episodes, a runner's presence, a hasattr /
                      getattr probe of an engine or source
  kind_branches_kind  the same tests that ask the Kind (run/build.kind_of) instead
  partial_walk        files that read generation.max_tokens_per_step or ask whether a run
                      or engine is partial (x.partial, getattr(x, "partial"))

Run it on a checkout of another commit (git archive REV jaxgrpo | tar -x -C DIR) to compare.
"""

import ast
import json
import os
import sys

COMMANDS = ("train", "evaluate", "export", "serve", "plot")
RAW = {"max_tokens_per_step", "backend", "dynamic_sampling", "partial", "episodes"}


def _files(root):
  for folder, _, names in os.walk(root):
    for name in sorted(names):
      if name.endswith(".py"):
        yield os.path.relpath(os.path.join(folder, name), root)


def _asks_kind(base) -> bool:
  call = getattr(base, "func", None)
  return ((isinstance(base, ast.Name) and base.id == "kind")
          or (isinstance(base, ast.Attribute) and base.attr == "kind")
          or (isinstance(base, ast.Call) and "kind_of" in (getattr(call, "attr", ""),
                                                             getattr(call, "id", ""))))


def _reads(expr) -> tuple[bool, bool]:
  """(reads a raw kind signal, asks the Kind)."""
  raw = kind = False
  for n in ast.walk(expr):
    if isinstance(n, ast.Attribute):
      if _asks_kind(n.value):
        kind = True
      elif n.attr in RAW or n.attr == "runner" or (
          n.attr == "name" and isinstance(n.value, ast.Attribute) and n.value.attr == "env"):
        raw = True
    elif isinstance(n, ast.Name) and n.id == "runner":
      raw = True
    elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
          and n.func.id in ("hasattr", "getattr") and any(
              getattr(a, "id", getattr(a, "attr", "")) in ("engine", "source") for a in n.args)):
      raw = True
  return raw, kind


def figures(root: str) -> dict:
  floors, top, branches, walk = {}, 0, {"raw": [], "kind": []}, []
  for rel in _files(root):
    name = os.path.basename(rel)
    folder = rel.split(os.sep)[0] if os.sep in rel else ""
    if not folder and name != "__init__.py":
      top += 1
    tree = ast.parse(open(os.path.join(root, rel)).read())
    if name not in ("__init__.py", "__main__.py") and folder != "bench":
      floor = folder or ("commands" if name[:-3] in COMMANDS else "top level")
      floors[floor] = floors.get(floor, 0) + 1
    if folder == "bench":
      continue
    if any((isinstance(x, ast.Attribute) and (x.attr == "max_tokens_per_step" or (
        x.attr == "partial" and getattr(x.value, "id", "") != "functools")))
           or (isinstance(x, ast.Constant) and x.value == "partial") for x in ast.walk(tree)):
      walk.append(rel)
    if rel == "config.py":
      continue

    def visit(node, skip):
      for child in ast.iter_child_nodes(node):
        inner = skip or (isinstance(child, ast.FunctionDef) and child.name.startswith("_check"))
        if isinstance(child, (ast.If, ast.IfExp, ast.While)) and not inner:
          for key, hit in zip(("raw", "kind"), _reads(child.test)):
            if hit:
              branches[key].append(f"{rel}:{child.lineno}")
        visit(child, inner)

    visit(tree, False)
  return {"top_level_modules": top, "floors": len(floors), "modules": sum(floors.values()),
          "modules_per_floor": floors,
          "kind_branches_raw": len(branches["raw"]),
          "kind_branches_raw_files": sorted({b.split(":")[0] for b in branches["raw"]}),
          "kind_branches_kind": len(branches["kind"]), "partial_walk": walk}


if __name__ == "__main__":
  here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxgrpo")
  print(json.dumps(figures(sys.argv[1] if len(sys.argv) > 1 else here)))

"""The command line of `python -m jaxgrpo.bench`: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import json
import sys

from jaxgrpo.bench import backends
from jaxgrpo.bench import common
from jaxgrpo.bench import decode_bytes
from jaxgrpo.bench import early_stop
from jaxgrpo.bench import episodes
from jaxgrpo.bench import long_tail
from jaxgrpo.bench import lora
from jaxgrpo.bench import memory
from jaxgrpo.bench import moe
from jaxgrpo.bench import packing
from jaxgrpo.bench import prefill
from jaxgrpo.bench import rewards
from jaxgrpo.bench import rollout
from jaxgrpo.bench import sampler
from jaxgrpo.bench import step
from jaxgrpo.bench import truncation
from jaxgrpo.bench import validation

SUBCOMMANDS = (sampler, rollout, truncation, validation, step, memory, early_stop, backends,
               prefill, rewards, lora, episodes, packing, long_tail, moe, decode_bytes)


def run_all(args) -> list[dict]:
  """The `all` subcommand: sampler (every mode), step and prefill for --preset, then the
  validation bench, each with its default settings."""
  parser = build_parser()
  results = []
  for argv in (["sampler", "--preset", args.preset, "--mode", "all"],
               ["step", "--preset", args.preset],
               ["prefill", "--preset", args.preset],
               ["validation"]):
    sub_args = parser.parse_args(argv)
    results.extend(sub_args.run(sub_args))
  return results


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxgrpo.bench", description=sys.modules[__package__].__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="bench", required=True)
  for module in SUBCOMMANDS:
    module.add_parsers(sub)
  a = sub.add_parser("all", help="sampler, step and prefill for --preset, then validation")
  a.add_argument("--preset", choices=sorted(common.PRESETS), default="tiny")
  a.add_argument("--out", default=None, help="also append the JSON lines to this file")
  a.set_defaults(run=run_all)
  for subparser in sub.choices.values():
    _show_defaults(subparser)
  return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
  """Every flag's help names its default (`--help` of each subcommand): a flag without help
  text gets one, where argparse's ArgumentDefaultsHelpFormatter would show nothing."""
  for action in parser._actions:  # pylint: disable=protected-access
    if (not action.option_strings or action.default in (None, argparse.SUPPRESS)
        or isinstance(action, argparse._HelpAction)):  # pylint: disable=protected-access
      continue
    if action.help is None:
      action.help = "default: %(default)s"
    elif "%(default)" not in action.help and "default" not in action.help:
      action.help += " (default: %(default)s)"


def main(argv=None) -> list[dict]:
  """Parses `argv`, runs the benchmark, prints (and optionally appends) one line per result."""
  args = build_parser().parse_args(argv)
  # Each subcommand has its own flags; a flag another subcommand lacks passes as its minimum.
  for flag, lowest in (("reps", 1), ("new_tokens", 1), ("seeds", 2), ("max_val_samples", 1),
                       ("prompts", 1), ("prompt_len", 1), ("samples", 1)):
    if getattr(args, flag, lowest) < lowest:
      raise SystemExit(f"--{flag}={getattr(args, flag)}: must be >= {lowest}")
  results = args.run(args)
  lines = [json.dumps(r) for r in results]
  for line in lines:
    print(line, flush=True)
  if args.out:
    with open(args.out, "a") as f:
      f.writelines(line + "\n" for line in lines)
  return results



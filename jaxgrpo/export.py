"""python -m jaxgrpo.export <workdir> [--step N] --out DIR

Writes a run's trained policy as a Hugging Face model folder (config.json, model.safetensors,
tokenizer files) that transformers and vLLM load. The architecture and tokenizer come from
the run's own config.json and the checkpoint it started from; a run that started from a
Hugging Face folder keeps that folder's config keys, chat template and generation config.
Without --step the newest checkpoint is exported. Bad input is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import ml_collections

from jaxgrpo import checkpoint, hf


_ARCH_KEYS = ("qkv_bias", "rope_scaling_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_max_positions")


class ExportError(ValueError):
  """A workdir or step that cannot be exported, in one line."""


def run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run folder recorded (config.json), its model keys completed."""
  config_path = os.path.join(workdir, "config.json")
  if not os.path.isfile(config_path):
    raise ExportError(f"{config_path}: missing (is {workdir} a jaxgrpo run folder?)")
  with open(config_path) as f:
    values = json.load(f)
  # Keys a run from an older version did not write: absent means "from the checkpoint".
  model = {"checkpoint": "", "hf_checkpoint": "", **{k: None for k in _ARCH_KEYS},
           **values.get("model", {})}
  return ml_collections.ConfigDict({**values, "model": model})


def run_step(workdir: str, step: int | None = None) -> tuple[str, int]:
  """(checkpoints folder, step) of a run's checkpoint `step` (default: the newest)."""
  directory = os.path.join(workdir, checkpoint.DIR_NAME)
  steps = checkpoint.step_dirs(directory)
  if not steps:
    raise ExportError(f"{directory}: no checkpoints")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ExportError(f"--step={step}: no such checkpoint in {directory}; allowed: {steps}")
  return directory, step


def load_run(workdir: str, step: int | None = None):
  """A run folder's config, model config, tokenizer and the parameters of checkpoint `step`
  (default: the newest): (config, model_cfg, tokenizer, params, step). Host arrays."""
  from jaxgrpo import train  # pylint: disable=g-import-not-at-top
  config = run_config(workdir)
  directory, step = run_step(workdir, step)
  try:
    cfg, _, tokenizer = train._load_policy(config)  # pylint: disable=protected-access
  except train.USER_ERRORS as e:
    raise ExportError(str(e)) from None
  ckpts = checkpoint.Checkpoints(directory, read_only=True)
  try:
    state, _ = ckpts.restore(step)
  finally:
    ckpts.close()
  return config, cfg, tokenizer, state["params"], step


def export(workdir: str, out: str, step: int | None = None) -> tuple[int, list[str]]:
  """Exports checkpoint `step` (default: the newest) of `workdir` to `out`."""
  config, cfg, tokenizer, params, step = load_run(workdir, step)
  source = config.model.get("hf_checkpoint") or config.model.get("checkpoint") or None
  written = hf.save_hf(out, cfg, params, tokenizer, source=source)
  return step, written


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxgrpo.export", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir", help="the run folder (holds config.json and checkpoints/)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  args = parser.parse_args(argv)
  try:
    step, written = export(args.workdir, args.out, args.step)
  except (ExportError, hf.PretrainedError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported step {step} of {args.workdir} to {args.out}: {', '.join(written)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""python -m jaxgrpo.export <workdir> [--step N] --out DIR [--format merged|peft]

Writes a run's trained policy as a Hugging Face model folder (config.json, model.safetensors,
tokenizer files) that transformers and vLLM load. The architecture and tokenizer come from
the run's own config.json and the checkpoint it started from; a run that started from a
Hugging Face folder keeps that folder's config keys, chat template and generation config.
Without --step the newest checkpoint is exported. Bad input is one line and exit status 2.

A LoRA run (model.lora_rank > 0) exports its adapters merged into its base (W + alpha/r A B)
by default, or with --format=peft as a PEFT adapter folder (adapter_config.json,
adapter_model.safetensors) that `peft.PeftModel.from_pretrained(base, DIR)` loads onto the
base. Its base_model_name_or_path is the Hugging Face folder the run started from; a run
that started from jaxgrpo weights (the embedded model, a jaxgrpo checkpoint, a random init)
gets its base written beside the adapter, as DIR/base, a Hugging Face folder.

`save_hf` writes the folder from parameters (hf.py reads such folders, with the same name map);
`save_peft` writes the adapter folder.
"""

from __future__ import annotations

import argparse
import sys

from jaxgrpo.model import hf
from jaxgrpo.run import artifacts


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxgrpo.export", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir", help="the run folder (holds config.json and checkpoints/)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  parser.add_argument("--format", default="merged", choices=artifacts.FORMATS,
                      help="merged: a Hugging Face model folder (a LoRA run's adapters merged "
                      "into its base); peft: a LoRA run's PEFT adapter folder")
  args = parser.parse_args(argv)
  try:
    step, written = artifacts.export(args.workdir, args.out, args.step, args.format)
  except (artifacts.ExportError, hf.PretrainedError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported step {step} of {args.workdir} to {args.out}: {', '.join(written)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""python -m jaxgrpo.evaluate --config=FILE [--workdir=DIR [--step=N]] [--config.KEY=VALUE ...]
                            [--out=DIR] [--metrics=M,...]
python -m jaxgrpo.evaluate --config=FILE --compare=A,B [--config.KEY=VALUE ...] [--out=DIR]

Grouped evaluation of a policy outside a training run, by the run's own validation code (the
Validator: the `val` sampling profile, k samples per prompt, val_seed, per-source metrics,
maj@k, the pass@j ladder). The policy is
  --workdir=DIR [--step=N]  a run's checkpoint (the newest by default): the run's config.json
                            gives the model section (architecture, tokenizer, dtypes), the
                            --config file and its overrides everything else;
  otherwise                 the config's own model: model.checkpoint, model.hf_checkpoint,
                            or the seeded random init.
With the run's config, the numbers equal the run's validation row at that step, bit for bit.

--compare=A,B evaluates two policies on the same prompts with the same seeds and reports the
per-prompt paired difference B - A (jaxgrpo/eval/paired.py). Each side is a run folder (DIR,
DIR:STEP or DIR/checkpoints/STEP), a jaxgrpo checkpoint folder (model.json, or @embedded/...)
or a Hugging Face model folder.

--metrics picks the rows of the printed table and the verdict lines (default: accuracy, each
pass@j and maj@k); `pass@4/gsm8k` names one source. The files hold every metric.

--trackers=wandb[,trackio,tensorboard] also logs the evaluation to those trackers (as
config.logging.trackers names them): every metric under eval/ (eval/A/, eval/B/ and the
paired differences under compare/ with --compare) at the checkpoint's step, the table, the
verdicts and the plots as images. The project is the run's own (its config.json's
logging.project; else the config's), --run_name defaults to eval-<what was evaluated>.

Writes into --out (default: <workdir>/eval/step_<N>-<time>; a comparison <workdir>/eval/compare-<time>
under its second side's run, else its first's; sides that are no run: runs/eval/...):
  eval.json       every metric with its stderr and per source, the checkpoint, the sampling
                  profile, wall time, tokens/s and the resolved config
  samples.jsonl   per prompt: its k completions, rewards and extracted answers
  pass_at_k.png   pass@j against j (log axis), +- stderr, one line per source
and with --compare, A/ and B/ as above beside compare.json and compare.png.
Keys only training reads (optim.*, grpo.beta, ...) are ignored and named once. Bad input is
one line on stderr and exit status 2, before anything compiles. Only process 0 writes.
"""

from __future__ import annotations

import sys

from jaxgrpo.run import evaluator


def main(argv=None) -> int:
  argv = sys.argv if argv is None else argv
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(__doc__.strip())
    return 0
  try:
    plan = evaluator.prepare(argv)
  except evaluator.USER_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from jaxgrpo.runtime import compile_options  # the device side: jax compiles from here on
  from jaxgrpo.run import sizing  # pylint: disable=g-import-not-at-top
  compile_options.enable_cache(plan.sides[0].config.compilation_cache_dir)
  try:
    return evaluator.run(plan)
  except sizing.FitError as e:  # an 'auto' val_batch_size with nothing that fits
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())

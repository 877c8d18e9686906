"""python bench/dynamic_sampling.py [--seeds 0,1,2] [--factors 1.5,2] [--target 0.30] [-- args]

Dynamic sampling against none on the embedded default: each arm (off, then filter at each
oversample factor) runs `python -m jaxgrpo.train --config=configs/math.py` once per seed,
validating every --val_period steps, and reports per run when validation accuracy first
reached its step-0 value + --target: the step, the wall time since the run's first logged
row, and the rollout tokens generated until then (rollout_tokens_per_s x rollout_s, summed
over the steps: with dynamic sampling, every generation batch). One JSON line per run, then
one per arm with the medians. Extra arguments after `--` go to every run (e.g. a config).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reached(workdir: str, target: float) -> dict:
  """When the run's validation accuracy first reached its first value + target."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  t0 = rows[0]["time"]
  val = [r for r in rows if r["split"] == "val"]
  tokens, cumulative = 0.0, {}
  for r in rows:
    if r["split"] == "train":
      tokens += r["rollout_tokens_per_s"] * r["rollout_s"]
      cumulative[r["step"]] = tokens
  goal = val[0]["accuracy"] + target
  hit = next((r for r in val if r["accuracy"] >= goal), None)
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  return dict(start_accuracy=val[0]["accuracy"], final_accuracy=val[-1]["accuracy"],
              goal=round(goal, 4), reached_step=hit and hit["step"],
              reached_wall_s=hit and round(hit["time"] - t0, 2),
              reached_rollout_tokens=hit and int(cumulative.get(hit["step"], 0)),
              total_wall_s=summary["wall_time_s"], total_rollout_tokens=int(tokens),
              generation_batches_mean=statistics.mean(
                  [r.get("dynamic_sampling/generation_batches", 1) for r in rows
                   if r["split"] == "train"]))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--factors", default="1.5,2")
  parser.add_argument("--target", type=float, default=0.30)
  parser.add_argument("--val_period", type=int, default=25)
  parser.add_argument("extra", nargs="*")
  args = parser.parse_args(argv)
  arms = [("off", None)] + [("filter", float(f)) for f in args.factors.split(",")]
  out = []
  for mode, factor in arms:
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
      with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, "-m", "jaxgrpo.train", "--config=configs/math.py",
               f"--workdir={workdir}", f"--config.seed={seed}",
               f"--config.grpo.val_period={args.val_period}",
               f"--config.grpo.dynamic_sampling={mode}", *args.extra]
        if factor is not None:
          cmd.append(f"--config.grpo.oversample_factor={factor}")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
          raise SystemExit(proc.stderr[-3000:])
        run = dict(bench="dynamic_sampling", mode=mode, oversample_factor=factor, seed=seed,
                   **reached(workdir, args.target))
      print(json.dumps(run), flush=True)
      runs.append(run)
    med = lambda k: (statistics.median([r[k] for r in runs]) if all(r[k] is not None
                                                                   for r in runs) else None)
    summary = dict(bench="dynamic_sampling", arm=mode, oversample_factor=factor,
                   seeds=len(runs), reached=sum(r["reached_step"] is not None for r in runs),
                   **{f"median_{k}": med(k) for k in (
                       "reached_step", "reached_wall_s", "reached_rollout_tokens",
                       "final_accuracy", "total_wall_s", "total_rollout_tokens",
                       "generation_batches_mean")})
    print(json.dumps(summary), flush=True)
    out.append(summary)
  return out


if __name__ == "__main__":
  main()

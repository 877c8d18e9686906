"""jaxgrpo against the Tunix peer benchmark, run alternately and back to back.

From the repository root:

    python bench/compare_tunix.py --tunix_python /work/tunixvenv/bin/python \
        --peer ../shared/peers/tunix_bench.py --presets tiny,small --rounds 3 \
        [--what sampler,step] [--out results.jsonl]

Each round and preset runs ours (`python -m jaxgrpo.bench sampler --preset P --mode all
--reps 10`, `python -m jaxgrpo.bench step --preset P --steps 10`) and the peer
(`<tunix_python> <peer> --config P --out_dir <tmp> --tag _rN`, with --skip_grpo when the step
is not asked for), each a fresh process with JAX_PLATFORMS=cpu. Which side goes first flips
every round, so a machine that slowly gets busier (it is shared) does not favour one side;
the spread of the per-round ratios shows how much the load moved the figures.

Reported per preset: for each sampler mode (pure, topk50_topp095, greedy) tokens/s of both
and ours / peer (higher is better for us), first-call ratio; for the step, steady step
median and first step (compile included) as ours / peer (lower is better for us). Each round
prints its ratios; the end prints a table with every round's ratio and the median, and a
final JSON summary line. --out gets every raw result, every ratio row and the summary, one
JSON object a line. A failing run is reported with its command and the tail of its stderr,
and the comparison goes on without it; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("pure", "topk50_topp095", "greedy")
WHATS = ("sampler", "step")
STDERR_TAIL = 2000


class RunFailed(RuntimeError):
  """A benchmark subprocess failed; the message says which and why."""


def _env() -> dict:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _run(argv, timeout: float) -> subprocess.CompletedProcess:
  try:
    proc = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired as e:
    raise RunFailed(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from e
  except OSError as e:
    raise RunFailed(f"could not start {' '.join(argv)}: {e}") from e
  if proc.returncode:
    raise RunFailed(f"exit status {proc.returncode}: {' '.join(argv)}\n"
                    f"--- stderr (tail) ---\n{proc.stderr[-STDERR_TAIL:]}")
  return proc


def ours_argv(what: str, preset: str, python: str = sys.executable) -> list[str]:
  if what == "sampler":
    return [python, "-m", "jaxgrpo.bench", "sampler", "--preset", preset, "--mode", "all",
            "--reps", "10"]
  return [python, "-m", "jaxgrpo.bench", "step", "--preset", preset, "--steps", "10"]


def parse_json_lines(text: str) -> list[dict]:
  """The JSON objects among a run's stdout lines (anything else it printed is skipped)."""
  out = []
  for line in text.splitlines():
    line = line.strip()
    if line.startswith("{"):
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return out


def run_ours(what: str, preset: str, timeout: float) -> list[dict]:
  argv = ours_argv(what, preset)
  results = [r for r in parse_json_lines(_run(argv, timeout).stdout) if r.get("bench") == what]
  if not results:
    raise RunFailed(f"no `{what}` JSON line in the output of {' '.join(argv)}")
  return results


def run_peer(tunix_python: str, peer: str, preset: str, tag: str, with_step: bool,
             out_dir: str, timeout: float) -> dict:
  argv = [tunix_python, peer, "--config", preset, "--out_dir", out_dir, "--tag", tag]
  if not with_step:
    argv.append("--skip_grpo")
  _run(argv, timeout)
  path = os.path.join(out_dir, f"tunix_bench_{preset}{tag}.json")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise RunFailed(f"peer wrote no readable {path}: {e}") from e


def _ratio(a, b):
  return a / b if a is not None and b else None


def ratio_rows(preset: str, ours: list[dict], peer: dict | None) -> list[dict]:
  """One row per sampler mode and one for the step, from our result lines and the peer's
  JSON: both figures and ours / peer. Rows whose two sides are not both there are left out."""
  if not peer:
    return []
  rows = []
  for r in ours:
    if r.get("bench") == "sampler" and r.get("preset") == preset:
      p = peer.get(f"sampler_{r['mode']}")
      if p:
        rows.append(dict(
            preset=preset, what="sampler", mode=r["mode"],
            ours_tokens_per_s=r["tokens_per_s"], peer_tokens_per_s=p["tokens_per_s"],
            ratio=_ratio(r["tokens_per_s"], p["tokens_per_s"]), ratio_is="ours / peer tokens/s",
            ours_first_call_s=r["first_call_s"], peer_first_call_s=p["first_call_s"],
            first_ratio=_ratio(r["first_call_s"], p["first_call_s"])))
    elif r.get("bench") == "step" and r.get("preset") == preset and peer.get("grpo"):
      g = peer["grpo"]
      first = g["per_step_s"][0] if g.get("per_step_s") else None
      rows.append(dict(
          preset=preset, what="step", mode="grpo",
          ours_steady_step_s=r["steady_step_median_s"],
          peer_steady_step_s=g.get("steady_step_median_s"),
          ratio=_ratio(r["steady_step_median_s"], g.get("steady_step_median_s")),
          ratio_is="ours / peer steady step time (lower is better for ours)",
          ours_first_step_s=r["first_step_s"], peer_first_step_s=first,
          first_ratio=_ratio(r["first_step_s"], first)))
  return rows


def summarize(rows: list[dict]) -> dict:
  """'preset/what/mode' -> every round's ratio and first-call ratio, and their medians."""
  out = {}
  for r in rows:
    entry = out.setdefault(f"{r['preset']}/{r['what']}/{r['mode']}",
                           {"ratio_is": r["ratio_is"], "ratios": [], "first_ratios": []})
    entry["ratios"].append(r["ratio"])
    entry["first_ratios"].append(r["first_ratio"])
  for entry in out.values():
    for name in ("ratios", "first_ratios"):
      values = [v for v in entry[name] if v is not None]
      entry[name.replace("ratios", "median")] = statistics.median(values) if values else None
  return out


def _fmt(x, spec=".3f"):
  return "-" if x is None else format(x, spec)


def format_table(summary: dict) -> str:
  """A fixed-width table: one line per preset / bench / mode."""
  lines = [f"{'preset/bench/mode':34} {'ratio per round':30} {'median':>7} {'first med':>9}"]
  for name, e in summary.items():
    rounds = " ".join(_fmt(v) for v in e["ratios"])
    lines.append(f"{name:34} {rounds:30} {_fmt(e['median']):>7} {_fmt(e['first_median']):>9}")
  lines.append("sampler: ours/peer tokens/s (higher is better for ours); step: ours/peer "
               "seconds (lower is better for ours); first: first call or step, compile included")
  return "\n".join(lines)


def _row_line(r: dict) -> str:
  if r["what"] == "sampler":
    return (f"  {r['preset']:6} sampler {r['mode']:15} ours {r['ours_tokens_per_s']:9.1f} tok/s "
            f"peer {r['peer_tokens_per_s']:9.1f} tok/s  ratio {_fmt(r['ratio'])}  "
            f"first {_fmt(r['first_ratio'])}")
  return (f"  {r['preset']:6} step    steady ours {_fmt(r['ours_steady_step_s'])} s "
          f"peer {_fmt(r['peer_steady_step_s'])} s  ratio {_fmt(r['ratio'])}  "
          f"first ours {_fmt(r['ours_first_step_s'])} s peer {_fmt(r['peer_first_step_s'])} s "
          f"ratio {_fmt(r['first_ratio'])}")


def _list(choices):
  def parse(text):
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if choices and x not in choices]
    if not items or bad:
      raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {list(choices)}")
    return items
  return parse


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tunix_python", required=True, help="python of the venv with google-tunix")
  p.add_argument("--peer", required=True, help="path of tunix_bench.py")
  p.add_argument("--presets", type=_list(("tiny", "small")), default=["tiny", "small"])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--what", type=_list(WHATS), default=list(WHATS))
  p.add_argument("--out", default=None, help="append raw results, ratios and summary here")
  p.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.rounds < 1:
    raise SystemExit(f"--rounds={args.rounds}: must be >= 1")
  peer = os.path.abspath(args.peer)
  if not os.path.isfile(peer):
    raise SystemExit(f"--peer {args.peer}: no such file")
  records, rows, failures = [], [], []
  with tempfile.TemporaryDirectory(prefix="compare_tunix_") as out_dir:
    for rnd in range(args.rounds):
      print(f"round {rnd + 1}/{args.rounds}", flush=True)
      for preset in args.presets:
        ours, peer_result = [], None
        # Alternate who goes first, round by round.
        sides = ("ours", "peer") if rnd % 2 == 0 else ("peer", "ours")
        # One job per process: our benches one by one (a failing one spares the other), the
        # peer's single run covering both.
        jobs = {"ours": [("ours", w) for w in args.what], "peer": [("peer", "+".join(args.what))]}
        for side, what in jobs[sides[0]] + jobs[sides[1]]:
          t0 = time.perf_counter()
          try:
            if side == "ours":
              got = run_ours(what, preset, args.timeout)
              ours += got
              records += [dict(source="ours", round=rnd, **r) for r in got]
            else:
              peer_result = run_peer(args.tunix_python, peer, preset, f"_r{rnd}",
                                     "step" in args.what, out_dir, args.timeout)
              records.append(dict(source="peer", round=rnd, preset=preset, result=peer_result))
          except RunFailed as e:
            failures.append(dict(round=rnd, preset=preset, side=side, what=what, error=str(e)))
            print(f"  FAILED ({side} {what}, {preset}, round {rnd + 1}): {e}", file=sys.stderr,
                  flush=True)
          print(f"  {preset} {side} {what}: {time.perf_counter() - t0:.0f}s", flush=True)
        got = [dict(r, round=rnd) for r in ratio_rows(preset, ours, peer_result)]
        for r in got:
          print(_row_line(r), flush=True)
        rows += got
  summary = summarize(rows)
  print(format_table(summary), flush=True)
  final = dict(summary=True, rounds=args.rounds, presets=args.presets, what=args.what,
               ratios=summary, failures=len(failures))
  if args.out:
    with open(args.out, "a") as f:
      for item in (records + [dict(ratio_row=True, **r) for r in rows]
                   + [dict(failure=True, **x) for x in failures] + [final]):
        f.write(json.dumps(item) + "\n")
  print(json.dumps(final), flush=True)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())

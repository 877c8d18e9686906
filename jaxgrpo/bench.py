"""Benchmarks, one JSON line per measurement:
`python -m jaxgrpo.bench {sampler,step,validation,prefill,memory,all} [--preset ...]`.

Every line carries the machine (jax version, device, cores, load average before and after).
Roofline fractions divide a figure's FLOP rate by the dense matmul rate measured in the same
process (roofline.matmul_rate). `step` (bench_step.py) times whole GRPO steps on the peer's
workload; `prefill` gives the prefill's FLOP rate and what prefix sharing buys; `all` runs
sampler, step and prefill for one preset, then validation. bench/compare_tunix.py runs these
and the peer's script back to back and prints the ratios.

`sampler` times the compiled sampler on the workload of the Tunix peer benchmark
(shared/peers/tunix_bench.py): its 8 prompts as byte-level tokens (0=pad, 1=bos, 2=eos,
3..258 = byte + 3, bos first) x 4 samples each, left-padded to 64 tokens (the longest
prompt is 33 tokens with bos; the next power of two), exactly 64 new tokens (no EOS),
float32, one CPU device, a random-init Qwen3-shaped model (seed 0).

One timed call is what a user waits for: encode and pad the prompts, sample, block on the
result, fetch tokens to the host and decode them to text. The first call (compile + run)
is reported as `first_call_s`; `tokens_per_s` is generated tokens / the median of the next
`--reps` calls, each with a new seed. The peer asks for 32 prompt slots, which Tunix raises
to 64 (the next power of two of the longest prompt), so the shapes match. One difference:
the peer prefills all 32 rows, while here each prompt is prefilled once and its 4 samples
share that prefill (the sampler's design).

`validation` measures what grouped validation buys, on the embedded default
(configs/math.py: the `@embedded/arith3` warm start, its 500 validation prompts of 3-digit
addition, the val profile = the training one: temperature 1, top_p 1, top_k 0, 5 new
tokens), one CPU device. For each k in `--ks` (one engine, compiled once, whose val profile
draws k samples per prompt) it validates the same parameters with val seeds 0..`--seeds`-1
after one uncounted warm-up (compile) call, and reports each seed's `accuracy`, their sample
std (ddof 1) across seeds next to the mean within-run `accuracy_stderr`, the mean pass@k and
the median wall time. The summary line compares the smallest and largest k:
`std_ratio` = std_kmin / std_kmax (how much steadier the number is) and `wall_ratio` =
wall_kmax / ((kmax / kmin) * wall_kmin) (what k samples cost against kmax / kmin separate
validations; below 1 because each prompt's prefill is shared and the k samples form one batch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxgrpo import config as config_lib  # noqa: E402
from jaxgrpo import data as data_lib  # noqa: E402
from jaxgrpo import model as model_lib  # noqa: E402
from jaxgrpo import policy as policy_lib  # noqa: E402
from jaxgrpo import roofline  # noqa: E402
from jaxgrpo import sampling  # noqa: E402
from jaxgrpo import sharding as sharding_lib  # noqa: E402
from jaxgrpo import train as train_lib  # noqa: E402
from jaxgrpo import trainer  # noqa: E402
from jaxgrpo import validation  # noqa: E402

PAD, BOS = 0, 1
NUM_SAMPLES = 4
NEW_TOKENS = 64
PROMPTS = (  # the peer's, verbatim
    "What is 12 + 30? Answer:",
    "Compute 7 * 6. Answer:",
    "Natalia sold 48 clips. How many?",
    "If x = 3, what is 2x + 1?",
    "Sum of 1..10 is",
    "Half of 84 is",
    "Tom has 5 apples and eats 2.",
    "The capital of France is",
)
_QWEN3 = dict(num_heads=4, num_kv_heads=2, rope_theta=1e4, norm_eps=1e-6,
              tie_embeddings=True, qk_norm=True, param_dtype="float32", dtype="float32")
PRESETS = {
    "tiny": dict(num_layers=2, d_model=128, mlp_dim=512, head_dim=32, vocab_size=512),
    "small": dict(num_layers=4, d_model=256, mlp_dim=1024, head_dim=64, vocab_size=1024),
}
MODES = {  # the peer's three sampler settings
    "pure": sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
    "topk50_topp095": sampling.SamplingParams(temperature=0.9, top_p=0.95, top_k=50),
    "greedy": sampling.SamplingParams(temperature=0.0, top_p=1.0, top_k=0),
}


def preset_config(name: str) -> model_lib.ModelConfig:
  return model_lib.ModelConfig(**_QWEN3, **PRESETS[name])


def encode(text: str) -> list[int]:
  return [BOS] + [b + 3 for b in text.encode("utf-8")]


def decode(ids) -> str:
  return bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259).decode("utf-8", errors="replace")


def prompt_batch(prompts=PROMPTS):
  """[B, P] left-padded tokens and mask, P the next power of two of the longest prompt."""
  rows = [encode(p) for p in prompts]
  longest = max(len(r) for r in rows)
  width = 1 << (longest - 1).bit_length()
  tokens = np.full((len(rows), longest), PAD, np.int32)
  mask = np.zeros((len(rows), longest), bool)
  for i, r in enumerate(rows):
    tokens[i, longest - len(r):] = r
    mask[i, longest - len(r):] = True
  return sampling.left_pad(tokens, mask, width, PAD)


def _loadavg() -> list[str]:
  try:
    with open("/proc/loadavg") as f:
      return f.read().split()[:3]
  except OSError:
    return []


def _machine(devices, loadavg_start) -> dict:
  """The fields every result carries: what ran where, and how busy the machine was."""
  return dict(jax=jax.__version__, device=str(devices[0]), platform=devices[0].platform,
              cpu_count=os.cpu_count(), loadavg_start=loadavg_start, loadavg_end=_loadavg())


def sampler_flops(cfg: model_lib.ModelConfig, prompts: int, samples: int, prompt_len: int,
                  new_tokens: int) -> float:
  """Analytic FLOPs of one sampler call as computed: each prompt's prefill once, then
  new_tokens - 1 decode steps of every row attending over the whole P + T cache (the loop
  masks unfilled slots rather than skipping them)."""
  return (prompts * prompt_len * roofline.model_flops_per_token(cfg, prompt_len)
          + prompts * samples * (new_tokens - 1)
          * roofline.model_flops_per_token(cfg, prompt_len + new_tokens))


def bench_sampler(policy: policy_lib.Policy, mode: str, reps: int, new_tokens: int) -> dict:
  """Times `reps` full sampler calls after a first (compiling) one; returns the stats."""
  sp = MODES[mode]

  def call(seed):
    tokens, mask = prompt_batch()
    out = policy.generate(tokens, sp, num_samples=NUM_SAMPLES, max_new_tokens=new_tokens,
                          seed=seed, prompt_mask_BxP=mask)
    jax.block_until_ready(out)
    ids, lengths = jax.device_get((out.tokens_NxT, out.lengths_N))
    texts = [decode(row[:n]) for row, n in zip(ids, lengths)]
    return ids, lengths, texts, tokens.shape[1]

  t0 = time.perf_counter()
  call(0)
  first = time.perf_counter() - t0
  times = []
  for r in range(reps):
    t0 = time.perf_counter()
    ids, lengths, texts, width = call(r + 1)
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  generated = int(np.sum(lengths))
  flops = sampler_flops(policy.cfg, len(PROMPTS), NUM_SAMPLES, width, new_tokens)
  return dict(flops_per_call=flops, flops_per_s=round(flops / med), 
      mode=mode, sampling=dict(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k),
      workload=dict(prompts=len(PROMPTS), samples=NUM_SAMPLES, prompt_len=width,
                    new_tokens=new_tokens, eos=None, dtype=policy.cfg.dtype),
      tokens_per_s=round(generated / med, 1), first_call_s=round(first, 3),
      median_s=round(med, 4), all_s=[round(t, 4) for t in times],
      generated_tokens=generated, rows=int(ids.shape[0]),
      decode_steps_per_s=round(new_tokens / med, 1), sample_text=texts[0][:40])


def run_sampler(args) -> list[dict]:
  """The `sampler` subcommand: one result per mode, model built once."""
  loadavg_start = _loadavg()
  devices = jax.devices()[:1]
  cfg = preset_config(args.preset)
  policy = policy_lib.Policy.init(cfg, seed=0, mesh=None, pad_id=PAD, eos_id=None)
  modes = list(MODES) if args.mode == "all" else [args.mode]
  results = []
  for mode in modes:
    stats = bench_sampler(policy, mode, args.reps, args.new_tokens)
    # The roofline's denominator, measured right after the figure it divides (same load).
    rate = roofline.matmul_rate()["flops_per_s"]
    results.append(dict(bench="sampler", preset=args.preset, n_params=policy.num_params,
                        **stats, matmul_flops_per_s=round(rate),
                        roofline_fraction=round(stats["flops_per_s"] / rate, 3),
                        **_machine(devices, loadavg_start)))
    loadavg_start = _loadavg()
  return results


def _timed(fn, reps: int):
  """(first call s, [reps timed calls s]); fn blocks on its own result."""
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return first, times


def run_prefill(args) -> list[dict]:
  """The `prefill` subcommand: the prefill's FLOP rate against the machine's matmul rate,
  and what sharing each prompt's prefill across its G samples buys.

  Workload: `--prompts` prompts of `--prompt_len` random tokens (all real, no padding), G =
  `--samples`, `--new_tokens` new tokens at temperature 1 with EOS off. `shared` is the
  engine as it runs (each prompt prefilled once, its K/V read by all G samples); `unshared`
  prefills every sample's copy of its prompt (RolloutEngine(share_prefix=False)), as a
  sampler without prefix sharing does. The two are timed alternately, call by call.
  """
  loadavg_start = _loadavg()
  devices = jax.devices()[:1]
  cfg = preset_config(args.preset)
  mesh = sharding_lib.make_mesh({"data": 1}, devices)
  params = sharding_lib.init_sharded(cfg, mesh, jax.random.key(0))
  rng = np.random.default_rng(0)
  b, p, g, t = args.prompts, args.prompt_len, args.samples, args.new_tokens
  tokens = rng.integers(3, cfg.vocab_size, size=(b, p)).astype(np.int32)
  mask = np.ones((b, p), bool)
  workload = dict(prompts=b, prompt_len=p, samples=g, new_tokens=t, eos=None, dtype=cfg.dtype)

  prefill = jax.jit(lambda params, tokens, mask: sampling.prefill(params, cfg, tokens, mask))
  flops = roofline.compiled_flops(prefill.lower(params, tokens, mask).compile())
  first, times = _timed(lambda: jax.block_until_ready(prefill(params, tokens, mask)), args.reps)
  med = statistics.median(times)
  rate = roofline.matmul_rate()["flops_per_s"]
  results = [dict(bench="prefill", kind="prefill", preset=args.preset, workload=workload,
                  flops=flops, first_call_s=round(first, 3), median_s=round(med, 4),
                  all_s=[round(x, 4) for x in times], flops_per_s=round(flops / med),
                  matmul_flops_per_s=round(rate), roofline_fraction=round(flops / med / rate, 3),
                  **_machine(devices, loadavg_start))]

  loadavg_start = _loadavg()
  profiles = {"train": sampling.Profile(MODES["pure"], g, t),
              "val": sampling.Profile(MODES["greedy"], 1, t)}  # required, never called
  engines = {share: sampling.RolloutEngine(cfg, mesh, profiles, max_prompt_length=p,
                                           eos_id=None, pad_id=PAD, seed=0, share_prefix=share)
             for share in (True, False)}
  calls = {share: (lambda e=e: jax.block_until_ready(e.sample("train", params, tokens, mask)))
           for share, e in engines.items()}
  firsts = {share: _timed(call, 0)[0] for share, call in calls.items()}
  walls = {True: [], False: []}
  for _ in range(args.reps):  # alternate, so a noisy moment hits both sides
    for share, call in calls.items():
      walls[share].append(_timed(call, 1)[1][0])
  shared, unshared = (statistics.median(walls[s]) for s in (True, False))
  results.append(dict(
      bench="prefill", kind="prefix_sharing", preset=args.preset, workload=workload,
      # Microseconds: a short rollout's median is a few ms, and 0.1 ms steps would move the
      # ratio of the two rounded medians by several percent away from cost_ratio.
      shared_median_s=round(shared, 6), unshared_median_s=round(unshared, 6),
      shared_all_s=[round(x, 6) for x in walls[True]],
      unshared_all_s=[round(x, 6) for x in walls[False]],
      shared_first_call_s=round(firsts[True], 3), unshared_first_call_s=round(firsts[False], 3),
      cost_ratio=round(shared / unshared, 4), speedup=round(unshared / shared, 2),
      cost_ratio_is="shared / unshared median wall per rollout call",
      **_machine(devices, loadavg_start)))
  return results


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


def default_config():
  """configs/math.py's get_config(), loaded from the repository (configs/ is no package)."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs", "math.py")
  if not os.path.isfile(path):
    raise SystemExit(f"validation bench: {path} not found; run it from a jaxgrpo checkout")
  spec = importlib.util.spec_from_file_location("jaxgrpo_bench_math_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def run_validation(args) -> list[dict]:
  """The `validation` subcommand: one result per k, then the summary comparing min / max k."""
  loadavg_start = _loadavg()
  devices = jax.devices()[:1]
  config = default_config()
  config.grpo.max_val_samples = args.max_val_samples
  config = config_lib.validate(config, len(devices))
  # The trainer's loader: it also checks that config.model matches the checkpoint.
  model_cfg, host_params, tokenizer = train_lib._load_policy(config)  # pylint: disable=W0212
  mesh = sharding_lib.make_mesh(config.mesh.to_dict(), devices)
  params = sharding_lib.shard_params(host_params, model_cfg, mesh)
  d, g, gen = config.data, config.grpo, config.generation
  val_rows = data_lib.make_sources(d)[1][:g.max_val_samples]
  batches = data_lib.validation_batches(val_rows, tokenizer, g.val_batch_size,
                                        d.max_prompt_length, template=d.prompt_template)
  results = []
  for k in args.ks:
    engine = trainer.make_engine(config, model_cfg, tokenizer, mesh, val_k=k)
    val_sp = engine.profile("val").sampling
    validator = validation.Validator(engine, batches, tokenizer, config.rewards.to_dict(),
                                     threshold=g.val_pass_threshold, seed=0, mesh=mesh)
    first = validator(params, 0)["wall_time_s"]  # compiles the sampler and the metrics
    runs = []
    for seed in range(args.seeds):
      # The key Validator(seed=seed) would hold; a new Validator per seed would recompile
      # its metrics function (about 1 s on CPU) inside every timed call.
      validator.key = jax.random.key(seed)
      runs.append(validator(params, 0))
    accuracy = [r["accuracy"] for r in runs]
    walls = [r["wall_time_s"] for r in runs]
    results.append(dict(
        bench="validation", preset="embedded-default", checkpoint=config.model.checkpoint,
        k=k, sampling=dict(temperature=val_sp.temperature, top_p=val_sp.top_p,
                           top_k=val_sp.top_k, max_new_tokens=gen.max_new_tokens),
        workload=dict(prompts=runs[0]["num_prompts"], rollouts=runs[0]["num_rollouts"],
                      val_batch_size=g.val_batch_size, dtype=model_cfg.dtype),
        val_seeds=list(range(args.seeds)), accuracy=accuracy,
        accuracy_mean=statistics.fmean(accuracy),
        accuracy_std_across_seeds=statistics.stdev(accuracy), ddof=1,
        accuracy_stderr_mean=statistics.fmean(r["accuracy_stderr"] for r in runs),
        pass_k_mean=statistics.fmean(r[f"pass@{k}"] for r in runs),
        first_call_s=round(first, 3), median_wall_s=round(statistics.median(walls), 4),
        all_wall_s=[round(t, 4) for t in walls],
        sampler_compilations=engine.compilations["val"], **_machine(devices, loadavg_start)))
    loadavg_start = _loadavg()
  lo, hi = results[0], results[-1]
  kmin, kmax = lo["k"], hi["k"]
  std_hi = hi["accuracy_std_across_seeds"]
  results.append(dict(
      bench="validation", preset="embedded-default", summary=True, ks=list(args.ks),
      std_ratio=lo["accuracy_std_across_seeds"] / std_hi if std_hi > 0 else None,
      std_ratio_is=f"std_k{kmin} / std_k{kmax} (accuracy across seeds, ddof 1)",
      wall_ratio=hi["median_wall_s"] * kmin / (kmax * lo["median_wall_s"]),
      wall_ratio_is=f"(wall_k{kmax} / {kmax}) / (wall_k{kmin} / {kmin}) (median wall, per sample)",
      **_machine(devices, loadavg_start)))
  return results


def _ks(text: str) -> tuple[int, ...]:
  """--ks: at least two distinct sample counts >= 1, e.g. '1,8'; returned sorted."""
  try:
    ks = tuple(sorted({int(x) for x in text.split(",")}))
  except ValueError:
    ks = ()
  if len(ks) < 2 or ks[0] < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: expected two or more distinct integers >= 1, "
                                     "e.g. 1,8")
  return ks


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxgrpo.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="bench", required=True)
  s = sub.add_parser("sampler", help="time the compiled sampler on the peer's workload")
  s.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
  s.add_argument("--mode", choices=[*MODES, "all"], default="pure",
                 help="sampling settings; 'all' runs each and prints one line each")
  s.add_argument("--reps", type=int, default=10, help="timed calls after the first")
  s.add_argument("--out", default=None, help="also append the JSON line(s) to this file")
  s.add_argument("--new_tokens", type=int, default=NEW_TOKENS, help=argparse.SUPPRESS)
  s.set_defaults(run=run_sampler)
  v = sub.add_parser("validation", help="grouped validation: seed spread and cost per k")
  v.add_argument("--ks", type=_ks, default=(1, 8), help="samples per prompt, e.g. 1,8")
  v.add_argument("--seeds", type=int, default=10, help="val seeds 0..N-1 per k (N >= 2)")
  v.add_argument("--max_val_samples", type=int, default=500, help="validation prompts")
  v.add_argument("--out", default=None, help="also append the JSON lines to this file")
  v.set_defaults(run=run_validation)
  from jaxgrpo import bench_step  # pylint: disable=C0415  (it imports this module)
  from jaxgrpo import bench_backends, bench_early_stop, bench_memory  # pylint: disable=C0415
  bench_step.add_parsers(sub)
  bench_memory.add_parsers(sub)
  bench_early_stop.add_parsers(sub)
  bench_backends.add_parsers(sub)
  pf = sub.add_parser("prefill", help="prefill FLOP rate, and what prefix sharing buys")
  pf.add_argument("--preset", choices=sorted(PRESETS), default="small")
  pf.add_argument("--prompts", type=int, default=4, help="distinct prompts")
  pf.add_argument("--prompt_len", type=int, default=512, help="tokens per prompt")
  pf.add_argument("--samples", type=int, default=8, help="samples per prompt (G)")
  pf.add_argument("--new_tokens", type=int, default=16, help="tokens sampled per row")
  pf.add_argument("--reps", type=int, default=5, help="timed calls (alternating shared/unshared)")
  pf.add_argument("--out", default=None, help="also append the JSON lines to this file")
  pf.set_defaults(run=run_prefill)
  a = sub.add_parser("all", help="sampler, step and prefill for --preset, then validation")
  a.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
  a.add_argument("--out", default=None, help="also append the JSON lines to this file")
  a.set_defaults(run=run_all)
  return parser


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


if __name__ == "__main__":
  main(sys.argv[1:])

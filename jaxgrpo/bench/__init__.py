"""Benchmarks, one JSON line per measurement:
`python -m jaxgrpo.bench {sampler,rollout,step,validation,prefill,memory,early-stop,backends,all}
[--preset ...]`. One module per subcommand in this package; `common` holds what they share.

Every line carries the machine (jax version, device, cores, load average before and after).
Roofline fractions divide a figure's FLOP rate by the dense matmul rate measured in the same
process (roofline.matmul_rate). `step` (step.py) times whole GRPO steps on the peer's
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

import os

# CPU unless the caller says otherwise (JAX_PLATFORMS=cuda on a GPU): before jax loads.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxgrpo.bench.cli import build_parser, main  # noqa: E402

__all__ = ["build_parser", "main"]

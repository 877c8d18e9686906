"""One GRPO update at a real model's scale, on whatever accelerator jax finds.

    python bench/update_at_scale.py [--rollouts 512 --prompt_len 256 --new_tokens 512]
        [--configs 32:128:none,16:128:none] [--shape qwen3-1.7b|medium|small]

A random-init Qwen3-1.7B-shaped policy (28 layers, d_model 2048, 16 / 8 heads x 128, MLP
6144, vocab 151,936, tied, bfloat16 parameters and compute), G = 8, every completion its
full length. For each `micro_batch_size:logprob_chunk_size:remat[:scan[:attention]]` in
--configs (scan: `scan` or `unrolled`, attention: `xla` or `cudnn`; left out, the platform's
defaults: scanned and, on a GPU with bfloat16, cuDNN; a micro-batch written `t<N>` packs
the rollouts into micro-batches of N tokens, grpo.micro_batch_tokens) it compiles
`grpo.compile_update` exactly as the trainer builds it and runs it --reps times on the same
batch, then prints one JSON line: compile and step seconds, model TFLOP/s (forward and
backward, 3x the forward's matmul FLOPs; remat's recomputation not counted), that rate as
a fraction of a square matmul in the compute dtype measured in the same process, the
compiled update's temporary and argument bytes (memory_analysis) and the device's peak
bytes in use so far in the process. A config that does not fit prints its error and the
next one runs. Only jax, flax and optax are imported (nothing the trainer's data or
logging stack needs). `--shape medium` is jaxgrpo.bench's medium preset with a 32k
vocabulary in float32 (the CPU figures); `--small` shrinks the model for a dry run.
"""

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgrpo.algo import grpo
from jaxgrpo.model import attention as attention_lib
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model import sharding as sharding_lib
from jaxgrpo.rollout import sampling

QWEN3_1_7B = dict(vocab_size=151936, d_model=2048, num_layers=28, num_heads=16,
                  num_kv_heads=8, head_dim=128, mlp_dim=6144, rope_theta=1e6, norm_eps=1e-6,
                  tie_embeddings=True, qk_norm=True, param_dtype="bfloat16", dtype="bfloat16")
SMALL = dict(QWEN3_1_7B, vocab_size=4096, d_model=128, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=32, mlp_dim=256)
# jaxgrpo.bench's medium preset (jaxgrpo/bench/step.py MEDIUM) with a 32k vocabulary, float32: the CPU
# figures of BENCHMARKS.md.
MEDIUM = dict(QWEN3_1_7B, vocab_size=32768, d_model=512, num_layers=8, num_heads=8,
              num_kv_heads=4, head_dim=64, mlp_dim=2048, rope_theta=1e4,
              param_dtype="float32", dtype="float32")
SHAPES = {"qwen3-1.7b": QWEN3_1_7B, "medium": MEDIUM, "small": SMALL}


def emit(**kw):
  print(json.dumps(kw), flush=True)


def forward_flops(cfg, prompts, g, p, t):
  """Matmul FLOPs of one teacher-forced forward: prompts once, completions per row."""
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_token = 2 * cfg.num_layers * (cfg.d_model * (q + 2 * kv) + q * cfg.d_model
                                    + 3 * cfg.d_model * cfg.mlp_dim)
  attn = lambda ctx: 4 * cfg.num_layers * q * ctx
  head = 2 * cfg.d_model * cfg.vocab_size
  prompt = prompts * p * (per_token + attn(p / 2))
  completion = prompts * g * t * (per_token + attn(p + t / 2) + head)
  return prompt + completion


def packed_forward_flops(cfg, rollouts, p, t):
  """Matmul FLOPs of the packed layout's forward (algo/packing.py): every rollout's prompt
  and completion as one sequence, the output projection at every position (the prompt's
  positions predict no loss token, but the packed forward projects them too)."""
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_token = 2 * cfg.num_layers * (cfg.d_model * (q + 2 * kv) + q * cfg.d_model
                                    + 3 * cfg.d_model * cfg.mlp_dim)
  attn = 4 * cfg.num_layers * q * (p + t) / 2
  return rollouts * (p + t) * (per_token + attn + 2 * cfg.d_model * cfg.vocab_size)


def matmul_rate(n=8192, reps=10, dtype=jnp.bfloat16):
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(reps):
    out = f(a)
  out.block_until_ready()
  return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def peak_bytes():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", 0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rollouts", type=int, default=512)
  ap.add_argument("--generations", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=256)
  ap.add_argument("--new_tokens", type=int, default=512)
  ap.add_argument("--configs", default="32:128:none,16:128:none,32:128:save_dots")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
  ap.add_argument("--small", action="store_true", help="--shape=small (a CPU dry run)")
  a = ap.parse_args()
  shape = "small" if a.small else a.shape
  cfg = model_lib.ModelConfig(**SHAPES[shape])
  emit(part="env", jax=jax.__version__, devices=[str(d) for d in jax.devices()], shape=shape)
  rate = matmul_rate(8192 if shape == "qwen3-1.7b" else 1024,
                     dtype=model_lib.DTYPES[cfg.dtype])  # the compute dtype's matmul rate
  emit(part="matmul_rate", tflops=round(rate / 1e12, 1))
  mesh = sharding_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  t0 = time.perf_counter()
  # Leaf by leaf from the abstract tree (no compiled initialiser: it is not what is measured).
  abstract = nn.unbox(jax.eval_shape(lambda r: model_lib.init_params(cfg, r), jax.random.key(0)))
  leaves, tree = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  made = [(0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
          for k, x in zip(keys, leaves)]
  params = jax.device_put(jax.tree.unflatten(tree, made), sharding_lib.param_shardings(cfg, mesh))
  jax.block_until_ready(params)
  emit(part="params", s=round(time.perf_counter() - t0, 2),
       params=int(sum(x.size for x in leaves)))
  g, p, t = a.generations, a.prompt_len, a.new_tokens
  b = a.rollouts // g
  rng = np.random.default_rng(0)
  batch = {"prompt_tokens_BxL": rng.integers(10, 50000, (b, p), dtype=np.int32) % cfg.vocab_size,
           "prompt_mask_BxL": np.ones((b, p), bool),
           "completion_tokens_NxT": rng.integers(10, 50000, (b * g, t), dtype=np.int32)
                                    % cfg.vocab_size,
           "completion_mask_NxT": np.ones((b * g, t), bool),
           "old_logp_NxT": np.full((b * g, t), -5.0, np.float32),
           "rewards_N": rng.random(b * g).astype(np.float32),
           "truncated_N": np.zeros(b * g, bool),
           "scored_N": np.ones(b * g, bool)}
  batch = sharding_lib.to_global(mesh, batch)
  sp = sampling.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
  optimizer, lr = grpo.make_optimizer(1e-6, 0, 100, 0.0, 1.0, "constant")
  flops = 3 * forward_flops(cfg, b, g, p, t)
  platform = jax.devices()[0].platform
  for spec in a.configs.split(","):
    micro, chunk, remat, *rest = spec.split(":")
    scan = {"scan": True, "unrolled": False, None: None}[rest[0] if rest else None]
    attention = rest[1] if len(rest) > 1 else None
    tokens = int(micro[1:]) if micro.startswith("t") else 0  # packed micro-batches
    micro = 0 if tokens else int(micro)
    loss = grpo.LossConfig(num_generations=g, beta=0.0, kl_type="k3", epsilon=0.2,
                           epsilon_high=0.28, loss_agg="token_mean", scale_rewards="group",
                           mask_truncated_completions=False, max_new_tokens=t,
                           micro_batch_size=micro, micro_batch_tokens=tokens,
                           logprob_chunk_size=int(chunk),
                           remat=remat, scan_layers=scan, attention=attention)
    spec_flops = 3 * packed_forward_flops(cfg, b * g, p, t) if tokens else flops
    state = grpo.init_state(jax.tree.map(lambda x: x.copy(), params), optimizer, mesh)
    try:
      t0 = time.perf_counter()
      step = grpo.compile_update(state, None, cfg=cfg, loss=loss, sp=sp, optimizer=optimizer,
                                 lr_schedule=lr, mesh=mesh)
      compiled = step.lower(state, batch, None).compile()
      compile_s = time.perf_counter() - t0
      memory = compiled.memory_analysis()
      times = []
      for _ in range(a.reps):
        t0 = time.perf_counter()
        state, aux = compiled(state, batch, None)
        jax.block_until_ready((state, aux))
        times.append(time.perf_counter() - t0)
      s = float(np.median(times))
      emit(part="update", rollouts=b * g, prompt_len=p, new_tokens=t, micro_batch_size=micro,
           micro_batch_tokens=tokens, logprob_chunk_size=int(chunk), remat=remat,
           scan_layers=model_lib.resolve_scan_layers(scan, platform),
           attention=attention_lib.resolve_attention(attention, platform, cfg.dtype),
           compile_s=round(compile_s, 1),
           step_s=[round(x, 3) for x in times], tflops=round(spec_flops / s / 1e12, 1),
           fraction_of_matmul_rate=round(spec_flops / s / rate, 3),
           temp_gib=round(memory.temp_size_in_bytes / 2**30, 1),
           argument_gib=round(memory.argument_size_in_bytes / 2**30, 1),
           peak_gib_so_far=round(peak_bytes() / 2**30, 1), loss=float(aux["loss"]),
           grad_norm=float(aux["grad_norm"]))
    except Exception as e:  # pylint: disable=broad-except
      emit(part="update_error", spec=spec, error=repr(e)[:500])
    del state


if __name__ == "__main__":
  main()

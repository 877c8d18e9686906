#!/bin/bash
# The GPU device check: what docs/gpu.md and BENCHMARKS.md quote, in one prepared run.
#
#   OUT=/tmp/gpu_check bash launch/gpu_check.sh            # on the GPU machine, repo root
#   OUT=/tmp/gpu_check SMALL=1 JAX_PLATFORMS=cpu bash launch/gpu_check.sh   # dry run on CPU
#   PARTS="versions default_run" bash launch/gpu_check.sh  # only these parts (a lease is short)
#   BANDWIDTH_GBS=3350 ...                                  # the card's nominal HBM figure
#
# Each part has its own timeout, so one that hangs or runs out of memory does not take the
# rest with it; log.txt says how each ended (rc, seconds) and results.jsonl collects every
# JSON line the parts print. A missing Python package (see ../shared/device/README.md: the
# machine lacked grain, ml_collections, math-verify, tensorboardX) travels as wheels in
# .whl/ and is installed first when that folder exists.
#
# Parts (the seconds are the H200's, with margin):
#   versions      jax, the devices, nvidia-smi
#   default_run   python -m jaxgrpo.train --config=configs/math.py: 500 steps (37 s there)
#   eval_cold     python -m jaxgrpo.evaluate on its last checkpoint, k=8, empty compile cache
#   eval_warm     the same again: the first call from the persistent compilation cache
#   sampler       python -m jaxgrpo.bench sampler --preset small --mode all
#   rollout       python -m jaxgrpo.bench rollout: the Qwen3-1.7B rollout, EOS off and
#                 long-tailed, T=1 and top-k/top-p, against the 4.8 TB/s floor
#   rollout_blocks  the same at T=1 with generation.decode_block_size 128 (the decode step
#                 reads the generated keys only up to the current block)
#   rollout_compact  rollout_blocks with generation.compact_stages 3 (live rows move into
#                 smaller batches): against rollout_blocks, what compaction buys
#   truncation    python -m jaxgrpo.bench truncation: one step's draw over 151,936 tokens for
#                 256 rows, per mode (top-k, top-p, both) against plain sampling
#   update        bench/update_at_scale.py: the Qwen3-1.7B update, scanned and unrolled,
#                 XLA and cuDNN attention
#   update_8k     the same update at 8,192 new tokens (64 rollouts, 256-token prompts,
#                 remat full, cuDNN): rows of 8 a micro-batch against packed micro-batches
#                 of 8,448 tokens (grpo.micro_batch_tokens, issue 51): the MFU of each
#   long_tail     python -m jaxgrpo.bench long-tail: partial rollouts (rounds of 512 tokens)
#                 against synchronous ones on a reasoning-like length distribution (log-normal,
#                 median 512, cap 4,096), the small preset, 16 x 8 rollouts: wall time and
#                 decode steps per trained token (issue 52)
#   lora_decode   python -m jaxgrpo.bench lora-decode: LoRA's merge once per step against
#                 the adapter path at every token, Qwen2.5-1.5B in bfloat16, 64 x 512 tokens
set -u
export PYTHONUNBUFFERED=1
# jaxgrpo.bench defaults to CPU unless told: on the GPU machine, the GPU.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
L=$OUT/log.txt
R=$OUT/results.jsonl
W=$(mktemp -d)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$L" 2>&1 || echo "pip failed" | tee -a "$L"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

PARTS=${PARTS:-all}
part() {  # part NAME TIMEOUT_S COMMAND...: runs it, logs how it ended, collects JSON lines
  local name=$1 t=$2 s rc
  shift 2
  case " $PARTS " in *" all "*|*" $name "*) ;; *) return 0 ;; esac
  echo "=== $name $(date +%T)" >>"$L"
  s=$(date +%s)
  timeout -k 5 "$t" "$@" >"$OUT/$name.out" 2>&1
  rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - s ))s" >>"$L"
  grep -h '^{' "$OUT/$name.out" | sed "s/^{/{\"part\": \"$name\", /" >>"$R"
  tail -5 "$OUT/$name.out" >>"$L"
}

if [ -n "${SMALL:-}" ]; then  # a dry run: every part, each cut to seconds on a CPU
  STEPS=--config.grpo.max_num_steps=4; UPDATE=(--small --rollouts 16 --configs 8:0:none:scan:xla)
  UPDATE_8K=(--small --rollouts 16 --prompt_len 32 --new_tokens 64 --reps 1
             --configs 8:0:full:scan:xla,t96:0:full:scan:xla)
  SAMPLER=(--preset tiny --reps 1); ROLLOUT=(--preset tiny --reps 1); TRUNC=(--rows 8 --reps 1)
  LORA=(--shape tiny --rows 4 --new_tokens 4 --reps 1)
  LONG_TAIL=(--preset tiny --prompts 2 --generations 4 --new_tokens 64 --steps 1)
else
  STEPS=; UPDATE=(--configs 32:128:save_dots:scan:xla,32:128:save_dots:scan:cudnn,32:128:save_dots:unrolled:cudnn --reps 2)
  UPDATE_8K=(--rollouts 64 --prompt_len 256 --new_tokens 8192 --reps 2
             --configs 8:128:full:scan:cudnn,t8448:128:full:scan:cudnn)
  SAMPLER=(--preset small --mode all --reps 5); ROLLOUT=(--bandwidth_gbs "${BANDWIDTH_GBS:-4800}" --reps 3)
  TRUNC=(--reps 10)
  LORA=(--shape qwen2.5-1.5b --dtype bfloat16 --rows 64 --new_tokens 512 --reps 3)
  LONG_TAIL=(--preset small --prompts 16 --generations 8 --new_tokens 4096 --steps 4)
fi

part versions 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"'
part default_run 150 python3 -m jaxgrpo.train --config=configs/math.py $STEPS --workdir="$W/run"
cp "$W/run/summary.json" "$OUT/default_summary.json" 2>/dev/null
for name in eval_cold eval_warm; do
  part $name 90 python3 -m jaxgrpo.evaluate --config=configs/math.py --workdir="$W/run" \
    --config.grpo.val_num_generations_per_prompt=8 --config.compilation_cache_dir="$W/cache" \
    --out="$W/$name"
  cp "$W/$name/eval.json" "$OUT/$name.json" 2>/dev/null
done
part sampler 120 python3 -m jaxgrpo.bench sampler "${SAMPLER[@]}"
part rollout 400 python3 -m jaxgrpo.bench rollout "${ROLLOUT[@]}"
part rollout_blocks 240 python3 -m jaxgrpo.bench rollout "${ROLLOUT[@]}" --modes pure \
  --decode_block 128
part rollout_compact 240 python3 -m jaxgrpo.bench rollout "${ROLLOUT[@]}" --modes pure \
  --decode_block 128 --compact_stages 3
part truncation 120 python3 -m jaxgrpo.bench truncation "${TRUNC[@]}"
part update 300 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/update_at_scale.py "${UPDATE[@]}"
part update_8k 420 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/update_at_scale.py \
  "${UPDATE_8K[@]}"
part long_tail 300 python3 -m jaxgrpo.bench long-tail "${LONG_TAIL[@]}"
part lora_decode 240 python3 -m jaxgrpo.bench lora-decode "${LORA[@]}"
echo "=== done $(date +%T)" >>"$L"
rm -rf "$W"

"""Makes the shipped warm-start checkpoint `jaxgrpo/assets/arith3` (rerun it to reproduce).

A randomly initialised model earns no reward, so GRPO has nothing to push on. This script
trains jaxgrpo's own decoder (the architecture in configs/math.py) with plain supervised
next-token loss on the answers of the arithmetic task's *training* split, and stops as soon
as its temperature-1 exact-match accuracy on held-out problems reaches --target (default
0.2): a policy that is partly right, with room for GRPO to improve it. The accuracy jumps
sharply during warm-start, so the snapshot is chosen by evaluation, not by step count.

    python scripts/make_warmstart.py [--out jaxgrpo/assets/arith3] [--target 0.2]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgrpo import data, rewards
from jaxgrpo.run import loading
from jaxgrpo.model import hf
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model.tokenizer import Tokenizer
from jaxgrpo.rollout import sampling
from jaxgrpo.rollout.policy import Policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_default_config():
  spec = importlib.util.spec_from_file_location("math_config",
                                                os.path.join(ROOT, "configs", "math.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def encode_examples(tok: Tokenizer, rows):
  """[bos] question answer [eos] as one row each, and a mask over the answer targets."""
  seqs = [tok.encode(r["question"]) + tok.encode(r["answer"], add_bos=False) + [tok.eos_id]
          for r in rows]
  width = max(len(s) for s in seqs)
  tokens = np.full((len(seqs), width), tok.pad_id, np.int32)
  target_mask = np.zeros((len(seqs), width), bool)
  for i, (s, r) in enumerate(zip(seqs, rows)):
    tokens[i, :len(s)] = s
    start = len(tok.encode(r["question"]))
    target_mask[i, start:len(s)] = True  # answer digits and eos are the targets
  return tokens, target_mask


def sft_step(cfg, optimizer, pad_id: int):
  """The jitted supervised step: (params, opt_state, tokens_BxT, target_BxT) -> (params,
  opt_state, loss), next-token loss on the target positions of right-padded rows.
  scripts/make_calculator.py uses it too."""

  @jax.jit
  def step(params, opt_state, tokens_BxT, target_BxT):
    def loss_fn(p):
      mask = tokens_BxT != pad_id
      # Right-padded rows: positions count from 0 at the first token.
      logits = model_lib.Decoder(cfg).apply({"params": p}, tokens_BxT,
                                            jnp.cumsum(mask, axis=1) - 1, mask)
      logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
      nll = -jnp.take_along_axis(logp, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
      w = target_BxT[:, 1:].astype(jnp.float32)
      return (nll * w).sum() / w.sum()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(ROOT, "jaxgrpo", "assets", "arith3"))
  ap.add_argument("--target", type=float, default=0.2)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--max_steps", type=int, default=3000)
  ap.add_argument("--eval_every", type=int, default=25)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  config = load_default_config()
  cfg = model_lib.ModelConfig.from_dict(loading.architecture(config))
  tok = Tokenizer.char_level("0123456789+=")
  d = config.data
  train_rows = data.arithmetic_examples(d.num_train_examples, d.num_digits, seed=args.seed,
                                        split="train")
  val_rows = data.arithmetic_examples(d.num_val_examples, d.num_digits, seed=args.seed,
                                      split="val")
  tokens, target_mask = encode_examples(tok, train_rows)
  val_prompts, val_mask = data.tokenize_prompts(tok, [r["question"] for r in val_rows],
                                                d.max_prompt_length)

  policy = Policy.init(cfg, seed=args.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
  optimizer = optax.adam(args.lr)
  params, opt_state = policy.params, optax.adam(args.lr).init(policy.params)

  step = sft_step(cfg, optimizer, tok.pad_id)

  def evaluate(params, seed):
    policy.params = params
    out = policy.generate(val_prompts, sampling.SamplingParams(1.0, 1.0, 0), 1,
                          config.generation.max_new_tokens, seed, prompt_mask_BxL=val_mask)
    completions = [tok.decode(row) for row in np.asarray(out.tokens_NxT)]
    return float(np.mean(rewards.exact_match(completions, [r["answer"] for r in val_rows])))

  rng = np.random.default_rng(args.seed)
  t0 = time.time()
  for i in range(1, args.max_steps + 1):
    idx = rng.integers(0, len(tokens), args.batch)
    params, opt_state, loss = step(params, opt_state, tokens[idx], target_mask[idx])
    if i % args.eval_every == 0:
      acc = evaluate(params, seed=i)
      print(f"step {i}: loss {float(loss):.4f}, temperature-1 val accuracy {acc:.3f} "
            f"({time.time() - t0:.0f}s)", flush=True)
      if acc >= args.target:
        hf.save_pretrained(args.out, cfg, params, tok)
        print(f"saved {args.out} at step {i} (accuracy {acc:.3f} >= {args.target})")
        return
  raise SystemExit(f"accuracy never reached {args.target} in {args.max_steps} steps")


if __name__ == "__main__":
  main()

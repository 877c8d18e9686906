"""Makes the calculator task's embedded assets `jaxgrpo/assets/calc3` (rerun to reproduce).

The task: multiply two 3-digit numbers ("123*456=" -> "56088"). The small character model
cannot do that in its head, but it can call the built-in `calculator` tool the way Qwen
models call tools and copy the result:

    123*456=<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>
        <tool_response>56088</tool_response>56088<eos>

(the <tool_response> part is the environment's observation: `tools` with chat='none').
This script writes the data (train.jsonl, val.jsonl: disjoint pairs) and a supervised warm
start: jaxgrpo's decoder trained with next-token loss on a mixture of direct answers and
such tool transcripts (observation tokens are not targets), in which only --tool_share
(default 0.2) of the examples call the tool. It stops once a tool call copies the result
right (--copy_target of the held-out calls) and saves. The warm start then calls the tool
in a minority of episodes and is mostly wrong without it: GRPO has a clear way up
(configs/calculator.py).

    python scripts/make_calculator.py [--out jaxgrpo/assets/calc3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import optax
from tokenizers import AddedToken

import make_warmstart  # scripts/make_warmstart.py, beside this file
from jaxgrpo.model import hf
from jaxgrpo.model import decoder as model_lib
from jaxgrpo.model.tokenizer import Tokenizer
from jaxgrpo.rollout.policy import Policy
from jaxgrpo.rollout import sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPHABET = "0123456789*=" + '{}":, ' + "abcdefghijklmnopqrstuvwxyz_"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def tokenizer() -> Tokenizer:
  """Characters, plus the four tool markers as single (non-special) tokens, as Qwen has."""
  tok = Tokenizer.char_level(ALPHABET)
  tok.hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
  tok.vocab_size = tok.hf.get_vocab_size(with_added_tokens=True)
  return tok


def call(question: str) -> str:
  expression = question.rstrip("=")
  return ('<tool_call>{"name": "calculator", "arguments": {"expression": "'
          f'{expression}"}}}}</tool_call>')


def rows(seed: int, n_train: int, n_val: int):
  """Disjoint train and val pairs (a, b) of 3-digit numbers, as question/answer rows."""
  rng = np.random.default_rng(seed)
  pairs = rng.permutation(900 * 900)[:n_train + n_val]
  out = [{"question": f"{100 + p // 900}*{100 + p % 900}=",
          "answer": str((100 + p // 900) * (100 + p % 900))} for p in pairs]
  return out[:n_train], out[n_train:]


def example(tok: Tokenizer, row: dict, tool: bool):
  """(ids, target mask): the prompt, then what the model writes (targets) and, on the tool
  path, the observation between its two turns (not a target)."""
  prompt = tok.encode(row["question"])
  if not tool:
    parts = [(row["answer"], True)]
  else:
    parts = [(call(row["question"]), True),
             (f"<tool_response>{row['answer']}</tool_response>", False),
             (row["answer"], True)]
  ids, target = list(prompt), [False] * len(prompt)
  for text, is_target in parts:
    piece = tok.encode(text, add_bos=False)
    ids += piece
    target += [is_target] * len(piece)
  ids.append(tok.eos_id)
  target.append(True)
  return ids, target


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.path.join(ROOT, "jaxgrpo", "assets", "calc3"))
  ap.add_argument("--tool_share", type=float, default=0.2)
  ap.add_argument("--copy_target", type=float, default=0.9)
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--max_steps", type=int, default=4000)
  ap.add_argument("--eval_every", type=int, default=100)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  tok = tokenizer()
  train_rows, val_rows = rows(args.seed, 20000, 500)
  cfg = model_lib.ModelConfig(vocab_size=tok.vocab_size, d_model=128, num_layers=2,
                              num_heads=4, num_kv_heads=4, head_dim=32, mlp_dim=512,
                              rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True)
  rng = np.random.default_rng(args.seed)
  tool_N = rng.random(len(train_rows)) < args.tool_share
  examples = [example(tok, r, t) for r, t in zip(train_rows, tool_N)]
  width = max(len(ids) for ids, _ in examples)
  tokens = np.full((len(examples), width), tok.pad_id, np.int32)
  targets = np.zeros((len(examples), width), bool)
  for i, (ids, target) in enumerate(examples):
    tokens[i, :len(ids)], targets[i, :len(ids)] = ids, target

  policy = Policy.init(cfg, seed=args.seed, pad_id=tok.pad_id, eos_id=tok.eos_id)
  optimizer = optax.adam(args.lr)
  params, opt_state = policy.params, optimizer.init(policy.params)

  step = make_warmstart.sft_step(cfg, optimizer, tok.pad_id)

  # Held-out checks at temperature 1: how often the first turn calls the tool, and how often
  # the answer after a (forced) correct tool response is copied right.
  val = val_rows[:256]
  first_prompts = [tok.encode(r["question"]) for r in val]
  copy_prompts = [example(tok, r, True)[0][:-len(r["answer"]) - 1] for r in val]

  def evaluate(params, seed):
    policy.params = params
    sp = sampling.SamplingParams(1.0, 1.0, 0)
    first = policy.generate(first_prompts, sp, 1, 8, seed)
    calls = float(np.mean(np.asarray(first.tokens_NxT)[:, 0] == tok.encode(
        "<tool_call>", add_bos=False)[0]))
    direct = float(np.mean([tok.decode(t) == r["answer"] for t, r in
                            zip(np.asarray(first.tokens_NxT), val)]))
    copied = policy.generate(copy_prompts, sp, 1, 8, seed)
    copy = float(np.mean([tok.decode(t) == r["answer"] for t, r in
                          zip(np.asarray(copied.tokens_NxT), val)]))
    return calls, direct, copy

  t0 = time.time()
  for i in range(1, args.max_steps + 1):
    idx = rng.integers(0, len(tokens), args.batch)
    params, opt_state, loss = step(params, opt_state, tokens[idx], targets[idx])
    if i % args.eval_every == 0:
      calls, direct, copy = evaluate(params, seed=i)
      print(f"step {i}: loss {float(loss):.4f}; first turn calls the tool {calls:.3f}, direct "
            f"answers right {direct:.3f}, tool results copied right {copy:.3f} "
            f"({time.time() - t0:.0f}s)", flush=True)
      if copy >= args.copy_target:
        hf.save_pretrained(args.out, cfg, params, tok)
        for name, part in (("train.jsonl", train_rows), ("val.jsonl", val_rows)):
          with open(os.path.join(args.out, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"saved {args.out} at step {i}")
        return
  raise SystemExit(f"copying never reached {args.copy_target} in {args.max_steps} steps")


if __name__ == "__main__":
  main()

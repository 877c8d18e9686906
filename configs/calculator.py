"""A task that needs a tool: multiply two 3-digit numbers, on a laptop CPU, nothing downloaded.

    python -m jaxgrpo.train --config=configs/calculator.py

The policy (`@embedded/calc3`, made by `python scripts/make_calculator.py`) is the embedded
default's small character model after a short supervised warm start on a mixture: mostly
direct answers, which it gets wrong (it cannot multiply in its head), and a minority of
transcripts that call the built-in `calculator` tool the way Qwen models call tools and copy
its answer:

    123*456=<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>
      <tool_response>56088</tool_response>56088

Each of G=8 episodes per prompt runs against the `tools` environment (jaxgrpo/tools.py;
chat='none': the model has no chat template): a turn ends at `</tool_call>` (a stop string)
or at the end token; the environment runs the call and answers with the <tool_response>
block, which is appended and never trained; a turn without a call ends the episode. The
`math` reward reads the last number the policy wrote itself (its turns, without the tool's
response: an episode that calls the tool and then writes only its end token scores 0). GRPO raises how often the model calls the
tool, and with it the accuracy; the progress line shows turns_mean and tool_calls_mean.

`arg`: `smoke` (a few steps, for tests).
"""

import importlib.util
import os


def _embedded_default():
  """configs/math.py's config, which this one changes where the task differs."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math.py")
  spec = importlib.util.spec_from_file_location("jaxgrpo_configs_math", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config(arg=None):
  c = _embedded_default()
  c.model.checkpoint = "@embedded/calc3"
  c.model.vocab_size = 53
  # The shipped rows: disjoint train and validation pairs of 3-digit numbers.
  c.data.source = "jsonl"
  c.data.train_path = "@calc3/train.jsonl"
  c.data.val_path = "@calc3/val.jsonl"
  c.data.max_prompt_length = 9  # <bos> + "123*456="
  c.rewards.exact_match, c.rewards.math = 0.0, 1.0
  # A call is 64 tokens; then a 7-token response and the copied answer.
  c.generation.max_new_tokens = 72
  c.generation.max_episode_tokens = 128
  c.generation.compact_stages = 2  # direct answers end after 6 tokens, calls after 64
  c.env.name = "tools"
  c.env.kwargs = '{"tools": "calculator", "chat": "none", "stop_at_call_end": true}'
  c.env.max_turns = 3
  c.env.max_observation_tokens = 48  # a result is 7 tokens, an error message longer
  c.grpo.num_prompts_per_step = 16
  c.grpo.max_num_steps = 60
  c.grpo.val_period = 20
  c.grpo.val_batch_size = 128
  c.grpo.max_val_samples = 256
  c.optim.learning_rate = 2e-4
  c.checkpoint.save_period = 20
  if arg == "smoke":
    c.grpo.num_prompts_per_step = 4
    c.grpo.num_generations_per_prompt = 4
    c.grpo.max_num_steps = 2
    c.grpo.val_period = 2
    c.grpo.val_batch_size = 8
    c.grpo.max_val_samples = 8
    c.grpo.val_num_generations_per_prompt = 2
    c.checkpoint.save_period = 2
    c.logging.plots = False
  elif arg not in (None, ""):
    raise ValueError(f"configs/calculator.py: unknown preset {arg!r}; allowed: smoke")
  return c

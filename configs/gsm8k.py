"""GRPO on GSM8K with a Hugging Face instruct model (Qwen2.5, Qwen3, Llama 3.x), for a TPU slice.

    python -m jaxgrpo.train --config=configs/gsm8k.py \
        --config.model.hf_checkpoint=/path/to/Qwen2.5-1.5B-Instruct --workdir=runs/gsm8k

The architecture, tokenizer, chat template and end-of-turn token come from the model folder
(architecture keys left None here); sampling never reads its generation_config.json. The
prompt is the model's chat template around the question and an instruction to put the final
answer in \\boxed{}; `math` (math-verify) scores it against GSM8K's reference answer. The GSM8K
files ship with jaxgrpo (`@gsm8k/`, MIT licence), so nothing is downloaded.

Numerics: float32 parameters and optimizer state, bfloat16 compute. Mesh: fully sharded data
parallel over every chip (fsdp=-1). Batches (64 prompts x 8) divide over up to 64 chips; on a
larger slice raise num_prompts_per_step with it.

Memory: each layer is rematerialised and log-probs are computed 128 positions at a time. The
update's micro-batch and the validation batch are 'auto': at start-up the trainer compiles
the update step and the val sampler for a few sizes, reads their memory from the compiler
and takes the largest that fits the chips (jaxgrpo/run/sizing.py; one line says what it chose, and
`launch/compile_check.py --topology=... --config=configs/gsm8k.py` prints the same choice
before a slice is reserved). A number instead (--config.grpo.micro_batch_size=256) skips
the search. What the check chose for real models and slices is in BENCHMARKS.md.

`arg`: `cpu` shrinks lengths and batches to check the pipeline on a laptop with a tiny model;
`lora` trains rank-16 adapters on a frozen bfloat16 base instead of every weight; `tools` runs
multi-turn episodes in which the model may call a calculator tool; `long` gives responses
up to 16,384 tokens (long reasoning; splash attention on TPU) (`cpu,lora`, `cpu,tools`,
`cpu,long`: combined).
"""

import ml_collections
from ml_collections import config_dict


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Compiled programs are kept on disk and loaded by later processes (a restart, the
  # evaluation command): 'auto' is $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxgrpo/jax
  # ($XDG_CACHE_HOME/jaxgrpo/jax); '' turns the cache off; any other value is the folder.
  c.compilation_cache_dir = "auto"
  unset = lambda t: config_dict.placeholder(t)  # None: the checkpoint's value

  c.model = ml_collections.ConfigDict(dict(
      checkpoint="", hf_checkpoint=config_dict.placeholder(str),
      vocab_size=unset(int), d_model=unset(int), num_layers=unset(int), num_heads=unset(int),
      num_kv_heads=unset(int), head_dim=unset(int), mlp_dim=unset(int),
      rope_theta=unset(float), norm_eps=unset(float), tie_embeddings=unset(bool),
      qk_norm=unset(bool), qkv_bias=unset(bool), rope_scaling_factor=unset(float),
      rope_low_freq_factor=unset(float), rope_high_freq_factor=unset(float),
      rope_original_max_positions=unset(int), num_experts=unset(int),
      num_experts_per_tok=unset(int), moe_mlp_dim=unset(int), norm_topk_prob=unset(bool),
      hidden_act=unset(str), norm_plus_one=unset(bool), post_norms=unset(bool),
      embed_scale=unset(bool), query_pre_attn_scalar=unset(float), sliding_window=unset(int),
      sliding_window_pattern=unset(int), rope_local_theta=unset(float),
      rope_scaling_type=unset(str),
      # A mixture's experts: auto = grouped matmuls (ragged_dot) on TPU/GPU, dense on CPU.
      # The router's logits in float32 (slime's choice): a bfloat16 mixture's choice of
      # experts does not turn on bfloat16 rounding; 'compute' routes as transformers does.
      moe_matmul="auto", router_dtype="float32",
      param_dtype="float32", dtype="bfloat16",
      # Each layer keeps only its input for the backward pass and recomputes the rest: at
      # 512 rollouts of ~900 tokens the activations, not the weights, fill the chips.
      remat="full",
      # None: the layers scanned (one compiled layer body) on TPU and GPU, unrolled on CPU.
      scan_layers=unset(bool),
      # None: splash (Pallas' flash kernel) on TPU, cuDNN's fused attention on a GPU
      # (bfloat16 compute), XLA's einsums elsewhere (CPU).
      attention=unset(str),
      # LoRA: rank 0 trains every weight; a rank trains adapters (alpha / rank scaled) on
      # the frozen base, on all-linear or a list of q,k,v,o,gate,up,down.
      lora_rank=0, lora_alpha=32.0, lora_targets="all-linear"))

  # dcn_data: TPU slices (multi-slice); data/fsdp/context/tensor are sizes inside one slice.
  # context > 1 splits the update's packed rows along their sequence (grpo.micro_batch_tokens).
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, expert=1, context=1, tensor=1, dcn_data=1,
                                             memory_limit_gib=config_dict.placeholder(float)))

  c.data = ml_collections.ConfigDict(dict(
      source="jsonl", train_path="@gsm8k/train.jsonl", val_path="@gsm8k/test.jsonl",
      question_key="question", answer_key="answer",
      prompt_template=("{question}\nPlease reason step by step, and put your final answer "
                       "within \\boxed{{}}."),
      use_chat_template=True, max_prompt_length=400, num_digits=3, num_train_examples=0,
      num_val_examples=0,
      # The date a chat template's strftime_now renders (Llama 3.1 writes "Today Date" into
      # every prompt): '' is the day the run starts, then kept in its config.json, so a
      # resume or an evaluation on another day renders the same prompts; or YYYY-MM-DD.
      chat_template_date=""))

  # math-verify against the reference's final answer; a small bonus for a \boxed{} answer
  # can be switched on with --config.rewards.format=0.1.
  c.rewards = ml_collections.ConfigDict(dict(exact_match=0.0, math=1.0, format=0.0))

  # Your own code, imported before the config is checked: comma-separated Python files or
  # module names whose @jaxgrpo.rewards.register(...) rewards `rewards` may then weight.
  c.user_modules = ""
  # Rewards run in this many worker processes (-1: one per core, at most 8; 0: in the main
  # process, without timeouts, for debugging), each call limited to reward_timeout_s
  # seconds; a reward that raises or times out scores None for its rows, and a run whose
  # every reward row fails reward_max_failed_steps steps in a row stops.
  c.reward_workers = -1
  c.reward_timeout_s = 60.0
  c.reward_max_failed_steps = 3

  c.generation = ml_collections.ConfigDict(dict(
      temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=512, backend="native",
      # jetstream only: decode slots (0: one per row of a rollout, so a call is one wave).
      max_concurrent_decodes=0,
      # native only: the decode step reads the samples' keys in blocks of this many slots,
      # up to the current token's (0: the whole cache every step; blocks measured 1.07-1.12x
      # slower on CPU, unmeasured on accelerators: see docs/scaling.md).
      decode_block_size=0,
      # native only: when the live rows fit in a batch half as large, decode them in one,
      # up to this many times (0: every row is computed until the longest ends). The same
      # rollout either way (tested). Completions here are long-tailed, up to 512 tokens;
      # 1.3-1.5x faster on CPU (BENCHMARKS.md).
      compact_stages=3,
      # Partial rollouts (run/partial_rollouts.py): > 0 decodes each sampler row at most this many
      # tokens a round, carries the rows that have not ended into the next step and refills
      # the freed rows with new prompts; 0: every step decodes until its longest row ends.
      max_tokens_per_step=0,
      # native only: the decode step's weights made whole on every chip once per sampler
      # call, where the mesh splits only rows (fsdp, data): otherwise each layer's weights
      # are all-gathered every token-step (Qwen2.5-7B on v5p:2x2x2: a token-step predicted
      # 66.8 -> 15.9 ms by the compile check). Costs the weights in the compute dtype on each
      # chip while sampling (the compile check's sampler totals include them).
      gather_weights=True,
      val_temperature=0.6, val_top_p=config_dict.placeholder(float),
      val_top_k=config_dict.placeholder(int),
      # Multi-turn episodes (env.name set): the prompt and every turn and observation
      # together fit in this many tokens (0: single-turn, unused).
      max_episode_tokens=0))

  # Multi-turn episodes (jaxgrpo/envs.py, episodes.py): '' samples one completion per
  # prompt, as always. A name runs episodes against that environment (registered with
  # @jaxgrpo.envs.register, built in: 'tools'), made with `kwargs` (a JSON object); each
  # turn ends at the end token or a `stop_strings` token (comma-separated), each step of an
  # environment runs in one of `workers` processes within `timeout_s`. An observation
  # appends at most `max_observation_tokens` (the chat template's framing included); longer
  # text is cut before templating, on `observation_truncation_side` ('right' keeps its
  # start, 'left' its end, 'middle' both).
  c.env = ml_collections.ConfigDict(dict(
      name="", kwargs="", max_turns=4, max_observation_tokens=64, stop_strings="",
      observation_truncation_side="right", timeout_s=30.0, workers=2))

  c.grpo = ml_collections.ConfigDict(dict(
      num_prompts_per_step=64, num_generations_per_prompt=8, num_iterations=1,
      beta=0.0, kl_type="k3", epsilon=0.2, epsilon_high=0.28, loss_agg="token_mean",
      scale_rewards="group", mask_truncated_completions=True,
      # Dynamic sampling (DAPO): 'filter' samples generation batches of ceil(oversample_factor
      # x num_prompts_per_step) prompts, up to max_generation_batches per step, and updates
      # on the first groups whose rewards differ (by the total reward, or by the reward
      # dynamic_sampling_metric names); 'off' updates on every group sampled.
      dynamic_sampling="off", oversample_factor=2.0, max_generation_batches=3,
      dynamic_sampling_metric=config_dict.placeholder(str),
      # Rollouts per forward/backward pass ('auto': the most that fit; 0 = all 512; else a
      # multiple of 8 x the chips), and completion positions per output projection: 512
      # rollouts x 128 positions x 151,936 float32 logits is a chunk of 37 GiB over the
      # slice, not 264 GiB for all 912.
      micro_batch_size="auto", logprob_chunk_size=128, max_num_steps=500,
      # Or rollouts packed end to end into micro-batches of this many tokens a chip, for
      # long-tailed lengths (0 = off; 'auto': the most that fit): docs/scaling.md.
      micro_batch_tokens=0,
      # Partial rollouts only: a group holding a token drawn more than max_staleness
      # parameter versions ago is dropped; each token's loss is weighted by
      # min(pi_step / pi_sampler, importance_weight_cap) (docs/loss.md).
      max_staleness=4, importance_weight_cap=2.0,
      # A mixture of experts (Qwen3-MoE) only: the router's load-balancing loss, added with
      # this weight (0 = off, as verl runs RL; Qwen3-MoE's config.json says 0.001).
      router_aux_loss_coef=0.0,
      val_period=50, val_at_start=True, val_at_end=True,
      # Prompts (x k=4) per validation batch: 'auto', the most whose val sampler fits beside
      # the train state; the numbers do not depend on the batch size.
      val_batch_size="auto",
      max_val_samples=0,  # all 1319 test problems
      val_num_generations_per_prompt=4, val_pass_threshold=0.0, val_seed=0,
      stop_at_validation_metric=config_dict.placeholder(str),
      stop_at_validation_threshold=config_dict.placeholder(float),
      # e.g. 0.95: stop only once the metric's 95% lower confidence bound reaches it.
      stop_at_validation_confidence=config_dict.placeholder(float)))

  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-6, warmup_steps=10, weight_decay=0.0, grad_clip=1.0,
      schedule="constant"))

  c.checkpoint = ml_collections.ConfigDict(dict(
      save_period=50, max_to_keep=2, resume="auto", best_metric="accuracy", best_to_keep=1))

  # Metrics go to metrics.jsonl and each tracker named here: tensorboard, wandb, trackio
  # (comma-separated; wandb and trackio are extras: pip install -e '.[wandb]'). run_name ''
  # is the workdir's name; tags are comma-separated.
  c.logging = ml_collections.ConfigDict(dict(
      trackers="tensorboard", project="jaxgrpo", run_name="", tags="", plots=True,
      console=True))

  presets = [a for a in (arg or "").split(",") if a]
  for preset in presets:
    if preset not in ("cpu", "lora", "tools", "long"):
      raise ValueError(f"configs/gsm8k.py: unknown preset {preset!r}; allowed: cpu, lora, "
                       "tools, long (or several: cpu,lora)")
  if "lora" in presets:
    # Rank-16 adapters on every linear layer of a frozen base (model/lora.py): the optimizer
    # holds the adapters' moments only and the KL reference is the base itself. Adapters
    # take a larger step than full fine-tuning's 1e-6. The frozen base stays in bfloat16,
    # the dtype Qwen2.5 and Llama 3 ship in (half the bytes; the compute is bfloat16 anyway,
    # so the forward sees the same weights): only the adapters are float32.
    c.model.lora_rank, c.model.lora_alpha, c.model.lora_targets = 16, 32.0, "all-linear"
    c.model.param_dtype = "bfloat16"
    c.optim.learning_rate = 1e-5
  if "tools" in presets:
    # Multi-turn episodes with a calculator (jaxgrpo/tools.py: exact arithmetic by its own
    # parser, never eval). The chat template shows the tool in the system prompt; the model
    # calls it as <tool_call>{json}</tool_call> and ends its turn with <|im_end|>; the
    # result comes back as a tool message the model's own chat template renders (Qwen2.5:
    # a user turn of <tool_response> blocks). A Llama 3.x model: add "parser":
    # "llama3_json" to env.kwargs (its calls are the turn's JSON; results an ipython turn).
    # Up to 4 turns of up to 512 tokens, 1024 after the prompt in all (turns and results). Turns run on a KV cache
    # kept between them (rollout/turns.py): the prompt prefilled once for its episodes,
    # each observation appended at its episode's place. Qwen2.5-1.5B on v5e:2x4: the train
    # sampler 11.3 GiB a chip, the update 10.8 (launch/compile_check.py; BENCHMARKS.md).
    c.env.name = "tools"
    c.env.kwargs = '{"tools": "calculator"}'
    c.env.max_turns = 4
    c.env.max_observation_tokens = 64
    c.generation.max_episode_tokens = c.data.max_prompt_length + 1024
  if "long" in presets:
    # Long reasoning (issue 51): responses of up to 16,384 tokens, as DAPO and DeepScaleR
    # train. On TPU the attention is splash (model.attention None: no [T, S] scores held);
    # the update packs rollouts into micro-batches by tokens ('auto': for Qwen2.5-7B on
    # v5p:2x2x2 one longest sequence's 16,784 tokens a chip, 36.4 GiB; rows padded to the
    # longest in sub-groups of 4 needed 65.7), so short completions cost their own length;
    # the validation batch stays 'auto' (on any slice the most prompts whose val sampler
    # fits; sizes whose KV cache alone overflows are not compiled: all 1,320 prompts would
    # need 886 GiB a chip and took 26 minutes to compile). Compaction
    # is off: its copies of a 16k cache do not fit (train sampler 129.5 GiB with 3 stages,
    # 73.3 without; BENCHMARKS.md). The decode reads the generated keys in blocks of 512,
    # only up to the current token's: at 16k a step's K/V reads, not the weights, bound the
    # decode (for 7B on 8 chips, projected 22 ms a step reading the whole cache, 11 reading
    # the filled part, beside 5.5 for the weights); on CPU it measured the same either way.
    # Truncated completions leave the loss.
    c.generation.max_new_tokens = 16384
    c.generation.compact_stages = 0
    c.generation.decode_block_size = 512
    # At 16k the cache fills the chips: whole bf16 weights on each (15 GB for 7B) would not
    # fit beside it (the train sampler 96.3 GiB of v5p's 95); the weights stay split.
    c.generation.gather_weights = False
    del c.grpo["micro_batch_tokens"]  # re-typed: the key ships as the number 0
    c.grpo.micro_batch_tokens = "auto"
    c.grpo.mask_truncated_completions = True
  if "cpu" in presets:
    c.mesh.fsdp = 1
    c.mesh.data = -1
    c.model.dtype = "float32"
    c.data.max_prompt_length = 1024  # the fixtures' byte-level tokenizer: long prompts
    # `cpu,long`: the long preset's path at a length the fixtures run in seconds.
    c.generation.max_new_tokens = 256 if "long" in presets else 16
    if "tools" in presets:  # two short turns and a result
      c.generation.max_episode_tokens = c.data.max_prompt_length + 64
    c.grpo.num_prompts_per_step = 8
    c.grpo.num_generations_per_prompt = 4
    c.grpo.max_num_steps = 2
    c.grpo.val_period = 2
    # val_batch_size and micro_batch_size stay 'auto': on CPU, with no memory limit, that is
    # the whole validation set (8) and the whole batch, and nothing is compiled to choose.
    c.grpo.max_val_samples = 8
    c.grpo.val_num_generations_per_prompt = 2
    c.logging.plots = False
  return c

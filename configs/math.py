"""The embedded default: GRPO on 3-digit addition, on a laptop CPU, nothing downloaded.

    python -m jaxgrpo.train --config=configs/math.py
    python -m jaxgrpo.train --config=configs/math.py:smoke        # a few steps (tests)
    python -m jaxgrpo.train --config=configs/math.py --config.grpo.max_num_steps=50

The policy starts from a small checkpoint shipped inside the package (`@embedded/arith3`,
made by `python scripts/make_warmstart.py`: a short supervised warm-start of jaxgrpo's own
decoder), which solves about a quarter of the problems at temperature 1. GRPO then rewards
exact answers ("0579" for "123+456=") and the accuracy climbs.

`arg` only switches presets that change several values at once (big_vision style):
  smoke: 3 steps, small batches, no plots; what the test-suite runs.
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

  # Architecture of the shipped checkpoint (the loader checks that they agree).
  c.model = ml_collections.ConfigDict(dict(
      checkpoint="@embedded/arith3",  # '' = random init with a char-level tokenizer
      hf_checkpoint="",  # or a Hugging Face model folder (see configs/gsm8k.py)
      vocab_size=16, d_model=128, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32,
      mlp_dim=512, rope_theta=10_000.0, norm_eps=1e-6, tie_embeddings=True, qk_norm=False,
      qkv_bias=False, rope_scaling_factor=0.0, rope_low_freq_factor=1.0,
      rope_high_freq_factor=4.0, rope_original_max_positions=8192,
      # A mixture of experts (Qwen3-MoE) when num_experts > 0; moe_matmul: how the experts
      # are computed (auto: a dense reference on CPU, grouped ragged_dot elsewhere).
      num_experts=0, num_experts_per_tok=0, moe_mlp_dim=0, norm_topk_prob=True,
      moe_matmul="auto", router_dtype="float32",
      # Gemma 3's layout (all off here): GeGLU, (1 + w) norms also after each sublayer,
      # scaled embeddings, its query scale, sliding-window local layers with their own RoPE.
      hidden_act="silu", norm_plus_one=False, post_norms=False, embed_scale=False,
      query_pre_attn_scalar=0.0, sliding_window=0, sliding_window_pattern=0,
      rope_local_theta=0.0, rope_scaling_type="llama3",
      param_dtype="float32", dtype="float32",
      remat="none",  # what each layer keeps for the backward: none, full, save_dots
      # The layers as one compiled loop body (True) or unrolled (False); None: unrolled on
      # CPU (faster steps there), scanned on TPU and GPU (compile time that does not grow
      # with depth).
      scan_layers=config_dict.placeholder(bool),
      # None: splash (Pallas' flash kernel) on TPU, cuDNN's fused attention on a GPU with
      # bfloat16 compute, XLA's einsums elsewhere (CPU).
      attention=config_dict.placeholder(str),
      # LoRA: rank 0 trains every weight; a rank trains adapters (alpha / rank scaled) on
      # the frozen base, on all-linear or a list of q,k,v,o,gate,up,down.
      lora_rank=0, lora_alpha=32.0, lora_targets="all-linear"))

  # dcn_data: TPU slices joined by the data-centre network, each a data-parallel replica;
  # data/fsdp/context/tensor are sizes inside one slice; context > 1 splits the update's
  # packed rows along their sequence (grpo.micro_batch_tokens; docs/scaling.md).
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, context=1, tensor=1, dcn_data=1,
                                             memory_limit_gib=config_dict.placeholder(float)))

  c.data = ml_collections.ConfigDict(dict(
      source="arithmetic", train_path="", val_path="", question_key="question",
      answer_key="answer", prompt_template="{question}", use_chat_template=False,
      chat_template_date="",  # with a chat template: the date it renders ('' = run start)
      max_prompt_length=9,
      num_digits=3, num_train_examples=20_000, num_val_examples=500))

  # Reward name -> weight; zero-weight rewards are not computed.
  c.rewards = ml_collections.ConfigDict(dict(exact_match=1.0, math=0.0, format=0.0))

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

  # Two sampling profiles, every field explicit (no model defaults). val_* left unset
  # (None) follow the training value, also when that is overridden on the command line;
  # setting one, e.g. --config.generation.val_temperature=0.3, never moves the training value.
  c.generation = ml_collections.ConfigDict(dict(
      temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5, backend="native",
      # jetstream only: decode slots (0: one per row of a rollout, so a call is one wave).
      max_concurrent_decodes=0,
      # native only: the decode step reads the samples' keys in blocks of this many slots,
      # up to the current token's (0: the whole cache every step; blocks measured 1.07-1.12x
      # slower on CPU, unmeasured on accelerators: see docs/scaling.md).
      decode_block_size=0,
      # native only: when the live rows fit in a batch half as large, decode them in one,
      # up to this many times (0: every row is computed until the longest ends). The same
      # rollout either way (tested). Off here: with 5 new tokens there is little to compact,
      # and each stage adds a decode loop to compile.
      compact_stages=0,
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
      val_temperature=config_dict.placeholder(float),
      val_top_p=config_dict.placeholder(float),
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
      num_prompts_per_step=32, num_generations_per_prompt=8, num_iterations=1,
      beta=0.0, kl_type="k3", epsilon=0.2, epsilon_high=0.28, loss_agg="token_mean",
      scale_rewards="group", mask_truncated_completions=False,
      # Dynamic sampling (DAPO): 'filter' samples generation batches of ceil(oversample_factor
      # x num_prompts_per_step) prompts, up to max_generation_batches per step, and updates
      # on the first groups whose rewards differ (by the total reward, or by the reward
      # dynamic_sampling_metric names); 'off' updates on every group sampled.
      dynamic_sampling="off", oversample_factor=2.0, max_generation_batches=3,
      dynamic_sampling_metric=config_dict.placeholder(str),
      # Memory, not maths: rollouts per forward/backward pass (0 = all), and completion
      # positions per output projection (None = all; a chunk never holds [N, T, vocab]).
      micro_batch_size=0, logprob_chunk_size=config_dict.placeholder(int),
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
      max_num_steps=500,
      val_period=100, val_at_start=True, val_at_end=True, val_batch_size=128,
      max_val_samples=500,  # prompts; each is sampled val_num_generations_per_prompt times
      val_num_generations_per_prompt=1, val_pass_threshold=0.0, val_seed=0,
      # e.g. "pass@4" and 0.9: stop (with a checkpoint) once a validation reaches it.
      stop_at_validation_metric=config_dict.placeholder(str),
      stop_at_validation_threshold=config_dict.placeholder(float),
      # e.g. 0.95: stop only once the metric's 95% lower confidence bound reaches it.
      stop_at_validation_confidence=config_dict.placeholder(float)))

  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=2e-4, warmup_steps=10, weight_decay=0.0, grad_clip=1.0,
      schedule="cosine"))

  # Checkpoints under <workdir>/checkpoints: every save_period steps (0: only at the end, an
  # early stop or a preemption), the newest max_to_keep plus the best_to_keep best by
  # best_metric (e.g. "pass@1"). resume: 'auto' continues the workdir's run, 'never', or a path.
  c.checkpoint = ml_collections.ConfigDict(dict(
      save_period=100, max_to_keep=3, resume="auto",
      best_metric=config_dict.placeholder(str), best_to_keep=1))

  # Metrics go to metrics.jsonl and each tracker named here: tensorboard, wandb, trackio
  # (comma-separated; wandb and trackio are extras: pip install -e '.[wandb]'). run_name ''
  # is the workdir's name; tags are comma-separated.
  c.logging = ml_collections.ConfigDict(dict(
      trackers="tensorboard", project="jaxgrpo", run_name="", tags="", plots=True,
      console=True))

  if arg == "smoke":
    c.grpo.num_prompts_per_step = 8
    c.grpo.num_generations_per_prompt = 4
    c.grpo.max_num_steps = 3
    c.grpo.val_period = 2
    c.grpo.val_batch_size = 16
    c.grpo.max_val_samples = 32
    c.grpo.val_num_generations_per_prompt = 2
    c.data.num_train_examples = 200
    c.data.num_val_examples = 32
    c.checkpoint.save_period = 2
    c.logging.plots = False
  elif arg not in (None, ""):
    raise ValueError(f"configs/math.py: unknown preset {arg!r}; allowed: smoke")
  return c

"""The loss options' names, jax-free: config.py checks a run's choices against them without
importing the loss (which imports jax), and algo/grpo.py implements each (its docstring says
what each means)."""

SCALE_REWARDS = ("group", "batch", "none")  # grpo.scale_rewards: the advantage's std
KL_TYPES = ("k1", "k3")  # grpo.kl_type: the KL penalty's estimator
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")  # grpo.loss_agg

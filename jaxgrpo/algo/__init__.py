"""The algorithm: the GRPO loss and update (grpo), the micro-batched gradient (microbatch),
and the loss options' names (options, jax-free: config.py validates them without importing
the loss). Imports model/, rollout/ and runtime/ only."""

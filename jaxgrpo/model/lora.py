"""LoRA: low-rank adapters on a frozen base (Hu et al. 2021, "LoRA").

For a target projection W (the stacked layers' [num_layers, in..., out...]) the adapted
weight is W' = W + (alpha / r) * A @ B, with A [num_layers, in..., r] and B [num_layers, r,
out...] (the paper's B A, written for x @ W). B starts at zero, so the first forward equals
the base model's; A starts N(0, 1/in). Adapters are float32; the base stays in its own
dtype and is never updated: the optimizer, the gradients and their accumulation cover only
the adapters, and with `beta` > 0 the reference policy is the base itself (adapters off), so
it costs no second copy of the weights.

Deviation from the paper: no dropout on the adapter's input (RL post-training recipes run
LoRA without it: verl's default and Tunix's qwix path have none), so `merge` is exact and
the sampler can run the merged weights.

Sharding: an adapter follows its base weight's logical axes (A its input axes, B its
output axes; the rank axis is never split), so FSDP and data parallelism shard them as they
shard the base.

Targets: the attention projections q, k, v, o and the MLP's gate, up, down, by those names
or Hugging Face's (q_proj, ..., down_proj), or `all-linear` for all seven. In a mixture of
experts gate, up and down are every expert's, each expert its own adapter (A [layers, E,
in, r], B [layers, E, r, out]: the expert axis is a batch axis like the layers'), as PEFT
adapts each of the hub's per-expert Linear modules; the router is not a target (a
[d_model, E] matrix whose rank is at most E anyway, and which PEFT's all-linear skips).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxgrpo.model import decoder as model_lib
from jaxgrpo.runtime import config_checks

# target -> (parameter path under "layers", how many leading axes (after layers) are its
# input; the rest are its output), with the logical axis names of the base weight.
TARGETS = {
    "q": (("attn", "q"), 1), "k": (("attn", "k"), 1), "v": (("attn", "v"), 1),
    "o": (("attn", "o"), 2), "gate": (("mlp", "gate"), 1), "up": (("mlp", "up"), 1),
    "down": (("mlp", "down"), 1),
}
HF_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
            "up_proj": "up", "down_proj": "down"}


def parse_targets(text: str) -> tuple[str, ...]:
  """'all-linear' or a comma-separated list (ours or HF's names) -> target names, in
  TARGETS order. Raises ValueError naming the unknown one."""
  if text.strip() == "all-linear":
    return tuple(TARGETS)
  names = [n.strip() for n in text.split(",") if n.strip()]
  out = []
  for name in names:
    target = HF_NAMES.get(name, name)
    if target not in TARGETS:
      raise ValueError(f"unknown LoRA target {name!r}; allowed: all-linear, or a "
                       f"comma-separated list of {', '.join(TARGETS)} (or {', '.join(HF_NAMES)})")
    out.append(target)
  if not out:
    raise ValueError("no LoRA target; allowed: all-linear, or a comma-separated list of "
                     f"{', '.join(TARGETS)}")
  return tuple(t for t in TARGETS if t in out)


def _weight(params, target):
  path, _ = TARGETS[target]
  node = params["layers"]
  for key in path:
    node = node[key]
  return node


def expert_axes(cfg: model_lib.ModelConfig, target: str) -> bool:
  """Whether the target's weight has an expert axis after the layers' (a mixture's MLP)."""
  return bool(cfg.num_experts) and TARGETS[target][0][0] == "mlp"


def _lead(cfg: model_lib.ModelConfig, target: str) -> int:
  """The weight's leading batch axes: layers, and experts where it has them."""
  return 2 if expert_axes(cfg, target) else 1


def shapes(cfg: model_lib.ModelConfig, rank: int, targets) -> dict:
  """{target: (A shape, B shape)} for the stacked layers."""
  base = nn.unbox(model_lib.param_structure(cfg))
  out = {}
  for target in targets:
    shape = _weight(base, target).shape
    lead, n_in = _lead(cfg, target), TARGETS[target][1]
    out[target] = (shape[:lead + n_in] + (rank,), shape[:lead] + (rank,) + shape[lead + n_in:])
  return out


def check_rank(cfg: model_lib.ModelConfig, rank: int, targets) -> str | None:
  """Why `rank` is too large for a target (its smaller side), or None."""
  for target, (a, b) in shapes(cfg, rank, targets).items():
    lead = _lead(cfg, target)
    n_in, n_out = math.prod(a[lead:-1]), math.prod(b[lead + 1:])
    if rank > min(n_in, n_out):
      return (f"rank {rank} exceeds the smaller side of target {target!r} "
              f"({min(n_in, n_out)}: {n_in} in, {n_out} out)")
  return None


def logical_axes(cfg: model_lib.ModelConfig, targets) -> dict:
  """{target: {"a": names, "b": names}}: the base weight's logical axes split at the rank."""
  boxed = model_lib.param_structure(cfg)
  out = {}
  for target in targets:
    names = tuple(_weight(boxed, target).names)  # ("layers", [expert,] in..., out...)
    lead, n_in = _lead(cfg, target), TARGETS[target][1]
    out[target] = {"a": names[:lead + n_in] + (None,),
                   "b": names[:lead] + (None,) + names[lead + n_in:]}
  return out


def init(cfg: model_lib.ModelConfig, rank: int, targets, key) -> dict:
  """Adapters {target: {"a", "b"}}: A ~ N(0, 1/in), B = 0 (the first forward is the base's)."""
  out = {}
  for i, (target, (a_shape, b_shape)) in enumerate(shapes(cfg, rank, targets).items()):
    fan_in = math.prod(a_shape[_lead(cfg, target):-1])
    a = jax.random.normal(jax.random.fold_in(key, i), a_shape, jnp.float32) * fan_in ** -0.5
    out[target] = {"a": a, "b": jnp.zeros(b_shape, jnp.float32)}
  return out


def delta(adapter, scale: float, lead: int = 1):
  """scale * A @ B in the base weight's shape [num_layers, (E,) in..., out...] (float32);
  lead: the leading batch axes (2 for experts' adapters, `expert_axes`)."""
  a, b = adapter["a"], adapter["b"]
  batch, rank = a.shape[:lead], a.shape[-1]
  # The batch axes stay apart: merged into one, the experts' split over `expert` (the minor
  # of the pair) is no tiling GSPMD can keep, and every chip held every expert's delta
  # (Qwen3-30B-A3B's compile check: 115 GiB a chip).
  a2 = a.reshape(batch + (-1, rank))
  b2 = b.reshape(batch + (rank, -1))
  out = jnp.einsum("...ir,...ro->...io", a2, b2, preferred_element_type=jnp.float32) * scale
  return out.reshape(a.shape[:-1] + b.shape[lead + 1:])


def merge(base, adapters, scale: float):
  """The base parameters with every adapted weight replaced by W + scale * A @ B (in the
  base's dtype). Differentiable in the adapters; the base gets no gradient."""
  base = jax.lax.stop_gradient(base)
  layers = dict(base["layers"])
  for target, adapter in adapters.items():
    (section, name), _ = TARGETS[target]
    w = layers[section][name]
    # w [layers, (E,) in..., out...], A [.., in..., r], B [.., r, out...]: the batch axes
    # are what A and B hold beyond the weight's own.
    lead = adapter["a"].ndim + adapter["b"].ndim - 2 - w.ndim
    merged = (w.astype(jnp.float32) + delta(adapter, scale, lead)).astype(w.dtype)
    layers[section] = {**layers[section], name: merged}
  return {**base, "layers": layers}


@config_checks.register(order=32)
def _check_config(c, num_devices: int) -> None:
  """model.lora_targets: names parse_targets knows (with lora_rank > 0)."""
  del num_devices
  m = c.model
  if not m.lora_rank:
    return
  try:
    parse_targets(m.lora_targets)
  except ValueError as e:
    config_checks.fail("model.lora_targets", m.lora_targets, str(e).split("; allowed: ")[-1])


@config_checks.register_model(order=10)
def _check_rank_against_the_model(c, model_cfg) -> None:
  """A LoRA rank larger than a target's smaller side, once the architecture (a checkpoint's
  own) is known."""
  m = c.model
  if not m.lora_rank:
    return
  problem = check_rank(model_cfg, m.lora_rank, parse_targets(m.lora_targets))
  if problem:
    config_checks.fail("model.lora_rank", m.lora_rank, "a smaller rank", reason=problem)

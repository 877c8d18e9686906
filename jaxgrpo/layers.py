"""The decoder's layers as one stack: how their parameters are laid out and how they run.

Every layer's parameters live stacked under `layers` ([num_layers, ...] per tensor, the
leading axis named "layers" and never sharded), and a scan runs them (`over_layers`):
either one compiled layer body in a loop (`model.scan_layers` True, MaxText's scan_layers)
or the same scan unrolled. Files on disk (jaxgrpo's own folders and Hugging Face's) name
each layer's tensors apart; `stack_layers` and `unstack_layers` convert.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np

LAYER_PREFIX = "layer_"
# A train-state checkpoint's meta names its layout; those written before the layers were
# stacked have none (their trees hold layer_0 ... and cannot restore into this one).
PARAM_LAYOUT = "stacked_layers"


def resolve_scan_layers(value: bool | None, platform: str) -> bool:
  """`model.scan_layers`; None picks by platform. Unrolled on CPU, where the steady update
  measured 1.12x and the tiny preset's rollout 1.45x faster unrolled (BENCHMARKS.md) and a
  model small enough for CPU compiles quickly either way; scanned on TPU and GPU, where a
  real model's 28+ layers would otherwise each be compiled (a 7B compile check: 308 s
  unrolled, 95 s scanned; MaxText's scan_layers default)."""
  return platform != "cpu" if value is None else bool(value)


def over_layers(body, num_layers: int, scan_layers: bool, num_broadcast: int):
  """`body` run over the stacked layers: params["layers"] holds every layer's parameters
  with a leading [num_layers] axis (logical name "layers"), sliced one layer per step.

  scan_layers=True compiles one layer body in a loop (MaxText's scan_layers); False unrolls
  the same scan into num_layers copies, as a Python loop over layers would, which lets XLA
  schedule and fuse across layers at the price of a compile that grows with depth. Both
  read the same parameter tree, so the choice is the compiler's, never the checkpoint's.
  """
  return nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                 in_axes=(nn.broadcast,) * num_broadcast, length=num_layers,
                 unroll=1 if scan_layers else num_layers,
                 metadata_params={nn.PARTITION_NAME: "layers"})


def unstack_layers(params) -> dict:
  """{..., "layers": {...[L, ...]}} -> {..., "layer_0": {...}, ..., "layer_{L-1}": {...}}."""
  out = {k: v for k, v in params.items() if k != "layers"}
  stacked = params["layers"]
  num = len(jax.tree.leaves(stacked)[0])
  for i in range(num):
    out[f"{LAYER_PREFIX}{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
  return out


def stack_layers(params) -> dict:
  """The inverse of `unstack_layers` on a host tree of numpy arrays (layer_0 ...
  layer_{L-1} must all be there)."""
  names = [k for k in params if k.startswith(LAYER_PREFIX)]
  out = {k: v for k, v in params.items() if not k.startswith(LAYER_PREFIX)}
  layers = [params[f"{LAYER_PREFIX}{i}"] for i in range(len(names))]
  out["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *layers)
  return out

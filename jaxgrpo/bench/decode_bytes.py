"""`python -m jaxgrpo.bench decode-bytes`: the bytes a decode token-step moves on a TPU chip,
from the compiled program itself, against the floor (the weights once and the live K/V once).

The train and val samplers are built as a run builds them (sampling.compile_sampler, the
config's profiles, mesh, decode block and compaction) for a model shape, compiled ahead of
time for `--topology` with libtpu on this machine (as launch/compile_check.py does: no TPU
is needed), and their HLO is read by runtime/tpu_cost.py: one token-step of the decode loop
(its layer loop times its trip count), each op's HBM bytes (padded to the layout's tiles;
slices of a stacked cache counted as slices, in-place writes as their updates). The floor is
run/predict.decode_floor_bytes: weights in the compute dtype plus every slot's K/V (the last
token-step). One JSON line per program: bytes_per_step, floor_bytes, bytes_over_floor, and
the step's predicted time.

Defaults: Qwen2.5-7B's shape (its config.json) with configs/gsm8k.py as it ships (64
prompts x 8 samples, 400 + 512 tokens, fsdp over every chip, bfloat16 compute), on v5p:2x2x2;
the val sampler at --val_batch_size prompts (the config's 'auto' is measured by the
trainer; 64 here).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import types

from jaxgrpo.bench import common

# Published config.json shapes (architecture only).
SHAPES = {
    "qwen2.5-7b": dict(vocab_size=152064, d_model=3584, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, mlp_dim=18944, rope_theta=1e6,
                       tie_embeddings=False, qkv_bias=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, d_model=1536, num_layers=28, num_heads=12,
                         num_kv_heads=2, head_dim=128, mlp_dim=8960, rope_theta=1e6,
                         qkv_bias=True),
}
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs", "gsm8k.py")


def load_config(path: str, arg: str | None):
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def run_decode_bytes(args) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import decoder  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import predict, sizing  # pylint: disable=g-import-not-at-top
  from jaxgrpo.runtime import compile_options, tpu_cost  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("libtpu") is None:
    raise SystemExit("error: bench decode-bytes compiles for a TPU topology and needs libtpu: "
                     f"pip install 'jax[tpu]=={jax.__version__}'")
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import setup  # pylint: disable=g-import-not-at-top
  values = load_config(args.config, args.config_arg).to_dict()
  values["grpo"].update(val_batch_size=args.val_batch_size, micro_batch_size=0)
  values["data"]["use_chat_template"] = False  # no folder, no template: the shapes are the same
  values["model"].update(SHAPES[args.shape], checkpoint="", hf_checkpoint="")
  for key, value in dataclasses.asdict(decoder.ModelConfig(**SHAPES[args.shape])).items():
    if values["model"].get(key, 0) is None:  # the architecture's other keys: their defaults
      values["model"][key] = value
  kwargs = compile_options.TOPOLOGY_KWARGS.get(args.topology.split(":")[0], {})
  devices = topologies.get_topology_desc(topology_name=args.topology, platform="tpu",
                                         **kwargs).devices
  chip = tpu_cost.chip_for(devices[0].device_kind)
  c = setup.validate(ml_collections.ConfigDict(values), len(devices))  # resolves val_* keys
  model_cfg = decoder.ModelConfig(**SHAPES[args.shape], dtype=c.model.dtype,
                                  param_dtype=c.model.param_dtype)
  mesh = sharding_lib.make_mesh(c.mesh.to_dict(), devices)
  tokenizer = types.SimpleNamespace(stop_ids=(1,), pad_id=0)  # ids only, as a folder's
  results = []
  with compile_options.as_tpu_host():
    for name, lowered, _ in sizing.programs(c, model_cfg, tokenizer, mesh, ["train", "val"]):
      text = lowered.compile().as_text()
      step, bound = tpu_cost.decode_step_cost(text, chip)
      floor = predict.decode_floor_bytes(c, model_cfg, mesh, name)
      weights = tpu_cost.decode_weight_bytes(model_cfg, mesh.shape["tensor"],
                                             mesh.shape["expert"])
      results.append(dict(
          bench="decode-bytes", program=name, topology=args.topology, shape=args.shape,
          mesh={k: v for k, v in mesh.shape.items()}, bytes_per_step=round(step.bytes),
          floor_bytes=round(floor), bytes_over_floor=round(step.bytes / floor, 3),
          weight_bytes=round(weights), kv_bytes=round(floor - weights),
          predicted_step_s=step.serial_s, step_collectives_s=step.collective_s,
          hbm_floor_fraction=round(floor / chip.hbm_bytes_s / step.serial_s, 4),
          token_steps_at_most=bound))
  return results


def add_parsers(sub) -> None:
  d = sub.add_parser("decode-bytes", help="a decode token-step's HBM bytes on a TPU chip "
                     "against the floor, from the compiled program (needs libtpu)",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  d.add_argument("--topology", default="v5p:2x2x2")
  d.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
  d.add_argument("--config", default=CONFIG, help="a run config file")
  d.add_argument("--config_arg", default=None, help="its preset (get_config's arg)")
  d.add_argument("--val_batch_size", type=common.at_least(1), default=64)
  d.add_argument("--out", default=None, help="also append the JSON lines to this file")
  d.set_defaults(run=run_decode_bytes)

"""Checkpoints: a sharded train state and its metadata come back exactly, under their step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxgrpo import checkpoint, grpo, model, sharding

from numpy_params import random_params  # tests/numpy_params.py

CFG = model.ModelConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2,
                        head_dim=16, mlp_dim=64)


def test_sharded_state_round_trips(tmp_path):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  params = sharding.shard_params(random_params(CFG, 0), CFG, mesh)
  state = grpo.init_state(params, optax.adam(1e-3), mesh)
  state = state._replace(step=jnp.int32(7))
  ckpts = checkpoint.Checkpoints(str(tmp_path))
  path = ckpts.save(7, state, {"reason": "end", "data": {"iterator": "{}", "seed": 0}})
  ckpts.close()  # waits for the asynchronous write
  assert path == str(tmp_path / "checkpoints" / "7")

  reopened = checkpoint.Checkpoints(str(tmp_path))
  assert reopened.steps() == [7]
  restored, meta = reopened.restore(7, state)
  reopened.close()
  assert int(restored.step) == 7 and meta["reason"] == "end" and meta["data"]["seed"] == 0
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == want.sharding  # restored straight onto the mesh layout

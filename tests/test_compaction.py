"""Tests for jaxgrpo.rollout.compaction: finished rows stop costing, and the rollout stays the same.

The reference is the sampler without compaction on one device: with compaction on, every
row's tokens, mask, lengths and truncation flags are equal, and its log-probs equal up to
float rounding (a compacted stage runs the same math on a batch of another size, where
XLA's matmuls may round differently, as on another mesh: tests/test_sampling.py).
A stage record (the step and bucket of every compaction, taken at run time) shows that the
compacted stages really ran, exactly when the live rows first fit in the next bucket.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.model import sharding
from jaxgrpo.model import decoder as model
from jaxgrpo.rollout import compaction, sampling
from numpy_params import left_padded_prompts, peaked_params  # tests/numpy_params.py

SP = sampling.SamplingParams
# GQA (4 query heads over 2 KV heads) and QK-norm, as Qwen3.
CFG = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64, qk_norm=True)
PAD = 0
B, G, T = 8, 4, 24
# Two end ids, among the tokens this model draws often enough that rows end at many
# different steps (and a few run to T): checked by the stage records below.
EOS = (43, 19)
STAGES = 2  # buckets of 32, 16, 8 rows on one device
# The sampling modes: greedy, plain, and temperature with top-k and top-p.
MODES = {"greedy": SP(0.0, 1.0, 0), "t1": SP(1.0, 1.0, 0), "t07_topk5_topp09": SP(0.7, 0.9, 5)}


@pytest.fixture(scope="module")
def params():
  return peaked_params(CFG)  # logits with std ~3 (tests/numpy_params.py)


@pytest.fixture(scope="module")
def prompts():
  return left_padded_prompts(CFG.vocab_size, PAD)  # 8 prompts, real lengths 1..6 of width 6


def _engine(mesh, sp, *, compact_stages=0, eos_id=EOS, **kwargs):
  profiles = {"train": sampling.Profile(sp, G, T), "val": sampling.Profile(sp, 1, T)}
  return sampling.RolloutEngine(CFG, mesh, profiles, max_prompt_length=6, eos_id=eos_id,
                                pad_id=PAD, seed=0, compact_stages=compact_stages, **kwargs)


def _one_device():
  return sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])


KEY = 7


@pytest.fixture(scope="module")
def reference(params, prompts):
  """mode -> the rollout without compaction on one device (key KEY), made once per mode."""
  cache = {}

  def get(mode, eos_id=EOS):
    if (mode, eos_id) not in cache:
      engine = _engine(_one_device(), MODES[mode], eos_id=eos_id)
      cache[mode, eos_id] = jax.device_get(engine.sample("train", params, *prompts,
                                                         key=jax.random.key(KEY)))
    return cache[mode, eos_id]

  return get


@pytest.fixture
def stage_record(monkeypatch):
  """(bucket rows per group, step) of every compaction, in the order they ran. Every stage
  compacts once, also after the last row ended (then at the step the loop stopped)."""
  record = []
  original = compaction._compact

  def recording(stage, size, ctx, first):
    jax.debug.callback(lambda i, size=size: record.append((size, int(i))), stage.i)
    return original(stage, size, ctx, first)

  monkeypatch.setattr(compaction, "_compact", recording)
  return record


def _expected_stages(lengths_N, groups: int, sizes, t: int):
  """The compactions the rule implies: a row of length L is live at steps i < L (it emitted
  its end id at token L - 1, or ran to T), and the loop moves to bucket k at the first step
  where every group's live rows fit in it, or where it stopped (step T, or no row live)."""
  lengths = np.asarray(lengths_N).reshape(groups, -1)
  live = lambda i: int(np.max(np.sum(lengths > i, axis=1)))
  i, out = 1, []
  for size in sizes[1:]:
    while i < t and live(i) > size:
      i += 1
    out.append((size, i))
  return out


def _decoding(record, lengths_N, t: int):
  """The compactions after which rows were still decoded (step < T, a row live)."""
  return [(size, i) for size, i in record if i < t and np.any(np.asarray(lengths_N) > i)]


def _assert_same_rollout(out, expected):
  np.testing.assert_array_equal(out.tokens_NxT, expected.tokens_NxT)
  np.testing.assert_array_equal(out.mask_NxT, expected.mask_NxT)
  np.testing.assert_array_equal(out.lengths_N, expected.lengths_N)
  np.testing.assert_array_equal(out.truncated_N, expected.truncated_N)
  np.testing.assert_allclose(out.logp_NxT, expected.logp_NxT, atol=1e-5)
  np.testing.assert_allclose(out.raw_logp_NxT, expected.raw_logp_NxT, atol=1e-5)


def test_bucket_sizes_halve_rounding_up():
  assert compaction.bucket_sizes(32, 3) == (32, 16, 8, 4)
  assert compaction.bucket_sizes(5, 4) == (5, 3, 2, 1)  # never below one row
  assert compaction.bucket_sizes(1, 3) == (1,)
  assert compaction.bucket_sizes(8, 0) == (8,)


@pytest.mark.parametrize("mode", list(MODES))
def test_compaction_gives_the_same_rollout(params, prompts, reference, stage_record, mode):
  expected = reference(mode)
  assert stage_record == []  # the reference never compacts
  engine = _engine(_one_device(), MODES[mode], compact_stages=STAGES)
  out = jax.device_get(engine.sample("train", params, *prompts, key=jax.random.key(KEY)))
  _assert_same_rollout(out, expected)
  # Rows end at different steps, some by each end id, and the compacted stages ran when
  # the rule says: the record is not empty, so the equality above covers them.
  assert len(set(out.lengths_N.tolist())) >= 4
  last = out.tokens_NxT[np.arange(B * G), out.lengths_N - 1]
  assert {int(x) for x in last[~out.truncated_N]} == set(EOS)
  sizes = compaction.bucket_sizes(B * G, STAGES)
  assert stage_record == _expected_stages(out.lengths_N, 1, sizes, T)
  assert len(_decoding(stage_record, out.lengths_N, T)) >= 2
  # A second call (another key) reuses the compiled sampler: one compile per profile.
  engine.sample("train", params, *prompts, key=jax.random.key(8))
  assert engine.compilations == {"train": 1, "val": 0}


@pytest.mark.parametrize("mesh_config, scan_layers, decode_block", [
    ({"data": 8}, None, 0), ({"data": 2, "fsdp": 2, "tensor": 2}, True, 3)],
    ids=["data8", "2x2x2-scanned-blocks"])
def test_compaction_on_a_mesh_equals_one_device(params, prompts, reference, stage_record,
                                                mesh_config, scan_layers, decode_block):
  # Each data-parallel group compacts its own rows; with scanned layers the caches are
  # stacked, and with blocks the compacted stages read their keys block by block too.
  expected = reference("t07_topk5_topp09")
  mesh = sharding.make_mesh(mesh_config)
  engine = _engine(mesh, MODES["t07_topk5_topp09"], compact_stages=STAGES,
                   scan_layers=scan_layers, decode_block=decode_block)
  out = engine.sample("train", sharding.shard_params(params, CFG, mesh), *prompts,
                      key=jax.random.key(KEY))
  assert len(out.tokens_NxT.sharding.device_set) == 8
  out = jax.device_get(out)
  _assert_same_rollout(out, expected)
  groups = sharding.batch_size_multiple(mesh)
  sizes = compaction.bucket_sizes(B * G // groups, STAGES)
  assert stage_record == _expected_stages(out.lengths_N, groups, sizes, T)
  assert _decoding(stage_record, out.lengths_N, T)  # compacted rows were decoded


def test_without_end_ids_nothing_compacts(params, prompts, reference, stage_record):
  # Every row runs to T: the first stage does all the work; the stages compact after it.
  expected = reference("t1", eos_id=None)
  engine = _engine(_one_device(), MODES["t1"], compact_stages=STAGES, eos_id=None)
  out = jax.device_get(engine.sample("train", params, *prompts, key=jax.random.key(KEY)))
  _assert_same_rollout(out, expected)
  assert out.truncated_N.all() and (out.lengths_N == T).all()
  assert stage_record == [(16, T), (8, T)]


def test_rows_never_leave_their_device(params):
  # On 8 data-parallel devices the compacted program moves no rows between devices: no
  # all-gather, all-to-all or collective-permute; its only collectives are the scalar
  # all-reduces that decide when a loop ends and when to compact.
  mesh = sharding.make_mesh({"data": 8})
  sampler = sampling.compile_sampler(CFG, sampling.Profile(MODES["t1"], G, T), eos_id=EOS,
                                     pad_id=PAD, mesh=mesh, compact_stages=STAGES)
  sds = jax.ShapeDtypeStruct
  text = sampler.lower(sharding.shard_params(params, CFG, mesh), sds((16, 6), jnp.int32),
                       sds((16, 6), bool), jax.random.key(0),
                       sds((16,), jnp.int32)).compile().as_text()
  assert not re.search(r"\b(all-gather|all-to-all|collective-permute)", text)
  reduces = re.findall(r"= (\S+) all-reduce(?:-start)?\(", text)
  assert reduces and all(re.fullmatch(r"(pred|s32|f32)\[\]", shape) for shape in reduces)

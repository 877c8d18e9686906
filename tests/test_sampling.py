"""Tests for jaxgrpo.rollout.sampling: profiles, truncation, the compiled sampler and the engine."""

import io
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.model import distribution, sharding
from jaxgrpo.model import decoder as model
from jaxgrpo.rollout import sampling
from numpy_params import left_padded_prompts, peaked_params  # tests/numpy_params.py

SP = sampling.SamplingParams
CFG = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64)
PAD = 0
T = 6  # max_new_tokens
G = 4  # samples per prompt
TRAIN = SP(1.0, 1.0, 0)
VAL = SP(0.7, 0.9, 5)

_forward = jax.jit(model.forward, static_argnums=1)


@pytest.fixture(scope="module")
def params():
  return peaked_params(CFG)  # logits with std ~3 (tests/numpy_params.py)


@pytest.fixture(scope="module")
def prompts():
  return left_padded_prompts(CFG.vocab_size, PAD)  # 8 prompts, real lengths 1..6 of width 6


def _single_device_mesh():
  return sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])


def _engine(mesh, train=TRAIN, val=VAL, *, max_prompt_length=6, eos_id=None, seed=0,
            share_prefix=True, scan_layers=None, decode_block=0):
  profiles = {"train": sampling.Profile(train, G, T), "val": sampling.Profile(val, G, T)}
  return sampling.RolloutEngine(CFG, mesh, profiles, max_prompt_length=max_prompt_length,
                                eos_id=eos_id, pad_id=PAD, seed=seed, share_prefix=share_prefix,
                                scan_layers=scan_layers, decode_block=decode_block)


@pytest.fixture(scope="module")
def engine_record(params):
  """The shared engine's first life, watched: 5 batches per profile, compiles logged.

  Prompt contents change every call and some prompts are narrower than max_prompt_length
  (the engine left-pads them). `sampling.prefill` is wrapped to record the prompt shape it
  is traced with. Runs once, at setup, so the record does not depend on test order.
  """
  eng = _engine(_single_device_mesh())
  rng = np.random.default_rng(3)
  prefill_shapes, outputs = [], {}
  original_prefill = sampling.prefill

  def recording_prefill(params, cfg, prompt_tokens_BxL, prompt_mask_BxL, *args, **kwargs):
    prefill_shapes.append(prompt_tokens_BxL.shape)  # runs at trace time only
    return original_prefill(params, cfg, prompt_tokens_BxL, prompt_mask_BxL, *args, **kwargs)

  stream = io.StringIO()
  handler = logging.StreamHandler(stream)
  handler.setLevel(logging.WARNING)
  # jax 0.10.2 logs "Compiling jit(<name>) ..." from pxla at WARNING under log_compiles().
  logger = logging.getLogger("jax._src.interpreters.pxla")
  logger.addHandler(handler)
  try:
    with pytest.MonkeyPatch.context() as mp, jax.log_compiles():
      mp.setattr(sampling, "prefill", recording_prefill)
      for i in range(5):
        for name in ("train", "val"):
          width = (6, 4, 3)[i % 3]
          tokens = rng.integers(1, CFG.vocab_size, size=(8, width)).astype(np.int32)
          mask = np.arange(width)[None, :] >= rng.integers(0, width, size=(8, 1))
          outputs.setdefault(name, []).append(jax.device_get(
              eng.sample(name, params, tokens, mask)))
  finally:
    logger.removeHandler(handler)
  return dict(engine=eng, compilations=dict(eng.compilations), log=stream.getvalue(),
              prefill_shapes=prefill_shapes, outputs=outputs)


@pytest.fixture(scope="module")
def engine(engine_record):
  """Single device; train: TRAIN, val: VAL, G samples each."""
  return engine_record["engine"]


@pytest.fixture(scope="module")
def mesh222():
  return sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def _teacher_forced_logits(params, prompt_BxL, mask_BxL, completion_NxT):
  """Logits predicting each completion token: forward over [prompt | completion]."""
  p = prompt_BxL.shape[1]
  rows = np.concatenate([np.repeat(prompt_BxL, G, axis=0), np.asarray(completion_NxT)], 1)
  mask = np.concatenate([np.repeat(mask_BxL, G, axis=0),
                         np.ones(completion_NxT.shape, bool)], 1)
  logits = _forward(params, CFG, rows, mask)
  return logits[:, p - 1:-1]  # position p-1+j predicts completion token j


# -------------------------------------------------------------------------------- profiles


def test_profile_rejects_bad_values():
  with pytest.raises(ValueError, match="sampling="):
    sampling.Profile({"temperature": 1.0}, 2, 4)
  with pytest.raises(ValueError, match="num_samples="):
    sampling.Profile(TRAIN, 0, 4)
  with pytest.raises(ValueError, match="max_new_tokens="):
    sampling.Profile(TRAIN, 2, 0)


# ---------------------------------------------------------------------------------- sampler


def _greedy_reference(params, prompt_BxL, mask_BxL, t):
  """Greedy decoding by full forward passes over the growing sequence (no KV cache).

  Run on the prompts repeated G times, so that the forward has the [B * G, L + T] shape the
  teacher-forced checks compile anyway; returns one row per prompt.
  """
  prompt_BxL, mask_BxL = np.repeat(prompt_BxL, G, axis=0), np.repeat(mask_BxL, G, axis=0)
  b, p = prompt_BxL.shape
  # One fixed-width buffer: causality makes position p-1+j ignore the unfilled tail.
  tokens = np.concatenate([prompt_BxL, np.full((b, t), PAD, np.int32)], 1)
  mask = np.concatenate([mask_BxL, np.ones((b, t), bool)], 1)
  for j in range(t):
    logits = _forward(params, CFG, tokens, mask)[:, p - 1 + j]
    tokens[:, p + j] = np.argmax(logits, axis=-1)
  return tokens[::G, p:]


@pytest.fixture(scope="module")
def greedy_tokens(params, prompts):
  return _greedy_reference(params, *prompts, T)


@pytest.fixture(scope="module")
def eos_id(greedy_tokens):
  """A token that greedy decoding first emits at step 2 of some row and never in another."""
  for v in range(1, CFG.vocab_size):
    hits = [np.flatnonzero(row == v) for row in greedy_tokens]
    if any(len(h) and h[0] == 2 for h in hits) and any(not len(h) for h in hits):
      return v
  raise AssertionError(f"no suitable EOS in greedy decoding {greedy_tokens}")


@pytest.fixture(scope="module")
def greedy_rollouts(params, prompts, eos_id):
  """train: temperature 0; val: top-k 1 at temperature 1; both stop at eos_id.

  One engine serves the greedy and the EOS tests (each sampler compile costs seconds).
  """
  eng = _engine(_single_device_mesh(), train=SP(0.0, 1.0, 0), val=SP(1.0, 1.0, 1),
                eos_id=eos_id)
  return {name: jax.device_get(eng.sample(name, params, *prompts)) for name in ("train", "val")}


@pytest.mark.parametrize("name", ["train", "val"])  # temperature 0, top-k 1
def test_temperature_zero_and_top_k_one_equal_greedy(greedy_rollouts, greedy_tokens, eos_id,
                                                     name):
  out = greedy_rollouts[name]
  expected = np.repeat(greedy_tokens, G, axis=0)
  mask = out.mask_NxT
  # Every generated token (up to and including EOS) is the greedy one ...
  np.testing.assert_array_equal(np.where(mask, out.tokens_NxT, -1), np.where(mask, expected, -1))
  # ... and rows that never meet EOS are the whole greedy decoding.
  full = ~np.any(expected == eos_id, axis=1)
  assert full.any()
  np.testing.assert_array_equal(out.tokens_NxT[full], expected[full])
  # A point mass: log 1 = 0 under the profile; the raw model still has its log-probs.
  np.testing.assert_allclose(out.logp_NxT, 0.0, atol=1e-6)
  assert np.all(out.raw_logp_NxT[mask] < 0)


@pytest.mark.parametrize("name", ["train", "val"])
def test_eos_stops_a_row(greedy_rollouts, greedy_tokens, eos_id, name):
  out = greedy_rollouts[name]
  stopped_at_2 = 0
  for n in range(out.tokens_NxT.shape[0]):
    ref = greedy_tokens[n // G]
    hit = np.flatnonzero(ref == eos_id)
    if len(hit):
      k = hit[0]
      stopped_at_2 += k == 2
      assert out.tokens_NxT[n, k] == eos_id
      np.testing.assert_array_equal(out.tokens_NxT[n, k + 1:], PAD)
      np.testing.assert_array_equal(out.mask_NxT[n], np.arange(T) <= k)
      np.testing.assert_array_equal(out.logp_NxT[n, k + 1:], 0.0)
      np.testing.assert_array_equal(out.raw_logp_NxT[n, k + 1:], 0.0)
      assert out.lengths_N[n] == k + 1 and not out.truncated_N[n]
    else:
      assert out.mask_NxT[n].all()
      assert out.lengths_N[n] == T and out.truncated_N[n]
  assert stopped_at_2 >= G  # every sample of the chosen row: mask True x3, length 3


@pytest.mark.parametrize("name, sp", [("train", TRAIN), ("val", VAL)])
def test_logprobs_match_teacher_forcing(engine, params, prompts, name, sp):
  out = engine.sample(name, params, *prompts, key=jax.random.key(11))
  tokens = np.asarray(out.tokens_NxT)
  assert tokens.shape == (8 * G, T) and np.all(out.mask_NxT)
  logits = _teacher_forced_logits(params, *prompts, tokens)
  raw = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(out.raw_logp_NxT, raw, atol=1e-4)
  cand_logp, ids = distribution.candidate_logprobs(logits, sp)
  profile = jnp.max(jnp.where(ids == tokens[..., None], cand_logp, -jnp.inf), axis=-1)
  assert np.all(np.isfinite(profile))  # every sampled token is a candidate
  np.testing.assert_allclose(out.logp_NxT, profile, atol=1e-4)
  if name == "val":
    # Truncation and temperature 0.7 make the profile differ from the raw model.
    assert not np.allclose(out.logp_NxT, out.raw_logp_NxT, atol=1e-2)
  else:
    np.testing.assert_allclose(out.logp_NxT, out.raw_logp_NxT, atol=1e-5)


WARM = SP(0.7, 1.0, 0)  # a temperature other than 1, nothing truncated


@pytest.fixture(scope="module")
def warm_engine():
  """Both profiles WARM; only `train` is ever called, so one sampler compiles."""
  return _engine(_single_device_mesh(), train=WARM, val=WARM)


def test_trainer_logprobs_equal_the_samplers_at_temperature_07(warm_engine, params, prompts):
  # The trainer's ratio needs log pi_old (the sampler's logp_NxT) and log pi_theta
  # (token_logprobs on teacher-forced logits) of one distribution: at temperature .7 both
  # divide the logits by .7 (without it, they would differ by ~0.1-1 nats here).
  out = warm_engine.sample("train", params, *prompts, key=jax.random.key(5))
  tokens = np.asarray(out.tokens_NxT)
  logits = _teacher_forced_logits(params, *prompts, tokens)
  trainer_logp = distribution.token_logprobs(logits, jnp.asarray(tokens), WARM)
  np.testing.assert_allclose(out.logp_NxT, trainer_logp, atol=1e-4)
  assert not np.allclose(out.logp_NxT, out.raw_logp_NxT, atol=1e-2)  # .7 is not 1


def test_each_step_draws_its_own_uniform(warm_engine, params, prompts):
  # A final norm scale of 0 makes every logit exactly 0: a uniform distribution over the
  # vocabulary at every step, so token i of prompt b's sample g is exactly
  # draw(zeros, u, WARM) with u = row_uniform(key, b, i, G)[g]. Reusing step 0's draws would
  # repeat one token along each row.
  flat = jax.tree.map(lambda x: x, params)
  flat["final_norm"] = {"scale": np.zeros_like(params["final_norm"]["scale"])}
  key = jax.random.key(9)
  out = warm_engine.sample("train", flat, *prompts, key=key)
  u_TxBxG = jnp.stack([sampling.row_uniforms(key, jnp.arange(8), i, G) for i in range(T)])
  want, _, _ = distribution.draw(jnp.zeros((T, 8, G, CFG.vocab_size)), u_TxBxG, WARM)
  want_NxT = np.asarray(want).transpose(1, 2, 0).reshape(8 * G, T)
  np.testing.assert_array_equal(out.tokens_NxT, want_NxT)
  assert all(len(set(row)) > 1 for row in want_NxT)  # each row's tokens change with the step


@pytest.mark.parametrize("mesh_config, scan_layers, decode_block", [
    ({"data": 2, "fsdp": 2, "tensor": 2}, None, 0), ({"data": 8}, None, 0),
    ({"data": 2, "fsdp": 2, "tensor": 2}, True, 0),
    ({"data": 2, "fsdp": 2, "tensor": 2}, None, 2),
    ({"data": 2, "fsdp": 2, "tensor": 2}, True, 3)],
    ids=["2x2x2", "data8", "2x2x2-scanned", "2x2x2-blocks", "2x2x2-scanned-blocks"])
def test_mesh_results_equal_single_device(engine, params, prompts, mesh_config, scan_layers,
                                          decode_block):
  # The single-device engine unrolls its layers (CPU's default) and reads the whole cache;
  # "scanned" samples with the layers scanned in the prefill and the decode step (stacked
  # caches), "blocks" reads the generated keys in blocks up to the current token's, on a
  # (2, 2, 2) mesh: the same tokens and log-probs.
  key = engine.key("val", 5)
  expected = jax.device_get(engine.sample("val", params, *prompts, key=key))
  mesh = sharding.make_mesh(mesh_config)
  sharded = _engine(mesh, scan_layers=scan_layers, decode_block=decode_block)
  out = sharded.sample("val", sharding.shard_params(params, CFG, mesh), *prompts, key=key)
  assert len(out.tokens_NxT.sharding.device_set) == 8
  out = jax.device_get(out)
  np.testing.assert_array_equal(out.tokens_NxT, expected.tokens_NxT)
  np.testing.assert_array_equal(out.mask_NxT, expected.mask_NxT)
  np.testing.assert_allclose(out.logp_NxT, expected.logp_NxT, atol=1e-4)
  np.testing.assert_allclose(out.raw_logp_NxT, expected.raw_logp_NxT, atol=1e-4)


def _gathers_in_decode_step(text):
  """All-gathers of decode.step's own ops (its named scope) inside the compiled program's
  decode loop (runtime/tpu_cost finds the loop, on any backend's HLO); the draw's own
  gathers, outside the step, are not counted."""
  from jaxgrpo.runtime import tpu_cost  # pylint: disable=g-import-not-at-top
  module = tpu_cost.parse(text)
  (_, loop), *_ = tpu_cost.decode_loops(module)
  seen, stack, count = set(), [loop.attr("body")], 0
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    for op in module.computations[name]:
      count += op.opcode.startswith("all-gather") and "decode_step" in op.op_name
      stack += [op.attr(k) for k in ("body", "calls", "to_apply")
                if op.attr(k) in module.computations]
  return count


@pytest.mark.parametrize("gather_weights", [True, False])
def test_decode_weights_gathered_once_per_call_on_an_fsdp_mesh(engine, params, prompts,
                                                              gather_weights):
  # Parameters split over fsdp=8 (issue 62): with gather_weights the decode step's weights
  # are made whole on every chip before the loop, so no all-gather runs in a token-step;
  # without, each layer's weights are gathered again every token-step. The same tokens
  # and log-probs as one device either way.
  key = engine.key("val", 5)
  expected = jax.device_get(engine.sample("val", params, *prompts, key=key))
  mesh = sharding.make_mesh({"data": 1, "fsdp": 8})
  profiles = {"train": sampling.Profile(TRAIN, G, T), "val": sampling.Profile(VAL, G, T)}
  sharded = sampling.RolloutEngine(CFG, mesh, profiles, max_prompt_length=6, eos_id=None,
                                   pad_id=PAD, seed=0, scan_layers=True,
                                   gather_weights=gather_weights)
  placed = sharding.shard_params(params, CFG, mesh)
  out = jax.device_get(sharded.sample("val", placed, *prompts, key=key))
  np.testing.assert_array_equal(out.tokens_NxT, expected.tokens_NxT)
  np.testing.assert_allclose(out.logp_NxT, expected.logp_NxT, atol=1e-4)
  sampler = sampling.compile_sampler(CFG, profiles["val"], eos_id=None, pad_id=PAD, mesh=mesh,
                                     scan_layers=True, gather_weights=gather_weights)
  tokens, mask = sharding.to_global(mesh, sampling.left_pad(*prompts, 6, PAD))
  text = sampler.lower(placed, tokens, mask, key, jnp.arange(8, dtype=jnp.int32)).compile(
      ).as_text()
  assert (_gathers_in_decode_step(text) == 0) == gather_weights


def test_unshared_prefill_draws_the_same_samples(engine, params, prompts, monkeypatch):
  # share_prefix=False (the benchmark's baseline) prefills all B * G rows, and must change
  # nothing but the cost: same draws, same tokens, log-probs equal up to float rounding.
  shapes = []
  original_prefill = sampling.prefill

  def recording_prefill(params, cfg, prompt_tokens_BxL, prompt_mask_BxL, *args, **kwargs):
    shapes.append(prompt_tokens_BxL.shape)  # trace time only
    return original_prefill(params, cfg, prompt_tokens_BxL, prompt_mask_BxL, *args, **kwargs)

  monkeypatch.setattr(sampling, "prefill", recording_prefill)
  unshared = _engine(_single_device_mesh(), share_prefix=False)
  for name in ("train", "val"):
    key = engine.key(name, 3)
    expected = jax.device_get(engine.sample(name, params, *prompts, key=key))
    out = jax.device_get(unshared.sample(name, params, *prompts, key=key))
    np.testing.assert_array_equal(out.tokens_NxT, expected.tokens_NxT)
    np.testing.assert_array_equal(out.mask_NxT, expected.mask_NxT)
    np.testing.assert_allclose(out.logp_NxT, expected.logp_NxT, atol=1e-4)
  assert shapes == [(8 * G, 6), (8 * G, 6)]  # every sample's copy of its prompt


def test_prefill_runs_once_per_prompt_not_per_sample(engine_record):
  # One trace per profile, each with the 8 distinct prompts: [8, 6], never [8 * G, 6].
  assert engine_record["prefill_shapes"] == [(8, 6), (8, 6)]
  # ... while the rollouts have B * G rows, prompt-major.
  for name in ("train", "val"):
    assert engine_record["outputs"][name][0].tokens_NxT.shape == (8 * G, T)


def test_each_profile_compiles_once(engine_record):
  assert engine_record["compilations"] == {"train": 1, "val": 1}
  log = engine_record["log"]
  assert log.count("Compiling jit(traced)") == 2, log
  # Different prompt contents gave different samples (the calls really ran).
  train = [o.tokens_NxT for o in engine_record["outputs"]["train"]]
  assert not np.array_equal(train[0], train[1])


# ---------------------------------------------------------------------------- engine guards


def test_engine_requires_exactly_train_and_val():
  mesh = _single_device_mesh()
  prof = sampling.Profile(TRAIN, 2, T)
  for names in (("train", "val", "extra"), ("train",), ("train", "eval")):
    with pytest.raises(ValueError, match="exactly"):
      sampling.RolloutEngine(CFG, mesh, {n: prof for n in names}, max_prompt_length=6,
                             eos_id=None, pad_id=PAD, seed=0)


def test_engine_rejects_unknown_profile_name(engine, params, prompts):
  with pytest.raises(ValueError, match=r"'eval'.*\['train', 'val'\]"):
    engine.sample("eval", params, *prompts)


def test_engine_rejects_prompt_wider_than_max(engine, params):
  tokens = np.ones((8, 7), np.int32)
  with pytest.raises(ValueError, match="max_prompt_length=6"):
    engine.sample("train", params, tokens, np.ones((8, 7), bool))


def test_engine_rejects_rows_not_dividing_data_axes(mesh222, params):
  eng = _engine(mesh222)
  tokens = np.ones((6, 6), np.int32)  # data x fsdp = 4 does not divide 6
  with pytest.raises(ValueError, match="6 prompts do not divide over the 4"):
    eng.sample("train", params, tokens, np.ones((6, 6), bool))


# -------------------------------------------------------------------------------------- keys


def test_consecutive_calls_draw_fresh_samples(engine, params, prompts):
  first = engine.sample("train", params, *prompts)
  second = engine.sample("train", params, *prompts)
  assert not np.array_equal(first.tokens_NxT, second.tokens_NxT)


def test_explicit_key_and_step_reproduce(engine, params, prompts):
  key = engine.key("train", 3)
  first = engine.sample("train", params, *prompts, key=key)
  second = engine.sample("train", params, *prompts, key=key)
  np.testing.assert_array_equal(first.tokens_NxT, second.tokens_NxT)
  np.testing.assert_array_equal(first.logp_NxT, second.logp_NxT)
  by_step = engine.sample("train", params, *prompts, step=3)
  np.testing.assert_array_equal(by_step.tokens_NxT, first.tokens_NxT)


def test_keys_differ_per_profile_and_step(engine):
  data = lambda k: np.asarray(jax.random.key_data(k))
  assert not np.array_equal(data(engine.key("train", 3)), data(engine.key("val", 3)))
  assert not np.array_equal(data(engine.key("train", 3)), data(engine.key("train", 4)))
  np.testing.assert_array_equal(data(engine.key("val", 3)), data(engine.key("val", 3)))


def test_a_prompts_draws_follow_its_row_id_not_its_position(engine, params, prompts):
  # Reversing the batch and its row ids together gives every prompt the same samples: its
  # draws depend on (key, row id) only, which is what makes validation independent of
  # batching. Other ids for the same rows draw other samples.
  tokens, mask = prompts
  key = engine.key("train", 7)
  ids = np.arange(8, dtype=np.int32) + 100
  out = engine.sample("train", params, tokens, mask, key=key, row_ids_B=ids)
  rev = engine.sample("train", params, tokens[::-1], mask[::-1], key=key, row_ids_B=ids[::-1])
  by_prompt = lambda x: np.asarray(x).reshape(8, G, -1)
  np.testing.assert_array_equal(by_prompt(rev.tokens_NxT)[::-1], by_prompt(out.tokens_NxT))
  np.testing.assert_allclose(by_prompt(rev.logp_NxT)[::-1], by_prompt(out.logp_NxT), atol=1e-5)
  other = engine.sample("train", params, tokens, mask, key=key, row_ids_B=ids + 8)
  assert not np.array_equal(other.tokens_NxT, out.tokens_NxT)
  with pytest.raises(ValueError, match=r"row_ids_B has shape \(3,\); expected \(8,\)"):
    engine.sample("train", params, tokens, mask, key=key, row_ids_B=ids[:3])

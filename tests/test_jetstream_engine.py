"""Tests for jaxgrpo/rollout/jetstream_engine.py and jetstream_rollouts.py (the backend's
rollouts and a GRPO run with it), and `python -m jaxgrpo.serve` answering a
request (here because it serves this module's trained run; tests/test_serve.py has the rest).

Marked `jetstream`: they need the jetstream extra (google-jetstream 0.2.2, which pulls
TensorFlow), so .ci/run runs them in a venv of their own (.ci-jetstream) and the main test
venv stays free of TensorFlow; there this module is skipped.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("jetstream", reason="needs the jetstream extra; .ci/run runs it "
                    "in .ci-jetstream")
pytestmark = pytest.mark.jetstream

import jax  # noqa: E402
import numpy as np  # noqa: E402
# First, so that the root logger it restores is the one before JetStream's orchestrator
# reconfigured it (DEBUG to stdout).
from jaxgrpo.rollout import jetstream_engine as je  # noqa: E402
from jaxgrpo.rollout import jetstream_rollouts as jr  # noqa: E402
from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402
import portpicker  # noqa: E402  (a JetStream dependency)

from jaxgrpo.model import decoder as model, sharding  # noqa: E402
from jaxgrpo.rollout import sampling
from jaxgrpo.model import tokenizer as tokenizer_lib  # noqa: E402
from cli import (HEAVY, MATH, ROOT, assert_smoke_run_imports_nothing_heavy, env,  # noqa: E402
                 run_train)
from numpy_params import random_params  # noqa: E402

CFG = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=64)
# Character ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then these 60 characters (vocab 64).
TOKENIZER = tokenizer_lib.Tokenizer.char_level(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567")
T = 8  # max_new_tokens
GREEDY = sampling.SamplingParams(0.0, 1.0, 0)
# Texts of 1 to 12 characters (2 to 13 tokens with the bos).
TEXTS = ["a", "hello", "GRPO", "jaxgrpoJAX01", "xyz", "Zq7", "mmmmmm", "b4"]


@pytest.fixture(scope="module")
def params():
  """Random parameters, final norm scale 25 (logits std ~3, so greedy has no near-ties)."""
  p = random_params(CFG, 0)
  p["final_norm"]["scale"] = p["final_norm"]["scale"] * 25.0
  return p


def _mesh(n):
  return sharding.make_mesh({"data": n}, devices=jax.devices()[:n])


def _prompts(texts, width=13):
  ids = TOKENIZER.encode_batch(texts)  # with the bos, as the trainer encodes prompts
  tokens = np.zeros((len(ids), width), np.int32)
  mask = np.zeros((len(ids), width), bool)
  for row, x in enumerate(ids):
    tokens[row, width - len(x):], mask[row, width - len(x):] = x, True
  return tokens, mask


def _engines(mesh, train, val, slots, g=4):
  profiles = {"train": sampling.Profile(train, g, T), "val": sampling.Profile(val, g, T)}
  # eos plus the character "e" end a completion, so rows end at different steps.
  kw = dict(max_prompt_length=13, eos_id=(TOKENIZER.eos_id, 8), pad_id=TOKENIZER.pad_id,
            seed=0)
  return (sampling.RolloutEngine(CFG, mesh, profiles, **kw),
          jr.JetStreamRolloutEngine(CFG, mesh, profiles, tokenizer=TOKENIZER, slots=slots, **kw))


def test_every_abstract_member_is_implemented(params):
  abstract = engine_api.Engine.__abstractmethods__
  assert len(abstract) == 12
  assert not je.Engine.__abstractmethods__
  for name in abstract:  # defined by the adapter itself, not inherited
    assert name in vars(je.Engine), name
  mesh = _mesh(8)
  engine = je.Engine(CFG, mesh, sampling.Profile(GREEDY, 1, T), tokenizer=TOKENIZER,
                     max_prompt_length=13, max_concurrent_decodes=8, eos_id=2, pad_id=0,
                     params=sharding.shard_params(params, CFG, mesh))
  assert (engine.max_concurrent_decodes, engine.samples_per_slot) == (8, 1)
  assert engine.max_prefill_length == 16  # JetStream's bucket above 13
  assert engine.mesh is mesh and engine.colocated_cpus is None
  assert isinstance(engine.get_tokenizer(), tokenizer_pb2.TokenizerParameters)
  tok = engine.build_tokenizer(engine.get_tokenizer())
  assert isinstance(tok, tokenizer_api.Tokenizer)
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_tokens) == (1, 2, 0, {2})
  ids, length = tok.encode("hello", is_bos=True, max_prefill_length=16, jax_padding=False)
  assert length == 6 and list(ids[:6]) == TOKENIZER.encode("hello") and ids.shape == (16,)
  ps = engine.load_params()
  prefix = engine.prefill(params=ps, padded_tokens=ids, true_length=length)
  # The prefix moves to the generate engine with the destination sharding (what the
  # orchestrator's transfer thread does), and is inserted and decoded from there.
  prefix = jax.device_put(prefix, engine.get_prefix_destination_sharding())
  assert int(prefix.length) == 6
  state = engine.insert(prefix, engine.init_decode_state(), slot=3)
  state, result = engine.generate(ps, state)
  slot = result.convert_to_numpy().get_result_at_slot(3)
  assert slot.valid.tolist() == [[1]] and slot.lengths.tolist() == [1]
  assert result.convert_to_numpy().get_result_at_slot(0).valid.tolist() == [[0]]  # empty slot
  with pytest.raises(NotImplementedError, match="existing_prefix"):
    engine.prefill(params=ps, existing_prefix=prefix, padded_tokens=ids, true_length=length)
  with pytest.raises(ValueError, match="multiple of 8"):
    je.Engine(CFG, mesh, sampling.Profile(GREEDY, 1, T), tokenizer=TOKENIZER,
              max_prompt_length=13, max_concurrent_decodes=4, eos_id=2, pad_id=0)


@pytest.mark.parametrize("devices", [1, 8])
def test_rollouts_are_the_native_samplers(params, devices):
  # The adapter draws with the native sampler's function and uniforms, so not only greedy
  # but sampled rollouts (top-k + top-p here) come out the same, token for token. Fewer
  # slots than rows (train: 8 slots for 32 rows) makes it run in waves, slots at different
  # steps; val gets one slot per row.
  mesh = _mesh(devices)
  sharded = sharding.shard_params(params, CFG, mesh)
  native, adapter = _engines(mesh, sampling.SamplingParams(1.0, 0.9, 5), GREEDY,
                             {"train": 8, "val": 32})
  tokens, mask = _prompts(TEXTS)
  for name in ("train", "val", "train"):
    a = jax.device_get(native.sample(name, sharded, tokens, mask, step=3))
    b = jax.device_get(adapter.sample(name, sharded, tokens, mask, step=3))
    for field, x, y in zip(a._fields, a, b):
      np.testing.assert_allclose(x, y, atol=1e-5, err_msg=f"{name} {field}")
    assert 0 < b.lengths_N.min() < T and b.truncated_N.any() and not b.truncated_N.all()
  assert adapter.compilations == {"train": 1, "val": 1}


def test_jetstreams_orchestrator_returns_the_native_greedy_tokens(params):
  # JetStream's own driver (interleaved: prefill and generate on one engine) with jaxgrpo's
  # engine, fed 8 prompts of 1 to 12 characters at once; each completion must be what the
  # native sampler gives greedily, up to its end token (which JetStream does not return).
  mesh = _mesh(8)
  sharded = sharding.shard_params(params, CFG, mesh)
  native, _ = _engines(mesh, GREEDY, GREEDY, {"train": 8, "val": 8}, g=1)
  tokens, mask = _prompts(TEXTS)
  rollout = jax.device_get(native.sample("val", sharded, tokens, mask, step=0))
  engine = je.Engine(CFG, mesh, sampling.Profile(GREEDY, 1, T), tokenizer=TOKENIZER,
                     max_prompt_length=13, max_concurrent_decodes=8, eos_id=(2, 8), pad_id=0,
                     params=sharded)
  driver = orchestrator.Driver(prefill_engines=[engine], generate_engines=[engine],
                               prefill_params=[engine.load_params()],
                               generate_params=[engine.load_params()], interleaved_mode=True)
  client = orchestrator.LLMOrchestrator(driver=driver)

  async def ask(text):
    # Token ids without the bos: JetStream prepends the tokenizer's bos to a new request.
    request = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(
            token_ids=TOKENIZER.encode(text, add_bos=False)), max_tokens=T)
    out = []
    async for response in client.Decode(request):
      out += list(response.stream_content.samples[0].token_ids)
    return out

  async def ask_all():
    return await asyncio.gather(*(ask(t) for t in TEXTS))

  try:
    got = asyncio.run(asyncio.wait_for(ask_all(), timeout=120))
  finally:
    driver.stop()
  for row, ids in enumerate(got):
    expected = rollout.tokens_NxT[row, :rollout.lengths_N[row]].tolist()
    if not rollout.truncated_N[row]:
      expected = expected[:-1]  # the end token
    assert ids == expected, (TEXTS[row], ids, expected)
  assert any(rollout.truncated_N) and not all(rollout.truncated_N)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The smoke preset through the CLI with each backend: {backend: (workdir, process)}."""
  out = {}
  for backend in ("jetstream", "native"):
    workdir = tmp_path_factory.mktemp(backend)
    out[backend] = workdir, run_train(f"--config={MATH}:smoke",
                                      f"--config.generation.backend={backend}",
                                      workdir=workdir)
  return out


@pytest.mark.slow
def test_grpo_run_with_the_jetstream_backend(runs):
  workdir, proc = runs["jetstream"]
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "compiled: update 1, samplers train 1 / val 1" in proc.stdout
  records = _metrics(workdir)
  val = [r for r in records if r["split"] == "val"]
  assert [r["step"] for r in val] == [0, 2, 3]
  assert all(0 <= r["accuracy"] <= 1 and "pass@2" in r for r in val)
  # The same rollouts as the native backend's run: the same rewards, and the same updates
  # up to float rounding.
  native_workdir, native = runs["native"]
  assert native.returncode == 0, native.stderr[-3000:]
  for a, b in zip(records, _metrics(native_workdir), strict=True):
    assert (a["split"], a["step"]) == (b["split"], b["step"])
    for key in ("reward_mean", "accuracy", "completion_length_mean", "pass@2"):
      if key in a:
        assert a[key] == b[key], (a["step"], key)
    for key in ("loss", "grad_norm"):
      if key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.slow
def test_serve_answers_a_request_on_localhost(runs):
  from jaxgrpo.run import serving  # pylint: disable=g-import-not-at-top
  workdir, proc = runs["jetstream"]
  assert proc.returncode == 0, proc.stderr[-3000:]
  port = portpicker.pick_unused_port()
  server = subprocess.Popen([sys.executable, "-m", "jaxgrpo.serve", f"--workdir={workdir}",
                             f"--port={port}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
  try:
    line = server.stdout.readline()  # printed once the server listens
    assert line.startswith(f"serving step 3 of {workdir} on localhost:{port}"), (
        line, server.stderr.read() if server.poll() is not None else "")
    text = serving.complete(port, "123+456=", max_tokens=8)
    # The smoke-trained arithmetic model answers with digits (its vocabulary has no others
    # besides + and =); that it is a completion at all is what this checks.
    assert text and set(text) <= set("0123456789+="), text
  finally:
    server.send_signal(signal.SIGTERM)
    out, err = server.communicate(timeout=60)
  assert server.returncode == 0, err[-3000:]
  assert "stopped" in out


def test_train_never_imports_jetstream_where_it_is_installed(tmp_path):
  # The same check as tests/test_train.py's, here where jetstream and TensorFlow are
  # installed and would load if anything imported them.
  assert_smoke_run_imports_nothing_heavy(tmp_path / "w")
  check = subprocess.run([sys.executable, "-c", "import sys, jaxgrpo.train; print(sorted("
                          f"m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"],
                         capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
  assert check.stdout.strip() == "[]", check.stderr[-2000:]

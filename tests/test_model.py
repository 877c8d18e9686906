"""Tests for jaxgrpo.model.decoder (decoding is tests/test_decode.py): padding, RoPE, RMSNorm, axes, dtypes, config."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgrpo.model import attention
from jaxgrpo.model import decoder as model
from numpy_params import random_params  # tests/numpy_params.py

# A tiny grouped-query model: 4 query heads share 2 KV heads.
BASE = model.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64)

# Two variants keep the compile time down while covering every switch: grouped-query
# attention with tied embeddings, and multi-head attention (num_kv_heads == num_heads) with
# QK-norm and an untied output head.
VARIANTS = {
    "gqa_tied": BASE,
    "mha_qknorm_untied": dataclasses.replace(BASE, num_kv_heads=4, qk_norm=True,
                                             tie_embeddings=False),
}

_forward = jax.jit(model.forward, static_argnums=1)
@functools.partial(jax.jit, static_argnums=2)
def _rope(x, positions, theta):
  """rope with plain frequencies theta^(-2i/d) (no scaling)."""
  cfg = model.ModelConfig(vocab_size=1, d_model=1, num_layers=1, num_heads=1, num_kv_heads=1,
                          head_dim=x.shape[-1], mlp_dim=1, rope_theta=theta)
  return attention.rope(x, positions, attention.rope_frequencies(cfg, x.shape[-1]))


def _random_params(cfg, seed):
  # Norm scales 1 + noise, so that a dropped scale would show.
  return random_params(cfg, seed, scale_noise=0.1)


@pytest.fixture(scope="module")
def base_params():
  return _random_params(BASE, seed=0)


def _padding_batch(rng):
  """One 5-token prompt after 0, 1, 3 and 6 pads of random content, in rows of width 11.

  Whatever follows the prompt cannot reach its logits (causal attention), so the rows are
  filled up with random tokens and one forward shape serves every amount of padding.
  """
  prompt = rng.integers(0, BASE.vocab_size, size=5).astype(np.int32)
  pads = np.array([0, 1, 3, 6])
  tokens = rng.integers(0, BASE.vocab_size, size=(4, 11)).astype(np.int32)
  for row, pad in enumerate(pads):
    tokens[row, pad:pad + 5] = prompt
  mask = np.arange(11)[None, :] >= pads[:, None]
  return tokens, mask, pads


def test_logits_invariant_to_left_padding(base_params):
  tokens, mask, pads = _padding_batch(np.random.default_rng(1))
  logits = _forward(base_params, BASE, tokens, mask)
  for row, pad in enumerate(pads[1:], start=1):
    np.testing.assert_allclose(logits[row, pad:pad + 5], logits[0, :5], atol=1e-5)
  # The pads' content is ignored: other random pads give the same logits.
  tokens2 = tokens.copy()
  tokens2[~mask] = (tokens2[~mask] + 1) % BASE.vocab_size
  np.testing.assert_allclose(_forward(base_params, BASE, tokens2, mask)[mask], logits[mask],
                             atol=1e-5)


def test_rope_position_zero_is_identity():
  x = np.random.default_rng(0).standard_normal((2, 3, 4, 8)).astype(np.float32)  # [B,T,H,D]
  np.testing.assert_allclose(_rope(x, jnp.zeros((2, 3), jnp.int32), 10_000.0), x,
                             atol=1e-7)


def test_rope_hand_example_depends_on_relative_position():
  # head_dim 2 has one frequency theta**0 = 1, so position m rotates by m radians:
  # rope([1, 0], m) = [cos m, sin m] and rope([0, 1], n) = [-sin n, cos n], whose dot
  # product is sin(m - n): sin(2) for both (m, n) = (3, 1) and (5, 3).
  q = jnp.array([[[1.0, 0.0]]])  # [T=1, H=1, D=2]
  k = jnp.array([[[0.0, 1.0]]])
  np.testing.assert_allclose(_rope(q, jnp.array([1]), 10_000.0)[0, 0],
                             [math.cos(1), math.sin(1)], atol=1e-6)

  def score(m, n):
    return float(jnp.sum(_rope(q, jnp.array([m]), 10_000.0)
                         * _rope(k, jnp.array([n]), 10_000.0)))

  assert score(3, 1) == pytest.approx(math.sin(2), abs=1e-5)
  assert score(5, 3) == pytest.approx(math.sin(2), abs=1e-5)
  assert score(1, 3) == pytest.approx(math.sin(-2), abs=1e-5)


def test_rope_relative_position_all_frequencies():
  rng = np.random.default_rng(3)
  q = rng.standard_normal((1, 1, 8)).astype(np.float32)  # [T, H, D]
  k = rng.standard_normal((1, 1, 8)).astype(np.float32)

  def score(m, n):
    return float(jnp.sum(_rope(q, jnp.array([m]), 100.0)
                         * _rope(k, jnp.array([n]), 100.0)))

  assert score(5, 2) == pytest.approx(score(3, 0), abs=1e-4)
  assert score(10, 7) == pytest.approx(score(3, 0), abs=1e-4)
  assert score(4, 2) != pytest.approx(score(3, 0), abs=1e-3)


def test_rmsnorm_hand_example():
  # x = [3, 4]: mean square (9 + 16) / 2 = 12.5, rms = sqrt(12.5) = 3.5355, so
  # x / rms = [0.8485, 1.1314]; scale [2, 0.5] gives [1.6971, 0.5657].
  cfg = dataclasses.replace(BASE, norm_eps=0.0)
  norm = model.RMSNorm(cfg, 2)
  out = norm.apply({"params": {"scale": jnp.array([2.0, 0.5])}}, jnp.array([3.0, 4.0]))
  rms = math.sqrt(12.5)
  np.testing.assert_allclose(out, [2 * 3 / rms, 0.5 * 4 / rms], rtol=1e-6)
  np.testing.assert_allclose(out, [1.6971, 0.5657], atol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_parameter_has_logical_axis_names(variant):
  cfg = VARIANTS[variant]
  boxed = jax.eval_shape(lambda key: model.init_params(cfg, key), jax.random.key(0))
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert leaves
  for leaf in leaves:
    assert isinstance(leaf, nn.LogicallyPartitioned), type(leaf)
    assert len(leaf.names) == len(leaf.value.shape), (leaf.names, leaf.value.shape)
    assert all(isinstance(n, str) for n in leaf.names), leaf.names
  # Stacked layers: q, k, v, o, gate, up, down and two norm scales, each [num_layers, ...]
  # with the leading axis named "layers"; plus the embedding and the final norm.
  expected = 9 + 2
  layers = boxed["layers"]
  attn = layers["attn"]
  assert boxed["embedding"].names == ("vocab", "embed")
  assert attn["q"].names == ("layers", "embed", "q_heads", "head_dim")
  assert attn["q"].value.shape[0] == cfg.num_layers
  assert attn["k"].names == ("layers", "embed", "kv_heads", "head_dim")
  assert attn["o"].names == ("layers", "q_heads", "head_dim", "embed")
  assert layers["mlp"]["down"].names == ("layers", "mlp", "embed")
  assert layers["attn_norm"]["scale"].names == ("layers", "norm")
  if variant == "mha_qknorm_untied":
    expected += 1 + 2  # lm_head; q_norm and k_norm
    assert boxed["lm_head"].names == ("embed", "vocab")
    assert attn["q_norm"]["scale"].names == ("layers", "norm")
  assert len(leaves) == expected


def test_bfloat16_runs_and_is_close_to_float32(base_params):
  cfg = dataclasses.replace(BASE, param_dtype="bfloat16", dtype="bfloat16")
  abstract = jax.eval_shape(lambda key: model.init_params(cfg, key), jax.random.key(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nn.unbox(abstract)))
  tokens, mask, _ = _padding_batch(np.random.default_rng(2))  # the shape compiled above
  ref = _forward(base_params, BASE, tokens, mask)
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base_params)
  out = _forward(params16, cfg, tokens, mask)
  assert out.dtype == jnp.float32  # logits always come out in float32
  assert np.all(np.isfinite(out))
  # Logits here are O(0.4); bfloat16 keeps ~3 significant digits.
  np.testing.assert_allclose(out, ref, atol=0.05)


def test_config_rejects_heads_not_multiple_of_kv_heads():
  with pytest.raises(ValueError, match="num_heads.*num_kv_heads"):
    dataclasses.replace(BASE, num_heads=4, num_kv_heads=3)


def test_config_rejects_unknown_dtype():
  with pytest.raises(ValueError, match=r"model\.dtype='float16'"):
    dataclasses.replace(BASE, dtype="float16")
  with pytest.raises(ValueError, match=r"model\.param_dtype"):
    dataclasses.replace(BASE, param_dtype="fp32")


def test_config_from_dict_rejects_unknown_key():
  values = dataclasses.asdict(BASE)
  assert model.ModelConfig.from_dict(values) == BASE
  values["n_layers"] = 3
  with pytest.raises(ValueError, match="n_layers"):
    model.ModelConfig.from_dict(values)


def test_config_rejects_non_positive_size():
  with pytest.raises(ValueError, match=r"model\.head_dim"):
    dataclasses.replace(BASE, head_dim=0)


def test_llama3_rope_scaling_by_hand():
  # d=8, theta=10000: inv_freq = [1, 0.1, 0.01, 0.001], wavelengths 2*pi/f = [6.28, 62.8,
  # 628, 6283]. With original_max 64, low 1, high 4: low_wavelen 64, high_wavelen 16.
  # f=1 (6.28 < 16) keeps 1; f=0.001 and f=0.01 (> 64) become f/8; f=0.1 (62.8, between)
  # is smoothed: s = (64/62.83 - 1) / 3 = 0.00620, (1-s) * 0.1/8 + s * 0.1 = 0.013043.
  cfg = model.ModelConfig(vocab_size=1, d_model=1, num_layers=1, num_heads=1, num_kv_heads=1,
                          head_dim=8, mlp_dim=1, rope_theta=10_000.0, rope_scaling_factor=8.0,
                          rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                          rope_original_max_positions=64)
  s = (64 / (2 * np.pi / 0.1) - 1) / 3
  want = [1.0, (1 - s) * 0.1 / 8 + s * 0.1, 0.01 / 8, 0.001 / 8]
  np.testing.assert_allclose(attention.rope_frequencies(cfg, 8), want, rtol=1e-5)


def test_dense_contracts_trailing_axes_like_einsum():
  # dense(x, w) is the einsum "...d,dn->...n"; with in_dims=2 "...hk,hkd->...d" (the output
  # projection). Hand example: x = [[1, 2]] (one row), w = [[1, 0, 2], [0, 1, 3]] gives
  # [1*1 + 2*0, 1*0 + 2*1, 1*2 + 2*3] = [1, 2, 8].
  got = model.dense(jnp.array([[1.0, 2.0]]), jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, 3.0]]))
  np.testing.assert_allclose(got, [[1.0, 2.0, 8.0]])
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 4, 5, 6)).astype(np.float32)
  w = rng.normal(size=(5, 6, 7)).astype(np.float32)
  np.testing.assert_allclose(model.dense(x, w, in_dims=2),
                             np.einsum("bgthk,hkd->bgtd", x, w), rtol=1e-5, atol=1e-5)
  w1 = rng.normal(size=(6, 2, 3)).astype(np.float32)
  np.testing.assert_allclose(model.dense(x, w1), np.einsum("...d,dhk->...hk", x, w1),
                             rtol=1e-5, atol=1e-5)


def test_mlp_weight_gradients_need_no_transposed_activation_copy():
  # The training loss runs the MLP on [B, G, T, d]. Written as an einsum over those axes,
  # XLA's CPU backend computed each weight gradient from a transposed copy of the [B*G*T,
  # mlp] activation gradient, fused into SwiGLU's backward as a strided loop (~12% of the
  # small-preset update, BENCHMARKS.md). model.dense flattens the rows, so the compiled
  # gradient has no transpose at all.
  mlp = model.MLP(BASE)
  x = jnp.ones((2, 3, 4, BASE.d_model))
  params = mlp.init(jax.random.key(0), x)
  grad = jax.jit(jax.grad(lambda p, x: jnp.sum(mlp.apply(p, x) ** 2)))
  hlo = grad.lower(params, x).compile().as_text()
  assert " transpose(" not in hlo


def test_remat_keeps_less_for_the_backward():
  # The compiled update's temporary bytes (memory_analysis): remat "full" keeps only each
  # layer's input for the backward pass, "save_dots" its projections' outputs too. XLA's
  # CPU scheduler runs much of the recomputation early, so on CPU the saving is small
  # (2 layers: measured 51.4 -> 47.1 / 47.7 MiB here, 4 layers 93 -> 85; a plain 8-layer MLP
  # under jax.checkpoint saved nothing);
  # what matters is that the update compiles with it and holds less, not how much.
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  from jaxgrpo.bench import memory as bench_memory  # pylint: disable=g-import-not-at-top
  cfg = model.ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, mlp_dim=256)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  temp = {remat: bench_memory.update_memory(cfg, mesh, prompts=8, generations=4, prompt_len=16,
                                            new_tokens=64, remat=remat)["temp_bytes"]
          for remat in ("none", "save_dots", "full")}
  assert temp["full"] < temp["none"] and temp["save_dots"] < temp["none"], temp


def _score_loss(params, cfg, batch, scan_layers, remat="none"):
  """A scalar of score_groups' logits (every position and vocabulary entry weighs in)."""
  logits = model.score_groups(params, cfg, *batch, remat=remat, scan_layers=scan_layers)
  return jnp.sum(jax.nn.log_softmax(logits) * jnp.cos(jnp.arange(logits.shape[-1])))


def _score_batch(cfg, rng, b=2, g=3, p=6, t=5):
  """Left-padded prompts (1 and 3 pads) and ragged completions (t and t - 2 real tokens)."""
  prompt = rng.integers(0, cfg.vocab_size, (b, p)).astype(np.int32)
  prompt_mask = np.arange(p)[None] >= np.array([1, 3])[:b, None]
  completion = rng.integers(0, cfg.vocab_size, (b, g, t)).astype(np.int32)
  completion_mask = np.ones((b, g, t), bool)
  completion_mask[:, 1, t - 2:] = False
  return prompt, prompt_mask, completion, completion_mask


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_scanned_layers_equal_unrolled_ones(variant):
  # The layers as one scanned body or unrolled read the same stacked parameters and run the
  # same ops: logits, prefill K/V, the training forward and its gradients agree (float32;
  # the forward came out bitwise equal on CPU, the gradients' sums differ in order: up to
  # 2e-5 relative, so gradients are compared to 1e-4 of the largest entry of each leaf).
  # test_decode.py pins the decode step (a Python loop over the stack) to `forward`, which
  # catches a layer applied out of order in both.
  from jaxgrpo.rollout import sampling  # pylint: disable=g-import-not-at-top
  cfg = VARIANTS[variant]
  params = _random_params(cfg, seed=1)
  tokens, mask, _ = _padding_batch(np.random.default_rng(1))
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
  logits = {s: jax.jit(model.forward, static_argnums=(1, 4))(params, cfg, tokens, mask, s)
            for s in (True, False)}
  close(logits[True], logits[False])
  prefill = jax.jit(sampling.prefill, static_argnums=(1, 4))
  (last_s, (ks_s, vs_s)), (last_u, (ks_u, vs_u)) = (prefill(params, cfg, tokens, mask, s)
                                                    for s in (True, False))
  close(last_s, last_u)
  assert len(ks_s) == len(ks_u) == cfg.num_layers
  jax.tree.map(close, (ks_s, vs_s), (ks_u, vs_u))
  batch = _score_batch(cfg, np.random.default_rng(2))
  grad = jax.jit(jax.value_and_grad(_score_loss), static_argnums=(1, 3, 4))
  # Remat wraps the layer the same way for every variant, so one variant checks it.
  for remat in ("none", "full") if variant == "gqa_tied" else ("none",):
    (loss_s, g_s), (loss_u, g_u) = (grad(params, cfg, batch, s, remat) for s in (True, False))
    close(loss_s, loss_u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-4 * float(np.abs(b).max())), g_s, g_u)
    assert float(jnp.abs(g_s["layers"]["mlp"]["down"][0]).max()) > 0  # a real gradient


def test_scanned_layers_compile_one_layer_body():
  # What scanning is for: the compiled training forward + backward holds one layer's
  # matmuls whatever the depth, where the unrolled program holds one set per layer (28
  # layers of a real model: 28 copies for XLA to compile). Counted in the optimized HLO.
  rng = np.random.default_rng(0)
  dots = {}
  for layers in (2, 6):
    cfg = dataclasses.replace(BASE, num_layers=layers)
    params = jax.eval_shape(lambda: random_params(cfg, 0))
    batch = _score_batch(cfg, rng)
    for scan in (True, False):
      fn = jax.jit(jax.grad(_score_loss), static_argnums=(1, 3))
      hlo = fn.lower(params, cfg, batch, scan).compile().as_text()
      dots[layers, scan] = hlo.count(" dot(")
  assert dots[2, True] == dots[6, True], dots
  assert dots[6, False] > 2 * dots[2, False], dots
  assert dots[6, True] < dots[6, False], dots


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_attention_path_equals_the_einsum_path(variant, monkeypatch):
  # attention="cudnn" routes the prompt forward (prefill) and the completions' `extend`
  # through jax.nn.dot_product_attention: one [B, 1, T, S] mask for causality and left
  # padding, and for `extend` one key sequence per sample, [its prompt | its own tokens].
  # cuDNN itself needs a GPU, so here the same call runs with jax's XLA implementation:
  # the layouts, the masks and the GQA grouping handed to the kernel must reproduce the
  # einsum path (logits, the loss and its gradients; ragged completions, left padding).
  from jaxgrpo.model import attention  # pylint: disable=g-import-not-at-top
  original = attention.fused_attention
  monkeypatch.setattr(attention, "fused_attention",
                      lambda q, k, v, allowed, implementation: original(q, k, v, allowed, "xla"))
  cfg = VARIANTS[variant]
  params = _random_params(cfg, seed=4)
  tokens, mask, _ = _padding_batch(np.random.default_rng(4))
  fwd = jax.jit(model.forward, static_argnums=(1, 4, 5))
  got, want = (fwd(params, cfg, tokens, mask, False, a) for a in ("cudnn", "xla"))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  batch = _score_batch(cfg, np.random.default_rng(5))

  def loss(p, attention):
    logits = model.score_groups(p, cfg, *batch, scan_layers=True, attention=attention)
    return jnp.sum(jax.nn.log_softmax(logits) * jnp.cos(jnp.arange(logits.shape[-1])))

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  (loss_f, g_f), (loss_x, g_x) = grad(params, "cudnn"), grad(params, "xla")
  assert_same_loss_and_grads((loss_f, g_f), (loss_x, g_x))


def test_splash_attention_equals_the_einsum_path():
  """Issue 51: Pallas' splash attention (run here in interpret mode: the kernel's own code,
  on CPU) gives the einsum path's outputs and gradients: grouped-query heads, left padding
  (a pad query's output is junk on both paths and never read, so only real queries are
  compared), and for `extend` ragged completions over a shared, padded prompt. Lengths that
  are not multiples of the kernel's 128-token blocks are padded inside."""
  rng = np.random.default_rng(0)
  b, t, h, hk, d = 2, 40, 4, 2, 16
  q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (h, hk, hk))
  mask = jnp.asarray(np.arange(t)[None] >= np.array([5, 0])[:, None])
  allowed = jnp.tril(jnp.ones((t, t), bool))[None] & mask[:, None, :]
  weights = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) * mask[..., None, None]

  def loss(fn):
    return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights), (0, 1, 2))

  want = loss(lambda q, k, v: attention.attend(q, k, v, allowed, "xla"))(q, k, v)
  got = loss(lambda q, k, v: attention.splash(q, k, v, mask, mask, 0))(q, k, v)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for a, b_ in zip(got[1], want[1]):
    np.testing.assert_allclose(a, b_, atol=2e-5 * float(jnp.abs(b_).max()))
  # extend: G=3 completions of T=24 per prompt, 24, 10 and 1 (and 5, 24, 20) real tokens.
  g, tt = 3, 24
  qe, ke, ve = (jnp.asarray(rng.standard_normal((b, g, tt, n, d)), jnp.float32)
                for n in (h, hk, hk))
  own_mask = jnp.asarray(np.arange(tt)[None, None] < np.array([[24, 10, 1], [5, 24, 20]])[..., None])
  own = jnp.tril(jnp.ones((tt, tt), bool))[None, None] & own_mask[:, :, None, :]
  prompt_k, prompt_v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  want = attention.extend(qe, ke, ve, prompt_k, prompt_v, mask, own, "xla")
  got = attention.extend_splash(qe, ke, ve, prompt_k, prompt_v, mask, own_mask)
  real = own_mask[..., None, None]
  np.testing.assert_allclose(got * real, want * real, atol=1e-5)


def test_splash_on_a_mesh_equals_the_einsum_path():
  """The model's training forward and backward (score_groups: prompts, then completions over
  their prompt's K/V) with attention='splash' on 8 devices (data 2 x fsdp 2 x tensor 2:
  the kernel inside shard_map, rows over the data axes, heads over tensor) against 'xla'
  on the same mesh: the loss and every parameter's gradient."""
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(BASE, num_layers=1)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  params = sharding.shard_params(_random_params(cfg, seed=4), cfg, mesh)
  rng = np.random.default_rng(5)
  prompt, _, completion, completion_mask = _score_batch(cfg, rng, b=4, g=2)
  prompt_mask = np.arange(prompt.shape[1])[None] >= np.array([1, 3, 0, 2])[:, None]
  batch = (prompt, prompt_mask, completion, completion_mask)
  batch = tuple(jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)) for x in batch)

  def loss(p, implementation):  # as the update runs it: on the mesh, activations pinned
    logits = model.score_groups(p, cfg, *batch, scan_layers=True, attention=implementation,
                                mesh=mesh, pin=True)
    real = batch[3][..., None]
    return jnp.sum(jax.nn.log_softmax(logits) * jnp.cos(jnp.arange(logits.shape[-1])) * real)

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  (loss_s, g_s), (loss_x, g_x) = grad(params, "splash"), grad(params, "xla")
  assert_same_loss_and_grads((loss_s, g_s), (loss_x, g_x))


def test_attention_resolves_by_platform_and_dtype():
  # cuDNN's flash attention takes half-precision inputs only: a float32 model on a GPU
  # keeps the einsum path, and CPU keeps it always. TPU runs splash (issue 51).
  assert attention.resolve_attention(None, "gpu", "bfloat16") == "cudnn"
  assert attention.resolve_attention(None, "gpu", "float32") == "xla"
  assert attention.resolve_attention(None, "tpu", "bfloat16") == "splash"
  assert attention.resolve_attention(None, "tpu", "float32") == "splash"
  assert attention.resolve_attention(None, "cpu", "bfloat16") == "xla"
  assert attention.resolve_attention("xla", "gpu", "bfloat16") == "xla"
  # A model with sliding-window layers (Gemma 3): the splash kernels take no window, so TPU
  # runs xla, and a splash that reaches here (refused at startup) becomes xla too: no window
  # is ever dropped. cuDNN's takes the window in its mask.
  assert attention.resolve_attention(None, "tpu", "bfloat16", windowed=True) == "xla"
  assert attention.resolve_attention("splash", "tpu", "bfloat16", windowed=True) == "xla"
  assert attention.resolve_attention(None, "gpu", "bfloat16", windowed=True) == "cudnn"


def test_packed_rows_attend_within_their_segments_with_splash_as_with_xla():
  """Issue 51's packing (algo/packing.py): score_packed over rows holding several sequences
  end to end (segment ids 1, 2, ...; 0 padding, positions restarting at 0). Each sequence's
  hidden states equal those of the sequence forwarded alone (the xla path), and splash
  attention (interpret mode) gives the xla path's loss and gradients on those rows."""
  cfg = dataclasses.replace(BASE, num_layers=1)
  params = _random_params(cfg, seed=6)
  rng = np.random.default_rng(7)
  lengths = [[5, 9, 3], [12, 6]]  # row 0: 17 tokens and 3 of padding; row 1: 18 and 2
  s = 20
  tokens = rng.integers(1, cfg.vocab_size, (2, s)).astype(np.int32)
  segments, positions = np.zeros((2, s), np.int32), np.zeros((2, s), np.int32)
  for r, row in enumerate(lengths):
    start = 0
    for i, n in enumerate(row):
      segments[r, start:start + n], positions[r, start:start + n] = i + 1, np.arange(n)
      start += n
  packed = jax.jit(functools.partial(model.score_packed, cfg=cfg, scan_layers=True),
                   static_argnames="attention")
  hidden, _ = packed(params, tokens_RxS=tokens, positions_RxS=positions,
                     segments_RxS=segments, attention="xla")
  # Row 0's second sequence (columns 5-13) alone: the same hidden states.
  alone, _ = packed(params, tokens_RxS=tokens[:1, 5:14], positions_RxS=positions[:1, 5:14],
                    segments_RxS=np.ones((1, 9), np.int32), attention="xla")
  np.testing.assert_allclose(hidden[0, 5:14], alone[0], atol=1e-5)

  grad = _packed_loss_grad(cfg, tokens, positions, segments)
  (loss_s, g_s), (loss_x, g_x) = grad(params, "splash"), grad(params, "xla")
  assert_same_loss_and_grads((loss_s, g_s), (loss_x, g_x))


def test_context_parallel_packed_forward_and_backward_equal_one_device():
  """Issue 51's context parallelism: packed rows (as above, 2 rows of 256 positions) on 8
  devices, data 2 x context 2 x tensor 2: each row's positions split over the context pair
  (the activations come out split so), attention with K/V gathered: "xla" (its queries
  split by the sharding) and "splash" (one kernel a chip position, causal offsets c * S / C,
  interpret mode). Loss and gradients equal the single-device xla ones."""
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(BASE, num_layers=1)
  params = _random_params(cfg, seed=8)
  rng = np.random.default_rng(9)
  # 256 positions: splash's blocks are 128, so each chip of the pair holds real queries
  # (with fewer, the second chip's would all be padding and its causal offset untested).
  s = 256
  tokens = rng.integers(1, cfg.vocab_size, (2, s)).astype(np.int32)
  cut = lambda *ns: np.concatenate([np.full(n, i + 1) for i, n in enumerate(ns)])
  segments = np.stack([np.concatenate([cut(100, 140), np.zeros(16)]),
                       np.concatenate([cut(200, 50), np.zeros(6)])]).astype(np.int32)
  positions = np.stack([np.concatenate([np.arange(100), np.arange(140), np.zeros(16)]),
                        np.concatenate([np.arange(200), np.arange(50), np.zeros(6)])]
                       ).astype(np.int32)

  grad = _packed_loss_grad(cfg, tokens, positions, segments)
  want_loss, want_grads = grad(params, "xla")
  mesh = sharding.make_mesh({"data": 2, "context": 2, "tensor": 2})
  on_mesh = sharding.shard_params(params, cfg, mesh)
  hidden, _ = jax.jit(lambda p: model.score_packed(p, cfg, tokens, positions, segments,
                                                   scan_layers=True, attention="xla",
                                                   mesh=mesh, pin=True))(on_mesh)
  assert hidden.sharding.spec[1] == "context", hidden.sharding  # the positions split
  for implementation in ("xla", "splash"):
    got_loss, got_grads = _packed_loss_grad(cfg, tokens, positions, segments, mesh)(
        on_mesh, implementation)
    assert_same_loss_and_grads((got_loss, got_grads), (want_loss, want_grads))


def assert_same_loss_and_grads(got, want):
  """(loss, grads) pairs equal: the loss to 1e-5 relative, every gradient leaf to 1e-4 of its
  largest entry (flash kernels sum in another order than the einsum path)."""
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=0, atol=1e-4 * float(np.abs(b).max())), got[1], want[1])


def _packed_loss_grad(cfg, tokens, positions, segments, mesh=None):
  """jit(value_and_grad) of a loss over packed rows' real positions (a fixed projection of
  every log-probability), by attention implementation (static); on `mesh` as the update
  runs it (activations pinned), or on one device."""
  def loss(p, implementation):
    h, head = model.score_packed(p, cfg, tokens, positions, segments, scan_layers=True,
                                 attention=implementation, mesh=mesh, pin=mesh is not None)
    real = (segments > 0)[..., None]
    return jnp.sum(jax.nn.log_softmax(h @ head) * jnp.cos(jnp.arange(cfg.vocab_size)) * real)
  return jax.jit(jax.value_and_grad(loss), static_argnums=1)

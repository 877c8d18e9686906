"""jaxgrpo.Policy: the notebook facade over the model and the compiled sampler."""

import jax
import numpy as np
import pytest

import jaxgrpo
from jaxgrpo.model import decoder as model_lib

CFG = model_lib.ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=16, mlp_dim=64)


@pytest.fixture(scope="module")
def policy():
  return jaxgrpo.Policy.init(CFG, seed=0, pad_id=0, eos_id=None)


def test_lazy_top_level_names():
  assert jaxgrpo.SamplingParams.__name__ == "SamplingParams"
  assert jaxgrpo.ModelConfig is model_lib.ModelConfig
  with pytest.raises(AttributeError):
    jaxgrpo.NoSuchThing


def test_logits_match_pure_forward(policy):
  tokens = np.array([[1, 5, 6, 7], [1, 8, 9, 10]])
  got = policy.logits(tokens)
  want = model_lib.forward(jax.device_get(policy.params), CFG, tokens, np.ones((2, 4), bool))
  assert got.shape == (2, 4, 32)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert policy.num_params == model_lib.count_params(policy.params)


def test_generate_ragged_prompts_greedy(policy):
  greedy = jaxgrpo.SamplingParams(temperature=0.0, top_p=1.0, top_k=0)
  out = policy.generate([[1, 5, 6], [1, 7]], greedy, num_samples=3, max_new_tokens=4, seed=0)
  assert out.tokens_NxT.shape == (6, 4) and out.logp_NxT.shape == (6, 4)
  tokens = np.asarray(out.tokens_NxT)
  # Greedy: the 3 samples of a prompt agree, and match a manual argmax loop.
  assert (tokens[0] == tokens[1]).all() and (tokens[3] == tokens[5]).all()
  seq = [1, 7]
  for _ in range(4):
    seq.append(int(np.argmax(np.asarray(policy.logits([seq]))[0, -1])))
  assert tokens[3].tolist() == seq[2:]
  assert np.asarray(out.truncated_N).all() and (np.asarray(out.lengths_N) == 4).all()


def test_generate_seed_controls_samples(policy):
  sp = jaxgrpo.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
  a = policy.generate([[1, 5, 6]], sp, num_samples=4, max_new_tokens=8, seed=1)
  b = policy.generate([[1, 5, 6]], sp, num_samples=4, max_new_tokens=8, seed=1)
  c = policy.generate([[1, 5, 6]], sp, num_samples=4, max_new_tokens=8, seed=2)
  np.testing.assert_array_equal(a.tokens_NxT, b.tokens_NxT)
  assert not np.array_equal(a.tokens_NxT, c.tokens_NxT)


def test_generate_rejects_bad_prompts(policy):
  sp = jaxgrpo.SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
  with pytest.raises(ValueError, match="prompts"):
    policy.generate([], sp, num_samples=1, max_new_tokens=2, seed=0)
  with pytest.raises(ValueError, match="num_samples"):
    policy.generate([[1, 2]], sp, num_samples=0, max_new_tokens=2, seed=0)


def test_the_python_api_page_runs_and_score_is_the_samplers_raw_logp():
  """docs/python.md's example as written (issue 48: Policy.from_pretrained worked but no page
  named it): it loads, samples, scores with rewards and with the model; the model's score
  of generate's own samples is the sampler's raw_logp_NxT."""
  import os
  import re
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  page = open(os.path.join(root, "docs", "python.md")).read()
  code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
  ns = {}
  exec(compile(code, "docs/python.md", "exec"), ns)  # pylint: disable=exec-used
  out, mask = ns["out"], np.asarray(ns["mask_NxT"])
  assert ns["logp_NxT"].shape == out.tokens_NxT.shape == (8, 5)
  np.testing.assert_array_equal(mask, np.asarray(out.mask_NxT))
  np.testing.assert_allclose(ns["logp_NxT"], np.where(mask, out.raw_logp_NxT, 0), atol=1e-4)
  assert len(ns["total"]) == 8 and ns["parts"]["exact_match"] == ns["total"]
  assert ns["completions"][0].isdigit() or ns["completions"][0] == ""


def test_score_takes_ragged_completions_and_checks_the_group_count(policy):
  prompts = [[1, 5, 6], [1, 7]]
  logp, mask = policy.score(prompts, [[8, 9], [10], [11, 12], [13]])
  assert logp.shape == mask.shape == (4, 2) and mask.tolist() == [
      [True, True], [True, False], [True, True], [True, False]]
  # Row 2 is prompt 1's first completion: the same numbers as scoring it alone.
  alone, _ = policy.score([[1, 7]], [[11, 12]])
  np.testing.assert_allclose(logp[2], alone[0], atol=1e-5)
  assert logp[1, 1] == 0.0
  with pytest.raises(ValueError, match="3 rows for 2 prompts"):
    policy.score(prompts, [[8], [9], [10]])

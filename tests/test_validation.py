"""Validation: which reward counts as correctness, and scoring only the real rows."""

import numpy as np

from jaxgrpo import validation


def test_correctness_prefers_math_then_exact_match():
  breakdown = {"math": [1.0, 0.0], "exact_match": [0.0, 1.0], "format": [1.0, 1.0]}
  total = [2.0, 1.5]
  np.testing.assert_array_equal(
      validation.correctness({"math": 1.0, "exact_match": 1.0}, total, breakdown), [1, 0])
  np.testing.assert_array_equal(
      validation.correctness({"math": 0.0, "exact_match": 1.0}, total, breakdown), [0, 1])
  # Neither active: a row is correct when its total reward is positive.
  np.testing.assert_array_equal(
      validation.correctness({"format": 1.0}, [0.0, 0.5], breakdown), [0, 1])


class _FakeEngine:
  """Answers '0579' for every row: the scoring is what is under test."""

  def __init__(self, tok):
    self.tok = tok

  def profile(self, name):
    assert name == "val"
    return type("P", (), {"num_samples": 1})()

  def sample(self, name, params, tokens, mask, key):
    import jaxgrpo.sampling as s
    n = len(tokens)
    row = self.tok.encode("0579", add_bos=False) + [self.tok.eos_id]
    toks = np.array([row] * n, np.int32)
    return s.Rollout(toks, np.zeros(toks.shape), np.zeros(toks.shape), np.ones(toks.shape, bool),
                     np.full(n, 5), np.zeros(n, bool))


def test_run_counts_only_valid_rows():
  import jax
  from jaxgrpo import data
  from jaxgrpo.tokenizer import Tokenizer
  tok = Tokenizer.char_level("0123456789+=")
  rows = [{"question": "123+456=", "answer": "0579"}, {"question": "001+001=", "answer": "0002"},
          {"question": "100+479=", "answer": "0579"}]
  # Batches of 2: the last batch is padded with a repeat of row 3, flagged invalid, so the
  # accuracy is 2 right of 3 rows (not 3 of 4).
  batches = data.validation_batches(rows, tok, 2, 9, process_index=0, process_count=1)
  result = validation.run(_FakeEngine(tok), None, batches, tok, {"exact_match": 1.0},
                          jax.random.key(0))
  assert result["num_samples"] == 3
  assert abs(result["accuracy"] - 2 / 3) < 1e-9

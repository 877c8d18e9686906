"""The scoring seam: columns, rich returns, None, and failures that never stop a run."""

import os
import textwrap
import time

import numpy as np

from jaxgrpo import plugins, rewards, scorer


class _Chars:
  """A tokenizer stand-in: token t is chr(t), pad 0 stops a row."""

  def decode_batch(self, tokens_NxT):
    return ["".join(chr(t) for t in row if t) for row in np.asarray(tokens_NxT)]


def _tokens(texts):
  width = max(map(len, texts))
  return (np.array([[ord(c) for c in t] + [0] * (width - len(t)) for t in texts], np.int32),
          np.array([len(t) for t in texts]))


def _batch(answers, **columns):
  rows = [{"question": f"q{i}", "answer": a, **{k: v[i] for k, v in columns.items()}}
          for i, a in enumerate(answers)]
  return {"prompts": [f"Q: q{i}" for i in range(len(rows))], "rows": rows}


def test_the_scorer_gives_every_reward_every_column_of_the_rows(registry):
  seen = {}

  @rewards.register("_test_columns")
  def columns(completions, answers, **kwargs):
    seen.update(kwargs, answers=answers, completions=completions)
    return [float(len(t)) for t in kwargs["tests"]]

  # Two prompts, G = 2 completions each; the second row has no `source`.
  batch = {"prompts": ["Q: 1+1", "Q: 2+2"],
           "rows": [{"question": "1+1", "answer": "2", "source": "easy", "tests": ["a"]},
                    {"question": "2+2", "answer": "4", "tests": ["b", "c"]}]}
  tokens_NxT = np.array([[50, 0, 0], [51, 52, 0], [52, 0, 0], [57, 57, 57]], np.int32)
  lengths_N = np.array([1, 2, 1, 3])
  scores = scorer.Scorer({"_test_columns": 2.0, "exact_match": 1.0}, _Chars())(
      tokens_NxT, lengths_N, batch, 2)
  assert seen["completions"] == ["2", "34", "4", "999"]
  assert seen["answers"] == ["2", "2", "4", "4"]
  assert seen["question"] == ["1+1", "1+1", "2+2", "2+2"]
  assert seen["source"] == ["easy", "easy", None, None]  # a row without it: None
  assert seen["tests"] == [["a"], ["a"], ["b", "c"], ["b", "c"]]
  assert seen["prompts"] == ["Q: 1+1", "Q: 1+1", "Q: 2+2", "Q: 2+2"]
  assert [list(ids) for ids in seen["completion_ids"]] == [[50], [51, 52], [52], [57, 57, 57]]
  assert sorted(seen) == ["answers", "completion_ids", "completions", "prompts", "question",
                          "source", "tests"]
  # total = 2 * len(tests) + exact_match: rows 0 and 2 are right.
  np.testing.assert_array_equal(scores.total_N, [3.0, 2.0, 5.0, 4.0])
  np.testing.assert_array_equal(scores.breakdown["_test_columns"], [1, 1, 2, 2])
  # exact_match is the correctness reward: validation and accuracy read it, not the total.
  np.testing.assert_array_equal(scores.correct_N, scores.breakdown["exact_match"])
  np.testing.assert_array_equal(scores.validation_N, [1, 0, 1, 0])
  assert scores.answers is None and scores.scored_N.all()  # answers: not asked for


def test_correctness_and_votes_come_from_the_correctness_reward(registry):
  @rewards.register("_test_right", correctness=True)
  def right(completions, answers, **columns):
    return [0.5] * len(completions)

  batch = _batch(["7", "7"])
  tokens_NxT, lengths_N = _tokens(["7", "8"])
  scores = scorer.Scorer({"math": 1.0, "_test_right": 1.0}, _Chars())(
      tokens_NxT, lengths_N, batch, 1, extract=True)
  np.testing.assert_array_equal(scores.validation_N, [0.5, 0.5])
  assert scores.answers is None  # no extractor, no preds: nothing to vote on
  # Without a correctness reward, validation reads the total and accuracy its sign.
  scores = scorer.Scorer({"format": 1.0}, _Chars())(tokens_NxT, lengths_N, batch, 1)
  np.testing.assert_array_equal(scores.validation_N, [0.0, 0.0])
  np.testing.assert_array_equal(scores.correct_N, [0.0, 0.0])
  math_scorer = scorer.Scorer({"math": 1.0}, _Chars())
  scores = math_scorer(tokens_NxT, lengths_N, batch, 1, extract=True)
  assert scores.answers == ["7", "8"] and math_scorer.answers_equal("7", "7.0")


def test_dict_returns_log_their_keys_and_pred_is_the_vote(registry):
  @rewards.register("_test_rich", correctness=True, pred=True)
  def rich(completions, answers, **columns):
    # Row 2 cannot be scored (None); row 3 scores, with no extra key.
    return [{"score": 1.0, "pred": "a", "steps": 3}, {"score": 0, "pred": "b", "steps": 5},
            None, {"score": 0.25}]

  @rewards.register("_test_half")
  def half(completions, answers, **columns):
    return [0.5, None, None, 1.0]

  s = scorer.Scorer({"_test_rich": 1.0, "_test_half": 2.0}, _Chars())
  tokens_NxT, lengths_N = _tokens(["w", "x", "y", "z"])
  scores = s(tokens_NxT, lengths_N, _batch(["1", "1", "1", "1"]), 1, extract=True)
  # A row's total is the weighted sum of the rewards that scored it: row 1 only _test_rich
  # (0), row 2 none (total 0, not scored), row 3 0.25 + 2 * 1.0.
  np.testing.assert_array_equal(scores.total_N, [2.0, 0.0, 0.0, 2.25])
  np.testing.assert_array_equal(scores.scored_N, [True, True, False, True])
  np.testing.assert_array_equal(scores.breakdown["_test_half"], [0.5, np.nan, np.nan, 1.0])
  np.testing.assert_array_equal(scores.extras["_test_rich/steps"], [3, 5, np.nan, np.nan])
  assert scores.answers == ["a", "b", None, None]
  assert not any(e.any() for e in scores.errors.values())  # None is not an error
  # The unscored row does not pass; accuracy leaves it out (NaN).
  np.testing.assert_array_equal(scores.validation_N, [1.0, 0.0, 0.0, 0.25])
  np.testing.assert_array_equal(scores.correct_N, [1.0, 0.0, np.nan, 0.25])
  assert s.answers_equal("a", "a") and not s.answers_equal(None, None)


def test_a_failing_reward_loses_only_its_rows_and_says_so_once_in_full(registry):
  @rewards.register("_test_picky")
  def picky(completions, answers, **columns):
    if any(c == "bad" for c in completions):
      raise ValueError("cannot read 'bad'")
    return [1.0] * len(completions)

  @rewards.register("_test_short")
  def short(completions, answers, **columns):
    return [1.0]  # one value, whatever the rows

  @rewards.register("_test_typed")
  def typed(completions, answers, **columns):
    return ["1.0" if c == "bad" else 1.0 for c in completions]

  lines = []
  s = scorer.Scorer({"_test_picky": 1.0, "_test_short": 1.0, "_test_typed": 1.0}, _Chars(),
                    log=lines.append)
  tokens_NxT, lengths_N = _tokens(["ok", "bad", "ok", "ok"])
  batch = _batch(["1"] * 4)
  scores = s(tokens_NxT, lengths_N, batch, 1, label="step 3")
  # The raising call is retried row by row: only the row that raises is lost.
  np.testing.assert_array_equal(scores.errors["_test_picky"], [False, True, False, False])
  np.testing.assert_array_equal(scores.errors["_test_short"], [True] * 4)
  np.testing.assert_array_equal(scores.errors["_test_typed"], [False, True, False, False])
  np.testing.assert_array_equal(scores.total_N, [2.0, 0.0, 2.0, 2.0])
  np.testing.assert_array_equal(scores.scored_N, [True, False, True, True])
  assert len(lines) == 3 and all(line.startswith("warning: reward '_test_") for line in lines)
  picky_line = next(line for line in lines if "_test_picky" in line)
  assert "failed on 1 of 4 rows (row 1) at step 3" in picky_line
  assert "Traceback" in picky_line and "ValueError: cannot read 'bad'" in picky_line
  assert "returned 1 values for 4 completions" in next(l for l in lines if "_test_short" in l)
  assert "returned str '1.0'" in next(l for l in lines if "_test_typed" in l)
  # Later failures: one line each, no traceback.
  lines.clear()
  s(tokens_NxT, lengths_N, batch, 1, label="step 4")
  assert len(lines) == 3 and not any("Traceback" in line or "\n" in line for line in lines)
  assert "failed on 1 of 4 rows (row 1) at step 4: ValueError: cannot read 'bad'" in next(
      l for l in lines if "_test_picky" in l)


USER_REWARDS = """
import os
import time

import jaxgrpo.rewards

@jaxgrpo.rewards.register("user_len")
def user_len(completions, answers, *, tests, **columns):
  # Runs in a worker process: its pid says so.
  return [{"score": float(len(t)), "pid": os.getpid()} for t in tests]

@jaxgrpo.rewards.register("user_slow")
def user_slow(completions, answers, **columns):
  if any(c == "slow" for c in completions):
    time.sleep(60)
  return [1.0] * len(completions)

@jaxgrpo.rewards.register("user_logged_slow")
def user_logged_slow(completions, answers, *, log, **columns):
  # Each call says it started (one line per call in the file `log` names).
  with open(log[0], "a") as f:
    f.write(f"{len(completions)}\\n")
  if any(c == "slow" for c in completions):
    time.sleep(60)
  return [1.0] * len(completions)

@jaxgrpo.rewards.register("user_crash")
def user_crash(completions, answers, **columns):
  if any(c == "crash" for c in completions):
    os._exit(3)
  return [1.0] * len(completions)
"""


def test_worker_processes_run_a_user_file_and_survive_hangs_and_crashes(registry, tmp_path):
  path = tmp_path / "my_rewards.py"
  path.write_text(textwrap.dedent(USER_REWARDS))
  plugins.import_modules(str(path))
  lines = []
  s = scorer.Scorer({"user_len": 1.0, "user_slow": 1.0, "user_crash": 1.0}, _Chars(),
                    workers=2, timeout_s=3.0, user_modules=str(path), log=lines.append)
  try:
    # Two workers: rows 0-1 go to one call of each reward, rows 2-3 to another.
    tokens_NxT, lengths_N = _tokens(["ok", "ok", "slow", "crash"])
    batch = _batch(["1"] * 4, tests=[["a"], ["a", "b"], [], ["c"]])
    scores = s(tokens_NxT, lengths_N, batch, 1)
    np.testing.assert_array_equal(scores.breakdown["user_len"], [1, 2, 0, 1])
    assert os.getpid() not in set(scores.extras["user_len/pid"])  # not the main process
    # The slow call (rows 2-3) timed out and the crashing one died: each was retried row by
    # row, and only its own culprit was lost.
    np.testing.assert_array_equal(scores.errors["user_slow"], [False, False, True, False])
    np.testing.assert_array_equal(scores.errors["user_crash"], [False, False, False, True])
    assert any("within reward_timeout_s=3 s" in line for line in lines)
    assert any("process died (exit code 3)" in line for line in lines)
    # The replaced workers answer the next call.
    tokens_NxT, lengths_N = _tokens(["ok"] * 4)
    scores = s(tokens_NxT, lengths_N, batch, 1)
    assert scores.scored_N.all() and not any(e.any() for e in scores.errors.values())
  finally:
    s.close()


def test_a_reward_that_cannot_go_to_a_worker_runs_in_the_main_process(registry):
  rewards.register("_test_lambda")(lambda c, a, **k: [1.0] * len(c))
  lines = []
  s = scorer.Scorer({"_test_lambda": 1.0}, _Chars(), workers=1, log=lines.append)
  try:
    assert "runs in the main process, without reward_timeout_s" in lines[0]
    tokens_NxT, lengths_N = _tokens(["a", "b"])
    np.testing.assert_array_equal(s(tokens_NxT, lengths_N, _batch(["1", "1"]), 1).total_N,
                                  [1.0, 1.0])
  finally:
    s.close()


def test_a_slow_row_costs_only_its_own_score_however_many_are_slow(registry, tmp_path):
  """Issue 48: a reward that hangs on a quarter of the rows lost every row of its calls.
  Issue 60: with many slow rows the row-by-row retries ran out of their budget and lost
  fast rows never tried. Each worker now runs its share of the retried rows side by side,
  a process each with its own time limit: exactly the slow rows are lost, whatever their
  number, and the warning names them."""
  path = tmp_path / "my_rewards.py"
  path.write_text(textwrap.dedent(USER_REWARDS))
  plugins.import_modules(str(path))
  log = tmp_path / "calls.txt"
  lines = []
  s = scorer.Scorer({"user_logged_slow": 1.0}, _Chars(), workers=2, timeout_s=1.0,
                    user_modules=str(path), log=lines.append)
  try:
    texts = ["ok"] * 12
    for r in (2, 5, 9):
      texts[r] = "slow"
    scores = s(*_tokens(texts), _batch(["1"] * 12, log=[str(log)] * 12), 1)
    np.testing.assert_array_equal(np.flatnonzero(scores.errors["user_logged_slow"]), [2, 5, 9])
    np.testing.assert_array_equal(scores.scored_N, [t == "ok" for t in texts])
    # Two calls of 6 rows (both timed out), then 12 calls of one row.
    assert log.read_text().split() == ["6", "6"] + ["1"] * 12
    assert "failed on 3 of 12 rows (rows 2, 5, 9);" in lines[0]
    assert "within reward_timeout_s=1 s (its process was killed)" in lines[0]
    # 24 of 32 rows slow, 8 fast among them (the old budget of 4 x 0.5 s retried about 8 rows
    # of 32 and lost fast ones); then every row slow.
    s.timeout_s = s._pool.timeout_s = 0.5
    texts = ["ok" if r % 4 == 3 else "slow" for r in range(32)]
    for slow_N in ([t == "slow" for t in texts], [True] * 32):
      log.unlink()
      texts = ["slow" if slow else "ok" for slow in slow_N]
      start = time.monotonic()
      scores = s(*_tokens(texts), _batch(["1"] * 32, log=[str(log)] * 32), 1)
      elapsed = time.monotonic() - start
      np.testing.assert_array_equal(scores.errors["user_logged_slow"], slow_N)
      np.testing.assert_array_equal(scores.scored_N, ~np.asarray(slow_N))
      assert log.read_text().split() == ["16", "16"] + ["1"] * 32  # every row retried
      # The bound the docs state: (1 + ceil(32 / (2 x 16))) x 0.5 s, and worker start-ups
      # (fresh Python processes here, each under a second); row by row it would be 8 s.
      assert elapsed < 1.0 + 4 * 1.0, elapsed
    assert "failed on 32 of 32 rows (rows 0, 1, 2, " in lines[-1]
    assert "15 and 16 more" in lines[-1]
  finally:
    s.close()


def test_episode_rewards_score_what_the_policy_wrote():
  """Issue 50 (its first item): rewards scored the whole transcript, so an episode that
  called the calculator and then wrote only its end token scored 1.0: the tool's response
  held the answer. The rewards' completions are now the policy's own turns; the transcript
  and its turns come as columns. With the calculator task's tokenizer and reward (math)."""
  from jaxgrpo.model import hf  # pylint: disable=g-import-not-at-top
  _, _, tok = hf.load_pretrained("@embedded/calc3")
  call = ('<tool_call>{"name": "calculator", "arguments": {"expression": '
          '"123*456"}}</tool_call>')
  response = "<tool_response>56088</tool_response>"

  def episode(last_turn):
    parts = [(call, True), (response, False), (last_turn, True)]
    ids = [(tok.encode(text, add_bos=False), sampled) for text, sampled in parts]
    ids[-1] = (ids[-1][0] + [tok.eos_id], True)
    tokens = [t for part, _ in ids for t in part]
    trained = [s for part, s in ids for _ in part]
    return tokens, trained

  rows = [episode(""), episode("56088")]
  width = max(len(t) for t, _ in rows)
  tokens_NxT = np.array([t + [tok.pad_id] * (width - len(t)) for t, _ in rows], np.int32)
  trained_NxT = np.array([m + [False] * (width - len(m)) for _, m in rows], bool)
  lengths_N = np.array([len(t) for t, _ in rows])
  seen = []
  rewards.register("_test_columns")(
      lambda c, a, **cols: seen.append(cols) or [0.0] * len(c))
  try:
    s = scorer.Scorer({"math": 1.0, "_test_columns": 0.5}, tok)
    batch = {"rows": [{"question": "123*456=", "answer": "56088"}], "prompts": ["123*456="]}
    scores = s(tokens_NxT, lengths_N, batch, 2, trained_NxT=trained_NxT)
  finally:
    rewards.REGISTRY.pop("_test_columns")
  np.testing.assert_array_equal(scores.breakdown["math"], [0.0, 1.0])
  assert "56088" not in scores.completions[0] and scores.completions[1].endswith("56088")
  assert "<tool_response>56088</tool_response>" in seen[0]["transcripts"][0]
  assert [t["role"] for t in seen[0]["turns"][1]] == ["assistant", "environment", "assistant"]
  assert seen[0]["turns"][1][1]["text"] == response and seen[0]["turns"][1][2]["text"] == "56088"

"""run/episodes.py: multi-turn episodes, a scripted policy against scripted environments."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cli import ROOT, command, run_train, xla_flags  # tests/cli.py
from cli import env as cli_env  # tests/cli.py
from jaxgrpo import envs, plugins
from jaxgrpo.run import episodes
from jaxgrpo.runtime import metrics as metrics_lib
from jaxgrpo.model.tokenizer import Tokenizer
from jaxgrpo.rollout import sampling, turns

# ids: <pad> 0, <bos> 1, <eos> 2, <unk> 3, a 4, b 5, c 6, x 7, y 8, z 9, = 10, ! 11
TOK = Tokenizer.char_level("abcxyz=!")
C, A, X, Y, Z, EOS, BANG = 6, 4, 7, 8, 9, 2, 11
FIXTURE_ENVS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                            "user_envs.py")


class ScriptedEngine:
  """Stands in for turns.EpisodeEngine: turn t of episode i samples script[i][t], cut at
  max_new_tokens (a turn that is cut there did not end: truncated), with log-probs
  -0.1 (t + 1) - 0.01 * position. Its "cache" is each row's tokens (what the real one holds
  keys and values of): the prompt but its last token, then each turn's appended tokens and
  its sampled tokens but the last. It checks each turn's slots against it and records every
  turn's profile, contexts (the cache with the turn's new tokens), row ids and active rows."""

  pad_id = 0

  def __init__(self, script, max_new_tokens=4, stops=(EOS,)):
    self.script, self.t, self.stops = script, max_new_tokens, stops
    self.calls = []

  def start(self, name, params, tokens, mask, samples):
    del name, params
    rows = [list(np.asarray(tokens)[r][np.asarray(mask)[r]][:-1]) for r in range(len(tokens))]
    return {"rows": [list(rows[i // samples]) for i in range(len(rows) * samples)],
            "base": [len(rows[i // samples]) for i in range(len(rows) * samples)]}

  def turn(self, name, params, cache, slot, new, *, key, row_ids_B, active_B):
    del params, key
    turn = len(self.calls)
    n = len(new)
    for i in range(n):
      if active_B[i]:  # the slot is where the row's cache ends
        assert slot[i] == len(cache["rows"][i]) - cache["base"][i], (i, slot[i], cache)
        cache["rows"][i] += list(new[i])
      else:
        assert not new[i]
    self.calls.append((name, [list(r) for r in cache["rows"]], np.array(row_ids_B),
                       np.array(active_B)))
    out = np.zeros((n, self.t), np.int32)
    logp = np.zeros((n, self.t), np.float32)
    lengths, truncated = np.zeros(n, np.int32), np.zeros(n, bool)
    for i in np.flatnonzero(active_B):
      seq = (self.script[i][turn] if turn < len(self.script[i]) else [EOS])[:self.t]
      out[i, :len(seq)] = seq
      logp[i, :len(seq)] = -0.1 * (turn + 1) - 0.01 * np.arange(len(seq))
      lengths[i] = len(seq)
      truncated[i] = len(seq) == self.t and seq[-1] not in self.stops
      cache["rows"][i] += list(seq[:-1])  # the decode loop feeds all but the last token
    j = jnp.asarray
    return (sampling.Rollout(j(out), j(logp), j(logp), j(out != 0), j(lengths), j(truncated)),
            cache)


@envs.register("_test_script")
class Script:
  """Answers turn t with row["obs"][t] (reward 0.5) and ends the episode after them (reward
  1); records the text of every turn it saw."""

  texts = []

  def reset(self, row, seed):
    return {"turn": 0, "obs": row["obs"], "seed": seed}

  def step(self, state, text):
    Script.texts.append(text)
    t = state["turn"]
    state["turn"] += 1
    if t < len(state["obs"]):
      return state["obs"][t], 0.5, False, {"seen": len(text)}
    return None, 1.0, True, {}


def _runner(engine, *, max_turns=4, width=12, prompt_len=4, max_obs=8, **kwargs):
  return episodes.Runner(engine, TOK, env_name=kwargs.pop("env", "_test_script"),
                         max_turns=max_turns, max_episode_tokens=width,
                         max_prompt_length=prompt_len, max_observation_tokens=max_obs,
                         **kwargs)


PROMPT = np.array([[0, 1, A, 5]], np.int32)  # <pad> <bos> a b, left-padded
PROMPT_MASK = np.array([[False, True, True, True]])


def _run(runner, rows, g=2, name="train", step=7):
  return runner.run(name, None, PROMPT, PROMPT_MASK, rows, g, key=jax.random.key(0),
                    step=step)


def test_an_episode_is_its_sampled_and_observation_tokens_exactly():
  # Episode 0: turn 0 samples "c<eos>", the environment answers "xy" (reward 0.5), turn 1
  # samples "a<eos>" and the environment ends it (reward 1). Episode 1: turn 0 samples "cc"
  # and reaches max_new_tokens=2 without ending: truncated, its environment never stepped.
  Script.texts.clear()
  engine = ScriptedEngine([[[C, EOS], [A, EOS]], [[C, C]]], max_new_tokens=2)
  ep = _run(_runner(engine), [{"obs": ["xy"], "answer": ""}])
  # The completion region is max_episode_tokens 12 - max_prompt_length 4 = 8 tokens.
  np.testing.assert_array_equal(ep.tokens_NxT, [[C, EOS, X, Y, A, EOS, 0, 0],
                                                [C, C, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(ep.mask_NxT, [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(ep.trained_NxT, [[1, 1, 0, 0, 1, 1, 0, 0],
                                                 [1, 1, 0, 0, 0, 0, 0, 0]])
  # The sampler's log-probs on sampled tokens (turn t: -0.1 (t + 1) - 0.01 position), 0 on
  # the observation.
  np.testing.assert_allclose(ep.logp_NxT, [[-0.1, -0.11, 0, 0, -0.2, -0.21, 0, 0],
                                           [-0.1, -0.11, 0, 0, 0, 0, 0, 0]], atol=1e-7)
  np.testing.assert_array_equal(ep.lengths_N, [6, 2])
  np.testing.assert_array_equal(ep.truncated_N, [False, True])
  np.testing.assert_allclose(ep.env_reward_N, [1.5, 0.0])
  np.testing.assert_array_equal(ep.env_rewarded_N, [True, False])
  np.testing.assert_array_equal(ep.turns_N, [2, 1])
  np.testing.assert_array_equal(ep.observation_tokens_N, [2, 0])
  # The environment read each turn's tokens decoded with the end token kept.
  assert Script.texts == ["c<eos>", "a<eos>"]
  # Turn 0 saw the prompt; turn 1 saw episode 0's prompt + "c<eos>xy", and every call was the train profile, one row per episode.
  names = [call[0] for call in engine.calls]
  assert names == ["train", "train"]
  first, second = engine.calls[0][1], engine.calls[1][1]
  np.testing.assert_array_equal(first[0], [1, A, 5])
  np.testing.assert_array_equal(second[0], [1, A, 5, C, EOS, X, Y])
  np.testing.assert_array_equal(engine.calls[0][2], [0, 1])  # episode ids r * G + g
  # Episode 1 ended after turn 0: turn 1 samples only episode 0.
  np.testing.assert_array_equal([call[3] for call in engine.calls], [[True, True],
                                                                     [True, False]])
  assert ep.info == {"env/seen": pytest.approx(np.array([6.0, np.nan]), nan_ok=True)}
  # Each step's reward is kept in turn order (issue 50: not only their sum); the mean per
  # step that gave one is logged: (0.5 + 1) / 2 steps.
  assert ep.turn_rewards == [[0.5, 1.0], []]
  assert episodes.metrics("s", *(getattr(ep, f) for f in episodes.METRIC_FIELDS), 1, 0,
                          {})["env/turn_reward_mean"] == 0.75


def test_max_turns_episode_tokens_and_observation_tokens_each_end_an_episode():
  rows = [{"obs": ["xyz", "xy"], "answer": ""}]
  script = [[[C, EOS], [A, EOS], [A, EOS]]]
  # max_turns=2: the environment answers twice but the second answer has no next turn: the
  # episode is truncated after 2 turns, the unused answer not appended.
  ep = _run(_runner(ScriptedEngine(script), max_turns=2, width=20), rows, g=1)
  assert ep.turns_N[0] == 2 and ep.truncated_N[0]
  np.testing.assert_array_equal(ep.tokens_NxT[0, :7], [C, EOS, X, Y, Z, A, EOS])
  assert ep.lengths_N[0] == 7
  # max_observation_tokens=1: "xyz" and "xy" are cut to "x" (2 observations, 2 cut); the
  # episode then ends as the environment says (third step: done).
  ep = _run(_runner(ScriptedEngine(script), max_obs=1, width=20), rows, g=1)
  np.testing.assert_array_equal(ep.tokens_NxT[0, :8], [C, EOS, X, A, EOS, X, A, EOS])
  assert (ep.observations, ep.observations_cut) == (2, 2) and not ep.truncated_N[0]
  # max_episode_tokens=9 (5 after the 4-token prompt): "c<eos>" + "xyz" leave no room for a
  # turn: truncated after one turn, the observation kept.
  ep = _run(_runner(ScriptedEngine(script), width=9), rows, g=1)
  np.testing.assert_array_equal(ep.tokens_NxT[0], [C, EOS, X, Y, Z])
  assert ep.turns_N[0] == 1 and ep.truncated_N[0]
  # ... and a turn longer than the room left is cut there: truncated, its tokens kept.
  ep = _run(_runner(ScriptedEngine([[[C, C, C, EOS]]]), width=6), rows, g=1)
  np.testing.assert_array_equal(ep.tokens_NxT[0], [C, C])
  assert ep.truncated_N[0] and ep.trained_NxT[0].all()


def test_validation_episodes_use_the_val_profile_every_turn():
  engine = ScriptedEngine([[[C, EOS], [A, EOS]]] * 2)
  _run(_runner(engine), [{"obs": ["x"], "answer": ""}], name="val")
  assert [call[0] for call in engine.calls] == ["val", "val"]


def test_environment_seeds_depend_on_seed_step_row_and_sample_only():
  seeds = {episodes.episode_seed(0, s, r, g) for s in range(3) for r in range(3)
           for g in range(3)}
  assert len(seeds) == 27
  assert episodes.episode_seed(5, 1, 2, 3) == episodes.episode_seed(5, 1, 2, 3)


def test_stop_strings_must_be_one_token():
  assert episodes.stop_ids(TOK, ["!"]) == (BANG,)
  with pytest.raises(ValueError, match=r"stop string 'ab' encodes to 2 tokens \[4, 5\]"):
    episodes.stop_ids(TOK, ["ab"])


@pytest.mark.parametrize("fail", ["raise", "hang", "garbage", "exit", "os_exit"])
def test_failing_environments_end_their_episodes_and_are_counted(fail):
  # fixture_faulty fails in step for every episode whose seed is divisible by 3, in a worker
  # process with a 1 s limit (a hang is killed there); the others end with reward 0. The run
  # goes on; the first failure is printed with its traceback, later ones one line each.
  plugins.import_modules(FIXTURE_ENVS)
  lines = []
  runner = _runner(ScriptedEngine([[[C, EOS]]] * 8), env="fixture_faulty",
                   env_kwargs=f'{{"fail": "{fail}"}}', workers=2, timeout_s=1.0,
                   user_modules=FIXTURE_ENVS, seed=3, log=lines.append)
  try:
    ep = _run(runner, [{"obs": [], "answer": ""}], g=8)
  finally:
    runner.close()
  want = np.array([episodes.episode_seed(3, 7, 0, g) % 3 == 0 for g in range(8)])
  assert want.any() and not want.all()  # both kinds occur with these seeds
  np.testing.assert_array_equal(ep.failed_N, want)
  np.testing.assert_array_equal(ep.env_rewarded_N, ~want)
  assert not ep.truncated_N.any()
  assert len(lines) == want.sum()
  first = {"raise": "ValueError: fixture_faulty fails on seed",
           "hang": "did not return within env.timeout_s=1 s",
           "garbage": "step returned str 'garbage'",
           "exit": "SystemExit: 3",  # sys.exit: the worker catches it, the call fails
           "os_exit": "worker process died (exit code 3)"}[fail]
  assert first in lines[0] and "episode ends with no reward" in lines[0]
  if fail == "raise":
    assert "Traceback" in lines[0]
  assert all("\n" not in line for line in lines[1:])
  m = runner.metrics([(np.ones(8, bool), ep)])
  assert m["env_errors/fixture_faulty"] == pytest.approx(want.mean())


def test_with_env_rewards_adds_the_steps_rewards_and_drops_failed_episodes():
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jaxgrpo import scorer  # pylint: disable=g-import-not-at-top
  nan = np.nan
  # Three episodes: the configured reward scored 1, 0 and None; the environment gave 0.5,
  # nothing and 1; the third's environment then failed.
  scores = scorer.Scores(
      completions=["", "", ""], total_N=np.array([1.0, 0.0, 0.0], np.float32),
      scored_N=np.array([True, True, False]), breakdown={}, extras={}, errors={},
      validation_N=np.array([1.0, 0.0, 0.0], np.float32),
      correct_N=np.array([1.0, 0.0, nan], np.float32), answers=None)
  ep = dataclasses.replace(
      _run(_runner(ScriptedEngine([[[C, EOS]]] * 3)), [{"obs": [], "answer": ""}], g=3),
      env_reward_N=np.array([0.5, 0.0, 1.0], np.float32),
      env_rewarded_N=np.array([True, False, True]), failed_N=np.array([False, False, True]))
  out = episodes.with_env_rewards(scores, ep, correctness="exact_match")
  np.testing.assert_allclose(out.total_N, [1.5, 0.0, 0.0])
  np.testing.assert_array_equal(out.scored_N, [True, True, False])
  np.testing.assert_array_equal(out.correct_N, [1.0, 0.0, nan])
  # Without a correctness reward validation passes on the total.
  out = episodes.with_env_rewards(scores, ep, correctness=None)
  np.testing.assert_allclose(out.validation_N, [1.5, 0.0, 0.0])


def test_turns_end_at_the_end_token_or_a_stop_string_on_the_real_sampler():
  # A random 1-layer model over the 12-token vocabulary, sampled at temperature 1 by the
  # real engine with the end token and "!" (a stop string) as end ids: each turn the
  # environment saw ends at the first of them (or is cut at max_new_tokens: truncated), and
  # the next turn's context is exactly the episode so far.
  from jaxgrpo.model import decoder as model_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  cfg = model_lib.ModelConfig(vocab_size=TOK.vocab_size, d_model=16, num_layers=1,
                              num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  sp = sampling.SamplingParams(1.0, 1.0, 0)
  profiles = {n: sampling.Profile(sp, 1, 6) for n in sampling.PROFILE_NAMES}
  stops = (EOS,) + episodes.stop_ids(TOK, ["!"])
  engine = turns.EpisodeEngine(cfg, mesh, profiles, max_prompt_length=4, max_episode_tokens=24,
                               max_append_tokens=9, eos_id=stops, pad_id=0, seed=0)
  recorder = _Recording(engine)
  params = sharding.init_sharded(cfg, mesh, jax.random.key(1))
  Script.texts.clear()
  ep = _runner(recorder, width=24, max_turns=3, max_obs=8).run(
      "train", params, PROMPT, PROMPT_MASK, [{"obs": ["x", "y"], "answer": ""}], 8,
      key=jax.random.key(2), step=0)
  ends = 0
  for turn, (tokens, lengths, truncated) in enumerate(recorder.outputs):
    for row in range(8):
      k = int(lengths[row])
      if ep.turns_N[row] <= turn:  # ended before this turn: an inactive row samples nothing
        assert k == 0 and not truncated[row]
        continue
      first = next((i for i, t in enumerate(tokens[row]) if t in stops), None)
      if truncated[row]:
        assert first is None and k == 6
      else:
        assert first == k - 1  # the turn's last token is its first end id
        ends += tokens[row][k - 1] == BANG
  assert ends > 0  # some turn ended at the stop string, not only at <eos>
  assert all(t.endswith(("<eos>", "!")) for t in Script.texts)
  # What each turn's cache held with its new tokens (the prompt but its last token, then
  # every turn's appended and fed tokens), at the slots the runner passed: the prompt and
  # the episode so far, exactly.
  assert len(recorder.contexts) >= 2 and ep.turns_N.max() >= 2
  prompt = list(PROMPT[0][PROMPT_MASK[0]])
  for turn, (context, slot) in enumerate(recorder.contexts):
    for row in np.flatnonzero(ep.turns_N > turn):
      seq = prompt + list(ep.tokens_NxT[row][:ep.lengths_N[row]])
      assert context[row] == seq[:len(context[row])]
      assert slot[row] == len(context[row]) - len(prompt) - len(recorder.news[turn][row]) + 1


class _Recording:
  """An engine that keeps each turn's contexts (the tokens its cache holds, with the turn's
  new ones), slots and outputs."""

  def __init__(self, engine):
    self.engine, self.pad_id = engine, engine.pad_id
    self.contexts, self.outputs, self.news = [], [], []
    self._rows = None

  def start(self, name, params, tokens, mask, samples):
    self._rows = [list(tokens[r][mask[r]][:-1]) for r in range(len(tokens))
                  for _ in range(samples)]
    return self.engine.start(name, params, tokens, mask, samples)

  def turn(self, name, params, cache, slot, new, **kwargs):
    out, cache = self.engine.turn(name, params, cache, slot, new, **kwargs)
    for row, ids in enumerate(new):
      self._rows[row] += list(ids)
    self.contexts.append(([list(r) for r in self._rows], np.array(slot)))
    self.news.append([list(ids) for ids in new])
    self.outputs.append(tuple(np.asarray(x) for x in (out.tokens_NxT, out.lengths_N,
                                                       out.truncated_N)))
    for row, k in enumerate(self.outputs[-1][1]):
      self._rows[row] += self.outputs[-1][0][row, :max(k - 1, 0)].tolist()
    return out, cache


# Multi-turn episodes (episodes.py): the calculator task (configs/calculator.py: the tools
# environment, deterministic), for 2 steps on 8 devices. Environments and rewards run in
# the main process here: worker processes (each importing jaxgrpo and math-verify) cost the
# suite seconds a run, and test_failing_environments_... above runs environments in them.
EPISODES = (f"--config={os.path.join(ROOT, 'configs', 'calculator.py')}:smoke",
            "--config.checkpoint.save_period=1", "--config.grpo.num_prompts_per_step=8",
            "--config.env.workers=0", "--config.env.timeout_s=0", "--config.reward_workers=0",
            "--config.logging.trackers=",
            "--config.generation.val_temperature=0", "--config.mesh.data=8")


@pytest.mark.slow
def test_episodes_run_validate_evaluate_and_resume_exactly(tmp_path):
  from test_faults import assert_same_run, rows  # pylint: disable=g-import-not-at-top
  straight = run_train(*EPISODES, workdir=tmp_path / "straight",
                       XLA_FLAGS=xla_flags(8))
  assert straight.returncode == 0, straight.stderr[-3000:]
  got = rows(tmp_path / "straight")
  train, val = got[("train", 1)], got[("val", 2)]
  # The episode metrics, in training and validation.
  for row in (train, val):
    for key in ("turns_mean", "turns_max", "tool_calls_mean", "tool_errors_fraction",
                "observation_tokens_mean", "episode_tokens_mean", "env_errors/tools"):
      assert key in row, key
    assert row["env_errors/tools"] == 0
  # The warm start calls the calculator in some episodes: a second turn after its result.
  assert max(r["turns_max"] for r in got.values()) >= 2
  assert max(r["tool_calls_mean"] for r in got.values()) > 0
  assert "env_s" in metrics_lib.read_metrics(str(tmp_path / "straight"))[1]
  # Still exactly two samplers, each compiled once: every turn reuses its profile's.
  summary = json.load(open(tmp_path / "straight" / "summary.json"))
  assert summary["compilations"] == {"update": 1, "train_sampler": 1, "val_sampler": 1}
  # evaluate runs the same validation episodes on the run's last checkpoint: its own row.
  proc = subprocess.run([sys.executable, "-m", "jaxgrpo.evaluate", *EPISODES,
                         f"--workdir={tmp_path / 'straight'}", f"--out={tmp_path / 'eval'}"],
                        capture_output=True, text=True, cwd=ROOT, timeout=600,
                        env=cli_env(XLA_FLAGS=xla_flags(8)))
  assert proc.returncode == 0, proc.stderr[-3000:]
  evaluated = json.load(open(tmp_path / "eval" / "eval.json"))["metrics"]
  logged = [r for r in metrics_lib.read_metrics(str(tmp_path / "straight"))
            if r["split"] == "val"][-1]
  for key in ("accuracy", "pass@1", "turns_mean", "tool_calls_mean", "episode_tokens_mean"):
    assert evaluated[key] == logged[key], key
  # Cut as kill -9 during step 2 leaves a run (its checkpoint 2 never written, its step-2
  # rows logged) and resumed: the same rows, prompts and parameters. (tests/test_faults.py
  # kills real processes; here the saved cost is one more run of the suite.)
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copytree(tmp_path / "straight", tmp_path / "cut")
  shutil.rmtree(tmp_path / "cut" / "checkpoints" / "2")
  shutil.copytree(tmp_path / "cut", tmp_path / "two")
  resumed = run_train(*EPISODES, workdir=tmp_path / "cut", XLA_FLAGS=xla_flags(8))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "at step 1" in resumed.stdout
  assert_same_run(tmp_path / "cut", tmp_path / "straight")
  # The same cut run resumed on 2 processes x 4 devices (the same 8-device mesh): each
  # process runs the episodes and steps the environments of its own rows, and step 2 logs
  # what the 1-process run logged, up to the order of float sums (gloo's all-reduce).
  from test_multihost import _free_port  # pylint: disable=g-import-not-at-top
  port = _free_port()
  procs = [subprocess.Popen(
      command(*EPISODES, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
              f"--process_id={i}", workdir=tmp_path / "two"),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
      env=cli_env(XLA_FLAGS=xla_flags(4))) for i in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
  two = rows(tmp_path / "two")
  for split in ("train", "val"):
    a, b = two[(split, 2)], got[(split, 2)]
    for key in ("turns_mean", "turns_max", "tool_calls_mean", "tool_errors_fraction",
                "observation_tokens_mean", "episode_tokens_mean", "accuracy",
                "loss" if split == "train" else "pass@1"):
      assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (split, key)


@envs.register("_test_verdict")
class Verdict:
  """One turn: reward 0.25, and the environment's own verdict info["correct"]: the turn
  starts with "c"."""

  def reset(self, row, seed):
    return None

  def step(self, state, text):
    return None, 0.25, True, {"correct": text.startswith("c")}


def test_an_environment_only_reward_reads_its_correct_flag_and_val_samples_add_up(tmp_path):
  """Issue 48: every config.rewards weight 0 is allowed with an environment; accuracy reads
  the environment's info["correct"] (absent without it, not a made-up 0), and val_samples
  record each rollout's total and each part, equal to what the metrics averaged."""
  import json  # pylint: disable=g-import-not-at-top
  from jaxgrpo import config as config_lib, data, scorer  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import rollouts  # pylint: disable=g-import-not-at-top
  from jaxgrpo.eval import validation  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  from test_config import _with  # pylint: disable=g-import-not-at-top
  zero = {"rewards.exact_match": 0.0, "rewards.math": 0.0, "rewards.format": 0.0}
  with pytest.raises(config_lib.ConfigError, match="every weight is 0"):
    config_lib.validate(_with(zero), num_devices=1)
  config_lib.validate(_with({**zero, "env.name": "tools", "generation.max_episode_tokens": 64,
                             "env.kwargs": '{"tools": "calculator", "chat": "none"}'}), 1)
  # Two prompts x 2 episodes: episodes 0 and 2 answer "c" (correct), 1 and 3 "a".
  engine = ScriptedEngine([[[C, EOS]], [[A, EOS]], [[C, EOS]], [[A, EOS]]])
  runner = _runner(engine, env="_test_verdict", prompt_len=4)
  rows = [{"question": "ab", "answer": "x"}, {"question": "ba", "answer": "y"}]
  batches = data.validation_batches(rows, TOK, 2, 4, process_index=0, process_count=1)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  none = scorer.Scorer({}, TOK)
  validator = validation.Validator(
      rollouts.EpisodeRollouts(engine, none, runner), batches, threshold=0.5,
      seed=0, mesh=mesh, samples_dir=str(tmp_path), k=2)
  out = validator(None, step=0)
  assert out["accuracy"] == 0.5 and out["reward_mean"] == 0.25
  samples = [json.loads(l) for l in open(tmp_path / "step_0.jsonl")]
  totals = [x for s in samples for x in s["rewards"]]
  assert totals == [0.25] * 4 and sum(totals) / 4 == out["reward_mean"]
  assert [s["reward_parts"] for s in samples] == [{"env": [0.25, 0.25]}] * 2
  assert [p for s in samples for p in s["passed"]] == [True, False, True, False]
  assert [s["turn_rewards"] for s in samples] == [[[0.25], [0.25]]] * 2
  # Training: the flag is the accuracy; with no flag and no configured reward, no accuracy.
  ep = _run(_runner(ScriptedEngine([[[C, EOS]], [[A, EOS]]]), env="_test_verdict"),
            [{"answer": ""}])
  tokens = np.zeros((2, 1), np.int32)
  scores = episodes.with_env_rewards(none(tokens, np.ones(2, np.int32), {"rows": [{"answer": ""}],
                                          "prompts": [""]}, 2), ep, None)
  np.testing.assert_array_equal(scores.correct_N, [1.0, 0.0])
  np.testing.assert_array_equal(scores.total_N, [0.25, 0.25])
  import dataclasses  # pylint: disable=g-import-not-at-top
  silent = dataclasses.replace(ep, correct_N=np.full(2, np.nan, np.float32))
  scores = episodes.with_env_rewards(none(tokens, np.ones(2, np.int32), {"rows": [{"answer": ""}],
                                          "prompts": [""]}, 2), silent, None)
  assert np.isnan(scores.correct_N).all() and scores.scored_N.all()


def test_observation_text_the_tokenizer_cannot_encode_is_said_once_and_counted():
  """Issue 48: the calculator's error observations reached the model with letters missing
  (the character vocabulary has no such letters), silently."""
  lines = []
  runner = _runner(ScriptedEngine([[[C, EOS]], [[C, EOS]]]), log=lines.append)
  ep = _run(runner, [{"obs": ["xQy"], "answer": ""}])  # "Q" is no token of TOK
  assert ep.observations == 2 and ep.observations_unencodable == 2
  ep = _run(runner, [{"obs": ["xy"], "answer": ""}])
  assert ep.observations_unencodable == 0
  _run(runner, [{"obs": ["R"], "answer": ""}])
  warned = [l for l in lines if "cannot encode" in l]
  assert len(warned) == 1 and "'Q'" in warned[0] and "<unk>" in warned[0]  # once per run
  m = runner.metrics([(np.ones(2, bool), _run(runner, [{"obs": ["xQ"], "answer": ""}]))])
  assert m["observation_unencodable_count"] == 2


@envs.register("_test_own_prompt")
class OwnPrompt:
  """Returns its own prompt "ab" for every seed, but fails in reset for sample 1 (its seed is
  the one episode_seed gives sample 1 of row 0 at step 7); one turn, reward 1."""

  def reset(self, row, seed):
    if seed == episodes.episode_seed(0, 7, 0, 1):
      raise ValueError("reset fails for this seed")
    return envs.Start(None, prompt="ab")

  def step(self, state, text):
    return None, 1.0, True, {}


def test_a_failed_reset_among_own_prompts_fails_only_its_episode():
  """Issue 50 (its item 5): one failed reset among G environments that return their own
  prompts failed the whole group ("reset returned different prompts")."""
  lines = []
  runner = _runner(ScriptedEngine([[[C, EOS]]] * 3), env="_test_own_prompt", log=lines.append)
  ep = _run(runner, [{"answer": ""}], g=3)
  np.testing.assert_array_equal(ep.failed_N, [False, True, False])
  np.testing.assert_array_equal(ep.env_reward_N, [1.0, 0.0, 1.0])
  assert ep.prompts == [TOK.encode("ab")] and "different prompts" not in "".join(lines)


@envs.register("_test_closing")
class Closing:
  """Records every close(state). Sample 4's reset fails; a turn starting "a" ends the episode,
  one starting "x" raises, any other gets an observation "y" and goes on."""

  closed = []

  def reset(self, row, seed):
    if seed == episodes.episode_seed(0, 7, 0, 4):
      raise ValueError("reset fails")
    return {"seed": seed, "turns": 0}

  def step(self, state, text):
    state["turns"] += 1
    if text.startswith("x"):
      raise ValueError("step fails")
    if text.startswith("a"):
      return None, 1.0, True, {}
    return "y", 0.0, False, {}

  def close(self, state):
    Closing.closed.append((state["seed"], state["turns"]))


def test_close_is_called_once_per_episode_whatever_ended_it():
  """Issue 50 (its close item): done (0), a turn cut at max_new_tokens (1), a step that
  raises (2: in the main process, with the state as the failed step left it), out of turns
  (3); a failed reset (4) has no state to close."""
  Closing.closed.clear()
  script = [[[A, EOS]], [[C, C, C, C]], [[X, EOS]], [[C, EOS], [C, EOS]], [[A, EOS]]]
  lines = []
  ep = _run(_runner(ScriptedEngine(script), env="_test_closing", max_turns=2, width=16,
                    log=lines.append), [{"answer": ""}], g=5)
  np.testing.assert_array_equal(ep.failed_N, [False, False, True, False, True])
  seed = lambda g: episodes.episode_seed(0, 7, 0, g)
  assert sorted(Closing.closed) == sorted([(seed(0), 1), (seed(1), 0), (seed(2), 1),
                                           (seed(3), 2)])
  # As soon as each ended: the first three after turn 0, the last after turn 1.
  assert [s for s, _ in Closing.closed[:3]] == [seed(0), seed(1), seed(2)]


@pytest.mark.parametrize("folder, parser, call", [
    ("qwen2.5", "hermes", '<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                          '"123*456"}}\n</tool_call>'),
    ("llama3.1", "llama3_json", '{"name": "calculator", "parameters": {"expression": '
                                '"123*456"}}')])
def test_a_tools_episode_is_the_chat_templates_rendering_of_its_conversation(folder, parser,
                                                                              call):
  """Issue 50: observations are rendered by the model's own chat template (Qwen2.5's and
  Llama 3.1's formats, tests/fixtures/templates): prompt + episode tokens are exactly the
  template's rendering of the conversation, the tool's turn included, and only the
  policy's turns are trained."""
  from jaxgrpo import data  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import chat, hf  # pylint: disable=g-import-not-at-top
  path = os.path.join(ROOT, "tests", "fixtures", "templates", folder)
  tok, template = hf.hf_tokenizer(path), chat.ChatTemplate.from_folder(path)
  kwargs = json.dumps({"tools": "calculator", "parser": parser})
  schemas = envs.tool_schemas("tools", kwargs)
  prompt = tok.encode(data.ChatPrompt("{question}", template, schemas)(
      {"question": "What is 123*456?"}), add_bos=False)
  turns_text = [call + tok.eos_token, "It is 56088." + tok.eos_token]
  script = [[tok.encode(t, add_bos=False) for t in turns_text]]
  engine = ScriptedEngine(script, max_new_tokens=80, stops=tok.stop_ids)
  engine.pad_id = tok.pad_id
  runner = episodes.Runner(engine, tok, env_name="tools", env_kwargs=kwargs, max_turns=3,
                           max_episode_tokens=len(prompt) + 300, max_prompt_length=len(prompt),
                           max_observation_tokens=100, chat=template, tools=schemas,
                           add_bos=False)
  ep = runner.run("train", None, np.array([prompt]), np.ones((1, len(prompt)), bool),
                  [{"question": "What is 123*456?", "answer": "56088"}], 1,
                  key=jax.random.key(0), step=0)
  n = int(ep.lengths_N[0])
  conversation = [{"role": "user", "content": "What is 123*456?"},
                  {"role": "assistant", "content": call}, envs.tool_message("56088"),
                  {"role": "assistant", "content": "It is 56088."}]
  rendered = tok.encode(template.render(conversation, add_generation_prompt=False,
                                        tools=schemas), add_bos=False)
  # The template closes the last turn with its end token (+ "\n" for Qwen): the episode
  # ends at the sampled end token.
  assert prompt + ep.tokens_NxT[0, :n].tolist() == rendered[:len(prompt) + n]
  assert len(rendered) - (len(prompt) + n) == (1 if folder == "qwen2.5" else 0)
  turn0, turn1 = (len(s) for s in script[0])
  assert ep.trained_NxT[0, :n].tolist() == [True] * turn0 + [False] * (n - turn0 - turn1) + (
      [True] * turn1)
  assert ep.turns_N[0] == 2 and ep.tool_calls_N[0] == 1 and ep.observations_cut == 0


def test_a_run_stopped_by_sigterm_closes_every_episode_it_started(tmp_path):
  """Issue 50 (its close item, the last way an episode ends): SIGTERM while episodes are
  in flight (the environment sends it during a step of the first training step). The run
  finishes the step, saves and stops; every episode whose reset ran was closed, once."""
  log = tmp_path / "episodes.log"
  kwargs = json.dumps({"log": str(log), "sigterm_at": 5})
  proc = run_train(*EPISODES, f"--config.user_modules={FIXTURE_ENVS}",
                   "--config.env.name=fixture_closing", f"--config.env.kwargs={kwargs}",
                   "--config.grpo.max_num_steps=3", "--config.grpo.val_period=0",
                   "--config.grpo.val_at_start=False",
                   workdir=tmp_path / "run", XLA_FLAGS=xla_flags(8))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "preempted (SIGTERM) after 1 steps" in proc.stdout + proc.stderr
  lines = log.read_text().split("\n")[:-1]
  at = lines.index("sigterm")
  opened = lambda part: ([l.split()[1] for l in part if l.startswith("reset")],
                         [l.split()[1] for l in part if l.startswith("close")])
  resets, closes = opened(lines[:at])
  assert len(resets) > len(closes)  # the signal came with episodes open
  resets, closes = opened(lines)
  assert sorted(resets) == sorted(closes) and len(set(closes)) == len(closes)
  assert len(resets) == 8 * 4  # one step's 8 prompts x 4 episodes: nothing after it

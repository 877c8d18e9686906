"""run/partial_rollouts.py: the pool of groups in flight (staleness drops exactly what it
should), and runs with partial rollouts through the CLI: rows carried between steps, the
metrics, an exact resume after kill -9 with rows carried on 1 device and on 2 processes of 4
devices (8 in all), and the refusals; rollouts carried over steps equal uninterrupted ones."""

import json
import shutil

import numpy as np
import pytest

import cli  # tests/cli.py
from jaxgrpo.run import partial_rollouts
from test_faults import assert_same_run, prompt_ids, rows  # tests/test_faults.py

# The embedded default at temperature 2.5 with room for 8 tokens: lengths 1-8 (it writes 5
# at temperature 1), so rounds of 2 tokens carry rows into later steps, and max_staleness 1
# drops some groups.
ARGS = (f"--config={cli.MATH}:smoke", "--config.generation.max_tokens_per_step=2",
        "--config.generation.max_new_tokens=8", "--config.generation.temperature=2.5",
        "--config.grpo.max_num_steps=4", "--config.checkpoint.save_period=1",
        "--config.grpo.val_period=0", "--config.grpo.val_at_start=False",
        "--config.grpo.max_staleness=1")


class _Batches:
  local_batch_size = 2


def _pool():
  """A pool of 4 groups of G=2 rollouts of up to 4 tokens, 3 sampler rows."""
  a = partial_rollouts.empty_arrays(4, 2, 4, 3)
  a["group_id_S"][:] = [10, 11, 12, -1]
  a["status_SxG"][:3] = [[2, 1], [1, 1], [2, 0]]
  a["length_SxG"][:3] = [[4, 2], [3, 1], [2, 0]]
  # Token versions: group 10's first row started at version 3, group 11's rows at 4 and 5,
  # group 12's done row at 2 (its pending row has no token yet). Tokens past a row's length
  # carry stale numbers that must not count.
  a["version_SxGxT"][:] = 0
  a["version_SxGxT"][0] = [[3, 3, 4, 5], [5, 5, 0, 0]]
  a["version_SxGxT"][1] = [[4, 5, 5, 0], [5, 0, 0, 0]]
  a["version_SxGxT"][2] = [[2, 3, 0, 0], [0, 0, 0, 0]]
  a["holder_N"][:] = [1, 2, 3]  # rows hold members (10, g1), (11, g0), (11, g1)
  return a


def test_below_the_bound_max_staleness_drops_exactly_the_groups_with_an_older_token():
  source = object.__new__(partial_rollouts.PartialRollouts)
  source.a, source.g, source.t, source.max_staleness = _pool(), 2, 4, 2
  source.slack = -1  # max_staleness below R - 1: nothing can be admitted safely
  # At version 6 with max_staleness 2: group 10's oldest token is version 3 (staleness 3 >
  # 2: dropped, and its live row 0 freed), group 11's oldest is 4 (2: kept), group 12's is 2
  # (4: dropped). 2 groups x G = 4 rollouts dropped, none re-queued.
  assert source._drop_stale(6) == (0, 4)
  assert source.a["group_id_S"].tolist() == [-1, 11, -1, -1]
  assert source.a["holder_N"].tolist() == [-1, 2, 3]
  # At version 5 nothing is older than 2 versions but group 12's token 0 (staleness 3).
  source.a = _pool()
  assert source._drop_stale(5) == (0, 2)
  assert source.a["group_id_S"].tolist() == [10, 11, -1, -1]


def test_at_the_bound_late_groups_are_requeued_not_lost_and_late_members_not_admitted():
  """Issue 63: groups over max_staleness were dropped after their tokens were drawn, and
  never re-queued, so the prompts that draw long answers were under-trained. At or above
  the bound (slack = max_staleness - (R - 1) >= 0) such a group goes back to pending whole,
  keeping its group id (first in line); and a group with a member still pending that
  could no longer finish in time starts none of it: re-queued at admission."""
  source = object.__new__(partial_rollouts.PartialRollouts)
  source.a, source.g, source.t, source.max_staleness, source.slack = _pool(), 2, 4, 2, 0
  # Version 6: groups 10 (oldest 3) and 12 (oldest 2) are over 2 versions: re-queued, their
  # ids kept, every member pending with nothing drawn, group 10's live row 0 freed.
  assert source._drop_stale(6) == (2, 0)
  a = source.a
  assert a["group_id_S"].tolist() == [10, 11, 12, -1]
  assert a["status_SxG"][:3].tolist() == [[0, 0], [1, 1], [0, 0]]
  assert a["length_SxG"][:3].tolist() == [[0, 0], [3, 1], [0, 0]]
  assert a["holder_N"].tolist() == [-1, 2, 3]
  # Admission at slack 0: only group 12 has a member pending; its oldest token (version
  # 2) is 4 versions old at version 6 (> 0: it could not finish in time): re-queued. At
  # version 2 it is 0 old: admitted, nothing changes.
  source.a = _pool()
  assert source._admit(2) == 0 and source.a["length_SxG"][2].tolist() == [2, 0]
  assert source._admit(6) == 1
  assert source.a["status_SxG"][:3].tolist() == [[2, 1], [1, 1], [0, 0]]
  assert source.a["length_SxG"][2].tolist() == [0, 0]


def _cut_and_resume(straight, cut, *, two_processes=False, **env):
  """The straight run as kill -9 during step 3 leaves it (checkpoints 3 and 4 never written,
  their rows logged), resumed: the same rows, prompts and parameters as the straight run."""
  shutil.copytree(straight, cut)
  for step in (3, 4):
    shutil.rmtree(cut / "checkpoints" / str(step))
  if two_processes:
    _two_processes(cut)
    # (The parameters of a 2-process checkpoint restore only on 2 processes: compared by
    # the rows, whose losses and gradient norms come from them.)
    assert rows(cut) == rows(straight)
    assert prompt_ids(cut) == prompt_ids(straight)
    return
  proc = cli.run_train(*ARGS, workdir=cut, **env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "at step 2" in proc.stdout
  assert_same_run(cut, straight)


def _two_processes(workdir):
  cli.run_two_processes(*ARGS, workdir=workdir, devices=4)


def test_a_run_carries_rows_reports_them_and_resumes_exactly(tmp_path):
  straight = tmp_path / "straight"
  proc = cli.run_train(*ARGS, workdir=straight)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Rows of up to 8 tokens in rounds of 2 may span 4 steps; max_staleness 1 is said to drop
  # long answers more often, once, at startup.
  assert proc.stderr.count("grpo.max_staleness=3 or more keeps every length") == 1
  got = rows(straight)
  train = [got[("train", s)] for s in range(1, 5)]
  for key in ("rollout/live_fraction", "rollout/carried_rows", "rollout/rounds",
              "staleness_mean", "staleness_max", "dropped_stale_fraction",
              "importance_weight_mean", "importance_weight_clipped_fraction"):
    assert all(key in r for r in train), key
  assert all(0 < r["rollout/live_fraction"] <= 1 for r in train)
  assert max(r["rollout/carried_rows"] for r in train) > 0     # rows outlive their step
  assert max(r["staleness_max"] for r in train) == 1           # and train a version later
  assert max(r["dropped_stale_fraction"] for r in train) > 0   # or are dropped past 1
  assert ("val", 4) in got  # validation: synchronous, with the val profile
  summary = json.loads((straight / "summary.json").read_text())
  assert summary["compilations"] == {"update": 1, "train_sampler": 1, "val_sampler": 1}
  _cut_and_resume(straight, tmp_path / "cut")


def test_on_2_processes_of_4_devices_each_carries_its_own_rows_and_resumes_exactly(tmp_path):
  # 8 devices in all (mesh data=8): each process's rows split over its 4.
  straight = tmp_path / "straight"
  _two_processes(straight)
  train = [r for k, r in rows(straight).items() if k[0] == "train"]
  assert max(r["rollout/carried_rows"] for r in train) > 0
  # Over both processes' rows (the round program's sum covers them all), not twice over.
  assert all(0 < r["rollout/live_fraction"] <= 1 for r in train)
  _cut_and_resume(straight, tmp_path / "cut", two_processes=True)
  # One process cannot continue the rows two processes carried: said in one line, exit 2.
  # (max_staleness 3: the startup warning of a smaller one would be a second line.)
  proc = cli.run_train(*ARGS, "--config.grpo.max_num_steps=5", "--config.grpo.max_staleness=3",
                       workdir=tmp_path / "cut", XLA_FLAGS=cli.xla_flags(4))
  cli.assert_clean_error(proc, "config.checkpoint.resume", "processes=2")


@pytest.mark.parametrize("key,value", [("env.name", "tools --config.generation.max_episode_tokens=64"),
                                       ("grpo.dynamic_sampling", "filter"),
                                       ("grpo.num_iterations", "2")])
def test_what_partial_rollouts_do_not_compose_with_is_refused_in_one_line(tmp_path, key, value):
  proc = cli.run_train(*ARGS, *f"--config.{key}={value}".split(), workdir=tmp_path / "w")
  cli.assert_clean_error(proc, f"config.{key}", "generation.max_tokens_per_step=2")


@pytest.mark.parametrize("budget", [5, 9])
def test_a_budget_no_completion_can_outlast_is_one_line_not_a_silent_no_op(budget):
  """Issue 63: max_tokens_per_step at or above max_new_tokens (the smoke preset's 5) ends
  every completion within its first round, so nothing is ever carried: refused in one
  line, where it used to run as a synchronous run in partial clothing."""
  from jaxgrpo import config as config_lib  # pylint: disable=g-import-not-at-top
  from test_config import math_config  # pylint: disable=g-import-not-at-top
  c = math_config("smoke")
  c.generation.max_tokens_per_step = budget
  with pytest.raises(config_lib.ConfigError, match=(
      rf"config.generation.max_tokens_per_step={budget}: every completion ends within one "
      r"round, so no row is ever carried: partial rollouts would change nothing; allowed: "
      r"0, or fewer than generation.max_new_tokens=5")):
    config_lib.validate(c, num_devices=8)
  c.generation.max_tokens_per_step = 4
  config_lib.validate(c, num_devices=8)


def test_a_carried_rows_tokens_are_as_stale_as_the_oldest_cache_they_read():
  """Issue 63: a carried row keeps its KV cache over updates, so a token drawn after an
  update reads K/V that older versions wrote; it was stamped staleness 0. With parameters
  that change every step (rounds of 3 of 12 tokens, so rows span steps), every trained
  token's staleness is the update's version minus the version its rollout started at (the
  minimum of the versions that drew its tokens so far), by hand from the drawn versions;
  some rollouts span versions, so the old per-token stamp would have said less."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxgrpo.bench import long_tail  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  from jaxgrpo.rollout import partial, sampling  # pylint: disable=g-import-not-at-top
  from test_partial import CFG, EOS, PAD, SP, T  # tests/test_partial.py
  from numpy_params import peaked_params  # tests/numpy_params.py
  base = peaked_params(CFG)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  profiles = {"train": sampling.Profile(SP, 1, T), "val": sampling.Profile(SP, 1, T)}
  b, g = 2, 4
  engine = partial.PartialEngine(CFG, mesh, profiles, rows=b * g, max_prompt_length=6,
                                 eos_id=EOS, pad_id=PAD, seed=0, scan_layers=False)
  config = ml_collections.ConfigDict({
      "generation": {"max_tokens_per_step": 3, "max_new_tokens": T},
      "grpo": {"max_staleness": 100, "importance_weight_cap": 2.0,
               "num_generations_per_prompt": g, "num_prompts_per_step": b}})
  source = partial_rollouts.PartialRollouts(
      config, engine, None, long_tail._Prompts(CFG, b, 6, seed=0))
  spanned = 0
  for step in range(1, 7):
    params = jax.tree.map(lambda x: x * (1.0 + 0.05 * step), base)  # a new version a step
    got, _, _, _, metrics = source.gather(params, step)
    version = step - 1
    for n in range(len(got["length_N"])):
      drawn = got["version_NxT"][n, :got["length_N"][n]]
      assert (np.diff(drawn) >= 0).all()  # a rollout's versions only grow
      np.testing.assert_array_equal(got["staleness_NxT"][n, :len(drawn)],
                                    version - drawn[0])
      spanned += int(drawn[-1] > drawn[0])
    stale = got["staleness_NxT"][got["mask_NxT"]]
    assert metrics["staleness_max"] == stale.max()
    np.testing.assert_allclose(metrics["staleness_mean"], stale.mean())
  assert spanned > 0  # rows that did carry over an update: the case that was under-counted


def test_rollouts_carried_over_steps_equal_uninterrupted_ones_with_frozen_parameters():
  # The pool end to end (pull, refill, harvest, the groups an update takes) with frozen
  # parameters: rounds of 3 tokens, whose rows carry across steps, against rounds of all 12
  # (nothing carried). Every group both runs trained has the same tokens and sampler
  # log-probs in both: a rollout's draws follow its id, whatever step or row it ran in.
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxgrpo.bench import long_tail  # pylint: disable=g-import-not-at-top
  from jaxgrpo.model import sharding  # pylint: disable=g-import-not-at-top
  from jaxgrpo.rollout import partial, sampling  # pylint: disable=g-import-not-at-top
  from test_partial import CFG, EOS, PAD, SP, T  # tests/test_partial.py
  from numpy_params import peaked_params  # tests/numpy_params.py
  params = peaked_params(CFG)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  profiles = {"train": sampling.Profile(SP, 1, T), "val": sampling.Profile(SP, 1, T)}
  b, g = 2, 4

  def trained(budget):
    engine = partial.PartialEngine(CFG, mesh, profiles, rows=b * g, max_prompt_length=6,
                                   eos_id=EOS, pad_id=PAD, seed=0, scan_layers=False)
    config = ml_collections.ConfigDict({
        "generation": {"max_tokens_per_step": budget, "max_new_tokens": T},
        "grpo": {"max_staleness": 100, "importance_weight_cap": 2.0,
                 "num_generations_per_prompt": g, "num_prompts_per_step": b}})
    source = partial_rollouts.PartialRollouts(
        config, engine, None, long_tail._Prompts(CFG, b, 6, seed=0))
    out, carried = {}, 0
    for step in range(1, 6):
      got, _, _, _, metrics = source.gather(params, step)
      carried += metrics["rollout/carried_rows"]
      for i, group in enumerate(got["group_id_B"]):
        rows_g = slice(i * g, (i + 1) * g)
        out[group] = (got["tokens_NxT"][rows_g], got["logp_NxT"][rows_g],
                      got["length_N"][rows_g])
    return out, carried

  whole, carried_whole = trained(T)
  rounds, carried = trained(3)
  assert carried_whole == 0 and carried > 0
  common = sorted(set(whole) & set(rounds))
  assert len(common) >= 6  # of 10 trained by each
  for group in common:
    for got, want in zip(rounds[group], whole[group]):
      np.testing.assert_array_equal(got, want)


def test_a_resume_checks_the_carried_layout_and_a_synchronous_one_leaves_the_rows_behind():
  # loading._check_carried, the host check before any compile: the saved layout against
  # this run's (processes, rows, lengths); a synchronous run warns that the rows stay behind.
  import warnings  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxgrpo import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import loading  # pylint: disable=g-import-not-at-top
  c = ml_collections.ConfigDict({
      "generation": {"max_tokens_per_step": 2, "max_new_tokens": 8, "backend": "native"},
      "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4,
               "dynamic_sampling": "off"},
      "data": {"max_prompt_length": 9}, "env": {"name": ""}})
  saved = loading.carried_meta(c)
  assert saved == {"processes": 1, "max_new_tokens": 8, "rows": 32, "max_prompt_length": 9}
  loading._check_carried(c, {"partial_rollouts": saved}, "ckpt/2")  # the same: fine
  loading._check_carried(c, {}, "ckpt/2")  # a synchronous checkpoint: nothing carried
  with pytest.raises(config_lib.ConfigError, match="rows=32 .* this run has 64"):
    c.grpo.num_prompts_per_step = 16
    loading._check_carried(c, {"partial_rollouts": saved}, "ckpt/2")
  c.generation.max_tokens_per_step = 0
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loading._check_carried(c, {"partial_rollouts": saved}, "ckpt/2")
  assert any("leaves behind" in str(w.message) for w in caught)

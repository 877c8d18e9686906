"""Tests for `python -m jaxgrpo.bench backends` (jaxgrpo/bench/backends.py)."""

import importlib.util

import pytest

from jaxgrpo import bench

HAS_JETSTREAM = importlib.util.find_spec("jetstream") is not None


@pytest.mark.skipif(HAS_JETSTREAM, reason="checks the message shown without the extra")
def test_without_the_extra_it_names_the_install():
  with pytest.raises(SystemExit, match=r"pip install 'jaxgrpo\[jetstream\]'"):
    bench.main(["backends", "--rounds", "1"])


@pytest.mark.jetstream
@pytest.mark.skipif(not HAS_JETSTREAM, reason="needs the jetstream extra; .ci/run runs it in "
                    ".ci-jetstream")
def test_reports_each_backend_beside_native(tmp_path, capsys):
  out = tmp_path / "b.jsonl"
  results = bench.main(["backends", "--rounds", "1", "--slots", "32", "--out", str(out)])
  assert [r["backend"] for r in results] == ["native", "jetstream", "jetstream_32_slots"]
  # One slot per row of the default's rollout (32 prompts x 8 samples) unless --slots says.
  assert [r["slots"] for r in results] == [None, 256, 32]
  assert all(r["same_tokens_as_native"] and r["tokens_per_s"] > 0 for r in results)
  assert results[0]["time_vs_native"] == 1.0
  assert len(out.read_text().splitlines()) == 3 == len(capsys.readouterr().out.splitlines())

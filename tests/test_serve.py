"""Tests for `python -m jaxgrpo.serve`'s command line (the live server: test_jetstream_engine)."""

import importlib.util
import subprocess
import sys
import time

import pytest

from cli import ROOT, env  # tests/cli.py

HAS_JETSTREAM = importlib.util.find_spec("jetstream") is not None


def serve_cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxgrpo.serve", *args], capture_output=True,
                        text=True, env=env(), cwd=ROOT, timeout=300)


def one_error_line(proc, fragment):
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error")]
  assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.skipif(HAS_JETSTREAM, reason="checks the message shown without the extra")
def test_serve_without_the_extra_names_the_install(tmp_path):
  one_error_line(serve_cli(f"--workdir={tmp_path}", "--port=9"),
                 "pip install 'jaxgrpo[jetstream]'")


@pytest.mark.jetstream
@pytest.mark.skipif(not HAS_JETSTREAM, reason="needs the jetstream extra; .ci/run runs it in "
                    ".ci-jetstream")
def test_serve_bad_input_is_one_line(tmp_path):
  for args, fragment in (
      ([f"--workdir={tmp_path}", "--port=9"], f"{tmp_path}/config.json: missing"),
      ([f"--workdir={tmp_path}", "--port=0"], "--port=0: allowed: 1 to 65535"),
      ([f"--workdir={tmp_path}", "--port=9", "--max_concurrent_decodes=0"],
       "--max_concurrent_decodes=0")):
    t0 = time.time()
    proc = serve_cli(*args)
    one_error_line(proc, fragment)
    assert time.time() - t0 < 120  # before anything compiles or loads



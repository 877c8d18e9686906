"""python -m jaxgrpo.serve --workdir DIR [--step N] --port P

Serves a run's trained policy through JetStream's gRPC server (its orchestrator driving
jaxgrpo's engine adapter, jaxgrpo/rollout/jetstream_engine.py) on localhost. Needs the extra:
pip install 'jaxgrpo[jetstream]'.

The checkpoint is the newest in DIR/checkpoints unless --step names one. Requests are sampled
with the run's validation profile (generation.val_temperature, val_top_p, val_top_k), one
sample per request, at most generation.max_new_tokens tokens (--max_new_tokens overrides).
A request's text is the prompt exactly as the model sees it (for the embedded arithmetic
model, "123+456="); the tokenizer is the run's. Clients use JetStream's own stub:

    import grpc
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
    stub = jetstream_pb2_grpc.OrchestratorStub(grpc.insecure_channel("localhost:P"))
    request = jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(
        text="123+456="), max_tokens=8)
    print("".join(s.text for r in stub.Decode(request) for s in r.stream_content.samples))

(`complete` below does exactly that.) Bad input is one line and exit status 2, before
anything compiles.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading


class ServeError(ValueError):
  """Input that cannot be served, in one line."""


def build_engine(workdir: str, step: int | None, *, max_concurrent_decodes: int,
                 max_new_tokens: int | None, devices=None):
  """(engine, step): a JetStream engine over checkpoint `step` of `workdir` on `devices`
  (default: all), slots split over them on the data axis."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import artifacts  # pylint: disable=g-import-not-at-top
  from jaxgrpo.rollout import sampling
  from jaxgrpo.model import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  devices = list(jax.devices() if devices is None else devices)
  if max_concurrent_decodes < 1 or max_concurrent_decodes % len(devices):
    raise ServeError(f"--max_concurrent_decodes={max_concurrent_decodes}: must be a positive "
                     f"multiple of the {len(devices)} devices (slots split over them)")
  if max_new_tokens is not None and max_new_tokens < 1:
    raise ServeError(f"--max_new_tokens={max_new_tokens}: must be an integer >= 1")
  try:
    config, cfg, tokenizer, params, step = artifacts.load_run(workdir, step)
  except artifacts.ExportError as e:
    raise ServeError(str(e)) from None

  from jaxgrpo.rollout import jetstream_engine  # pylint: disable=g-import-not-at-top
  gen = config.generation
  get = lambda key, fallback: gen.get(key) if gen.get(key) is not None else gen[fallback]
  sp = sampling.SamplingParams(get("val_temperature", "temperature"),
                               get("val_top_p", "top_p"), get("val_top_k", "top_k"))
  profile = sampling.Profile(sp, 1, max_new_tokens or gen.max_new_tokens)
  mesh = sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices)
  engine = jetstream_engine.Engine(
      cfg, mesh, profile, tokenizer=tokenizer,
      max_prompt_length=config.data.max_prompt_length,
      max_concurrent_decodes=max_concurrent_decodes, eos_id=tokenizer.stop_ids,
      pad_id=tokenizer.pad_id, params=sharding_lib.shard_params(params, cfg, mesh),
      seed=config.seed)
  return engine, step


def _enable_cache(workdir: str) -> None:
  """The run's compilation cache setting (a run from before the key: the per-user folder).
  An unreadable run folder is left for build_engine to report, after the flags' checks."""
  from jaxgrpo.runtime import compile_options  # pylint: disable=g-import-not-at-top
  from jaxgrpo.run import artifacts
  try:
    setting = artifacts.run_config(workdir).get("compilation_cache_dir", "auto")
  except artifacts.ExportError:
    setting = "auto"
  compile_options.enable_cache(setting)


def start(engine, port: int, host: str = "localhost"):
  """JetStream's gRPC server with `engine` as its one interleaved engine (prefill and
  generate on the same devices); returns the running server (`.stop()` ends it)."""
  from jetstream.core import config_lib, server_lib  # pylint: disable=g-import-not-at-top
  devices = list(engine.mesh.devices.flat)
  server_config = config_lib.ServerConfig(
      interleaved_slices=(f"{devices[0].platform}={len(devices)}",),
      interleaved_engine_create_fns=(lambda devices: engine,))
  # JetStream binds every interface ("[::]", a module constant); serve only `host`.
  server_lib._HOST = host  # pylint: disable=protected-access
  return server_lib.run(port=port, config=server_config, devices=devices)


def complete(port: int, text: str, max_tokens: int, host: str = "localhost",
             timeout: float = 60.0) -> str:
  """One request to a running server: the completion's text."""
  import grpc  # pylint: disable=g-import-not-at-top
  from jetstream.core.proto import (  # pylint: disable=g-import-not-at-top
      jetstream_pb2, jetstream_pb2_grpc)
  with grpc.insecure_channel(f"{host}:{port}") as channel:
    grpc.channel_ready_future(channel).result(timeout=timeout)
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)
    request = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text=text), max_tokens=max_tokens)
    return "".join(s.text for r in stub.Decode(request, timeout=timeout)
                   for s in r.stream_content.samples)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxgrpo.serve", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the run folder (config.json, "
                      "checkpoints/)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--port", type=int, required=True, help="gRPC port on localhost")
  parser.add_argument("--max_concurrent_decodes", type=int, default=8,
                      help="decode slots: requests generated at once (default 8)")
  parser.add_argument("--max_new_tokens", type=int, default=None,
                      help="cap per request (default: the run's generation.max_new_tokens)")
  args = parser.parse_args(argv)
  if not 0 < args.port < 65536:
    print(f"error: --port={args.port}: allowed: 1 to 65535", file=sys.stderr)
    return 2
  if importlib.util.find_spec("jetstream") is None:
    print("error: jaxgrpo.serve needs JetStream: pip install 'jaxgrpo[jetstream]'",
          file=sys.stderr)
    return 2
  try:
    _enable_cache(args.workdir)
    engine, step = build_engine(args.workdir, args.step,
                                max_concurrent_decodes=args.max_concurrent_decodes,
                                max_new_tokens=args.max_new_tokens)
  except ServeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  stopping = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background
    signal.signal(sig, lambda *_: stopping.set())
  server = start(engine, args.port)
  print(f"serving step {step} of {args.workdir} on localhost:{args.port} (JetStream gRPC, "
        f"{engine.max_concurrent_decodes} slots); Ctrl-C or SIGTERM stops", flush=True)
  while not stopping.wait(1.0):
    pass
  # JetStream's stop drains its queues and joins its threads; one of them is not a daemon
  # and a stuck one would keep the process alive, so the stop gets 30 s and the process
  # then exits regardless.
  stopper = threading.Thread(target=server.stop, daemon=True)
  stopper.start()
  stopper.join(30.0)
  print("stopped" if not stopper.is_alive() else "stop timed out after 30 s; exiting",
        flush=True)
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  sys.exit(main())

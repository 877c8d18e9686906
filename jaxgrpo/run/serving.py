"""Serving a run's policy through JetStream's gRPC server, for `python -m jaxgrpo.serve`
(serve.py, whose docstring says what users get): `build_engine` (a run's checkpoint behind
jaxgrpo's JetStream engine adapter, with the run's validation profile), `start` (the
orchestrator and its gRPC server) and `complete` (a client call through JetStream's own
stub). JetStream is imported only when these run: it pulls in TensorFlow.
"""

from __future__ import annotations



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


def enable_cache(workdir: str) -> None:
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

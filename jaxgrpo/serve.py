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

from jaxgrpo.run import serving


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
    serving.enable_cache(args.workdir)
    engine, step = serving.build_engine(args.workdir, args.step,
                                max_concurrent_decodes=args.max_concurrent_decodes,
                                max_new_tokens=args.max_new_tokens)
  except serving.ServeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  stopping = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):  # also when started in the background
    signal.signal(sig, lambda *_: stopping.set())
  server = serving.start(engine, args.port)
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

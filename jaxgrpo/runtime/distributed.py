"""Multi-host start and the few host-side collectives a run needs.

On a TPU pod slice (or several, launched with xpk) the same program runs once per host, and
JAX's multi-controller runtime joins them: `jax.distributed.initialize()` must run before
any other JAX call. On GKE it takes no arguments (the TPU environment names the peers); a
rehearsal on one machine passes the coordinator, the process count and this process's id
explicitly, and uses gloo for CPU collectives.

Everything else about hosts lives where the data does: each process loads its slice of a
batch (data.PromptBatches), `sharding.to_global` assembles global arrays from the slices, and
only process 0 writes logs, plots and samples (metrics.MetricsWriter, trainer). What the
host computes from its own rows (rewards, lengths) is gathered here before it is logged, so
every process logs the same numbers as one process would.
"""

from __future__ import annotations

import json
import os

import numpy as np

# Set by the TPU runtime on every host of a multi-host slice (comma-separated host names),
# and by xpk for multi-slice jobs: either means "more than one process".
_POD_ENV = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


def pod_environment() -> bool:
  """True when the TPU environment says this host is one of several."""
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return "," in hosts or bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Joins the other processes of a multi-host run; returns whether it did.

  With explicit arguments (a rehearsal: several processes on localhost) all three must be
  given. Without them, initializes only when `pod_environment()` says so, letting JAX read
  the peers from the TPU environment. A single-host run does nothing here.
  """
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
    raise ValueError("--coordinator_address, --num_processes and --process_id go together")
  import jax  # pylint: disable=g-import-not-at-top
  if coordinator_address is not None:
    if not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id}: allowed 0..{num_processes - 1}")
    # CPU processes need a collectives library to talk to each other (TPUs use ICI/DCN).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return True
  if pod_environment():
    jax.distributed.initialize()
    return True
  return False


def gather_rows(*arrays_N):
  """Every process's rows of each host array, concatenated in process order (the global
  batch order); on one process the arrays come back as they are."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return tuple(np.asarray(a) for a in arrays_N)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  out = multihost_utils.process_allgather(tuple(np.asarray(a) for a in arrays_N), tiled=True)
  return tuple(np.asarray(a) for a in out)


def gather_objects(obj) -> list:
  """Every process's JSON-able `obj`, in process order (for logs that process 0 writes,
  such as validation samples: small, and only at validation)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes)]


def union_keys(keys) -> list[str]:
  """The sorted union of every process's `keys` (names some host's rows produced, such as a
  reward's dict keys), so every process gathers the same arrays in the same order."""
  return sorted({k for part in gather_objects(sorted(keys)) for k in part})


def any_process(flag: bool) -> bool:
  """True on every process when `flag` is True on any (a signal that reached one host must
  stop them all at the same step, or the others wait forever in the next collective)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


def barrier(name: str) -> None:
  """Waits until every process reaches the same named point (no-op on one process)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)

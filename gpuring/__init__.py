"""gpuring: ring allreduce and its family for CuPy and NumPy arrays across processes.

The public API is what this package exports, plus `gpuring.devices` (the device interface),
`gpuring.interop`, `gpuring.torch`, `gpuring.distributed` (a drop-in for
`cupyx.distributed`), `gpuring.settings` and `gpuring.bench`. Everything else is internal:
the top-level modules whose names start with an underscore, and the layers
`gpuring.algorithms`, `gpuring.rendezvous` and `gpuring.transports`.

Glossary: the words met on the call path (docs/design.md has the picture).

- call: one verb's arguments checked into a `Call` (`_argcheck`): the collective, the
  arrays, op, root, chunk_bytes, channels, algorithm.
- signature: what every rank must call alike (`Signature`: the collective, shape, dtype,
  op, root, algorithm under its current name, settings that shape the plan, the device's
  `device_settings`); the ranks compare it before a call of a new key first runs
  (agreement), and a difference is a `CollectiveMismatchError`.
- prepared call: an agreed call ready to run again (`PreparedCall`, made once per key by
  `CallPath.prepare`): its route and, for the engine, its launch.
- route: who runs a prepared call (`Route`): alone (a world of one), mpi, nccl, nodes (two
  levels across nodes), or engine; a pure function of the call and the communicator's
  facts (`_route.choose`).
- engine: gpuring's own collectives on one device (`_engine.Engine`): the communication
  buffer, the peers' mapped buffers, the streams; it binds a plan to them and enqueues it.
- launch: a collective prepared for an engine (`_engine.Launch`): its rounds, or the one
  operation it runs as, and the runners compiled on its first run.
- round: one pass through the buffer regions (`algorithms.plan.RoundPlan`: one op sequence
  per channel); a collective larger than a region runs in several.
- fused: a small collective (up to GPURING_FUSED_BYTES) run on the GPU as one operation (one
  kernel, or a few stream operations: GPURING_CUDA_FUSED) on the caller's stream instead of
  in rounds; `last_schedule` says "fused". The engine marks it `Launch.fused` up to
  `Engine.fused_bytes` for the kinds in `Capabilities.fused_kinds`; the device prepares it
  once as a `FusedOp` (`Device.prepare_fused`, `devices/_cuda_fused.py`, the kernels
  `gpuring_fused_*`). Not to be confused with fusion (`all_reduce_many`: many small arrays
  reduced as one buffer).
- schedules (`algorithm=`, what `last_schedule` reports): `ring` (reduce-scatter then
  all-gather around the ranks: 2(n-1) flag hops, the order of a fold depending on the
  segment); `chain` (broadcast and reduce: a pipelined chain from or to the root, what
  `algorithm="ring"` runs for reduce); `one_shot` (all_reduce: every rank reduces every
  rank's data, one flag hop); `two_shot` (a direct reduce-scatter then an all-gather, each
  rank reading its peers: 2 flag hops, every element one fold in rank order; formerly
  "direct", still accepted with a DeprecationWarning); `exchange` (gather, scatter,
  all_to_all: moves without a reduction).
- registered memory: arrays every peer has mapped (`Communicator.empty`/`zeros`,
  `_registry`); a collective on them reads its peers' arrays where they lie ("registered
  two_shot" and the other registered forms) instead of staging through the buffers.
- persistent collective: a collective checked, agreed on and prepared once on arrays given
  once (`Communicator.all_reduce_init` and its twins, `PersistentCollective`), then started
  any number of times, as MPI 4.0's `MPI_Allreduce_init`/`MPI_Start`.
- status board: a page of shared memory per rank (`_status`) where each publishes the
  collective it has entered and whether it gave up; peers read it to catch mismatches,
  dead or failed peers and stalls.
- watchdog: the thread (`_watchdog`) that reads the status board every few tens of
  milliseconds, fails the communicator when a peer died or gave up, warns of stalls, and
  times out a GPU collective that never completes.
- lifecycle: the communicator's state and its transitions (`_failures.Lifecycle`): open,
  failed (a failure from outside any call), broken (a call raised one), closed.
- failures (`_failures`, the one module that handles them): `fail` (a failure from outside a
  call: release every wait), `give_up` (a call cannot go on: break the communicator, tell
  the peers), and the context managers that turn an engine's, a transport's or an
  exchange's plain error into the user's, naming the collective, its sequence number and
  the rank that failed first.
- call stages (`CallPath.run`): the request (`Call`, made by `_argcheck`), the agreement
  across ranks (`CallPath.agree`, once per signature), the route and plan (`_prepare`, once
  per key, kept as the call's `PreparedCall`), the run (by route; for the engine
  `Engine.run`).
"""

from ._communicator import Communicator
from ._errors import (
    ArgumentError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
)
from ._ops import ReduceOp
from ._persistent import PersistentCollective
from ._work import Work
from ._world import (
    all_gather,
    all_gather_v,
    all_reduce,
    all_reduce_async,
    all_reduce_many,
    all_to_all,
    all_to_all_v,
    barrier,
    broadcast,
    gather,
    init,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_v,
    scatter,
    send,
    sendrecv,
    split,
    synchronize,
)

__version__ = "0.1.0"

__all__ = [
    "init",
    "Communicator",
    "ReduceOp",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_gather_v",
    "all_to_all_v",
    "reduce_scatter_v",
    "send",
    "recv",
    "sendrecv",
    "isend",
    "irecv",
    "split",
    "barrier",
    "synchronize",
    "all_reduce_async",
    "all_reduce_many",
    "Work",
    "PersistentCollective",
    "GpuringError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerFailureError",
    "CommunicatorClosedError",
    "ArgumentError",
]

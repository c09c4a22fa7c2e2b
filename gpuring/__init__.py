"""gpuring: ring allreduce and its family for CuPy and NumPy arrays across processes.

The public API is what this package exports, plus `gpuring.devices` (the device interface),
`gpuring.interop`, `gpuring.torch`, `gpuring.distributed` (a drop-in for
`cupyx.distributed`), `gpuring.settings` and `gpuring.bench`. Everything else is internal:
the top-level modules whose names start with an underscore, and the layers
`gpuring.algorithms`, `gpuring.rendezvous` and `gpuring.transports`.
"""

from ._communicator import Communicator
from ._errors import (
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
]

"""CUDA graph capture on the call path: what a capture records of a prepared call, and the
refusals of what it cannot record. A refusal is raised before anything is enqueued and
before the call's sequence number moves on, so the capture and the communicator stay usable
(see docs/gpu.md, "CUDA graphs")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _arrays
from ._call import PreparedCall, Route
from ._errors import GpuringError

if TYPE_CHECKING:
    from ._engine import Launch

__all__ = ["refuse_barrier", "first_call_refused", "recorded", "refuse_route"]

#: routes whose collectives are refused under capture (their calls record events a watcher
#: queries, and agree on the host)
_OUTSIDE_GRAPHS = frozenset({Route.NCCL, Route.NODES})


def refuse_barrier() -> None:
    """A barrier holds the host, which a graph cannot record."""
    if _arrays.capturing(None):
        raise GpuringError("barrier cannot be captured into a CUDA graph")


def first_call_refused(collective: str) -> GpuringError:
    return GpuringError(
        f"{collective}: its first call with these arguments is being captured into a CUDA "
        "graph, but a first call allocates and synchronizes: call it once outside the "
        "capture first")


def recorded(prepared: PreparedCall, collective: str, timeline: bool, empty: bool
             ) -> Launch | None:
    """The launch a capture records of `prepared` (on an engine whose device captures):
    None for an `empty` collective, which records nothing; or the refusal (`timeline`: a
    timeline records, which times each call on the host)."""
    if timeline or (prepared.captured is None and not empty):
        raise GpuringError(
            f"{collective} cannot be captured into a CUDA graph here: graphs record gpuring's "
            "kernels, on up to 8 ranks with GPURING_CUDA_FUSED auto or kernel, without "
            "GPURING_VERIFY or a recording timeline (GPURING_TIMELINE)")
    return None if empty else prepared.captured


def refuse_route(prepared: PreparedCall, collective: str, x: Any) -> None:
    """Refuse a call of input `x` on a route outside gpuring's engines under capture."""
    if prepared.route in _OUTSIDE_GRAPHS and _arrays.capturing(x):
        raise GpuringError(
            f"{collective} cannot be captured into a CUDA graph: it runs "
            + ("on NCCL" if prepared.route is Route.NCCL else "in two levels") +
            " here (GPUs without peer access, ranks on several nodes, or GPURING_TRANSPORT), "
            "which gpuring does not capture")

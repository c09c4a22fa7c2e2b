"""The forms a CudaDevice runs small collectives in as one operation (`GPURING_CUDA_FUSED`),
chosen once per job from every rank's handle (`choose`), and the size of a rank's region for
them (`region_bytes`). The operations themselves are `_cuda_fused`'s.

- `kernel`: one kernel (`gpuring_fused_*` in kernels/reduce.cu, any collective) that waits
  for its peers' blocks by spinning on flags. Nothing in its arguments changes from call to
  call (the call's epoch is a counter on the GPU), so a CUDA graph can record it; a collective
  larger than a slot is recorded as one such kernel per piece.
- `memops`: all_reduce as three stream operations that wait with a stream memory operation,
  which costs nothing on the GPU while it waits. The flag values are the host's counts, so a
  graph cannot record it.
- `auto` (the default): memops where two ranks share a GPU and every rank has stream memory
  operations (processes that share a GPU without MPS take turns on it, and a spinning kernel
  holds its turn), else the kernel (without stream memory operations the rounds' waits spin
  too).
- `off`: in rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .. import settings
from .._errors import GpuringError
from . import _kernels
from ._cuda_memory import CudaHandle
from ._topology import ring_order
from .base import Capabilities

__all__ = ["FUSED_ENV", "GRAPH_PIECE_ENV", "fused_setting", "capability_settings",
           "region_bytes", "Forms", "choose"]

#: the setting that selects the form of a fused collective: "auto", "kernel", "memops", "off"
FUSED_ENV = "GPURING_CUDA_FUSED"
#: the size of the pieces a CUDA graph records of a collective larger than the kernel's slot
GRAPH_PIECE_ENV = "GPURING_CUDA_GRAPH_PIECE_BYTES"
#: the collectives of each form
_KINDS = {"kernel": frozenset(_kernels.DIRECT_KINDS), "memops": frozenset({"all_reduce"})}


def fused_setting() -> str:
    """GPURING_CUDA_FUSED, as asked (the ranks agree on it: `capability_settings`)."""
    return str(settings.get(FUSED_ENV)).lower()


def capability_settings() -> tuple[tuple[str, str], ...]:
    """The settings that shape the forms, so what every rank enqueues."""
    return ((FUSED_ENV, fused_setting()), (GRAPH_PIECE_ENV, str(settings.get(GRAPH_PIECE_ENV))))


def region_bytes(limit: int, most: int) -> int:
    """Bytes of each rank's region for one-operation collectives of at most `limit` bytes (at
    most `most`): two slots of `limit` bytes, or of a graph's piece where that is larger."""
    if fused_setting() == "off":
        return 0
    slot = max(limit, settings.get(GRAPH_PIECE_ENV))
    slot = -(-min(slot, most) // 16) * 16
    return _kernels.fused_region_bytes(slot) if slot > 0 else 0


class Forms(NamedTuple):
    """What one job's ranks run as one operation: the same on every rank."""

    #: the form outside graphs: "kernel", "memops" or "off"
    form: str
    #: the one-kernel collective's most blocks (its grid, the same on every rank)
    blocks: int
    capabilities: Capabilities


def choose(handles: Sequence[CudaHandle], most: int) -> Forms:
    """The forms of the job of the ranks whose handles these are (every rank's), for
    collectives of at most `most` bytes. Where ranks share a GPU, pieces
    are whole buffer regions: a rank's piece never runs beside a peer's there, and every
    piece costs driver calls and a turn."""
    mode = fused_setting()
    shared = len({(h.host, h.gpu) for h in handles}) < len(handles)
    memops = all(h.memops for h in handles)
    if mode == "auto":
        mode = "memops" if shared and memops else "kernel"
    if mode == "memops" and not memops:
        raise GpuringError(f"{FUSED_ENV}=memops, but not every rank's GPU has stream "
                           "memory operations")
    # the kernel's grid: the same on every rank, and on every GPU all of it at once (its
    # blocks wait for the peers' blocks of the same index: one left waiting for an SM that a
    # spinning block holds would never run)
    blocks = min(_kernels.FUSED_MAX_BLOCKS, *(h.fused_blocks for h in handles))
    form = mode if mode == "memops" or blocks > 0 else "off"
    return Forms(form, blocks, Capabilities(
        0 if form == "off" else most, whole_pieces=shared,
        fused_kinds=_KINDS.get(form, frozenset()), fused_capturable=form == "kernel",
        ring=ring_order([h.gpu for h in handles])))


"""The forms a CudaDevice runs small collectives in as one operation (`GPURING_CUDA_FUSED`),
chosen once per job from every rank's handle (`choose`), what a CUDA graph records, and how a
rank's region for them is laid out (`Slots`). The operations themselves are `_cuda_fused`'s.

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
  too). A CUDA graph records the kernel form even where the ranks share a GPU: the first
  time a rank captures it there, it warns once that the captured collectives spin
  (`warn_captured_spins`).
- `off`: in rounds; nothing is captured.

The two forms keep their state apart in each rank's region (their counters, inboxes and
slots), so one job runs both: the memops form outside graphs, the kernel form in them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import NamedTuple

from .. import settings
from .._errors import GpuringError
from . import _kernels
from ._cuda_memory import CudaHandle
from ._topology import ring_order
from .base import Capabilities

__all__ = ["FUSED_ENV", "GRAPH_PIECE_ENV", "fused_setting", "capability_settings", "Slots",
           "Forms", "choose", "warn_captured_spins"]

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


class Slots(NamedTuple):
    """Bytes of each of the two slots of each form in a rank's region (0: the form never
    runs in this job). The region is

        [counters and inboxes (FUSED_DATA bytes) | the kernel form's 2 slots |
         the memops form's 2 slots]"""

    kernel: int = 0
    staged: int = 0

    @classmethod
    def for_limit(cls, limit: int, most: int) -> Slots:
        """The slots for one-operation collectives of at most `limit` bytes (at most `most`):
        the kernel form's hold `limit` or a graph's piece where that is larger."""
        mode = fused_setting()
        if mode == "off":
            return cls()

        def rounded(nbytes: int) -> int:
            return -(-min(nbytes, most) // 16) * 16 if nbytes > 0 else 0

        kernel = 0 if mode == "memops" else rounded(max(limit, settings.get(GRAPH_PIECE_ENV)))
        staged = 0 if mode == "kernel" else rounded(limit)
        return cls(kernel, staged)

    def region_bytes(self) -> int:
        """Bytes of the region (0: none)."""
        slots = self.kernel + self.staged
        return _kernels.FUSED_DATA + 2 * slots if slots else 0

    def staged_at(self) -> int:
        """Where the memops form's first slot starts in the region."""
        return _kernels.FUSED_DATA + 2 * self.kernel


class Forms(NamedTuple):
    """What one job's ranks run as one operation: the same on every rank."""

    #: the form outside graphs: "kernel", "memops" or "off"
    form: str
    #: the one-kernel collective's most blocks (its grid, the same on every rank)
    blocks: int
    capabilities: Capabilities


def choose(handles: Sequence[CudaHandle], slots: Slots, most: int) -> Forms:
    """The forms of the job of the ranks whose handles these are (every rank's), with the
    region `slots`, for collectives of at most `most` bytes. Where ranks share a GPU, pieces
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
    graphs = blocks > 0 and slots.kernel > 0  # (the kernel form, whatever `form`)
    return Forms(form, blocks, Capabilities(
        0 if form == "off" else most, whole_pieces=shared,
        fused_kinds=_KINDS.get(form, frozenset()),
        graph_kinds=_KINDS["kernel"] if graphs else frozenset(),
        ring=ring_order([h.gpu for h in handles])))


_warned_spins = False


def warn_captured_spins() -> None:
    """Once per process: a collective captured where the form outside graphs does not spin
    (the ranks share a GPU, GPURING_CUDA_FUSED=auto) spins in the graph."""
    global _warned_spins
    if _warned_spins:
        return
    _warned_spins = True
    warnings.warn(
        "gpuring: collectives captured into a CUDA graph run there as kernels that spin while "
        "they wait for their peers, though the ranks share a GPU: outside graphs these ranks "
        "wait with stream memory operations, which a graph cannot record (their flag values "
        "are the host's counts). On a GPU shared by processes without MPS, a spinning kernel "
        "holds its process's time slice, so each replay's waits can cost whole time slices: "
        "start MPS (nvidia-cuda-mps-control -d) for shared GPUs. "
        f"{FUSED_ENV}=kernel (the spinning kernel outside graphs too) silences this; "
        f"{FUSED_ENV}=memops refuses captures instead.",
        RuntimeWarning, stacklevel=2)

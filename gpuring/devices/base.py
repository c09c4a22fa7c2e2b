"""The device interface: the only thing the engine knows about memory and execution.

A device provides peer-mappable memory, ordered streams of operations, and 64-bit flags
that streams wait on and write (`gpuring.devices._streams`), and runs the programs a schedule
compiles to (`gpuring.devices._program`). `HostDevice` implements it with shared memory and
threads, `CudaDevice` with CUDA IPC, CuPy kernels and stream memory operations. The same
schedule runs on both. The names of those two modules are importable from here too.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import GpuringError, PeerFailureError
from .._ops import ReduceOp
from ._program import (
    CopyI,
    Instruction,
    ReduceI,
    ReduceNI,
    Runner,
    WaitI,
    WriteI,
    enqueue_program,
)
from ._streams import (
    Arg,
    Event,
    Flag,
    FlagWaitAborted,
    FlagWaitTimeout,
    Memory,
    Span,
    Stream,
)

if TYPE_CHECKING:
    from ..rendezvous.base import ControlPlane

__all__ = ["Memory", "Span", "Arg", "Flag", "Event", "Stream", "FusedOp", "Device", "Capabilities",
           "FlagWaitTimeout",
           "FlagWaitAborted", "CopyI", "ReduceI", "ReduceNI", "WaitI", "WriteI", "Instruction",
           "Runner", "open_peer"]


class Capabilities(NamedTuple):
    """What a device offers one job's collectives (one operation, whole pieces, a ring
    order), chosen from every rank's `export` handle (`Device.capabilities`): the same on
    every rank."""

    #: the largest input (bytes) of a collective that runs as one operation
    #: (`Device.prepare_fused`); 0: none
    fused_bytes: int = 0
    #: pieces are whole buffer regions where the user set no chunk size: the ranks share one
    #: processor, which runs one rank's work at a time, so pipelining pieces overlaps nothing
    whole_pieces: bool = False
    #: the collectives that run as one operation (`Device.prepare_fused`) up to `fused_bytes`
    fused_kinds: frozenset[str] = frozenset()
    #: the collectives a CUDA graph can record (`Device.prepare_fused`'s `graph`: one operation
    #: each, or one per piece where the input is larger); empty: none can be captured
    graph_kinds: frozenset[str] = frozenset()
    #: the ranks in the order the ring and the chains visit them (following the fastest
    #: links between the ranks' processors); empty: rank order
    ring: tuple[int, ...] = ()
    #: the device reaches its peers' arrays where they lie, by cross-memory attach (`attach`)
    attach: bool = False
    #: why this rank may not, where the device does (None: it may). Each rank's own (the
    #: engine agrees on it)
    attach_refused: str | None = None


class FusedOp(abc.ABC):
    """A collective prepared to run as one operation that every rank enqueues alike, every
    rank reading its peers directly (`Device.prepare_fused`): reductions fold in rank order
    (the bits of `Stream.reduce_n`). It waits for the peers itself, each wait bounded."""

    #: whether `run` can record it into a CUDA graph (`captured`)
    capturable: bool = False

    @abc.abstractmethod
    def bind(self, out: Memory, inp: Memory) -> Any:
        """The collective's operands as `run` takes them: `inp` (of the prepared size) in,
        `out` out. It holds their addresses, not the arrays: a call that comes again with the
        same arrays runs the same operands (the caller keeps the arrays alive while it
        runs)."""

    @abc.abstractmethod
    def run(self, stream: Stream, operands: Any, *, captured: bool = False) -> Event | None:
        """Enqueue the collective of `operands` (from `bind`) on `stream` (the caller's), and
        return an event that completes with it (`stream.record()`, made in the same step;
        the engine orders and watches later work by it). `captured`: the stream records
        it into a graph, whose replays run it again; None then, and only then (the host
        never waits for a graph's work)."""


class Device(abc.ABC):
    """Memory, streams and flags of one kind of processor."""

    #: short name used in signatures and messages ("cpu", "cuda")
    kind: str
    #: piece size the engine uses when the user sets none
    default_chunk_bytes: int
    #: parallel rings the engine uses when the user sets none
    default_channels: int
    #: size of one buffer region when the user sets none (collectives run in rounds of it)
    default_buffer_bytes: int = 16 << 20
    #: True when a collective must be complete before it returns (host memory); False when
    #: ordering the caller's stream after it is enough (GPU memory)
    blocking: bool

    #: the arrays whose collectives it runs, and how it reaches its peers (for messages)
    arrays: str
    reach: str
    #: driver calls the collectives' stream operations have made so far to enqueue work or
    #: make events (kernel launches, copies, stream memory operations, event creations,
    #: records and waits; not setup, abort or close): a GPU's host cost per collective; a
    #: device that calls no driver (the host's) stays at 0
    operations: int = 0

    #: the largest input (bytes) of a collective the device can run as one operation
    #: (`Device.prepare_fused`)
    #: among at most `fused_max_ranks` ranks; 0: it has no such operation
    fused_max_bytes: int = 0
    fused_max_ranks: int = 0
    #: the most sources a fold whose destination is one of them (`Stream.reduce_n` in place)
    #: may have; 0: any number
    in_place_fold_sources: int = 0

    @classmethod
    def capability_settings(cls) -> tuple[tuple[str, str], ...]:
        """The device's settings that shape its capabilities and so what every rank
        enqueues, as (name, value): the ranks agree on them with each call's signature
        (`Signature.device_settings`)."""
        return ()

    def fused_region_bytes(self, limit: int) -> int:
        """Bytes of each rank's region that the one-operation collectives
        (`prepare_fused`) of at most `limit` bytes use (allocated once with the communication
        buffer); 0: none."""
        return 0

    def capabilities(self, handles: Sequence[Any]) -> Capabilities:
        """What the device offers the collectives of the ranks whose `export` handles these
        are (each rank's, in rank order). The same on every rank: it depends on the handles
        and the agreed settings only. Default: in rounds, in pieces of
        `default_chunk_bytes`."""
        return Capabilities()

    def attach(self, peer: int, handle: Any, mapped: Memory, word: int, nbytes: int) -> Memory:
        """Peer `peer`'s array of `nbytes` in a collective, where its process holds it
        (memory that no peer mapped), reached by cross-memory attach: `handle` is the peer's
        `export` handle of its buffer, `mapped` that buffer mapped here, where the peer
        publishes the array's address at every call in the 64-bit word at byte `word`. Only
        devices whose `capabilities` allow it (`Capabilities.attach_refused` None)."""
        raise GpuringError(f"{type(self).__name__} reaches no peer's array where it lies")

    def address(self, mem: Memory) -> int:
        """Where the wrapped array `mem` (`wrap`) lies, as `attach`'s peers read it."""
        raise GpuringError(f"{type(self).__name__} reaches no peer's array where it lies")

    def capturing(self) -> bool:
        """Whether the caller's current stream records work into a graph instead of running
        it (CUDA graph capture). Default: never."""
        return False

    def check(self) -> None:
        """Raise what the device's completed work says went wrong by itself: FlagWaitTimeout
        for a wait that gave up, FlagWaitAborted once aborted. Default: nothing to say."""

    def prepare_fused(self, kind: str, regions: Sequence[Span], rank: int, root: int,
                       dtype: str, op: ReduceOp, divisor: int, nbytes: int, *,
                       graph: bool = False) -> FusedOp:
        """The collective `kind` (one of `Capabilities.fused_kinds`) of an input of `nbytes`
        prepared as one operation. `regions[q]` is rank q's region of `fused_region_bytes`,
        mapped here, which only these operations use (its size says how large an input it
        holds). `graph` (`kind` one of `Capabilities.graph_kinds`): what a CUDA graph records
        of the collective, an operation that can be captured (`FusedOp.capturable`), or one
        per piece, in order, where the input is larger than the region holds (a collective
        that runs in rounds outside a graph). A device that offers none raises
        NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} runs no collective as one operation")

    def caller_stream(self) -> Stream:
        """The caller's current stream, as a stream of this device (the same object for the
        same stream): where a prepared `FusedOp` runs."""
        raise NotImplementedError(f"{type(self).__name__} has no caller's stream")

    #: whether the ranks of one node may be unable to map each other's memory (GPUs without
    #: peer access): then the ranks ask `unreachable` before the engine is made
    may_be_unreachable: bool = False

    @classmethod
    def place(cls, control: ControlPlane) -> str:
        """Where this rank's device memory lies, in terms `unreachable` compares (a GPU's PCI
        bus id); "" where every rank reaches every other."""
        return ""

    @classmethod
    def unreachable(cls, control: ControlPlane, places: Sequence[str]) -> str | None:
        """Why this rank cannot map the memory of some rank of this node (`places`: every
        rank's `place`); None where it maps every one."""
        return None

    @classmethod
    def for_job(cls, control: ControlPlane, timeout: float) -> Device:
        """This rank's device for collectives of the job `control` describes (flag waits
        bounded by `timeout` seconds); GpuringError where the job is out of its reach: a
        device maps its peers' memory, so every rank must run on this node."""
        if not control.single_node:
            raise GpuringError(
                f"a {cls.arrays} engine serves the ranks of one node ({cls.reach}); across "
                "nodes gpuring runs two levels or MPI/NCCL (GPURING_TRANSPORT)")
        return cls._for_rank(control, timeout)

    @classmethod
    @abc.abstractmethod
    def _for_rank(cls, control: ControlPlane, timeout: float) -> Device:
        """`for_job` once the job is known to be within reach."""

    def caller_event(self) -> Event | None:
        """An event on the caller's current stream, so the collective starts after work the
        caller already queued. None when the device has no such notion (host)."""
        return None

    def order_caller_after(self, event: Event) -> None:
        """Make the caller's current stream wait for `event` (no host block). Host: no-op."""

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> Memory:
        """Zero-filled memory that peers can map after `export`/`open`."""

    @abc.abstractmethod
    def export(self, mem: Memory) -> Any:
        """A picklable handle a peer passes to `open`."""

    @abc.abstractmethod
    def open(self, handle: Any) -> Memory:
        """Map a peer's memory from its exported handle."""

    def compile(self, program: tuple[Instruction, ...], dtype: str, op: ReduceOp,
                stream: Stream) -> Runner:
        """Prepare `program` for repeated runs on `stream`; each run enqueues it with the given
        input and output memory and round number. Devices may override this to bind memory
        once (host) or capture a graph (GPU); this default enqueues instruction by instruction
        (`enqueue_program`)."""
        return enqueue_program(program, dtype, op, stream)

    def detach_peers(self) -> None:
        """Unmap every peer's memory (once this rank no longer reads it). Closing a
        communicator calls this on every rank before any rank frees its own memory.
        Default: nothing to do (host mappings keep shared memory alive by themselves)."""

    def seal(self, mem: Memory) -> None:
        """Every peer has opened `mem`: drop any name it was shared by, so that nothing is
        left behind if this process dies. Default: nothing to do."""

    @abc.abstractmethod
    def array(self, mem: Memory, shape: tuple[int, ...], dtype: Any) -> Any:
        """A user array of `shape` and `dtype` over `mem` (from `alloc`, at its start), which
        keeps the allocation alive for as long as it lives, even once the device is closed
        (registered memory: `Communicator.empty`)."""

    @abc.abstractmethod
    def wrap(self, array: Any) -> Memory:
        """Borrow a user array (C-contiguous) as memory; the array is never freed by the device."""

    @abc.abstractmethod
    def create_stream(self, *, inline: bool = False) -> Stream:
        """A new stream. `inline` hints that the caller waits for it at once; a device may then
        run operations in the calling thread."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Make every pending and future flag wait fail with FlagWaitAborted(reason), or (GPU
        streams, which cannot fail an operation) end at once, running what is queued without
        touching peers; either way no stream stays blocked on a flag. Any thread may call it."""

    @abc.abstractmethod
    def close(self, *, peers_may_read: bool = False) -> None:
        """Free local memory, close peer mappings, stop streams. Idempotent. `peers_may_read`:
        the job failed and a peer may still read this device's exported memory; a device
        whose peers' reads of freed memory would be undefined keeps that memory then."""


def open_peer(device: Device, handle: Any, rank: int) -> Memory:
    """Map rank's memory; a peer that already left (its name is gone) is a PeerFailureError."""
    try:
        return device.open(handle)
    except FileNotFoundError:
        raise PeerFailureError(f"rank {rank} left before its memory could be mapped",
                               peer=rank) from None

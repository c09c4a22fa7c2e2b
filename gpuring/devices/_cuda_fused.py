"""CudaDevice's one-operation collectives (`Device.prepare_fused`): everything a call
enqueues is worked out once per prepared collective (kernel, grid, every argument but the two
arrays' addresses), so that a call costs one launch of Python work. Two forms (see
`_cuda_forms`): one kernel that waits for its peers itself (`FusedKernel`), and, for
all_reduce where ranks share a GPU, three stream operations that wait with a stream memory
operation (`StagedAllReduce`); and a collective larger than a slot as one kernel per piece
(`PiecedKernel`: how a CUDA graph records it). What they ask of their device is
`FusedDevice`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import numpy as np

from .._ops import ReduceOp
from . import _kernels
from ._cuda_driver import check_cu
from ._cuda_forms import Slots, warn_captured_spins
from ._cuda_memory import CudaMemory
from ._cuda_streams import THREADS, CudaStream, addr, flag_addr
from ._streams import Event, Flag, Memory, Span, Stream
from .base import FusedOp

__all__ = ["prepare_fused", "FusedDevice", "FusedKernel", "PiecedKernel", "StagedAllReduce",
           "HostEpoch"]

_BLOCK = (THREADS,)
#: input bytes per block of the one kernel
_BYTES_PER_BLOCK = 4096
#: where the memops form keeps its state in a rank's region, apart from the kernel form's
#: (`_cuda_forms`): its staging kernel's blocks-done counter (the kernel form's calls done and
#: blocks done are the first two words), and its inbox, a word per producer, after the kernel
#: form's inbox
_STAGED_DONE = 16
_STAGED_INBOX = _kernels.FUSED_INBOX + 8 * _kernels.FUSED_MAX_BLOCKS * _kernels.FUSED_MAX_RANKS
assert _STAGED_INBOX + 8 * _kernels.FUSED_MAX_RANKS <= _kernels.FUSED_DATA


class FusedDevice(Protocol):
    """What the one-operation collectives ask of their device (`CudaDevice`)."""

    device_id: int
    #: `with device.scope():` the device is current in the calling thread
    scope: Callable[[], AbstractContextManager[Any]]
    #: the job's form outside graphs ("kernel", "memops", "off"), the kernel's most blocks,
    #: and the slots of the region (`_cuda_forms`)
    fused_form: str
    fused_blocks: int
    slots: Slots
    #: the memops form's calls so far
    fused_epoch: HostEpoch
    timeout_ns: int
    status_ptr: int
    abort_ptr: int
    #: driver calls made to enqueue work or make events (`Device.operations`)
    operations: int
    #: a collective was captured into a graph, which holds the device's memory from then on
    captured: bool

    def check(self) -> None: ...

    def fused_kernel(self, dtype: str, op: ReduceOp) -> Any: ...

    def reduce_n_kernel(self, dtype: str, op: ReduceOp) -> tuple[Any, int]: ...

    def grid_for(self, kernel: Any, n: int, per_thread: int) -> int: ...

    def note_wait_word(self, word: int) -> None: ...


def prepare_fused(device: FusedDevice, kind: str, regions: Sequence[Span], rank: int,
                  root: int, dtype: str, op: ReduceOp, divisor: int, nbytes: int, *,
                  graph: bool = False) -> FusedOp:
    """The collective in the job's form (`device.fused_form`); `graph`: in the kernel form,
    which a CUDA graph can record, as one kernel per piece where larger than a slot."""
    slots = device.slots
    form = "kernel" if graph else device.fused_form
    slot = slots.kernel if form == "kernel" else slots.staged
    if nbytes <= 0 or kind not in _kernels.DIRECT_KINDS or (nbytes > slot and not graph):
        raise ValueError(f"no one-operation {kind} of {nbytes} bytes (at most {slot})")
    if form == "memops":
        if kind != "all_reduce":
            raise ValueError(f"the stream-memory-operation form runs no {kind}")
        return StagedAllReduce(device, regions, rank, slots, dtype, op, divisor, nbytes)
    if slot <= 0 or device.fused_blocks <= 0:
        raise ValueError("this job runs no collective as one kernel")
    if nbytes > slot:
        return PiecedKernel(device, kind, regions, rank, root, slot, dtype, op, divisor,
                            nbytes)
    return FusedKernel(device, kind, regions, rank, root, slot, dtype, op, divisor, nbytes)


def _captured(device: FusedDevice) -> None:
    """A kernel is being captured into a graph, which holds the device's memory from now on;
    where the form outside graphs does not spin, say once that this does."""
    device.captured = True
    if device.fused_form != "kernel":
        warn_captured_spins()


class FusedKernel(FusedOp):
    """One launch of gpuring_fused_* (kernels/reduce.cu): a block per 4 KiB of input, at
    most the job's `fused_blocks`, the same grid on every rank (it depends on the size only).
    Copies (all_gather, broadcast, gather, scatter, all_to_all) run as bytes. Nothing in the
    launch changes from call to call but the arrays (the call's epoch is a counter on the
    GPU), so it can be captured."""

    __slots__ = ("_device", "_grid", "_kernel", "_nbytes", "_rest")
    capturable = True

    def __init__(self, device: FusedDevice, kind: str, regions: Sequence[Span], rank: int,
                 root: int, slot: int, dtype: str, op: ReduceOp, divisor: int, nbytes: int,
                 stride: int = 0):
        """`stride`: bytes from one rank's block to the next in an array of a block per rank
        (`_kernels.BLOCKED_INPUT_KINDS`' input; all_gather's, gather's and all_to_all's
        output) where this is one piece of a larger collective (0: a block)."""
        if kind in _kernels.COPY_KINDS:
            dtype, op = "uint8", ReduceOp.SUM
        itemsize = np.dtype(dtype).itemsize
        elements = nbytes // len(regions) if kind in _kernels.BLOCKED_INPUT_KINDS else nbytes
        stride = stride or elements
        if nbytes % itemsize or elements % itemsize or stride % itemsize or stride < elements:
            raise ValueError(f"{nbytes} bytes is not a whole number of {dtype}")
        pointers = [np.uint64(addr(region)) for region in regions]
        pointers += [np.uint64(0)] * (_kernels.FUSED_MAX_RANKS - len(pointers))
        self._device = device
        self._kernel = device.fused_kernel(dtype, op)
        self._grid = (max(1, min(device.fused_blocks, -(-nbytes // _BYTES_PER_BLOCK))),)
        self._nbytes = nbytes
        self._rest = (np.uint64(elements // itemsize), np.uint64(stride // itemsize),
                      np.int64(divisor),
                      np.int32(_kernels.DIRECT_KINDS[kind]), np.int32(root), np.int32(rank),
                      np.int32(len(regions)), *pointers, np.uint64(slot),
                      np.uint64(device.timeout_ns), np.uint64(device.status_ptr),
                      np.uint64(device.abort_ptr))

    def bind(self, out: Memory, inp: Memory) -> tuple[np.uint64, np.uint64]:
        """The kernel's first two arguments."""
        assert isinstance(out, CudaMemory) and isinstance(inp, CudaMemory)
        if inp.nbytes != self._nbytes:
            raise ValueError(f"prepared for {self._nbytes} bytes, given {inp.nbytes}")
        return np.uint64(out.ptr), np.uint64(inp.ptr)

    def run(self, stream: Stream, operands: tuple[np.uint64, np.uint64], *,
            captured: bool = False) -> Event | None:
        dev = self._device
        dev.check()
        if captured:
            _captured(dev)
        with dev.scope():
            self.launch(stream, operands)
            return None if captured else stream.record_in_scope()  # type: ignore[attr-defined]

    def launch(self, stream: Stream, operands: tuple[np.uint64, np.uint64]) -> None:
        """Only the launch, inside `device.scope()` (`run` checks the device first)."""
        self._enqueue(stream, operands + self._rest)
        self._device.operations += 1

    def _enqueue(self, stream: Stream, args: tuple[Any, ...]) -> None:
        """The driver call."""
        self._kernel(self._grid, _BLOCK, args, stream=stream.raw)  # type: ignore[attr-defined]


class PiecedKernel(FusedOp):
    """A collective whose input is larger than a slot as `FusedKernel` launches per piece, in
    order on the stream: piece i covers bytes [i p, (i + 1) p) of every rank's block (the
    whole input, or each rank's block of an input or output that holds one per rank),
    p the largest multiple of 16 elements whose staging fits a slot. An all_reduce on more
    than 2 ranks runs each whole piece two-shot, a reduce_scatter of the piece into this
    rank's segment of it in `out` and an all_gather of the segments in place (each rank reads
    2 (n - 1) / n of a piece from its peers instead of n - 1 pieces; the same rank-order
    fold); its last, shorter piece one-shot. Each launch is a call of its own on the device's
    epoch, so the pieces capture into a CUDA graph as the one kernel does. A piece waits for
    the peers' same piece: pipelining is left to the GPU's queue (the next piece's copy
    starts as soon as this one's blocks finish)."""

    __slots__ = ("_block", "_device", "_kernels", "_mine", "_nbytes", "_piece", "_two_shot")
    capturable = True

    def __init__(self, device: FusedDevice, kind: str, regions: Sequence[Span], rank: int,
                 root: int, slot: int, dtype: str, op: ReduceOp, divisor: int, nbytes: int):
        nranks = len(regions)
        staged = nranks if kind in _kernels.BLOCKED_INPUT_KINDS else 1  # (per piece)
        block = nbytes // staged  # bytes of one rank's block of the input
        itemsize = np.dtype(dtype).itemsize
        unit = 16 * itemsize  # the kernel's ranges are packs of 16 elements
        if kind == "all_reduce" and nranks > 2:
            unit *= nranks  # (two-shot: a piece of n whole segments)
        piece = slot // staged // unit * unit
        if nbytes % (staged * itemsize) or piece <= 0:
            raise ValueError(f"no {kind} of {nbytes} bytes in pieces of a {slot}-byte slot")
        self._two_shot: tuple[FusedKernel, FusedKernel] | None = None
        if kind == "all_reduce" and nranks > 2:
            self._two_shot = (
                FusedKernel(device, "reduce_scatter", regions, rank, root, slot, dtype, op,
                             divisor, piece),
                FusedKernel(device, "all_gather", regions, rank, root, slot, dtype, op,
                             divisor, piece // nranks))
        sizes = {block % piece} if self._two_shot else {piece, block % piece}
        #: per piece size (the whole pieces', the last one's): its kernel
        self._kernels = {size: FusedKernel(device, kind, regions, rank, root, slot, dtype, op,
                                            divisor, size * staged, block)
                         for size in sizes - {0}}
        self._device = device
        self._nbytes, self._block, self._piece = nbytes, block, piece
        self._mine = rank * (piece // nranks)  # this rank's segment of a two-shot piece

    def bind(self, out: Memory, inp: Memory) -> tuple[tuple[FusedKernel, Any], ...]:
        """Per launch: its kernel, and its output and input addresses."""
        assert isinstance(out, CudaMemory) and isinstance(inp, CudaMemory)
        if inp.nbytes != self._nbytes:
            raise ValueError(f"prepared for {self._nbytes} bytes, given {inp.nbytes}")
        block, piece, two_shot = self._block, self._piece, self._two_shot
        launches: list[tuple[FusedKernel, Any]] = []
        for at in range(0, block, piece):
            size = min(piece, block - at)
            if two_shot is not None and size == piece:
                scatter, gather = two_shot
                mine = np.uint64(out.ptr + at + self._mine)
                launches.append((scatter, (mine, np.uint64(inp.ptr + at))))
                launches.append((gather, (np.uint64(out.ptr + at), mine)))
            else:
                launches.append((self._kernels[size],
                                 (np.uint64(out.ptr + at), np.uint64(inp.ptr + at))))
        return tuple(launches)

    def run(self, stream: Stream, operands: tuple[tuple[FusedKernel, Any], ...], *,
            captured: bool = False) -> Event | None:
        dev = self._device
        dev.check()
        if captured:
            _captured(dev)
        with dev.scope():
            for kernel, pair in operands:
                kernel.launch(stream, pair)
            return None if captured else stream.record_in_scope()  # type: ignore[attr-defined]


class _Operands(NamedTuple):
    """A staged all_reduce's operands, per epoch parity: the staging kernel's arguments up to
    the epoch, and the arguments of each launch of the fold into the output."""

    stage: tuple[tuple[Any, ...], tuple[Any, ...]]
    folds: tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]


_ONE = np.uint64(1)


def _inbox(region: Span, producer: int) -> Flag:
    """The word of `region`'s memops-form inbox where `producer` tells its rank."""
    return Flag(region.mem, region.offset + _STAGED_INBOX + 8 * producer)


class HostEpoch:
    """The stream-memory-operation form's calls so far on one GPU, as the host counts them
    (`value`) and as the staging kernel takes the count (`arg`, a NumPy uint64 kept up by
    adding one: making one from a Python int costs several times as much). Each call adds
    one to both (`StagedAllReduce.run`)."""

    __slots__ = ("arg", "value")

    def __init__(self) -> None:
        self.value = 0
        self.arg = np.uint64(0)


class StagedAllReduce(FusedOp):
    """Three operations, none spinning: gpuring_stage_publish copies the input into this
    rank's slot (call e uses slot e % 2, e counted by the device) and then tells every peer,
    one cuStreamBatchMemOp waits until every peer told this rank, gpuring_reduce_n folds the
    slots in rank order into out (the bits of `Stream.reduce_n`; its launches' arguments are
    made when the operands are bound). Slot e % 2 is written again at call e + 2, after this
    stream waited in call e + 1 for every peer to start it, so to finish call e. The
    waited-on words are this rank's own (abort releases them). Its counter, inbox and slots
    are its own (`_STAGED_DONE`, `_STAGED_INBOX`, `Slots.staged_at`), apart from the kernel
    form's, which a graph records in the same job. Not capturable: the epoch is the
    host's."""

    __slots__ = ("_device", "_divisor", "_elements", "_fold_grid", "_fold_kernel", "_grid",
                 "_kernel", "_nbytes", "_nbytes_arg", "_params", "_rank", "_stage_at",
                 "_stage_rest", "_staged", "_told", "_waits")

    def __init__(self, device: FusedDevice, regions: Sequence[Span], rank: int, slots: Slots,
                 dtype: str, op: ReduceOp, divisor: int, nbytes: int):
        self._device = device
        self._rank, self._divisor = rank, divisor
        self._nbytes, self._nbytes_arg = nbytes, np.uint64(nbytes)
        #: per epoch parity: every rank's staged copy, and where this rank stages its input
        at = slots.staged_at()
        self._staged = tuple(
            tuple(addr(r) + at + parity * slots.staged for r in regions) for parity in (0, 1))
        self._stage_at = tuple(np.uint64(staged[rank]) for staged in self._staged)
        peers = [q for q in range(len(regions)) if q != rank]
        told = [np.uint64(flag_addr(_inbox(regions[q], rank))) for q in peers]
        self._told = (*told, *[np.uint64(0)] * (8 - len(told)), np.int32(len(told)))
        #: what this rank waits for, per peer: the flag, and the tag its timeout names
        self._waits = tuple((_inbox(regions[rank], q), (q, "its part of a one-operation "
                                                          "all_reduce")) for q in peers)
        for flag, _tag in self._waits:
            device.note_wait_word(flag_addr(flag))
        self._fold_kernel, itemsize = device.reduce_n_kernel(dtype, op)
        if nbytes % itemsize:
            raise ValueError(f"{nbytes} bytes is not a whole number of {dtype}")
        self._elements = nbytes // itemsize
        with device.scope():
            self._kernel = _kernels.get_function(_kernels.STAGE_KERNEL, device.device_id)
            self._grid = (device.grid_for(self._kernel, nbytes, 16),)
            self._fold_grid = (device.grid_for(self._fold_kernel, self._elements,
                                               max(1, 16 // itemsize)),)
        # the blocks-done word of this rank's region, and the abort word
        self._stage_rest = (np.uint64(addr(regions[rank]) + _STAGED_DONE),
                            np.uint64(device.abort_ptr))
        self._params: list[Any] | None = None  # the wait's parameters, made on first use

    def _wait_params(self) -> list[Any]:
        """The wait's parameters but the value, made on first use (and kept)."""
        from cuda.bindings import driver

        params = []
        for flag, _tag in self._waits:
            param = driver.CUstreamBatchMemOpParams()
            param.operation = driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
            param.waitValue.address = driver.CUdeviceptr(flag_addr(flag))
            param.waitValue.flags = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
            params.append(param)
        self._params = params
        return params

    def bind(self, out: Memory, inp: Memory) -> _Operands:
        assert isinstance(out, CudaMemory) and isinstance(inp, CudaMemory)
        if inp.nbytes != self._nbytes or out.nbytes < self._nbytes:
            raise ValueError(f"prepared for {self._nbytes} bytes, given {inp.nbytes} into "
                             f"{out.nbytes}")
        folds = []
        for staged in self._staged:  # this rank's own input stands for its staged copy
            sources = [inp.ptr if q == self._rank else a for q, a in enumerate(staged)]
            launches = []
            for addrs, last in _kernels.fold_launches(out.ptr, sources):
                pointers = [np.uint64(a) for a in addrs]
                pointers += [np.uint64(0)] * (_kernels.MAX_SOURCES - len(addrs))
                launches.append((np.uint64(out.ptr), *pointers, np.int32(len(addrs)),
                                 np.uint64(self._elements),
                                 np.int64(self._divisor if last else 1),
                                 np.uint64(self._device.abort_ptr)))
            folds.append(tuple(launches))
        inp_ptr = np.uint64(inp.ptr)
        stage = tuple((at, inp_ptr, self._nbytes_arg, *self._told) for at in self._stage_at)
        return _Operands((stage[0], stage[1]), (folds[0], folds[1]))

    def run(self, stream: Stream, operands: _Operands, *, captured: bool = False
            ) -> Event | None:
        assert isinstance(stream, CudaStream)
        dev = self._device
        dev.check()
        if captured:
            raise ValueError("the stream-memory-operation form cannot be captured")
        counter = dev.fused_epoch  # (no method: this is on every call's path)
        counter.value = epoch = counter.value + 1
        counter.arg = arg = counter.arg + _ONE
        parity = epoch & 1
        folds = operands.folds[parity]
        with dev.scope():
            self._enqueue(stream, operands.stage[parity] + (arg, *self._stage_rest))
            driver, cu = stream.cu or stream.driver_stream()
            params = self._params or self._wait_params()
            value = driver.cuuint64_t(epoch)  # each parameter copies it
            for param in params:
                param.waitValue.value64 = value
            waits = stream.waits
            for flag, tag in self._waits:  # (a loop of appends: several times extend's speed)
                waits.append((flag, epoch, tag))
            self._wait(driver, cu, params)
            for args in folds:
                self._fold(stream, args)
            dev.operations += 2 + len(folds)
            return stream.record_in_scope()

    def _fold(self, stream: Stream, args: tuple[Any, ...]) -> None:
        """One launch of the fold (a driver call)."""
        self._fold_kernel(self._fold_grid, _BLOCK, args, stream=stream.raw)  # type: ignore[attr-defined]

    def _enqueue(self, stream: Stream, args: tuple[Any, ...]) -> None:
        """The staging kernel's launch (a driver call)."""
        self._kernel(self._grid, _BLOCK, args, stream=stream.raw)  # type: ignore[attr-defined]

    def _wait(self, driver: Any, cu: Any, params: list[Any]) -> None:
        """The stream memory operation (a driver call)."""
        check_cu(driver.cuStreamBatchMemOp(cu, len(params), params, 0), "cuStreamBatchMemOp")

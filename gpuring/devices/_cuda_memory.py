"""CudaDevice's memory: what it allocates (plain `cudaMalloc`, `cupy.cuda.Memory` outside
CuPy's pool, so one IPC handle names exactly one buffer) and exports to its peers, what it
opens of theirs (CUDA IPC), and the users' arrays it borrows. See `gpuring.devices.cuda`."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

from .._errors import GpuringError
from ._cuda_driver import cupy_module
from ._streams import Memory

__all__ = ["CudaMemory", "CudaHandle", "IpcMemory", "bus_id_of", "why_unreachable",
           "unreachable_peer", "keep_forever"]


class CudaMemory(Memory):
    """Device memory: `kind` is "local" (allocated here), "peer" (opened from a peer) or
    "borrowed" (a user's array). `owner` keeps the allocation alive (the cupy Memory, the
    user's array; None for a peer's)."""

    def __init__(self, ptr: int, nbytes: int, kind: str, owner: Any = None):
        self.ptr = ptr
        self.nbytes = nbytes
        self.kind = kind
        self.owner = owner

    def release(self) -> None:
        """Drop the reference that keeps the allocation alive (frees a local allocation)."""
        self.owner = None
        self.ptr = 0

    def __repr__(self) -> str:
        return f"CudaMemory({self.kind}, ptr={self.ptr:#x}, nbytes={self.nbytes})"


class CudaHandle(NamedTuple):
    """What `export` hands to peers (picklable). `process` is a random token of the exporting
    process and `host` its node: only an equal token means "my own memory"; `gpu` is the
    GPU's PCI bus id (the same GPU whatever each process's device numbering)."""

    process: str
    host: str
    gpu: str
    #: blocks of the one-kernel collective that fit on this GPU at once (0: not offered)
    fused_blocks: int
    #: whether this rank's streams wait with stream memory operations
    memops: bool
    device_id: int
    ptr: int
    nbytes: int
    ipc: bytes


#: this process, in the handles it exports: a PID can repeat across nodes and PID namespaces
_PROCESS_TOKEN = secrets.token_hex(16)


def _new_process_token() -> None:
    """A forked child is another process: it gets its own token."""
    global _PROCESS_TOKEN
    _PROCESS_TOKEN = secrets.token_hex(16)


os.register_at_fork(after_in_child=_new_process_token)
#: memory of failed communicators that peers may still map: never freed (see `IpcMemory.free`)
_LEAKED: list[Any] = []


def why_unreachable(device_id: int, own_bus: str, bus_id: str) -> str | None:
    """Why GPU `device_id` (at PCI bus `own_bus`) cannot read the GPU at PCI bus `bus_id`
    directly (None: it can)."""
    runtime = cupy_module().cuda.runtime
    try:
        peer = int(runtime.deviceGetByPCIBusId(bus_id))
    except Exception:
        return f"GPU {bus_id} is not visible to this process (CUDA_VISIBLE_DEVICES)"
    if peer != device_id and not runtime.deviceCanAccessPeer(device_id, peer):
        return f"GPU {device_id} ({own_bus}) cannot access GPU {peer} ({bus_id}) peer to peer"
    return None


def bus_id_of(slot: int) -> str:
    """The PCI bus id of the GPU of a rank in device slot `slot` (GPU slot % the GPU count);
    "" where none is visible."""
    cupy = cupy_module()
    count = cupy.cuda.runtime.getDeviceCount()
    return str(cupy.cuda.Device(slot % count).pci_bus_id) if count else ""


def unreachable_peer(slot: int, mine: str, places: Sequence[str]) -> str | None:
    """Why the GPU of the rank in device slot `slot` (at PCI bus `mine`) cannot map the
    memory of the GPUs at `places` (PCI bus ids; "": that rank says why itself); None where
    it can map every one's."""
    count = cupy_module().cuda.runtime.getDeviceCount()
    if not mine or not count:
        return None  # (the device says why when it is made)
    for bus in sorted(set(places) - {mine, ""}):
        why = why_unreachable(slot % count, mine, bus)
        if why is not None:
            return why
    return None


class IpcMemory:
    """The memory of one device (GPU `device_id`, at PCI bus `bus_id`): its allocations,
    the peers' allocations it opened, and the users' arrays it wraps. Every CUDA call runs in
    `scope()` (the device current)."""

    def __init__(self, device_id: int, bus_id: str,
                 scope: Callable[[], AbstractContextManager[Any]]):
        self.device_id = device_id
        self.bus_id = bus_id
        self._scope = scope
        self.owned: list[CudaMemory] = []
        self._opened: dict[bytes, CudaMemory] = {}

    def alloc(self, nbytes: int, zero: Callable[[int, int], None]) -> CudaMemory:
        """`nbytes` of device memory (at least 1), which `zero(ptr, nbytes)` fills with
        zeros."""
        with self._scope():
            raw = cupy_module().cuda.Memory(max(nbytes, 1))
        zero(int(raw.ptr), max(nbytes, 1))
        mem = CudaMemory(int(raw.ptr), nbytes, "local", raw)
        self.owned.append(mem)
        return mem

    def export(self, mem: Memory, fused_blocks: int, memops: bool) -> CudaHandle:
        if not isinstance(mem, CudaMemory) or mem.kind != "local":
            raise TypeError(f"only memory from CudaDevice.alloc can be exported, not {mem!r}")
        with self._scope():
            ipc = bytes(cupy_module().cuda.runtime.ipcGetMemHandle(mem.ptr))
        return CudaHandle(_PROCESS_TOKEN, socket.gethostname(), self.bus_id, fused_blocks,
                          memops, self.device_id, mem.ptr, mem.nbytes, ipc)

    def open(self, handle: Any) -> CudaMemory:
        handle = CudaHandle(*handle)
        if handle.process == _PROCESS_TOKEN:  # a process cannot open its own handle
            return CudaMemory(handle.ptr, handle.nbytes, "peer")
        here = socket.gethostname()
        if handle.host != here:
            raise GpuringError(
                f"CUDA IPC maps memory of processes on this host only; a rank on {handle.host!r} "
                f"shares a node with this one on {here!r} (ranks that report one node name, "
                "GPURING_HOSTNAME or the host's, must run on one host)")
        if handle.gpu != self.bus_id:
            why = why_unreachable(self.device_id, self.bus_id, handle.gpu)
            if why is not None:
                raise GpuringError(
                    f"CUDA IPC between GPUs needs peer-to-peer access, and {why}: run these "
                    "ranks on one GPU, or their CuPy collectives on NCCL "
                    "(GPURING_TRANSPORT=nccl)")
        mem = self._opened.get(handle.ipc)
        if mem is None:
            with self._scope():
                ptr = cupy_module().cuda.runtime.ipcOpenMemHandle(handle.ipc)
            mem = CudaMemory(int(ptr), handle.nbytes, "peer")
            self._opened[handle.ipc] = mem
        return mem

    def array(self, mem: Memory, shape: tuple[int, ...], dtype: Any) -> Any:
        if not isinstance(mem, CudaMemory) or mem.kind != "local" or mem.owner is None:
            raise TypeError(f"only memory from CudaDevice.alloc can hold an array, not {mem!r}")
        cupy = cupy_module()
        with self._scope():  # the pointer holds the cupy.cuda.Memory: cudaFree once both go
            return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem.owner, 0))

    def wrap(self, array: Any) -> CudaMemory:
        if not isinstance(array, cupy_module().ndarray) or not array.flags.c_contiguous:
            raise TypeError("CudaDevice wraps C-contiguous CuPy arrays only")
        data = array.data
        if data.device_id != self.device_id:
            raise ValueError(f"array is on device {data.device_id}, "
                             f"the communicator uses device {self.device_id}")
        return CudaMemory(data.ptr, array.nbytes, "borrowed", array)

    def detach(self) -> None:
        """Close every peer's memory this device opened."""
        runtime = cupy_module().cuda.runtime
        with self._scope():
            for mem in self._opened.values():
                runtime.ipcCloseMemHandle(mem.ptr)
                mem.release()
            self._opened.clear()

    def free(self, *, keep: bool) -> int:
        """Free every allocation (inside `scope()`), or, with `keep` (peers or a graph may
        still use them), keep them allocated for the process's life: the bytes kept."""
        kept = 0
        if keep and self.owned:
            _LEAKED.extend(mem.owner for mem in self.owned)
            kept = sum(mem.nbytes for mem in self.owned)
        for mem in self.owned:
            mem.release()  # drops the cupy.cuda.Memory: cudaFree (unless kept above)
        self.owned.clear()
        return kept


def keep_forever(obj: Any) -> None:
    """Keep `obj` (device memory a graph may still touch) alive for the process's life."""
    _LEAKED.append(obj)

"""Host memory for the host device: shared-memory mappings (`HostMemory`, with 64-bit flag
words), borrowed NumPy arrays (`HostArray`), and a peer process's array that only
cross-memory attach reaches (`AttachedMemory`)."""

from __future__ import annotations

import mmap
import os

import numpy as np

from ._streams import Flag, Memory

__all__ = ["HostMemory", "HostArray", "AttachedMemory", "check_local", "unlink_quietly"]


class HostMemory(Memory):
    """Bytes in host memory: a shared-memory mapping or a borrowed array. `i64` indexes the
    64-bit words of a mapping (flags): plain Python ints, cheaper than NumPy scalars."""

    __slots__ = ("i64", "mapping", "nbytes", "owner", "path", "u8")

    def __init__(self, u8: np.ndarray, *, mapping: mmap.mmap | None = None,
                 path: str | None = None, owner: bool = False):
        self.u8 = u8
        self.nbytes = u8.nbytes
        self.mapping = mapping
        self.path = path
        self.owner = owner
        self.i64: memoryview | None = (
            memoryview(mapping)[: (self.nbytes // 8) * 8].cast("q") if mapping is not None
            else None)

    def view(self, offset: int, nbytes: int, dtype: str) -> np.ndarray:
        return self.u8[offset:offset + nbytes].view(dtype)

    def release(self) -> None:
        """Unmap (and remove the file if this process created it and still names it)."""
        if self.owner and self.path is not None:
            unlink_quietly(self.path)
            self.path = None
        if self.mapping is not None:
            if self.i64 is not None:
                self.i64.release()
            self.u8 = self.i64 = None  # type: ignore[assignment]
            try:
                self.mapping.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass
            self.mapping = None


class HostArray(Memory):
    """A borrowed C-contiguous NumPy array, seen flat in its own dtype (`flat`) and, on
    demand, as bytes (`u8`)."""

    __slots__ = ("_u8", "flat", "nbytes")

    def __init__(self, flat: np.ndarray):
        self.flat = flat
        self.nbytes = flat.nbytes
        self._u8: np.ndarray | None = None

    @property
    def u8(self) -> np.ndarray:
        if self._u8 is None:
            self._u8 = self.flat.view(np.uint8)
        return self._u8

    def view(self, offset: int, nbytes: int, dtype: str) -> np.ndarray:
        return self.u8[offset:offset + nbytes].view(dtype)


class AttachedMemory(Memory):
    """An array of peer `peer`'s process `pid`, neither shared nor mapped here: read and
    written with `process_vm_readv`/`process_vm_writev` (`gpuring._cma`). It is another array
    at every call: the peer publishes where this call's lies in a word of its buffer, which
    is mapped here (`words[index]`), before it signals that it entered the collective."""

    __slots__ = ("index", "nbytes", "peer", "pid", "words")

    def __init__(self, peer: int, pid: int, words: memoryview, index: int, nbytes: int):
        self.peer, self.pid, self.words, self.index, self.nbytes = (
            peer, pid, words, index, nbytes)

    @property
    def address(self) -> int:
        """Where the peer's array of the call in progress starts, in its process."""
        return int(self.words[self.index])


def check_local(flag: Flag) -> None:
    """Streams wait only on flags in memory this process allocated (see Stream.wait_flag)."""
    if not (isinstance(flag.mem, HostMemory) and flag.mem.owner):
        raise ValueError(f"a stream may only wait on a flag in memory this device allocated, "
                         f"not {flag.mem!r}")


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""A stand-in for the slice of PyTorch's CUDA API that gpuring's interop meets, on the CUDA
simulator: tensors that share simulated device memory through DLPack, and torch's own current
stream per thread (`torch.cuda.current_stream`, `torch.cuda.stream`). Importing it installs it
as `torch` (only for test processes running on the simulator, where no CUDA torch can run).

As torch does, a tensor handed to a consumer through `__dlpack__(stream=s)` orders the
producer's current stream before `s`; `from_dlpack` of a consumer's array does not order
anything here (torch would: leaving it out makes the tests stricter, not looser).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import cupy

__version__ = "0.0.0+cudasim"
_local = threading.local()


class _Device:
    def __init__(self, index: int):
        self.type = "cuda"
        self.index = index


class _Stream:
    """torch.cuda.Stream: `cuda_stream` is the CUDA handle."""

    def __init__(self, raw: Any):
        self._raw = raw
        self.cuda_stream = raw.ptr

    def synchronize(self) -> None:
        self._raw.synchronize()


def _stream_of(ptr: int) -> Any:
    return cupy.cuda.ExternalStream(ptr)


class _Cuda(types.ModuleType):
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def Stream(device: Any = None) -> _Stream:  # torch names it so
        return _Stream(cupy.cuda.Stream(non_blocking=True))

    @staticmethod
    def current_stream(device: Any = None) -> _Stream:
        stream = getattr(_local, "stream", None)
        return stream if stream is not None else _Stream(cupy.cuda.Stream.null)

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: _Stream) -> Iterator[None]:
        previous = getattr(_local, "stream", None)
        _local.stream = stream
        try:
            yield
        finally:
            _local.stream = previous


cuda = _Cuda("torch.cuda")


class Tensor:
    """A CUDA tensor over a simulated device array."""

    def __init__(self, array: Any):
        self._array = array
        self.is_cuda = True
        self.device = _Device(array.device.id)
        self.shape = tuple(array.shape)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device.index)  # kDLCUDA

    def __dlpack__(self, stream: int | None = None) -> Any:
        current = cuda.current_stream(self.device.index).cuda_stream
        consumer = 0 if stream in (None, 1, 2) else int(stream)
        if consumer != current:  # the consumer's stream waits for torch's pending work
            _stream_of(consumer).wait_event(_stream_of(current).record())
        return self._array._a.__dlpack__()


Tensor.__module__ = "torch"


def from_dlpack(array: Any) -> Tensor:
    return Tensor(array)


sys.modules["torch"] = sys.modules[__name__]
sys.modules["torch.cuda"] = cuda

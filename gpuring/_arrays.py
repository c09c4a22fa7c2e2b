"""What the library needs to know about array types: which device, and how to make one."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._errors import GpuringError

__all__ = ["device_kind", "array_module", "module_for", "dtype_name", "contiguous", "address",
           "may_overlap", "same_memory", "to_host"]


def is_cupy(x: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def device_kind(x: Any) -> str:
    """"cpu" for NumPy arrays, "cuda" for CuPy arrays; TypeError otherwise."""
    if isinstance(x, np.ndarray):
        return "cpu"
    if is_cupy(x):
        return "cuda"
    raise TypeError(
        f"expected a NumPy or CuPy array, got {type(x).__module__}.{type(x).__name__}; "
        "convert it with numpy.asarray() or cupy.asarray()")


def capturing(x: Any) -> bool:
    """Whether the current stream of `x`'s GPU records work into a CUDA graph (False for
    NumPy arrays; for None, the current GPU's stream, where CuPy is in use)."""
    if x is None:
        cupy = sys.modules.get("cupy")
        return cupy is not None and bool(cupy.cuda.get_current_stream().is_capturing())
    if not is_cupy(x):
        return False
    stream = sys.modules["cupy"].cuda.get_current_stream(x.device.id)
    return bool(stream.is_capturing())


def array_module(x: Any) -> Any:
    if is_cupy(x):
        return sys.modules["cupy"]
    return np


def module_for(kind: str) -> Any:
    """The array module of a device kind: numpy for "cpu", cupy for "cuda"."""
    if kind == "cpu":
        return np
    try:
        import cupy
    except ImportError:
        raise GpuringError("CuPy arrays need CuPy (pip install 'gpuring[cuda13]')") from None
    return cupy


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}


def dtype_name(x: Any) -> str:
    """The NumPy name of x's dtype ("float32"), cached: this is on every call's path."""
    dtype = x.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(np.dtype(dtype).name)
    return name


def contiguous(x: Any) -> Any:
    """`x` itself when C-contiguous, else a C-contiguous copy."""
    if x.flags.c_contiguous:
        return x
    return array_module(x).ascontiguousarray(x)


def address(x: Any) -> int:
    """Where `x`'s data starts (a device address for CuPy arrays)."""
    return int(x.data.ptr) if is_cupy(x) else int(x.ctypes.data)


def may_overlap(a: Any, b: Any) -> bool:
    """Whether two arrays of one kind may share memory. C-contiguous CuPy arrays cover
    exactly [ptr, ptr + nbytes): compared directly (cupy.may_share_memory costs more than
    the collective's own Python)."""
    if is_cupy(a) and a.flags.c_contiguous and b.flags.c_contiguous:
        pa, pb = a.data.ptr, b.data.ptr
        return pa < pb + b.nbytes and pb < pa + a.nbytes and a.nbytes > 0 and b.nbytes > 0
    return bool(array_module(a).may_share_memory(a, b))


def same_memory(a: Any, b: Any) -> bool:
    """True when `a` and `b` cover exactly the same bytes."""
    return bool(address(a) == address(b) and a.nbytes == b.nbytes)


def to_host(x: Any) -> np.ndarray:
    """A NumPy array with x's contents (a device-to-host copy for CuPy arrays)."""
    return x.get() if is_cupy(x) else np.asarray(x)

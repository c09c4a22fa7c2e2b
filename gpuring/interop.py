"""Arrays of other libraries: DLPack and the CUDA array interface, without copies.

A collective given, say, a torch tensor views it as a NumPy array (CPU) or a CuPy array (GPU)
through `__dlpack__` (or `__cuda_array_interface__`), runs on that view, and hands the result
back as the caller's type: the caller's own object when the result was written into it
(`out=`, `broadcast`), else a new one made by the producing package's `from_dlpack`
(`torch.from_dlpack` for torch). Packages without one get the NumPy or CuPy array.

Streams: a GPU collective is ordered after the work already queued on the caller's stream, and
the caller's stream after the collective. For CuPy arrays that stream is CuPy's current one;
for torch CUDA tensors it is torch's current stream on the tensor's device, which
`caller_stream` makes CuPy's current stream for the length of the call.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["to_native", "from_native", "is_native", "device_kind", "convert", "call",
           "caller_stream"]

_DL_CPU = 1
_DL_CUDA = 2


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise TypeError("this array lives on a GPU; install CuPy (pip install "
                        "'gpuring[cuda13]') to run collectives on it") from None
    return cupy


def is_native(x: Any) -> bool:
    """Whether `x` is a NumPy or CuPy array (which the collectives take as it is)."""
    if isinstance(x, np.ndarray):
        return True
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def device_kind(x: Any) -> str | None:
    """"cpu" or "cuda" for arrays gpuring can run on (native or not), else None."""
    if isinstance(x, np.ndarray):
        return "cpu"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cuda"
    if hasattr(x, "__dlpack_device__"):
        kind = int(x.__dlpack_device__()[0])
        return {_DL_CPU: "cpu", _DL_CUDA: "cuda"}.get(kind)
    if hasattr(x, "__cuda_array_interface__"):
        return "cuda"
    return None


def to_native(x: Any) -> Any:
    """`x` as a NumPy or CuPy array sharing its memory (`x` itself when it is one)."""
    if is_native(x):
        return x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        kind = int(x.__dlpack_device__()[0])
        if kind == _DL_CPU:
            return np.from_dlpack(x)
        if kind == _DL_CUDA:
            return _cupy().from_dlpack(x)
        raise TypeError(f"{type(x).__name__} lives on DLPack device type {kind}; gpuring runs "
                        "on CPU memory and CUDA devices only")
    if hasattr(x, "__cuda_array_interface__"):
        return _cupy().asarray(x)
    raise TypeError(
        f"expected a NumPy or CuPy array or an array with __dlpack__ or "
        f"__cuda_array_interface__, got {type(x).__module__}.{type(x).__name__}")


def from_native(result: Any, like: Any) -> Any:
    """`result` (NumPy/CuPy) as the type of `like`, through its package's `from_dlpack`."""
    if result is None or is_native(like):
        return result
    package = sys.modules.get(type(like).__module__.partition(".")[0])
    maker: Callable[[Any], Any] | None = getattr(package, "from_dlpack", None)
    return result if maker is None else maker(result)


def convert(args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any], Callable[[Any], Any]]:
    """Native views of a verb's `x` (first argument) and `out`, and the function that turns
    the verb's result back into the caller's type (the caller's own object when the result
    was written into it)."""
    x = args[0]
    native_x = to_native(x)
    out = kwargs.get("out")
    native_out = None
    if out is not None:
        native_out = to_native(out)
        kwargs = {**kwargs, "out": native_out}

    def restore(result: Any) -> Any:
        if result is None:
            return None
        if native_out is not None and result is native_out:
            return out
        if result is native_x:
            return x
        return from_native(result, x)

    return (native_x, *args[1:]), kwargs, restore


def _torch_cuda_device(x: Any) -> int | None:
    """The GPU index of a torch CUDA tensor, else None."""
    if type(x).__module__.partition(".")[0] != "torch" or not getattr(x, "is_cuda", False):
        return None
    return int(x.device.index)


def caller_stream(x: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which CuPy's current stream is the stream the caller orders `x`'s work
    on: torch's current stream on the tensor's GPU for a torch CUDA tensor (so the collective
    starts after the caller's queued torch work and torch work queued afterwards sees its
    result); for anything else, nothing changes."""
    device = _torch_cuda_device(x)
    if device is None:
        return contextlib.nullcontext()
    torch = sys.modules["torch"]
    return _on_stream(int(torch.cuda.current_stream(device).cuda_stream), device)


@contextlib.contextmanager
def _on_stream(handle: int, device: int) -> Iterator[None]:
    """CuPy's current stream on `device` is the CUDA stream `handle` for the block. The device
    is made current first: CuPy keeps one current stream per device, and refuses a stream of
    another device."""
    cuda = _cupy().cuda
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cuda.ExternalStream(handle, device)
    with cuda.Device(device), stream:
        yield


def call(method: Callable[..., Any], comm: Any, args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> Any:
    """`method(comm, *args, **kwargs)` on native views, on the caller's stream; the result in
    the caller's type."""
    with caller_stream(args[0]):
        args, kwargs, restore = convert(args, kwargs)
        return restore(method(comm, *args, **kwargs))

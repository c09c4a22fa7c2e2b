"""The CUDA driver beside CuPy: driver-call results, whether stream memory operations work
on a device (and the warning when they do not), a kernel's occupancy, and making a device
current in any thread without leaving a context on another GPU (`Scope`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Any

__all__ = ["FLAGS_ENV", "MEMCPY_DEFAULT", "cupy_module", "check_cu", "memops_support",
           "flag_waits", "occupancy", "warn_spin_waits", "Scope"]

#: the setting that selects how flags are waited for (gpuring.settings declares it)
FLAGS_ENV = "GPURING_CUDA_FLAGS"
#: cudaMemcpyDefault (a stable ABI value): the direction follows from the pointers
MEMCPY_DEFAULT = 4


_cupy: Any = None


def cupy_module() -> Any:
    """The cupy module, imported on first use (it needs a CUDA driver to import)."""
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


def check_cu(result: tuple[Any, ...], what: str) -> None:
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err}")


def memops_support(device_id: int) -> str | None:
    """None when 64-bit stream memory operations work on the device, else why not."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return f"cuda-bindings is not importable ({exc})"
    try:
        check_cu(driver.cuInit(0), "cuInit")
        err, dev = driver.cuDeviceGet(device_id)
        check_cu((err,), "cuDeviceGet")
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
        err, value = driver.cuDeviceGetAttribute(attr, dev)
        check_cu((err,), "cuDeviceGetAttribute")
    except Exception as exc:  # no driver entry point, an old driver
        return f"the driver refused: {exc}"
    if not value:
        return (f"device {device_id} reports no 64-bit stream memory operations "
                "(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0)")
    return None


def flag_waits(requested: str, device_id: int, loud: bool = True) -> str:
    """How the streams of device `device_id` wait for flags, as `requested` (GPURING_CUDA_FLAGS:
    "memops", "kernel" or "auto"): "memops" (stream memory operations) where asked and
    available, else "kernel" (spinning kernels; auto says why, once: `warn_spin_waits`,
    as a warning where `loud`)."""
    mode = requested.lower()
    if mode not in ("auto", "memops", "kernel"):
        raise ValueError(f"{FLAGS_ENV}={mode!r}: use memops, kernel or auto")
    why_not = memops_support(device_id)
    if mode == "memops" and why_not is not None:
        raise RuntimeError(f"{FLAGS_ENV}=memops, but {why_not}; use {FLAGS_ENV}=kernel")
    if mode == "auto" and why_not is not None:
        warn_spin_waits(why_not, loud)
    return "memops" if mode != "kernel" and why_not is None else "kernel"


def occupancy(kernel: Any, threads: int) -> int | None:
    """Blocks of `threads` threads of `kernel` that fit on one SM at once, as the driver
    computes it from the kernel's registers and shared memory
    (cuOccupancyMaxActiveBlocksPerMultiprocessor, through cuda-bindings, else through CuPy's
    wrapper of the same call); None when neither can tell. Call it with the kernel's device
    current."""
    function = getattr(kernel, "kernel", kernel)  # a RawModule's RawKernel holds a Function
    handle = int(getattr(function, "ptr", 0) or 0)  # the CUfunction
    if not handle:
        return None
    try:
        from cuda.bindings import driver

        err, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            driver.CUfunction(handle), threads, 0)
        if err == driver.CUresult.CUDA_SUCCESS and blocks > 0:
            return int(blocks)
    except Exception:  # no cuda-bindings, or no driver library behind it
        pass
    try:
        blocks = cupy_module().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            handle, threads, 0)
    except Exception:  # an old CuPy, a driver error
        return None
    return int(blocks) if blocks > 0 else None


_warned_spin = False
log = logging.getLogger("gpuring")


def warn_spin_waits(reason: str, loud: bool = True) -> None:
    """Once per process: flag waits will spin on the GPU, and why, and what to do. `loud`
    (the job's rank 0): a RuntimeWarning (Python's warnings filters silence it, as does
    GPURING_CUDA_FLAGS=kernel); else a line of the "gpuring" logger at INFO level, shown
    only where the program asks for it, so that the job says it once."""
    global _warned_spin
    if _warned_spin:
        return
    _warned_spin = True
    text = (
        f"gpuring: GPU flag waits fall back to spinning kernels because {reason.rstrip('.')}. "
        "A spinning "
        "kernel holds the GPU: where several processes share one GPU without MPS, each "
        "hand-off can cost a whole time slice. Install cuda-bindings matching your CUDA "
        "driver (pip install 'gpuring[cuda13]' or 'gpuring[cuda12]'), and start MPS "
        f"(nvidia-cuda-mps-control -d) for shared GPUs; {FLAGS_ENV}=kernel silences this.")
    if loud:
        warnings.warn(text, RuntimeWarning, stacklevel=5)
    else:
        log.info("%s", text)


class _Thread(threading.local):
    """Per thread: `nothing`, set once the thread had a context on the device (see
    `Scope.enter`), and the devices to restore, innermost last."""

    nothing: Any = None

    def __init__(self) -> None:
        self.stack: list[int | None] = []


class Scope:
    """`with device.scope():` this device is current in the calling thread for the block.
    The previous device is restored only if the thread had a CUDA context before: making a
    device current creates its context (CUDA >= 12), so restoring a thread that had none (a
    fresh watchdog thread reads device 0) would put a context on GPU 0 for every rank."""

    def __init__(self, device_id: int):
        self._id = device_id
        self._local = _Thread()
        self._get_device = cupy_module().cuda.runtime.getDevice

    def enter(self) -> contextlib.AbstractContextManager[Any]:
        """What `with` enters: nothing to do where the device is current already and this
        thread was seen with its context (the common case, on every call's path: one runtime
        call), else this scope's switch. Nothing is this thread's own uncontended lock, whose
        enter and exit are C calls (a nullcontext's are Python calls, and this is on every
        call's path). A thread whose context other code pops with the driver API
        (cuCtxPopCurrent) while the runtime still names this device would then get
        CUDA_ERROR_INVALID_CONTEXT from a driver call, raised as such."""
        nothing = self._local.nothing
        if nothing is not None and self._get_device() == self._id:
            return nothing  # type: ignore[no-any-return]
        return self

    def __enter__(self) -> None:
        cuda = cupy_module().cuda
        runtime = cuda.runtime
        restore = None
        if runtime.getDevice() != self._id:
            if cuda.driver.ctxGetCurrent() != 0:
                restore = runtime.getDevice()
            runtime.setDevice(self._id)
        elif cuda.driver.ctxGetCurrent() == 0:
            runtime.setDevice(self._id)  # a current context, for driver API calls
        local = self._local
        if local.nothing is None:  # a context on the device from now on
            local.nothing = threading.RLock()
        local.stack.append(restore)

    def __exit__(self, *exc: object) -> None:
        restore = self._local.stack.pop()
        if restore is not None:
            cupy_module().cuda.runtime.setDevice(restore)

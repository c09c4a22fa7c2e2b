"""The CUDA kernels of `kernels/reduce.cu`: names, headers, NVRTC compilation, CuPy loading.

Every kernel is `extern "C"`, so its symbol is its name. Two ways to compile:

- `nvrtc_compile`: NVRTC from cuda-bindings, no GPU needed. `CudaDevice` loads its CUBIN for
  the GPU's architecture (`get_module`, cached on disk by `cubin_for`); CI compiles every
  kernel for the architectures we ship to (`compile_all_with_nvrtc`).
- CuPy's `RawModule`, only where cuda-bindings is missing: it adds -ftz=true, so subnormal
  floats flush to zero there.

`reduce.cu` includes `<cuda_fp16.h>`, which NVRTC does not find on its own. `cuda_include_dirs`
looks, in order, in `$GPURING_CUDA_INCLUDE`, the pip wheel `nvidia-cuda-runtime` or a CUDA
toolkit (through cuda-pathfinder, then `$CUDA_PATH`, `$CUDA_HOME`, `/usr/local/cuda`), and last
the headers that NVRTC >= 13 bundles, extracted once into a cache directory.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import settings
from .._ops import COMPLEX_DTYPES, SUPPORTED_DTYPES, ReduceOp, check_op_dtype
from ._file_cache import cached_bytes

__all__ = [
    "KernelCompileError",
    "REDUCE_KERNEL_NAMES",
    "REDUCE_N_KERNEL_NAMES",
    "DIRECT_KERNEL_NAMES",
    "FUSED_MAX_BLOCKS",
    "FUSED_MAX_RANKS",
    "fused_region_bytes",
    "MAX_SOURCES",
    "COPY_KERNEL",
    "WAIT_FLAG_KERNEL",
    "WRITE_FLAG_KERNEL",
    "WRITE_FLAGS_KERNEL",
    "STAGE_KERNEL",
    "MAX_FLAGS",
    "ALL_KERNEL_NAMES",
    "reduce_kernel_name",
    "reduce_n_kernel_name",
    "fold_launches",
    "kernel_source_path",
    "kernel_source",
    "cuda_include_dirs",
    "compile_options",
    "nvrtc_compile",
    "compile_all_with_nvrtc",
    "cubin_path",
    "cubin_for",
    "get_module",
    "get_function",
    "get_kernel",
    "get_reduce_n_kernel",
    "get_fused_kernel",
]

SOURCE_NAME = "reduce.cu"
#: a header that must be found for reduce.cu to compile
_PROBE_HEADER = "cuda_fp16.h"

_REAL_OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
_COMPLEX_OPS = (ReduceOp.SUM, ReduceOp.PROD)


class KernelCompileError(RuntimeError):
    """The kernel source did not compile; the message carries the compiler log."""


def reduce_kernel_name(dtype: str, op: ReduceOp | str) -> str:
    """Symbol of the kernel that reduces `dtype` with `op` (avg uses the sum kernel)."""
    op = ReduceOp.parse(op)
    check_op_dtype(op, dtype)
    if op is ReduceOp.AVG:
        op = ReduceOp.SUM
    return f"gpuring_reduce_{dtype}_{op.value}"


def reduce_n_kernel_name(dtype: str, op: ReduceOp | str) -> str:
    """Symbol of the n-input kernel that folds up to `MAX_SOURCES` arrays of `dtype` with
    `op` (avg uses the sum kernel)."""
    return reduce_kernel_name(dtype, op).replace("gpuring_reduce_", "gpuring_reduce_n_", 1)


def fused_kernel_name(dtype: str, op: ReduceOp | str) -> str:
    """Symbol of the one-kernel collectives of `dtype` with `op` (avg uses the sum kernel)."""
    return reduce_kernel_name(dtype, op).replace("gpuring_reduce_", "gpuring_fused_", 1)


_OP_PAIRS = tuple((dtype, op) for dtype in SUPPORTED_DTYPES
                  for op in (_COMPLEX_OPS if dtype in COMPLEX_DTYPES else _REAL_OPS))
#: every binary reduce kernel in reduce.cu, one per (dtype, op)
REDUCE_KERNEL_NAMES: tuple[str, ...] = tuple(reduce_kernel_name(d, o) for d, o in _OP_PAIRS)
#: every n-input reduce kernel in reduce.cu, one per (dtype, op)
REDUCE_N_KERNEL_NAMES: tuple[str, ...] = tuple(reduce_n_kernel_name(d, o) for d, o in _OP_PAIRS)
#: every one-kernel collective in reduce.cu, one per (dtype, op)
DIRECT_KERNEL_NAMES: tuple[str, ...] = tuple(
    fused_kernel_name(d, o) for d, o in _OP_PAIRS)
#: the collectives gpuring_fused_* runs, by its `kind` argument (GPURING_ALL_REDUCE ...)
DIRECT_KINDS = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2, "broadcast": 3,
                "reduce": 4, "gather": 5, "scatter": 6, "all_to_all": 7}
#: those whose input holds a block per rank (in rank order), and those that only copy
BLOCKED_INPUT_KINDS = frozenset({"reduce_scatter", "scatter", "all_to_all"})
COPY_KINDS = frozenset({"all_gather", "broadcast", "gather", "scatter", "all_to_all"})
#: the one-kernel collectives' most blocks and ranks, and where its data starts in a rank's
#: region (GPURING_FUSED_MAX_BLOCKS, GPURING_FUSED_MAX_RANKS, GPURING_FUSED_DATA in reduce.cu)
FUSED_MAX_BLOCKS = 32
FUSED_MAX_RANKS = 8
FUSED_INBOX = 8 * FUSED_MAX_BLOCKS
FUSED_DATA = 4096
#: the most sources one launch of an n-input kernel folds (GPURING_MAX_SOURCES in reduce.cu)
MAX_SOURCES = 8
COPY_KERNEL = "gpuring_copy_bytes"
WAIT_FLAG_KERNEL = "gpuring_wait_flag"
WRITE_FLAGS_KERNEL = "gpuring_write_flags"
#: the most flags one WRITE_FLAGS_KERNEL launch sets
MAX_FLAGS = 8
WRITE_FLAG_KERNEL = "gpuring_write_flag"
#: copy, then (its last block) set up to MAX_FLAGS flags: the staging step of the
#: stream-memory-operation form of the one-operation all_reduce
STAGE_KERNEL = "gpuring_stage_publish"
ALL_KERNEL_NAMES: tuple[str, ...] = (
    *REDUCE_KERNEL_NAMES, *REDUCE_N_KERNEL_NAMES, *DIRECT_KERNEL_NAMES, COPY_KERNEL,
    WAIT_FLAG_KERNEL, WRITE_FLAG_KERNEL, WRITE_FLAGS_KERNEL, STAGE_KERNEL)


def fold_launches(dst: int, srcs: Sequence[int]) -> list[tuple[tuple[int, ...], bool]]:
    """The launches of an n-input kernel that fold `srcs` (two or more addresses) into `dst`
    in order: (sources of the launch, whether it is the last, which applies the divisor).
    The first launch takes up to `MAX_SOURCES` sources; each later one starts from `dst` (the
    fold so far, already rounded to the dtype) and takes up to `MAX_SOURCES` - 1 more. So
    `dst` may be the same memory as a source of the first launch (each element is read from
    every source of a launch before it is written), not as a later one: that is refused."""
    if len(srcs) < 2:
        raise ValueError(f"a fold needs at least two sources, not {len(srcs)}")
    if dst in srcs[MAX_SOURCES:]:
        raise ValueError(f"an in-place fold of more than {MAX_SOURCES} sources whose "
                         f"destination is source {list(srcs).index(dst)} (a later launch's)")
    launches = [tuple(srcs[:MAX_SOURCES])]
    for start in range(MAX_SOURCES, len(srcs), MAX_SOURCES - 1):
        launches.append((dst, *srcs[start:start + MAX_SOURCES - 1]))
    return [(launch, i == len(launches) - 1) for i, launch in enumerate(launches)]


def fused_region_bytes(slot_bytes: int) -> int:
    """Bytes of one rank's region for one-operation collectives of up to `slot_bytes` bytes
    (a multiple of 16): counters and inbox, then two slots."""
    return FUSED_DATA + 2 * slot_bytes


# ------------------------------------------------------------------------------- source

def kernel_source_path() -> Path:
    """`gpuring/kernels/reduce.cu` (installed package data), else `kernels/reduce.cu` of the
    source tree next to the package."""
    package_dir = Path(__file__).resolve().parent.parent
    candidates = (package_dir / "kernels" / SOURCE_NAME,
                  package_dir.parent / "kernels" / SOURCE_NAME)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"gpuring kernel source {SOURCE_NAME} not found; looked at "
        + ", ".join(str(p) for p in candidates))


@functools.cache
def kernel_source() -> str:
    """The text of reduce.cu."""
    return kernel_source_path().read_text(encoding="utf-8")


# ------------------------------------------------------------------------------- headers

def _has_probe(directory: str | os.PathLike[str] | None) -> bool:
    return bool(directory) and (Path(str(directory)) / _PROBE_HEADER).is_file()


def _toolkit_include_dir() -> str | None:
    """The include directory of the pip CUDA runtime wheel or of an installed toolkit."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        pass
    else:
        try:
            found = find_nvidia_header_directory("cudart")
        except Exception:  # pathfinder raises its own errors on odd installs
            found = None
        if _has_probe(found):
            return str(found)
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and _has_probe(Path(root) / "include"):
            return str(Path(root) / "include")
    return None


def _bundled_include_dirs() -> list[str]:
    """Extract the headers bundled in libnvrtc-builtins (NVRTC >= 13) into a cache directory.
    Empty when this NVRTC has no bundled headers."""
    try:
        from cuda.bindings import nvrtc
        err, info, _log = nvrtc.nvrtcGetBundledHeadersInfo()
    except Exception:  # older cuda-bindings or NVRTC without bundled headers
        return []
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or not info.available:
        return []
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = f"{info.cudaVersionMajor}.{info.cudaVersionMinor}"
    target = cache_root / "gpuring" / f"nvrtc-headers-{version}"
    if not _has_probe(target):
        target.mkdir(parents=True, exist_ok=True)
        flags = nvrtc.NVRTC_INSTALL_HEADERS_SKIP_IF_EXISTS
        result = nvrtc.nvrtcInstallBundledHeaders(str(target).encode(), flags)
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS or not _has_probe(target):
            return []
    dirs = [str(target)]
    if (target / "cccl").is_dir():
        dirs.append(str(target / "cccl"))
    return dirs


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories to pass with -I so that `<cuda_fp16.h>` resolves. Raises when none found."""
    override = settings.get("GPURING_CUDA_INCLUDE")
    if override:
        return tuple(d for d in override.split(os.pathsep) if d)
    toolkit = _toolkit_include_dir()
    if toolkit:
        return (toolkit,)
    bundled = _bundled_include_dirs()
    if bundled:
        return tuple(bundled)
    raise KernelCompileError(
        f"CUDA headers not found ({_PROBE_HEADER}); install the pip package "
        "'nvidia-cuda-runtime' (matching your CUDA major version), install a CUDA toolkit, "
        "or set GPURING_CUDA_INCLUDE to a directory that holds cuda_fp16.h")


def compile_options(include_dirs: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """NVRTC options shared by both compile paths (no architecture option)."""
    if include_dirs is None:
        include_dirs = cuda_include_dirs()
    return ("-std=c++17", *(f"-I{d}" for d in include_dirs))


# ------------------------------------------------------------------------------- NVRTC

def _check_nvrtc(nvrtc: Any, result: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise KernelCompileError(f"{what} failed: {msg.decode(errors='replace')}")
    return result[1:]


def nvrtc_compile(arch: str, source: str | None = None) -> bytes:
    """Compile reduce.cu (or `source`) with cuda-bindings NVRTC for `arch` ("sm_90", ...)
    and return the CUBIN. Needs no GPU. Raises KernelCompileError with the NVRTC log."""
    from cuda.bindings import nvrtc

    text = kernel_source() if source is None else source
    (prog,) = _check_nvrtc(
        nvrtc, nvrtc.nvrtcCreateProgram(text.encode(), SOURCE_NAME.encode(), 0, [], []),
        "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in (f"--gpu-architecture={arch}", *compile_options())]
        compiled = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        (log_size,) = _check_nvrtc(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * log_size
        _check_nvrtc(nvrtc, nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        if compiled[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(
                f"NVRTC could not compile {SOURCE_NAME} for {arch} "
                f"(options {' '.join(o.decode() for o in opts)}):\n"
                + log.decode(errors="replace").rstrip("\x00 "))
        (size,) = _check_nvrtc(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check_nvrtc(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_all_with_nvrtc(arch: str) -> bytes:
    """Compile every kernel for `arch` ("sm_80", "sm_90", ...), check that each kernel name
    is in the CUBIN, and return the CUBIN. Raises KernelCompileError (with the NVRTC log) on
    failure."""
    cubin = nvrtc_compile(arch)
    missing = [name for name in ALL_KERNEL_NAMES if name.encode() + b"\x00" not in cubin]
    if missing:
        raise KernelCompileError(f"kernels missing from the {arch} CUBIN: {', '.join(missing)}")
    return cubin


# ------------------------------------------------------------------------------- CuPy

def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "gpuring" / "cubin"


def cubin_path(arch: str) -> Path:
    """Where `cubin_for` keeps the CUBIN for `arch`: ~/.cache/gpuring/cubin (or under
    $XDG_CACHE_HOME), named after a hash of the source, the options and the NVRTC version."""
    from cuda.bindings import nvrtc

    _err, major, minor = nvrtc.nvrtcVersion()
    key = hashlib.sha256("\0".join(
        (kernel_source(), arch, *compile_options(), f"{major}.{minor}")).encode()).hexdigest()
    return _cache_dir() / f"reduce-{arch}-{key[:20]}.cubin"


def cubin_for(arch: str) -> bytes:
    """The CUBIN of reduce.cu for `arch`, compiled by `nvrtc_compile` once and then kept on
    disk (`cubin_path`): processes that need it at once build it once."""
    return cached_bytes(cubin_path(arch), lambda: nvrtc_compile(arch))


@functools.cache
def get_module(device_id: int) -> Any:
    """reduce.cu loaded on GPU `device_id`.

    Compiled with our own NVRTC options (`cubin_for`): CuPy's RawModule would add -ftz=true,
    which flushes subnormal floats and breaks the host device's arithmetic rules. Without
    cuda-bindings, RawModule is the fallback (subnormal float32 results then flush to zero).
    """
    import cupy

    with cupy.cuda.Device(device_id) as device:
        try:
            cubin = cubin_for(f"sm_{device.compute_capability}")
        except Exception as exc:  # no cuda-bindings, no libnvrtc, an NVRTC too old for the GPU
            warnings.warn(f"gpuring: compiling the kernels with CuPy's RawModule instead of "
                          f"NVRTC ({type(exc).__name__}: {exc}); subnormal floats will flush "
                          "to zero", RuntimeWarning, stacklevel=2)
            return cupy.RawModule(code=kernel_source(), options=compile_options(),
                                  backend="nvrtc")
        module = cupy.cuda.function.Module()
        module.load(cubin)
        return module


@functools.cache
def get_function(name: str, device_id: int) -> Any:
    """A kernel of reduce.cu by symbol name, on GPU `device_id`; called as
    `kernel(grid, block, args, stream=stream)`."""
    if name not in ALL_KERNEL_NAMES:
        raise KeyError(f"no kernel named {name!r} in {SOURCE_NAME}")
    return get_module(device_id).get_function(name)


def get_kernel(dtype: str, op: ReduceOp | str, device_id: int) -> Any:
    """The reduce kernel for (dtype, op) on GPU `device_id`, with the signature
    `(dst, a, b, n: uint64, divisor: int64, abort)`."""
    return get_function(reduce_kernel_name(dtype, op), device_id)


def get_reduce_n_kernel(dtype: str, op: ReduceOp | str, device_id: int) -> Any:
    """The n-input reduce kernel for (dtype, op) on GPU `device_id`, with the signature
    `(dst, s0, ..., s7, nsrc: int32, n: uint64, divisor: int64, abort)`."""
    return get_function(reduce_n_kernel_name(dtype, op), device_id)


def get_fused_kernel(dtype: str, op: ReduceOp | str, device_id: int) -> Any:
    """The one-kernel collectives for (dtype, op) on GPU `device_id`, with the signature
    `(out, in, n: uint64, stride: uint64, divisor: int64, kind: int32 (DIRECT_KINDS),
    root: int32, rank: int32, nranks: int32, r0, ..., r7, slot_bytes: uint64,
    timeout_ns: uint64, status, abort)`."""
    return get_function(fused_kernel_name(dtype, op), device_id)

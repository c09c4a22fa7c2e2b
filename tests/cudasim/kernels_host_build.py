"""Build kernels/reduce.cu with the host C++ compiler, for the CPU (see cuda_host_emulation.h).

`build(directory)` returns the path of the shared library, or raises `Unavailable` (with what
is missing) when there is no compiler or no CUDA headers; `load(path)` opens it. The library
is named after a hash of its inputs, so a directory serves as a cache.

A simulated GPU loads the CUBIN NVRTC builds for `COMPUTE_CAPABILITY` too (for its kernels'
register counts): `simulator_env` builds it into gpuring's on-disk cache first, so that no
simulated process pays for that build (tens of seconds of CPU) inside a time box of its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from gpuring.devices import _kernels
from gpuring.devices._file_cache import build_lock

HERE = Path(__file__).resolve().parent
SHIM = HERE / "cuda_host_emulation.h"
#: what every simulated GPU answers for its compute capability
COMPUTE_CAPABILITY = "90"


#: what installs the simulator's tools: pyproject's `sim` extra (CI installs it)
INSTALL = "pip install -e '.[sim]'"
#: why a test that needs NVRTC is skipped where cuda-bindings is missing
NVRTC_MISSING = f"cuda-bindings (NVRTC) is not installed: the CUDA simulator's extra, {INSTALL}"


class Unavailable(RuntimeError):
    """No host compiler or no CUDA headers here."""


def header_dirs() -> list[str]:
    """Include directories holding cuda_fp16.h, crt/host_defines.h and nv/target."""
    candidates: list[Path] = []
    try:
        candidates += [Path(d) for d in _kernels.cuda_include_dirs()]
    except _kernels.KernelCompileError:
        pass
    candidates += [Path(d) for d in _kernels._bundled_include_dirs()]
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.append(Path(root) / "include")
    candidates += [d / "cccl" for d in list(candidates)]
    dirs: list[str] = []
    for wanted in ("cuda_fp16.h", "crt/host_defines.h", "nv/target"):
        found = next((d for d in candidates if (d / wanted).is_file()), None)
        if found is None:
            raise Unavailable(f"no CUDA header {wanted} for the CUDA simulator's host build "
                              f"of the kernels: the simulator's extra, {INSTALL} (or a CUDA "
                              "toolkit)")
        if str(found) not in dirs:
            dirs.append(str(found))
    return dirs


def build(directory: Path) -> Path:
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        raise Unavailable("no host C++ compiler (c++ or g++, or $CXX) for the CUDA "
                          "simulator's host build of the kernels")
    source = _kernels.kernel_source_path()
    cmd = [compiler, "-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off",
           *(f"-I{d}" for d in header_dirs()), "-include", str(SHIM), "-x", "c++", str(source)]
    key = hashlib.sha256("\0".join(cmd).encode() + source.read_bytes() + SHIM.read_bytes())
    out = directory / f"libreduce-host-{key.hexdigest()[:16]}.so"
    if out.is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    # one build per directory: concurrent builders (test workers) wait for the first
    with build_lock(directory / ".build.lock"):
        if out.is_file():
            return out
        partial = out.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([*cmd, "-o", str(partial)], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"host build of {source.name} failed:\n{done.stderr}")
        partial.replace(out)  # atomic: a reader never sees half a library
    return out


def simulator_env(directory: Path, **extra: str) -> dict[str, str]:
    """The environment of a process that runs on the CUDA simulator: this directory first on
    PYTHONPATH (so `import cupy` finds the simulator) and the kernels' host build, made in
    `directory`, and the CUBIN a simulated GPU loads in gpuring's on-disk cache. Raises
    Unavailable as `build` does, or where cuda-bindings has no NVRTC."""
    lib = build(directory)
    try:
        _kernels.cubin_for(f"sm_{COMPUTE_CAPABILITY}")
    except ImportError as exc:  # no NVRTC here (a compile error is an error, not this)
        raise Unavailable(f"no NVRTC to build the simulated GPU's CUBIN ({exc}): the "
                          f"simulator's extra, {INSTALL}") from exc
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, GPURING_CUDASIM_LIB=str(lib), **extra)


def load(path: Path | str) -> ctypes.CDLL:
    """The built library, with the signatures of its launchers (cuda_host_emulation.h)."""
    lib = ctypes.CDLL(str(path))
    u64, i64, vp, uint = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint
    lib.emu_launch_reduce.argtypes = [vp, uint, uint, vp, vp, vp, u64, i64, vp]
    lib.emu_launch_reduce_n.argtypes = [vp, uint, uint, vp, *[vp] * 8, ctypes.c_int, u64, i64,
                                        vp]
    lib.emu_launch_copy.argtypes = [vp, uint, uint, vp, vp, u64, vp]
    lib.emu_launch_wait.argtypes = [vp, uint, uint, vp, u64, u64, vp, vp]
    lib.emu_launch_write.argtypes = [vp, uint, uint, vp, u64, vp]
    lib.emu_launch_write_many.argtypes = [vp, uint, uint, *[vp] * 8, ctypes.c_int, u64, vp]
    lib.emu_launch_fused.argtypes = [vp, uint, uint, vp, vp, u64, u64, i64,
                                      *[ctypes.c_int] * 4,
                                      *[vp] * 8, u64, u64, vp, vp]
    lib.emu_launch_stage.argtypes = [vp, uint, uint, vp, vp, u64, *[vp] * 8, ctypes.c_int, u64,
                                     vp, vp]
    lib.emu_last_vector_width.argtypes = []
    lib.emu_last_vector_width.restype = ctypes.c_int
    return lib

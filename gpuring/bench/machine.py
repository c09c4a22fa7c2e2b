"""What the numbers were measured on: CPU, GPUs and driver, library versions, git commit."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["describe", "cpu_model", "gpus", "memory_bytes", "versions", "git_commit"]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (platform's guess when /proc/cpuinfo has none)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> dict[str, Any] | None:
    """GPU names and the driver version through nvidia-ml-py; None when unavailable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:  # pragma: no cover - needs a GPU
        pynvml.nvmlInit()
        try:
            def text(value: Any) -> str:
                return value.decode() if isinstance(value, bytes) else str(value)

            handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(pynvml.nvmlDeviceGetCount())]
            found = {"driver": text(pynvml.nvmlSystemGetDriverVersion()),
                     "names": [text(pynvml.nvmlDeviceGetName(h)) for h in handles],
                     "memory_bytes": [int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
                                      for h in handles]}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError: no driver, no GPU
        return None
    from ..devices._topology import read

    topology = read(pynvml)  # pragma: no cover - needs a GPU
    if topology is not None:
        found["topology"] = topology.summary()
        found["topology_matrix"] = topology.lines()
    return found


def memory_bytes() -> int | None:
    """The host's physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _mpi_library() -> str | None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:  # already imported (under mpiexec): ask the library itself
        return str(mpi.Get_library_version()).splitlines()[0].strip()
    for name in ("mpich", "openmpi", "impi-rt"):
        version = _dist_version(name)
        if version:
            return f"{name} {version}"
    return None


def versions() -> dict[str, str | None]:
    """Versions of gpuring, numpy, cupy, mpi4py (and its MPI library), torch, Python."""
    import numpy

    from .. import __version__

    cupy = sys.modules.get("cupy")
    return {
        "gpuring": __version__,
        "numpy": numpy.__version__,
        "cupy": getattr(cupy, "__version__", None) or _dist_version(
            "cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x"),
        "mpi4py": _dist_version("mpi4py"),
        "mpi": _mpi_library(),
        "torch": _dist_version("torch"),
        "python": platform.python_version(),
    }


def git_commit() -> str | None:
    """Short commit of the checkout gpuring runs from (+ "-dirty" with local changes)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                              capture_output=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def describe() -> dict[str, Any]:
    """Everything above in one dict (the JSON's "machine")."""
    return {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "os": f"{platform.system()} {platform.release()}",
        "gpus": gpus(),
        "versions": versions(),
        "commit": git_commit(),
    }

"""What the options need, checked before anything is measured: the packages they use and
the files they write. A run that cannot deliver what it was asked for stops at once (exit
status 2) instead of measuring for minutes and then writing nothing.

`gpuring bench --ranks N` checks in the launching process, before any rank starts. Ranks
started otherwise (`gpuring run`, mpiexec) check after the rendezvous: rank 0, which writes
the files, checks them; every rank checks what it needs itself; then they agree (one
all_reduce), so every rank stops or none does and no rank is left waiting in a collective.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from typing import Any

from .options import Settings
from .peers import all_ranks_ok

__all__ = ["problems", "device_problems", "output_problems", "agree", "check_ranks"]


def _missing(module: str) -> str | None:
    """Why `module` cannot be imported; None when it can."""
    try:
        importlib.import_module(module)
    except ImportError:
        return "not installed"
    except Exception as exc:  # installed but broken, e.g. CuPy built for another CUDA
        return f"{type(exc).__name__}: {exc}"
    return None


def device_problems(device: str) -> list[str]:
    """What this rank lacks for `--device` ("auto" falls back to the CPU: nothing)."""
    if device != "cuda":
        return []
    why = _missing("cupy")
    if why is None:
        return []
    return [f"--device cuda needs CuPy ({why}): pip install 'gpuring[cuda13]' (or cuda12)"]


def _unwritable(path: str) -> str | None:
    """Why the file `path` cannot be written; None when it can. The results are written to a
    new file in its directory and then renamed over it, so the directory must take one."""
    if os.path.isdir(path):
        return "is a directory"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"no directory {folder}"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file is not writable"
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".gpuring-bench-check-")
    except OSError as exc:
        return f"cannot create a file in {folder} ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(probe)
    return None


def output_problems(s: Settings) -> list[str]:
    """What stops rank 0 from writing --json, --csv and --plot."""
    found: list[str] = []
    seen: dict[str, str] = {}
    for flag, path in (("--json", s.json), ("--csv", s.csv), ("--plot", s.plot)):
        if not path:
            continue
        same = seen.setdefault(os.path.realpath(path), flag)
        if same != flag:
            found.append(f"{flag} {path}: the same file as {same}")
            continue
        why = _unwritable(path)
        if why:
            found.append(f"{flag} {path}: {why}")
    if s.plot:
        why = _missing("matplotlib")
        if why:
            found.append(f"--plot {s.plot}: needs matplotlib ({why}): pip install matplotlib "
                         "(or 'gpuring[bench]')")
    return found


def problems(s: Settings, *, writes_files: bool) -> list[str]:
    """Everything that would stop this process's part of the run; empty when it can run."""
    return device_problems(s.device) + (output_problems(s) if writes_files else [])


def agree(comm: Any, mine: list[str]) -> bool:
    """True when no rank has a problem (a collective: every rank must call it)."""
    return all_ranks_ok(comm, not mine)


def check_ranks(s: Settings, comm: Any) -> bool:
    """The check inside the ranks: each says what it lacks on stderr; True when every rank
    can run. Rank 0 writes the files."""
    mine = problems(s, writes_files=comm.rank == 0)
    if agree(comm, mine):
        return True
    for line in mine or ["stopped before measuring: another rank cannot run this benchmark "
                         "(its message says why)"]:
        print(f"gpuring bench: {line}", file=sys.stderr, flush=True)
    return False

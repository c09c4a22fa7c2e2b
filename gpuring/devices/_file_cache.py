"""Files built once per machine and kept on disk (the kernels' CUBINs): the processes that
find one missing at once build it once, the others wait for it and read it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["cached_bytes", "build_lock"]


def cached_bytes(path: Path, build: Callable[[], bytes]) -> bytes:
    """The contents of `path`, else `build()`'s, written there (atomically) for next time;
    while one process builds, the others wait (`build_lock`). A read-only directory only
    means building again next time."""
    try:
        return path.read_bytes()
    except OSError:
        pass
    with build_lock(path.with_suffix(".lock")):
        try:  # another process of this machine built it while this one waited
            return path.read_bytes()
        except OSError:
            pass
        data = build()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{socket.gethostname()}-{os.getpid()}.tmp")
            partial.write_bytes(data)
            partial.replace(path)  # atomic: a reader never sees part of a file
        except OSError:
            pass
    return data


@contextlib.contextmanager
def build_lock(path: Path, seconds: float = 600.0) -> Iterator[None]:
    """Held while this process builds what `path` guards (a CUBIN takes a minute of CPU).
    Bounded: after `seconds` of another holder, or where the filesystem has no flock (NFS
    without lockd, say), it goes on without the lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a")  # closed below
    except OSError:
        yield
        return
    try:
        deadline, delay = time.monotonic() + seconds, 0.01
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process holds it: wait, backing off
                if time.monotonic() > deadline:
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except OSError:  # no flock here
                break
        yield
    finally:
        lock.close()  # releases the lock

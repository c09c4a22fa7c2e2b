"""The flight recorder: each communicator's last collectives, kept by every rank in a ring,
and written as JSON when something goes wrong (docs/faults.md, "The flight recorder").

Per collective the call path appends one entry to the communicator's `Ring`, `[before,
prepared, start, 0.0, ""]` (`before`: the collectives this rank started before it, its number
less one; `prepared`: the `PreparedCall` that runs it, which holds the description of the call
it was prepared for, made once when it was prepared), and writes the end time when the call
returns: a list built, an append, two clock reads. Where the call raises, its description
becomes the call's own and its last field says "failed" (or "refused": the communicator had
failed before the call, which never ran). Nothing else is done per call: the words of each
entry (verb, shapes, site) are worked out when a dump is written, and so is its state
(running, queued, done, failed), from the communicator's lifecycle (`Standing`).

A dump holds every live communicator of the process, one file per rank of the job
(`trace_file`), written on a failure, a timeout, an abort, `Communicator.dump_trace()` and
SIGUSR1; `gpuring doctor` reads the files of every rank (`_doctor`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from types import CodeType
from typing import Any, NamedTuple, Protocol

from . import settings
from ._wording import REDUCING, ROOTED

__all__ = ["FORMAT", "VERSION", "What", "Described", "fields", "Ring", "Standing", "Recorded",
           "describe", "register", "dump", "trace_dir", "trace_file", "clock", "BEFORE", "WHAT",
           "START", "END", "FAILED"]

#: the dump's format and version (docs/faults.md describes version 1)
FORMAT = "gpuring-flight-recorder"
VERSION = 1

#: the fields of an entry (BEFORE: the collectives started before it, so its number less one;
#: WHAT: a `What`, or what holds one, `Described`; END: 0.0 while the call has not returned;
#: FAILED: "" while the call has not raised, else its state)
BEFORE, WHAT, START, END, FAILED = range(5)

#: the clock of the start and end times (`time.monotonic`: one clock for every process of a
#: node); a dump writes them as Unix times
clock = time.monotonic


class What(NamedTuple):
    """What does not change between the runs of one checked call, as it came (`describe`
    makes it once per call, a plain tuple: nothing is worked out then; `fields` says it in
    words, for a dump)."""

    #: the call's key (`Call.key`: the verb, and for a call on arrays the input's shape,
    #: dtype, type, op, root, ...)
    key: tuple[Any, ...]
    #: the output's shape (None: none, as off the root of a reduce)
    out_shape: tuple[int, ...] | None
    #: what runs (`PreparedCall.schedule`)
    schedule: str
    #: the first frame outside gpuring that made the call: its code and the instruction
    #: (None: none was found)
    code: CodeType | None
    lasti: int


class Described(Protocol):
    """What an entry may hold instead of its `What` (a `PreparedCall`: the description of the
    call it was prepared for)."""

    @property
    def what(self) -> tuple[Any, ...] | None: ...


def fields(what: tuple[Any, ...] | Described) -> dict[str, Any]:
    """An entry's fields of a dump, but its number, state and times (`what`: a `What`, or
    what holds one)."""
    if not isinstance(what, tuple):
        held = what.what
        if held is None:  # (not described: not prepared by a call path)
            return {"verb": None, "shapes": [], "dtype": None, "op": None, "root": None,
                    "schedule": "", "site": ""}
        what = held
    key, out_shape, schedule, code, lasti = what
    verb = key[0]
    if len(key) == 1:  # a barrier
        return {"verb": verb, "shapes": [], "dtype": None, "op": None, "root": None,
                "schedule": schedule, "site": _site(code, lasti)}
    x_shape, dtype, op, root = key[1], key[2], key[4], key[5]
    return {"verb": verb,
            "shapes": [list(x_shape), list(out_shape or ())],
            "dtype": str(dtype),
            "op": getattr(op, "value", str(op)) if verb in REDUCING else None,
            "root": root if verb in ROOTED else None,
            "schedule": schedule, "site": _site(code, lasti)}


#: where gpuring's own source files lie (a frame there is not the user's)
_OURS = tuple({os.path.dirname(__file__) + os.sep,
               os.path.dirname(os.path.abspath(__file__)) + os.sep})


def describe(key: tuple[Any, ...], out: Any, schedule: str, above: int = 2
             ) -> tuple[Any, ...]:
    """The `What` of a call (`key`: its `Call.key()`; `out`: its output, None for none), as
    a plain tuple, made where the call path is called from: the first frame outside gpuring
    from `above` frames up (the call path's caller) is the call's site."""
    frame = sys._getframe(above)
    ours = _OURS
    while frame.f_code.co_filename.startswith(ours):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return (key, None if out is None else out.shape, schedule, None, -1)
    return (key, None if out is None else out.shape, schedule, frame.f_code, frame.f_lasti)


def _site(code: CodeType | None, lasti: int) -> str:
    """FILE:LINE of instruction `lasti` of `code` ("" for none)."""
    if code is None:
        return ""
    line = None
    for start, _end, number in code.co_lines():
        if start > lasti:
            break
        if number is not None:
            line = number
    return f"{code.co_filename}:{line if line is not None else code.co_firstlineno}"


class Ring(deque[list[Any]]):
    """A communicator's last `capacity` collectives: the entries, oldest first (appending one
    to a full ring drops the oldest). A call whose number comes again (one refused before it
    ran) has its newest entry shown."""

    __slots__ = ()

    def __init__(self, capacity: int):
        super().__init__((), capacity)

    @property
    def capacity(self) -> int:
        return self.maxlen or 0

    def entries(self) -> list[list[Any]]:
        """The entries, by number, the newest of each number (copies: the caller's thread
        may write meanwhile)."""
        newest: dict[int, list[Any]] = {}
        for entry in list(self):  # (one copy, under the interpreter's lock)
            newest[entry[BEFORE]] = entry
        return [list(newest[before]) for before in sorted(newest)]


class Standing(NamedTuple):
    """What a dump needs of a communicator besides its ring, read when it is written."""

    #: the communicator's name among the job's (`ControlPlane.job_id`: the job's own id for
    #: the job's communicator, a name made from it for a sub-communicator)
    group: str
    #: its ranks, as ranks of the job
    job_ranks: tuple[int, ...]
    rank: int
    #: collectives this rank started
    seq: int
    #: the lifecycle's state ("open", "failed", "broken", "closed")
    state: str
    #: every collective up to this one completed without error
    completed_through: int
    #: the newest collective that may not have completed (None: none)
    in_flight: int | None
    #: the newest collective in flight when a failure came (None: none, or no failure)
    lost_through: int | None
    #: the failure: the error a call raised, else one that came from outside a call, else
    #: the last error every rank raised alike that left the communicator usable (a mismatch
    #: found when the ranks agreed on a call)
    failure: BaseException | None
    #: whether a failure broke the communicator (it runs no collective any more)
    broken: bool
    #: the rank of the job `failure` blames (None: nobody, or not known)
    blames: int | None


class Recorded(Protocol):
    """What a dump reads of a communicator's call path."""

    ring: Ring | None

    def standing(self) -> Standing: ...


def _state(entry: list[Any], standing: Standing, newest: int) -> str:
    seq = entry[BEFORE] + 1
    if entry[FAILED]:
        return str(entry[FAILED])
    broken = standing.broken
    if not entry[END]:  # the call has not returned
        return "failed" if broken and seq >= newest else "running"
    if seq <= standing.completed_through or standing.in_flight is None \
            or seq > standing.in_flight:
        return "done"
    if broken and standing.lost_through is not None and seq <= standing.lost_through:
        return "failed"
    return "queued"


def _error_name(error: BaseException) -> str:
    kind = type(error)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _communicator(recorded: Recorded, offset: float) -> dict[str, Any] | None:
    ring = recorded.ring
    if ring is None:
        return None
    standing = recorded.standing()
    if standing.state == "closed" and standing.failure is None:
        return None  # (closed in order: nothing to tell)
    entries = ring.entries()
    newest = entries[-1][BEFORE] + 1 if entries else 0
    failure = standing.failure
    return {
        "group": standing.group,
        "ranks": list(standing.job_ranks),
        "rank": standing.rank,
        "size": len(standing.job_ranks),
        "seq": standing.seq,
        "state": standing.state,
        "failure": None if failure is None else {
            "type": _error_name(failure), "message": str(failure),
            "blames": standing.blames},
        "entries": [{
            "seq": entry[BEFORE] + 1,
            **fields(entry[WHAT]),
            "state": _state(entry, standing, newest),
            "start": round(entry[START] + offset, 6),
            "end": round(entry[END] + offset, 6) if entry[END] else None,
        } for entry in entries],
    }


# -- the process's recorders, and writing them ------------------------------------------------
_live: list[weakref.ref[Any]] = []
_lock = threading.RLock()  # (the SIGUSR1 handler may run inside a dump)
_signal_installed = False


def register(recorded: Recorded) -> None:
    """Keep `recorded` (weakly) among what dumps write; the first one installs the SIGUSR1
    handler (`_on_signal`), where nothing else handles that signal."""
    global _signal_installed
    with _lock:
        _live[:] = [ref for ref in _live if ref() is not None]
        _live.append(weakref.ref(recorded))
        if _signal_installed or threading.current_thread() is not threading.main_thread():
            return
        _signal_installed = True
    if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        signal.signal(signal.SIGUSR1, _on_signal)


def _on_signal(signum: int, frame: object) -> None:
    try:
        dump("SIGUSR1")
    except Exception:  # a handler must not raise into whatever the program was doing
        pass


def trace_dir(job: str) -> str:
    """Where dumps go: GPURING_TRACE_DIR, else the directory of GPURING_TIMELINE, else
    `gpuring-trace-JOB` in the temporary directory."""
    chosen = settings.get("GPURING_TRACE_DIR")
    if chosen:
        return str(chosen)
    timeline = settings.get("GPURING_TIMELINE")
    if timeline:
        return os.path.dirname(os.path.abspath(timeline))
    return os.path.join(tempfile.gettempdir(), f"gpuring-trace-{job}")


def trace_file(directory: str, job: str, rank: int) -> str:
    """The dump of rank `rank` of job `job`."""
    return os.path.join(directory, f"gpuring-trace-{job}-rank{rank}.json")


def dump(reason: str) -> str | None:
    """Write every live communicator's recorder of this process as this rank's dump (`reason`:
    why); the file's path, or None where no communicator records. Any thread."""
    with _lock:
        recorded = [r for r in (ref() for ref in _live) if r is not None]
    offset = time.time() - clock()
    communicators = [c for c in (_communicator(r, offset) for r in recorded) if c is not None]
    if not communicators:
        return None
    first = communicators[0]
    job = first["group"].partition("-")[0]
    rank = first["ranks"][first["rank"]]
    document = {"format": FORMAT, "version": VERSION, "job": job, "rank": rank,
                "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
                "written": round(time.time(), 6), "communicators": communicators}
    directory = trace_dir(job)
    os.makedirs(directory, exist_ok=True)
    path = trace_file(directory, job, rank)
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(document, f, separators=(",", ":"))
    os.replace(partial, path)
    return path

"""What `gpuring run` tells of a job whose ranks failed: one summary on one screen.

Each rank's output goes whole to its log file; on the terminal, a Python traceback a rank
writes to stderr is held back (`RankOutput`) and shown only if the rank goes on or ends well:
a rank that fails is summed up instead. `summary` names the root cause (the rank the ranks'
flight recorders blame, see `_doctor`; else the rank that failed first), its exit status or
signal, its error and the line of the user's code it came from, and how many other ranks gave
up because of it.
"""

from __future__ import annotations

import os
import re
import signal
import sysconfig
import threading
from collections.abc import Callable, Sequence
from typing import IO, NamedTuple

from ._wording import ranks_text

__all__ = ["RankOutput", "Outcome", "Report", "describe_status", "root_cause", "summary",
           "exit_status"]

_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct")
_FRAME = re.compile(r'^  File "(.*)", line (\d+), in (.*)$')
#: frames that are not the user's: gpuring's own, the standard library's, frozen modules
_NOT_THE_USERS = tuple(p for p in {
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    sysconfig.get_paths()["stdlib"] + os.sep,
    sysconfig.get_paths()["platstdlib"] + os.sep} if p)


def describe_status(code: int) -> str:
    """An exit status in words: "exited with code 3", "was killed by SIGKILL"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    """A process's status as a shell gives it (128 + the signal number for a signal)."""
    return 128 - code if code < 0 else code


class Raised(NamedTuple):
    """The last traceback a rank wrote: its exception line, and the innermost frame of the
    user's code in it (`FILE:LINE, in FUNCTION: SOURCE`; "" where there is none)."""

    error: str
    where: str


def _raised(block: Sequence[str]) -> Raised:
    """The exception and the user's innermost frame of a traceback (its last section, where
    exceptions were chained: the one that reached the top)."""
    start = max(i for i, line in enumerate(block) if line.startswith(_TRACEBACK))
    section = list(block[start:])
    error = next((line for line in reversed(section) if line.strip()), "")
    where = ""
    for i, line in enumerate(section):
        match = _FRAME.match(line)
        if match is None:
            continue
        path, number, function = match.groups()
        if path.startswith("<") or os.path.abspath(path).startswith(_NOT_THE_USERS):
            continue
        source = section[i + 1].strip() if i + 1 < len(section) and \
            section[i + 1].startswith("    ") else ""
        where = f"{path}:{number}, in {function}" + (f": {source}" if source else "")
    return Raised(error, where)


class RankOutput:
    """One rank's output: every line to its log file (`log`, None: none), the others on to
    `show` (the terminal), but for a traceback on stderr, held back until the rank writes
    another line (then shown, and the line after it) or ends (`release`, if it ended well).
    Called from the rank's two pump threads."""

    def __init__(self, log: IO[str] | None, show: Callable[[str, bool], None],
                 hold: bool = True):
        """`hold`: hold tracebacks back (else every line is shown as it comes)."""
        self.log = log
        self._show = show
        self._hold = hold
        self._lock = threading.Lock()
        self._held: list[str] = []
        self._complete = False  # the held traceback has its exception line
        self.raised: Raised | None = None  #: the last traceback's exception, once complete

    def line(self, text: str, stderr: bool) -> None:
        """A line the rank wrote (without its end of line)."""
        with self._lock:
            if self.log is not None:
                self.log.write(text + "\n")
                self.log.flush()
            if stderr and self._hold and self._holds(text):
                self._held.append(text)
                if self._complete:
                    self.raised = _raised(self._held)
                return
            if self._complete:  # the rank went on after its traceback: show it after all
                self._flush()
            self._show(text, stderr)

    def _holds(self, text: str) -> bool:
        """Whether stderr's `text` belongs to a traceback (starts one, or goes on with the
        one held: its frames, its exception's line, then blank lines and the words that
        chain another); marks the traceback complete at its exception's line."""
        if text.startswith(_TRACEBACK):
            self._complete = False
            return True
        if not self._held:
            return False
        if not self._complete:
            if text.strip() and not text.startswith(" "):
                self._complete = True
            return True
        return not text.strip() or text.startswith(_CHAINED)

    def _flush(self) -> None:
        for held in self._held:
            self._show(held, True)
        self._held = []
        self._complete = False
        self.raised = None  # (shown: not how the rank ended)

    def release(self) -> None:
        """The rank ended well: show what is held."""
        with self._lock:
            self._flush()


class Outcome(NamedTuple):
    """How one rank ended."""

    rank: int
    #: its status (negative: the signal that killed it; None: still running, never ended)
    status: int | None
    #: whether `gpuring run` stopped it (after a failure, or when it was told to stop)
    stopped: bool
    raised: Raised | None


class Report(NamedTuple):
    """The job's failure: its root cause and the ranks that gave up because of it."""

    cause: Outcome
    #: why that rank is the root cause, in words ("" where it only failed first)
    why: str
    others: list[Outcome]
    #: the job's exit status
    status: int


def root_cause(outcomes: Sequence[Outcome], first: int, blamed: Sequence[int],
               why: str) -> Report | None:
    """The report of a failed job: `first` the rank that failed first, `blamed` the ranks the
    flight recorders name as the root cause (`why`: their reason), None where no rank
    failed. The exit status is the root cause's, unless `gpuring run` stopped it or it ended
    well: then the first failure's."""
    by_rank = {o.rank: o for o in outcomes}
    failed = [o for o in outcomes if o.status not in (None, 0)]
    if not failed:
        return None
    named = [by_rank[r] for r in blamed if r in by_rank]
    cause = next((o for o in named if o.status not in (None, 0) and not o.stopped),
                 named[0] if named else by_rank[first])
    if cause not in named:
        why = ""
    first_status = by_rank[first].status or 1
    status = cause.status if cause.status not in (None, 0) and not cause.stopped \
        else first_status
    others = [o for o in failed if o.rank != cause.rank]
    return Report(cause, why, others, exit_status(status))


def summary(report: Report, logs: str | None, traces: str | None) -> list[str]:
    """The summary's lines (`logs`: the log files, as a pattern; `traces`: the flight
    recorder's directory, where it holds the job's dumps)."""
    cause = report.cause
    if cause.status is None:
        how = "never ended"
    elif cause.stopped:
        how = f"{describe_status(cause.status)} (stopped by gpuring run)"
    else:
        how = f"it {describe_status(cause.status)}"
    lines = [f"gpuring run: rank {cause.rank} failed: {how}" if not cause.stopped and
             cause.status else f"gpuring run: rank {cause.rank} caused the failure: {how}"]
    if report.why:
        lines.append(f"  why: {report.why}")
    if cause.raised is not None:
        lines.append(f"  error: {_short(cause.raised.error)}")
        if cause.raised.where:
            lines.append(f"  at: {cause.raised.where}")
    others = report.others
    if others:
        kinds = sorted({o.raised.error.split(":", 1)[0] for o in others if o.raised})
        stopped = [o.rank for o in others if o.stopped]
        said = f" ({', '.join(kinds)})" if kinds else ""
        lines.append(f"  {len(others)} other rank{'s' if len(others) > 1 else ''} gave up "
                     f"because of it: {ranks_text([o.rank for o in others])}{said}"
                     + (f"; {ranks_text(stopped)} stopped by gpuring run" if stopped else ""))
    if logs is not None:
        lines.append(f"  full output and tracebacks: {logs}")
    if traces is not None:
        lines.append(f"  what each rank ran: gpuring doctor {traces}")
    lines.append(f"gpuring run: exit status {report.status}")
    return lines


def _short(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."

"""`gpuring run`: start N ranks on this node and see the job through.

The launcher holds the job's control-plane server (loopback, per-job key), prefixes each rank's
output with its rank and writes it whole to the rank's log file, and when a rank fails tells
the others at once, gives them `grace` seconds, stops what is left and removes the job's shared
memory. A job whose ranks failed ends with one summary (`_reports`): the root cause (the rank
the ranks' flight recorders blame, else the first to fail), its error and line of code, the
ranks that gave up because of it, where the logs and the recorders' dumps are; the exit
status is the root cause's (128 + signal number for a signal).
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from . import _doctor
from ._reports import Outcome, RankOutput, describe_status, exit_status, root_cause, summary
from ._wording import ranks_text
from .devices.host import SHM_DIR, SHM_PREFIX
from .rendezvous.store import ENV_ADDR, ENV_JOB, ENV_KEY, StoreServer

__all__ = ["run", "describe_status"]

#: the variable of the flight recorder's directory (`gpuring.settings`), which the ranks
#: get where the user did not set it: the job's log directory
_TRACE_DIR = "GPURING_TRACE_DIR"
#: ... and of its size, and the size the ranks get where the user did not set it
_TRACE_ENTRIES, RECORDED = "GPURING_TRACE_ENTRIES", 256


def _pump(stream: IO[bytes], output: RankOutput, stderr: bool) -> None:
    for raw in iter(stream.readline, b""):
        output.line(raw.decode(errors="replace").rstrip("\n"), stderr)
    stream.close()


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread]
    output: RankOutput
    #: gpuring run signalled it to stop (after a failure, or forwarding a signal)
    stopped: bool = field(default=False)
    #: its failure was told to the other ranks
    reported: bool = field(default=False)


def shm_leftovers(job_id: str) -> list[str]:
    """Shared-memory files of this job still present."""
    return glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{job_id}-*"))


def run(command: list[str], nranks: int, *, grace: float = 3.0, host: str = "127.0.0.1",
        env: dict[str, str] | None = None, quiet: bool = False,
        log_dir: str | None = None, keep_going: bool = False) -> int:
    """Run `command` as `nranks` ranks; return the job's exit status. Unless `quiet`, each
    rank's output also goes to `LOG_DIR/rank-N.log` (default: `gpuring-run-JOB` in the
    temporary directory, removed when the job ends well), tracebacks of ranks that fail are
    summed up, and a failed job ends with one summary (`_reports.summary`). `keep_going`: a
    rank that fails does not stop the others (they are told, and may shrink their
    communicators and go on); the job ends well where every other rank does."""
    if nranks < 1:
        raise ValueError("the number of ranks must be at least 1")
    if not command:
        raise ValueError("nothing to run: give a command, e.g. python script.py")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    key = secrets.token_bytes(32)
    job_id = secrets.token_hex(8)
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    logs = None if quiet else _log_dir(log_dir, job_id)
    if logs is not None:  # (the summary reads the ranks' flight recorders)
        base_env.setdefault(_TRACE_DIR, logs)
        if not base_env.get(_TRACE_ENTRIES):
            base_env[_TRACE_ENTRIES] = str(RECORDED)
    server = StoreServer(nranks, key, host)
    lock = threading.Lock()
    ranks: list[_Rank] = []
    stopping = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        stopping.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.ExitStack() as files:
            for r in range(nranks):
                rank_env = dict(base_env)
                rank_env.update({
                    "GPURING_RANK": str(r), "GPURING_WORLD_SIZE": str(nranks),
                    "GPURING_LOCAL_RANK": str(r), "GPURING_LOCAL_SIZE": str(nranks),
                    ENV_ADDR: f"{server.address[0]}:{server.address[1]}",
                    ENV_JOB: job_id, ENV_KEY: key.hex(),
                })
                log = None if logs is None else files.enter_context(
                    open(os.path.join(logs, f"rank-{r}.log"), "w", encoding="utf-8"))
                output = RankOutput(log, _shower(f"[{r}] ", lock), hold=not quiet)
                proc = subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
                pumps = [threading.Thread(target=_pump, args=(pipe, output, stderr),
                                          daemon=True)
                         for pipe, stderr in ((proc.stdout, False), (proc.stderr, True))]
                for pump in pumps:
                    pump.start()
                ranks.append(_Rank(r, proc, pumps, output))
            try:
                first_failure = _supervise(ranks, server, grace, stopping, received,
                                           keep_going)
            finally:
                for rank in ranks:
                    if rank.proc.poll() is None:
                        rank.stopped = True
                        _signal_group(rank.proc, signal.SIGKILL)
                        rank.proc.wait()
                    for pump in rank.pumps:
                        pump.join(timeout=5)
    finally:
        server.close()
        for path in shm_leftovers(job_id):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for s, handler in old_handlers.items():  # restored only once everything is cleaned
            signal.signal(s, handler)
    for rank in ranks:
        if rank.proc.returncode == 0:
            rank.output.release()
    if first_failure is None:
        if logs is not None and log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)
        return 0
    rank_id, code = first_failure
    if rank_id < 0:
        if not quiet:
            print(f"gpuring run: stopped by {signal.Signals(-code).name}"
                  + ("" if logs is None else f"; the ranks' output: {logs}"), file=sys.stderr)
        return exit_status(code)
    outcomes = [Outcome(r.rank, r.proc.returncode, r.stopped, r.output.raised) for r in ranks]
    if keep_going and received == [] and _survived(outcomes, quiet, logs):
        return 0
    traces = base_env.get(_TRACE_DIR) or None
    blamed, why = _blamed(traces, job_id)
    report = root_cause(outcomes, rank_id, blamed, why)
    if report is None:
        return exit_status(code)
    if not quiet:
        with lock:
            for line in summary(report, None if logs is None else
                                os.path.join(logs, "rank-N.log"),
                                traces if blamed or why else None):
                print(line, file=sys.stderr)
    return report.status


def _survived(outcomes: list[Outcome], quiet: bool, logs: str | None) -> bool:
    """Under --keep-going: whether the job went on without the ranks that failed: every
    other rank ended well (then say which failed, and that the others went on)."""
    died = [o for o in outcomes if o.status != 0]
    if not died or len(died) == len(outcomes) or any(o.stopped for o in outcomes):
        return False
    if not quiet:
        for o in died:
            print(f"gpuring run: rank {o.rank} {describe_status(o.status or 0)}",
                  file=sys.stderr)
        went_on = [o.rank for o in outcomes if o not in died]
        print(f"gpuring run: {ranks_text(went_on)} went on (--keep-going) and ended well"
              + ("" if logs is None else f"; the ranks' output: {logs}"), file=sys.stderr)
    return True


def _log_dir(chosen: str | None, job_id: str) -> str:
    """The job's log directory: `chosen`, else `gpuring-run-JOB` in the temporary
    directory (made here, readable by this user only)."""
    path = chosen or os.path.join(tempfile.gettempdir(), f"gpuring-run-{job_id}")
    os.makedirs(path, mode=0o700, exist_ok=chosen is not None)
    return path


def _shower(prefix: str, lock: threading.Lock):  # type: ignore[no-untyped-def]
    """What shows a rank's line on the terminal: prefixed, on stdout or stderr."""
    def show(text: str, stderr: bool) -> None:
        sink = sys.stderr if stderr else sys.stdout
        with lock:
            sink.write(f"{prefix}{text}\n")
            sink.flush()
    return show


def _blamed(traces: str | None, job_id: str) -> tuple[list[int], str]:
    """The ranks the flight recorders' dumps of this job in `traces` name as the root cause
    of the job communicator's failure, and why (none: no dump, or none names one)."""
    if traces is None:
        return [], ""
    try:
        dumps = _doctor.load(traces)
    except (OSError, ValueError):
        return [], ""
    if dumps.job != job_id:
        return [], ""
    for communicator in _doctor.diagnose(dumps)["communicators"]:
        cause = communicator["root_cause"]
        if communicator["group"] == job_id and cause is not None:
            return list(cause["ranks"]), str(cause["why"])
    return [], ""


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _supervise(ranks: list[_Rank], server: StoreServer, grace: float,
               stopping: threading.Event, received: list[int],
               keep_going: bool = False) -> tuple[int, int] | None:
    """Wait for every rank; return (rank, status) of the first that failed, if any. A rank
    that fails is reported to the others (`server`); unless `keep_going`, the others are
    stopped `grace` seconds later."""
    first_failure: tuple[int, int] | None = None
    stop_at: float | None = None
    killed = False
    forwarded = False
    while True:
        running = any(rank.proc.poll() is None for rank in ranks)
        if stopping.is_set() and not forwarded:
            forwarded = True
            for rank in ranks:
                if rank.proc.poll() is None:
                    rank.stopped = True
                    _signal_group(rank.proc, received[0])
            stop_at = time.monotonic() + grace
        for rank in ranks:
            code = rank.proc.poll()
            if code not in (None, 0) and not rank.reported:
                rank.reported = True
                if first_failure is None:
                    first_failure = (rank.rank, code)
                    if not keep_going:
                        stop_at = time.monotonic() + grace
                server.report_failure(rank.rank, f"rank {rank.rank} {describe_status(code)}",
                                      dead=True)
        if stop_at is not None and time.monotonic() > stop_at:
            signum = signal.SIGKILL if killed else signal.SIGTERM
            for rank in ranks:
                if rank.proc.poll() is None:
                    rank.stopped = True
                    _signal_group(rank.proc, signum)
            killed = True
            stop_at = time.monotonic() + 2.0
        if not running:  # the sweep above saw every final status
            break
        time.sleep(0.02)
    if first_failure is None and received:
        return (-1, -received[0])
    return first_failure

"""`gpuring run`: start N ranks on this node and see the job through.

The launcher holds the job's control-plane server (loopback, per-job key), prefixes each rank's
output with its rank, and when a rank fails tells the others at once, gives them `grace`
seconds, stops what is left, removes the job's shared memory and exits with the failed rank's
status (128 + signal number for a signal).
"""

from __future__ import annotations

import glob
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from .devices.host import SHM_DIR, SHM_PREFIX
from .rendezvous.store import ENV_ADDR, ENV_JOB, ENV_KEY, StoreServer

__all__ = ["run", "describe_status"]


def describe_status(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _pump(stream: IO[bytes], sink: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        with lock:
            sink.write(prefix + line)
            sink.flush()
    stream.close()


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    pumps: list[threading.Thread]


def shm_leftovers(job_id: str) -> list[str]:
    """Shared-memory files of this job still present."""
    return glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{job_id}-*"))


def run(command: list[str], nranks: int, *, grace: float = 3.0, host: str = "127.0.0.1",
        env: dict[str, str] | None = None, quiet: bool = False) -> int:
    """Run `command` as `nranks` ranks; return the job's exit status."""
    if nranks < 1:
        raise ValueError("the number of ranks must be at least 1")
    if not command:
        raise ValueError("nothing to run: give a command, e.g. python script.py")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    key = secrets.token_bytes(32)
    job_id = secrets.token_hex(8)
    server = StoreServer(nranks, key, host)
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    lock = threading.Lock()
    ranks: list[_Rank] = []
    stopping = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        stopping.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for r in range(nranks):
            rank_env = dict(base_env)
            rank_env.update({
                "GPURING_RANK": str(r), "GPURING_WORLD_SIZE": str(nranks),
                "GPURING_LOCAL_RANK": str(r), "GPURING_LOCAL_SIZE": str(nranks),
                ENV_ADDR: f"{server.address[0]}:{server.address[1]}",
                ENV_JOB: job_id, ENV_KEY: key.hex(),
            })
            proc = subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            pumps = [threading.Thread(target=_pump, args=(pipe, sink, f"[{r}] ", lock),
                                      daemon=True)
                     for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
            for pump in pumps:
                pump.start()
            ranks.append(_Rank(r, proc, pumps))
        first_failure = _supervise(ranks, server, grace, stopping, received)
    finally:
        for rank in ranks:
            if rank.proc.poll() is None:
                _signal_group(rank.proc, signal.SIGKILL)
                rank.proc.wait()
            for pump in rank.pumps:
                pump.join(timeout=5)
        server.close()
        for path in shm_leftovers(job_id):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for s, handler in old_handlers.items():  # restored only once everything is cleaned
            signal.signal(s, handler)
    if first_failure is None:
        return 0
    rank_id, code = first_failure
    if not quiet:
        what = (f"stopped by {signal.Signals(-code).name}" if rank_id < 0
                else f"rank {rank_id} failed first: it {describe_status(code)}")
        print(f"gpuring run: {what}", file=sys.stderr)
    return _exit_code(code)


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _supervise(ranks: list[_Rank], server: StoreServer, grace: float,
               stopping: threading.Event, received: list[int]) -> tuple[int, int] | None:
    """Wait for every rank; return (rank, status) of the first that failed, if any."""
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
                    _signal_group(rank.proc, received[0])
            stop_at = time.monotonic() + grace
        for rank in ranks:
            code = rank.proc.poll()
            if code not in (None, 0) and first_failure is None:
                first_failure = (rank.rank, code)
                server.report_failure(rank.rank, f"rank {rank.rank} {describe_status(code)}",
                                      dead=True)
                stop_at = time.monotonic() + grace
        if stop_at is not None and time.monotonic() > stop_at:
            signum = signal.SIGKILL if killed else signal.SIGTERM
            for rank in ranks:
                if rank.proc.poll() is None:
                    _signal_group(rank.proc, signum)
            killed = True
            stop_at = time.monotonic() + 2.0
        if not running:  # the sweep above saw every final status
            break
        time.sleep(0.02)
    if first_failure is None and received:
        return (-1, -received[0])
    return first_failure

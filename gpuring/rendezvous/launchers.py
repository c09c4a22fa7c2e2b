"""Meeting through a control-plane server that rank 0 serves: for processes started by the
standard launchers (torchrun, Slurm's srun) and by hand (`gpuring.distributed`).

    torchrun  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: rank 0 serves on
              MASTER_ADDR at GPURING_PORT, else MASTER_PORT + 1 (torchrun's own store holds
              MASTER_PORT)
    Slurm     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID: rank 0 serves on MASTER_ADDR where
              set, else on the first host of the job step (SLURM_STEP_NODELIST or
              SLURM_JOB_NODELIST); at GPURING_PORT, else MASTER_PORT + 1, else
              29500 + SLURM_JOB_ID % 10000

Every process proves the job's key (GPURING_JOB_KEY, a hex string, the same in every
process) to the server, which refuses the others. Without a key one is derived from the port
and the launcher's job ids: any process that reaches the server and knows them can then join
(and disturb the job; it cannot make a rank run code: the control plane decodes plain data
only), which is said loudly when the server listens beyond loopback. Rank 0 starts the
server, in a process of its own that serves while rank 0's process lives, as `gpuring run`
serves its job (a communicator made again after a close meets on the same server), and
after it while any rank is still connected: rank 0 may end first, even without closing, once
its last collective completed, and its peers finish theirs. After the meeting each rank
knows every rank's node name (`host_name()`), hence its local rank and local size.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import settings
from .base import host_name
from .store import ENV_KEY
from .store_client import StoreClient, waiting_line

__all__ = ["Job", "Served", "from_environment", "first_host", "job_key", "meet", "serve",
           "start_server"]


@dataclass(frozen=True)
class Job:
    """This process in a job a launcher started: its rank, the job's size, the GPU slot the
    launcher gave it (its local rank, where the launcher says), and where rank 0 serves."""

    launcher: str
    rank: int
    size: int
    local_rank: int | None
    host: str
    port: int
    #: what tells this job from another on the same port (for a key derived without
    #: GPURING_JOB_KEY): the launcher's job and step ids, or its store's address
    salt: str = ""


#: the servers this process started, by address: each serves for the process's life, as
#: `gpuring run` serves its job (a communicator made again after a close, and
#: sub-communicators that outlive theirs, meet on it), and after it while ranks are connected
_serving: dict[tuple[str, int], Served] = {}
_serving_lock = threading.Lock()


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _checked(job: Job) -> Job:
    if job.size < 1 or not 0 <= job.rank < job.size:
        raise ValueError(f"{job.launcher}: rank {job.rank} of {job.size} ranks is no rank")
    if not 0 < job.port < 65536:
        raise ValueError(f"{job.launcher}: port {job.port} for gpuring's control plane is "
                         "out of range (set GPURING_PORT)")
    return job


def from_environment(environ: Mapping[str, str] | None = None) -> Job | None:
    """The job torchrun or Slurm started this process in (None: neither)."""
    env = os.environ if environ is None else environ
    port = settings.SETTINGS["GPURING_PORT"].read(env)
    master_port = _int(env, "MASTER_PORT")
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and size is not None and env.get("MASTER_ADDR") and master_port:
        salt = f"torchrun {env['MASTER_ADDR']}:{master_port} {env.get('TORCHELASTIC_RUN_ID', '')}"
        return _checked(Job("torchrun", rank, size, _int(env, "LOCAL_RANK"),
                            env["MASTER_ADDR"], port or master_port + 1, salt))
    rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if rank is not None and size is not None:
        host = env.get("MASTER_ADDR") or first_host(
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
        if not host:
            raise ValueError("Slurm job without MASTER_ADDR or SLURM_JOB_NODELIST: gpuring "
                             "cannot tell where rank 0 serves")
        if not port:
            port = master_port + 1 if master_port else 29500 + (_int(env, "SLURM_JOB_ID")
                                                                or 0) % 10000
        salt = f"slurm {env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
        return _checked(Job("slurm", rank, size, _int(env, "SLURM_LOCALID"), host, port,
                            salt))
    return None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `gpu[07-09,12],cpu1` -> `gpu07`,
    `n-[3-4]-ib` -> `n-3-ib`."""
    match = re.match(r"\s*([^,\[\s]*)(?:\[([^\]]+)\]([^,\s]*))?", nodelist)
    if match is None:
        return ""
    prefix, ranges, suffix = match.group(1), match.group(2), match.group(3) or ""
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges, maxsplit=1)[0] + suffix


def job_key(host: str, port: int, who: str, salt: str = "") -> bytes:
    """The job's key: GPURING_JOB_KEY, else one derived from the port and `salt` (with a
    warning where the server listens beyond loopback: any process that reaches it may
    join)."""
    given = os.environ.get(ENV_KEY)
    if given:
        try:
            return bytes.fromhex(given)
        except ValueError:
            raise ValueError(f"{ENV_KEY} must be a hex string") from None
    if not loopback(host):
        warnings.warn(f"{who}: the control plane on {host}:{port} has no job key: any process "
                      f"that reaches it can join the job; set {ENV_KEY} (the same hex string "
                      "in every process)", RuntimeWarning, stacklevel=3)
    return f"gpuring:{port}:{salt}".encode()


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def serve(size: int, key: bytes, host: str, port: int, timeout: float,
          who: str) -> tuple[str, int]:
    """Serve the control plane of a job of `size` ranks on host:port for this process,
    unless a server it started does already (`start_server`: in a process of its own, which
    serves as long as this process lives and, after it, as long as any rank is connected, so
    this rank may leave first). Returns where it listens (port 0: a free port, which it
    tells)."""
    with _serving_lock:
        running = _serving.get((host, port))
        if running is not None and running.process.poll() is None:
            if running.size != size:
                raise ValueError(f"{who}: this process serves a job of {running.size} ranks "
                                 f"on {host}:{port}, not {size}")
            return running.address
        served = start_server(size, key, host, port, timeout, who)
        _serving[host, port] = served
        return served.address


def start_server(size: int, key: bytes, host: str, port: int, timeout: float,
                 who: str) -> Served:
    """A new control-plane server for a job of `size` ranks on host:port (`server_process`),
    serving until this process ends or `Served.release()` says it left, and then as long as
    any rank is still connected. Waits at most `timeout` s for it to listen."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuring.rendezvous.server_process"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        close_fds=True, env=_server_env())
    assert process.stdin is not None and process.stdout is not None
    # what it logs (a connection refused) goes to this process's stderr while this
    # process lives: holding that stderr itself would keep whoever reads it waiting
    threading.Thread(target=_forward, args=(process.stderr,), daemon=True).start()
    # (stdin stays open: the server sees it end the moment this process ends, or releases it)
    process.stdin.write(json.dumps({"size": size, "host": host, "port": port,
                                    "key": key.hex(), "parent": os.getpid()}) + "\n")
    process.stdin.flush()
    answer = _first_line(process, timeout).split()
    if answer[:1] != ["ready"] or len(answer) != 3:
        process.kill()
        process.wait()
        said = " ".join(answer).removeprefix("error: ") or "its server did not start"
        raise OSError(f"{who}: rank 0 cannot serve the control plane on {host}:{port} "
                      f"({said})")
    return Served(size, process, (answer[1], int(answer[2])))


@dataclass(frozen=True)
class Served:
    """A server process this process started, for a job of `size` ranks."""

    size: int
    process: subprocess.Popen[str]
    #: where it listens
    address: tuple[str, int]

    def release(self) -> None:
        """This process is done with the job: the server takes no new rank and ends once
        the connected ones have gone (it does not wait for them). Idempotent."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.close()
            except OSError:  # (it ended already)
                pass


def _server_env() -> dict[str, str]:
    """The server's environment: this process's, with gpuring importable as it is here."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))))
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=package_root + (os.pathsep + path if path else ""))


def _forward(lines: Any) -> None:
    for line in lines:
        sys.stderr.write(line)
        sys.stderr.flush()


def _first_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The server's first line (bounded by `timeout` s; "" if it ended or said nothing)."""
    found: list[str] = []
    stdout = process.stdout
    assert stdout is not None
    reader = threading.Thread(target=lambda: found.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0].strip() if found else ""


def meet(rank: int, size: int, host: str, port: int, key: bytes, timeout: float,
         who: str) -> StoreClient:
    """Rank 0 serves on host:port (`serve`), every rank connects (retrying until
    `timeout`); then the ranks exchange a job name (rank 0's) and their node names. `who`
    names the caller in errors."""
    if rank == 0:
        serve(size, key, host, port, timeout, who)
    control = StoreClient(rank, size, 0, 1, (host, port), key, "pending", timeout=timeout)
    with contextlib.ExitStack() as undo:
        undo.callback(control.close)  # (if the meeting fails)
        with waiting_line(f"gpuring: rank {rank} is waiting for all {size} ranks to meet at "
                          f"{host}:{port} (up to {timeout:g} s): start the others with the "
                          "same host, port and number of ranks"):
            met = control.exchange("meeting", (secrets.token_hex(8) if rank == 0 else None,
                                               host_name()), timeout)
        undo.pop_all()
    control.job_id = met[0][0]
    control.locate([name for _, name in met])
    return control

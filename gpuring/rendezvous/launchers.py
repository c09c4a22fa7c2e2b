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
process) to the server, which refuses the others. Without a key one is derived from the port:
any process that reaches the server can then join, which is said loudly when the server
listens beyond loopback. After the meeting each rank knows every rank's node name
(`host_name()`), hence its local rank and local size.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from .. import settings
from .base import host_name
from .store import ENV_KEY, StoreServer
from .store_client import StoreClient

__all__ = ["Job", "Meeting", "from_environment", "first_host", "job_key", "meet"]


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


@dataclass
class Meeting:
    """A rank's control plane after the meeting, and on rank 0 the server it serves (to
    stop once every rank left: `store.leave_and_stop`)."""

    control: StoreClient
    server: StoreServer | None


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    return int(value) if value.strip() else None


def from_environment(environ: Mapping[str, str] | None = None) -> Job | None:
    """The job torchrun or Slurm started this process in (None: neither)."""
    env = os.environ if environ is None else environ
    port = settings.SETTINGS["GPURING_PORT"].read(env)
    master_port = _int(env, "MASTER_PORT")
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and size is not None and env.get("MASTER_ADDR") and master_port:
        return Job("torchrun", rank, size, _int(env, "LOCAL_RANK"), env["MASTER_ADDR"],
                   port or master_port + 1)
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
        return Job("slurm", rank, size, _int(env, "SLURM_LOCALID"), host, port)
    return None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `gpu[07-09,12],cpu1` -> `gpu07`."""
    match = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return ""
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges, maxsplit=1)[0]


def job_key(host: str, port: int, who: str) -> bytes:
    """The job's key: GPURING_JOB_KEY, else one derived from the port (with a warning where
    the server listens beyond loopback: any process that reaches it may join)."""
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
    return f"gpuring:{port}".encode()


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def meet(rank: int, size: int, host: str, port: int, key: bytes, timeout: float,
         who: str) -> Meeting:
    """Rank 0 serves on host:port, every rank connects (retrying until `timeout`); then the
    ranks exchange a job name (rank 0's) and their node names. `who` names the caller in
    errors."""
    server = None
    if rank == 0:
        try:
            server = StoreServer(size, key, host, port)
        except OSError as exc:
            raise OSError(f"{who}: rank 0 cannot serve the control plane on {host}:{port} "
                          f"({exc}); choose another port (GPURING_PORT)") from None
    control = None
    try:
        control = StoreClient(rank, size, 0, 1, (host, port), key, "pending", timeout=timeout)
        met = control.exchange("meeting", (secrets.token_hex(8) if rank == 0 else None,
                                           host_name()), timeout)
    except BaseException:
        if control is not None:
            control.close()
        if server is not None:
            server.close()
        raise
    control.job_id = met[0][0]
    control._place([name for _, name in met])
    return Meeting(control, server)

"""Every GPURING_* setting, declared once: its variable, how it is read, its default and what
it means. The rest of gpuring reads settings through `get`; docs/settings.md's table is
`markdown_table()` (a test keeps the two equal).

Not settings in this sense: the variables `gpuring run` hands its ranks (GPURING_RANK,
GPURING_WORLD_SIZE, GPURING_LOCAL_RANK, GPURING_LOCAL_SIZE, GPURING_STORE, GPURING_JOB_KEY,
GPURING_JOB_ID: the launcher's protocol, `gpuring.rendezvous.store`) and those of the
benchmark and device-check tools (`gpuring.bench`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .algorithms.collectives import ALGORITHMS, FORMER_NAMES, algorithm_name

__all__ = ["Setting", "SETTINGS", "get", "parse_size", "markdown_table"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from `8`, `4K`, `64M`, `1G` (binary units; a trailing B or iB is allowed)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be non-negative, got {text}")
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", str(text).upper())
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; write it like 8, 4K, 64M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _graph_piece(text: str) -> int:
    size = parse_size(text)
    if not 4 << 10 <= size <= 4 << 20:
        raise ValueError(f"use a size from 4K to 4M, not {text!r}")
    return size


def _flag(text: str) -> bool:
    return text.strip() not in ("", "0")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"use one of {', '.join(allowed)}")
        return value
    return parse


def _algorithm(text: str) -> str:
    """GPURING_ALGORITHM: one of `ALGORITHMS`, or a former name (`FORMER_NAMES`: "direct"),
    translated with a DeprecationWarning."""
    value = text.strip().lower()
    if value in FORMER_NAMES:
        return algorithm_name(value, f"GPURING_ALGORITHM={value}")
    return _choice(*ALGORITHMS)(value)


@dataclass(frozen=True)
class Setting:
    """One environment variable. `default` is what `get` returns when the variable is unset
    or empty (None: decided elsewhere, e.g. per device); `shown` is that default as the
    settings table writes it."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    shown: str
    meaning: str

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value from the environment, else the default; a value that cannot be
        read is a ValueError naming the variable."""
        text = (os.environ if environ is None else environ).get(self.name, "")
        if text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{self.name}={text!r}: {exc}") from None


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("GPURING_TIMEOUT", float, 300.0, "300",
            "seconds any wait may take before the collective fails"),
    Setting("GPURING_CHUNK_BYTES", parse_size, None, "1M (CPU), 8M (GPU)",
            "piece size of the pipeline (GPU ranks that share one GPU: a whole buffer region, "
            "as pipelining overlaps nothing there)"),
    Setting("GPURING_CHANNELS", int, None, "1 (CPU), 1 (GPU)",
            "parallel rings, each on its own stream"),
    Setting("GPURING_BUFFER_BYTES", parse_size, None, "16M (CPU), 64M (GPU)",
            "size of one buffer region; larger collectives run in rounds"),
    Setting("GPURING_ONE_SHOT_BYTES", parse_size, 64 << 10, "64K",
            "all_reduce up to this size runs one-shot (every rank reduces every rank's data: "
            "one flag hop, the lowest latency)"),
    Setting("GPURING_FUSED_BYTES", parse_size, 64 << 10, "64K",
            "on the GPU, any collective whose input is up to this size (and 4M, 8 ranks) runs "
            "fused: as one operation on the caller's stream instead of in rounds "
            "(`GPURING_CUDA_FUSED` says in which form)"),
    Setting("GPURING_ALGORITHM", _algorithm, "auto", "auto",
            "all_reduce, reduce_scatter and reduce: `ring` (a chain for reduce), `two_shot` "
            "(each rank reduces its segment of every rank's data in rank order, then the "
            "segments are copied; `direct`, its former name, is deprecated), `one_shot` "
            "(all_reduce: every rank reduces everything), `auto` (all_reduce: one-shot up to "
            "`GPURING_ONE_SHOT_BYTES` where that fits a buffer region, else the ring; the "
            "others: the ring; in deterministic mode one-shot for a small all_reduce, else "
            "two-shot); a call's `algorithm=` overrides it"),
    Setting("GPURING_DETERMINISTIC", _flag, False, "0",
            "1: every element of every all_reduce, reduce_scatter and reduce result is the "
            "fold of the ranks' values in rank order (across nodes node-major), the same bits "
            "whatever the size, `chunk_bytes`, `channels` and fusion"),
    Setting("GPURING_TUNING", str, None, "unset",
            "a tuning table from `gpuring tune` (JSON): all_reduce, reduce_scatter and reduce "
            "take the algorithm, `chunk_bytes` and `channels` it chose for their size where "
            "neither the call nor another setting asks for one (every rank must load the same "
            "table; one made for another device or rank count is not used)"),
    Setting("GPURING_STALL_WARNING", float, 60.0, "60",
            "seconds in a collective before missing ranks are logged"),
    Setting("GPURING_VERIFY", _flag, False, "0",
            "1: compare result checksums across ranks after each collective"),
    Setting("GPURING_TRANSPORT", _choice("auto", "mpi", "nccl"), "auto", "auto",
            "`auto`: on one node gpuring's own engines (NCCL for CuPy arrays on GPUs without "
            "peer access); across nodes two levels where every "
            "node runs as many ranks, more than one (in each node shared memory or CUDA IPC, "
            "between nodes MPI for NumPy arrays and NCCL for CuPy arrays), else MPI or NCCL "
            "flat; `mpi`: NumPy collectives flat on MPI always (needs `mpiexec`); `nccl`: CuPy "
            "collectives flat on NCCL always"),
    Setting("GPURING_HOSTNAME", str, None, "the host's name",
            "the node name this rank reports; ranks with the same name are one node (they map "
            "each other's memory): for tests and containers, e.g. two simulated nodes on one "
            "machine (NCCL's NCCL_HOSTID follows it where unset)"),
    Setting("GPURING_PORT", int, None, "MASTER_PORT + 1",
            "under torchrun or Slurm (not `gpuring run` or `mpiexec`): the port rank 0 serves "
            "gpuring's control plane on (Slurm without MASTER_PORT: 29500 + job id % 10000)"),
    Setting("GPURING_MESSAGE_BYTES", parse_size, None, "8M / peers of the node (64K to 4M)",
            "point-to-point messages of NumPy arrays: the ring each rank keeps in its inbox "
            "for each peer of its node (at least 16K); messages up to a quarter of it (1M at "
            "most) go eagerly, larger ones, once received, straight from the sender's memory "
            "where the kernel allows it (process_vm_readv), else in pieces of a quarter of "
            "the ring"),
    Setting("GPURING_MESSAGE_ATTACH", _flag, True, "1",
            "0: a rank never reads a peer's memory with process_vm_readv (cross-memory "
            "attach); messages larger than the eager limit then stream through the inbox"),
    Setting("GPURING_ATTACH_BYTES", parse_size, 0, "0 (off)",
            "where set (e.g. 4M), NumPy all_reduce (above `GPURING_ONE_SHOT_BYTES` too), "
            "reduce_scatter and all_gather of plain arrays on ranks of one node, with inputs "
            "of at least this many bytes, on one channel (ring not asked for): each rank reads "
            "and writes its peers' arrays where they lie with "
            "process_vm_readv/process_vm_writev (cross-memory attach), as over registered "
            "memory (2 x size through memory, the rank-order fold's bits), instead of staging "
            "them through the shared buffers; where the kernel refuses it between any two "
            "ranks (probed when the communicator is made; said once in the log, at INFO "
            "level) they stage. Off by default: a rank whose call fails (an abort, a timeout) "
            "returns while a peer may still be writing into its arrays, which it may free or "
            "reuse then. 4M: below it, on a 2-core VM, the ring staged in cache was faster "
            "(bench/results/cpu-plain-cma-vs-mpi.txt)"),
    Setting("GPURING_FUSION_BYTES", parse_size, 64 << 20, "64M",
            "largest fusion buffer of `all_reduce_many`"),
    Setting("GPURING_TIMELINE", str, None, "unset",
            "a path: record a Chrome trace of every collective from `init()` to `close()` there"),
    Setting("GPURING_TRACE_ENTRIES", int, 0, "0 (256 under `gpuring run`)",
            "the flight recorder: the collectives each communicator keeps on every rank (the "
            "last ones), written on a failure, a timeout, an abort, `comm.dump_trace()` and "
            "SIGUSR1 for `gpuring doctor` and `gpuring run`'s summary (0: off; it costs "
            "each call a few tenths of a microsecond, docs/faults.md)"),
    Setting("GPURING_TRACE_DIR", str, None, "unset",
            "where the flight recorder writes (one file per rank); unset: the directory of "
            "`GPURING_TIMELINE`, else `gpuring-trace-JOB` in the temporary directory "
            "(`gpuring run` sets it to its job's log directory)"),
    Setting("GPURING_CUDA_FLAGS", _choice("auto", "memops", "kernel"), "auto", "auto",
            "GPU flag waits: `memops` (stream memory operations), `kernel` (spin kernel), "
            "`auto` (memops where available, else kernel with a warning)"),
    Setting("GPURING_CUDA_FUSED", _choice("auto", "kernel", "memops", "off"), "auto", "auto",
            "the form of a fused GPU collective (up to `GPURING_FUSED_BYTES`, at most 4M, 8 "
            "ranks: one operation on the caller's stream): `kernel` (one kernel that spins "
            "on its peers' flags, any collective; capturable in CUDA graphs), `memops` "
            "(all_reduce as three stream operations that wait with stream memory operations), "
            "`auto` (memops where ranks share a GPU: processes sharing a GPU without MPS take "
            "turns on it, and a spinning kernel holds its turn; else kernel), `off` (in rounds)"),
    Setting("GPURING_CUDA_GRAPH_PIECE_BYTES", _graph_piece, 1 << 20, "1M",
            "a GPU collective that runs in rounds, captured into a CUDA graph, runs there as "
            "one kernel per piece of this size, or of `GPURING_FUSED_BYTES` where larger "
            "(4K to 4M; each rank's GPU holds two pieces per communicator); where the input "
            "holds a block per rank (reduce_scatter, scatter, all_to_all) the piece is that "
            "divided by the ranks"),
    Setting("GPURING_CUDA_COPY", _choice("memcpy", "kernel"), "memcpy", "memcpy",
            "GPU copies of this rank's own memory: `memcpy` (cudaMemcpyAsync) or `kernel`; "
            "copies from a peer are always a kernel"),
    Setting("GPURING_CUDA_INCLUDE", str, None, "auto-detected",
            "directories (separated by `:`) with `cuda_fp16.h`/`cuda_bf16.h` for runtime "
            "kernel compilation"),
    Setting("GPURING_JITTER", _flag, False, "0",
            "1: random short delays in the host device (tests)"),
)}


def get(name: str) -> Any:
    """The value of setting `name` now (the environment is read at each call)."""
    return SETTINGS[name].read()


def markdown_table() -> str:
    """The settings table of docs/settings.md."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {s.shown} | {s.meaning} |" for s in SETTINGS.values()]
    return "\n".join(rows)

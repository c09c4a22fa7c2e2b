"""Sizes, bandwidth factors and the memory traffic of gpuring's algorithms."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["COLLECTIVES", "MESSAGES", "MEASURED", "ROOTED", "REDUCING", "MESSAGES_PER_CALL",
           "bus_factor", "size_series",
           "align_bytes", "plan_count", "memory_traffic", "rank_traffic", "closed_form_traffic",
           "required_traffic", "copy_repeats", "Memory", "group_memories", "shared_floor", "STEADY"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
#: messages between ranks: every rank sends to the next and receives from the previous
#: (nccl-tests' sendrecv_perf), and a ping-pong between ranks 0 and 1 (OSU's osu_latency:
#: its time is half a round trip)
MESSAGES = ("sendrecv", "pingpong")
#: what `gpuring bench` measures: the collectives, the barrier's latency, messages
MEASURED = (*COLLECTIVES, "barrier", *MESSAGES)
#: messages one timed call of these makes one after the other (its time is per message)
MESSAGES_PER_CALL = {"pingpong": 2}
ROOTED = ("broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
OUT_OF_PLACE = "out-of-place"
IN_PLACE = "in-place"
#: the value an in-place reduction by this op maps to itself on every rank, call after call,
#: which its timed calls work on (min, max and avg keep any input within its range)
STEADY = {"sum": 0, "prod": 1}


def bus_factor(kind: str, n: int) -> float:
    """busbw / algbw as nccl-tests defines it."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if kind in ROOTED or kind in MESSAGES:
        return 1.0
    if kind == "barrier":  # nothing moves
        return 0.0
    raise ValueError(f"unknown collective {kind!r}")


def align_bytes(kind: str, n: int, itemsize: int) -> int:
    """Sizes are multiples of this: whole elements, and one block per rank where needed."""
    return itemsize * (n if kind in ("reduce_scatter", "all_gather") else 1)


def size_series(first: int, last: int, factor: int, align: int,
                step: int | None = None) -> list[int]:
    """Sizes first, first*factor, ... up to last (with `step`: first, first+step, ...), each
    rounded down to a multiple of `align` (at least `align`), without repeats."""
    if first < 1 or last < first:
        raise ValueError(f"need 1 <= min size <= max size, got {first} and {last}")
    if step is None and factor < 2:
        raise ValueError(f"the factor must be at least 2, got {factor}")
    if step is not None and step < 1:
        raise ValueError(f"the step must be at least 1 byte, got {step}")
    sizes: list[int] = []
    size = first
    while size <= last:
        rounded = max(align, size - size % align)
        if not sizes or rounded != sizes[-1]:
            sizes.append(rounded)
        size = size + step if step is not None else size * factor
    return sizes


def plan_count(kind: str, n: int, size: int, itemsize: int) -> int:
    """The `count` gpuring's planner takes: all_gather plans one rank's block."""
    count = size // itemsize
    return count // n if kind == "all_gather" else count


def _plan_traffic(kind: str, n: int, rank: int, count: int, itemsize: int, root: int,
                  buffer_bytes: int, one_shot_bytes: int, avg: bool, registered: bool) -> int:
    from ..algorithms.collectives import plan_collective
    from ..algorithms.plan import Copy, Reduce, ReduceN

    rounds = plan_collective(kind, n, rank, count, itemsize=itemsize,
                             capacity_bytes=buffer_bytes, chunk_bytes=buffer_bytes, channels=1,
                             root=root, one_shot_bytes=one_shot_bytes,
                             in_place=kind == "broadcast", peer_in=registered,
                             peer_out=registered)
    moved = 0
    for round_plan in rounds:
        for channel in round_plan.channels:
            for op in channel:
                if isinstance(op, Copy):
                    moved += 2 * op.length
                elif isinstance(op, Reduce):
                    moved += (5 if avg and op.last else 3) * op.length
                elif isinstance(op, ReduceN):  # each source read once, dst written once
                    moved += (len(op.srcs) + (3 if avg and op.last else 1)) * op.length
    return moved * itemsize


def closed_form_traffic(kind: str, n: int, size: int, *, one_shot: bool = False) -> float:
    """Bytes through memory on the busiest rank, from the formulas in the package docstring
    (avg's division not included)."""
    if n < 2:
        return 0.0
    if kind == "all_reduce":
        return (n + 3) * size if one_shot else (7 * n - 5) / n * size
    if kind == "reduce_scatter":
        return (3 * n - 1) / n * size
    if kind == "all_gather":
        return (4 * n - 2) / n * size
    if kind == "broadcast":
        return (2 if n == 2 else 4) * size
    if kind == "reduce":
        return 3.0 * size
    if kind == "sendrecv":  # into the receiver's inbox and out of it: two copies each way
        return 4.0 * size
    if kind == "pingpong":  # one message: copied in by the sender, out by the receiver
        return 2.0 * size
    raise ValueError(f"unknown collective {kind!r}")


def rank_traffic(kind: str, n: int, size: int, itemsize: int, *, root: int = 0,
                 buffer_bytes: int = 16 << 20, one_shot_bytes: int = 64 << 10,
                 avg: bool = False, ranks: Iterable[int] | None = None,
                 registered: bool = False) -> list[float]:
    """Bytes each of `ranks` (default: every rank) reads and writes in one collective (out of
    place; a broadcast in place), counted from the plan (every rank gets the busiest rank's
    `closed_form_traffic` when the plan cannot be read). `registered`: on registered arrays
    (`Communicator.empty`), which the peers read in place, nothing staged."""
    which = list(range(n) if ranks is None else ranks)
    if n < 2:
        return [0.0] * len(which)
    count = plan_count(kind, n, size, itemsize)
    try:
        return [float(_plan_traffic(kind, n, r, count, itemsize, root, buffer_bytes,
                                    one_shot_bytes, avg, registered)) for r in which]
    except (ImportError, AttributeError, TypeError, ValueError):
        one_shot = kind == "all_reduce" and size <= one_shot_bytes
        return [closed_form_traffic(kind, n, size, one_shot=one_shot)] * len(which)


def memory_traffic(kind: str, n: int, size: int, itemsize: int, *, root: int = 0,
                   buffer_bytes: int = 16 << 20, one_shot_bytes: int = 64 << 10,
                   avg: bool = False, ranks: Iterable[int] | None = None,
                   registered: bool = False) -> float:
    """Bytes the busiest rank reads and writes in one collective (see `rank_traffic`)."""
    if n < 2:
        return 0.0
    return max(rank_traffic(kind, n, size, itemsize, root=root, buffer_bytes=buffer_bytes,
                            one_shot_bytes=one_shot_bytes, avg=avg, ranks=ranks,
                            registered=registered))


def required_traffic(kind: str, n: int, size: int, *, root: int = 0) -> list[float]:
    """Bytes each rank's share of the collective must move through memory at the least,
    whatever the algorithm: every input byte read once, every output byte written once (S =
    the size column). all_reduce 2S per rank (its input, its output); reduce_scatter and
    all_gather (n+1)/n x S (the whole array on one side, one block on the other); broadcast S
    per rank (the root's data read once, every other rank's copy written once); reduce S per
    rank and 2S on the root (every input read once, the root's output written once)."""
    if n < 2:
        return [0.0] * max(n, 1)
    if kind == "all_reduce":
        return [2.0 * size] * n
    if kind in ("reduce_scatter", "all_gather"):
        return [(n + 1) / n * size] * n
    if kind == "broadcast":
        return [float(size)] * n
    if kind == "reduce":
        return [2.0 * size if r == root else float(size) for r in range(n)]
    if kind == "barrier":
        return [0.0] * n
    if kind == "sendrecv":  # its input read, its output written
        return [2.0 * size] * n
    if kind == "pingpong":  # one message: read on one rank, written on the other
        return [float(size) if r < 2 else 0.0 for r in range(n)]
    raise ValueError(f"unknown collective {kind!r}")


def copy_repeats(nbytes: int) -> int:
    """How many copies of `nbytes` in a row time a bandwidth at that size: about 64 MiB in
    all, at least 5 and at most 2000."""
    return max(5, min(2000, (64 << 20) // max(nbytes, 1)))


@dataclass
class Memory:
    """A memory that ranks' arrays live in, the ranks that share it, and its bandwidth (GB/s)
    measured while all of them copied at once."""

    name: str
    ranks: list[int]
    GBps: float


def group_memories(keys: Sequence[tuple[int, int]], moved: Sequence[float],
                   seconds: Sequence[float], device: str) -> list[Memory]:
    """The memories of the job from what every rank measured: rank r's arrays live in memory
    `keys[r]` = (node, index on the node: 0 for host memory, the GPU for CUDA), and it copied
    `moved[r]` bytes in `seconds[r]`, all ranks at once. A memory's bandwidth is the bytes all
    its ranks copied / the longest of their times (ranks time-sliced on one GPU take turns:
    the last one finishes when the memory has moved everybody's bytes)."""
    nodes = list(dict.fromkeys(node for node, _ in keys))
    groups: dict[tuple[int, int], list[int]] = {}
    for r, key in enumerate(keys):
        groups.setdefault(key, []).append(r)
    memories = []
    for (node, index), ranks in groups.items():
        name = "host memory" if device == "cpu" else f"GPU {index}"
        if len(nodes) > 1:
            name += f" of node {nodes.index(node)}"
        longest = max(seconds[r] for r in ranks)
        total = sum(moved[r] for r in ranks)
        memories.append(Memory(name, ranks, total / longest / 1e9 if longest > 0 else 0.0))
    return memories


def shared_floor(traffic: Sequence[float], memories: Sequence[Memory]) -> tuple[float, Memory]:
    """The floor in seconds: every memory must move the bytes of all the ranks that share it
    (`traffic[r]`: rank r's bytes), so the floor is the largest of (their sum / the memory's
    bandwidth); returned with the memory that sets it (the first of equals)."""
    def seconds(m: Memory) -> float:
        return sum(traffic[r] for r in m.ranks) / (m.GBps * 1e9)

    memory = max(memories, key=seconds)
    return seconds(memory), memory

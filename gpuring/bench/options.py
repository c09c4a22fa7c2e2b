"""What one `gpuring bench` run is asked to do: the `Settings` every part of the bench reads
(the runner, the measurements, the preflight), in a module of its own that imports nothing of
the bench, so that those parts need not import each other for it."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Settings"]


@dataclass
class Settings:
    """Everything one `gpuring bench` run needs (sizes in bytes)."""

    collective: str = "all_reduce"
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    factor: int = 2
    step_bytes: int | None = None  # -i: sizes grow by this many bytes instead of by -f
    iters: int = 20
    warmup: int = 5
    average: int = 1  # nccl-tests' -a: 0 rank 0, 1 average, 2 minimum, 3 maximum
    per_iteration: bool = False
    repeats: int = 1  # -N: the whole sweep this many times
    blocking: bool = False  # -z 1: wait for every call to complete
    graph_launches: int = 0  # -G: launches of a CUDA graph of `iters` calls (0: no graphs)
    check_iters: int = 1
    ops: list[str] = field(default_factory=lambda: ["sum"])
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    roots: list[int] = field(default_factory=lambda: [0])
    device: str = "cpu"
    peers: list[str] = field(default_factory=list)
    chunk_bytes: int | None = None
    channels: int | None = None
    off_cache: bool = False
    registered: bool = False  # -R 1: every array in registered memory (comm.empty)
    overlap: bool = False
    persistent: bool = False  # -P: gpuring's persistent form too, as the system "persist"
    json: str | None = None
    csv: str | None = None
    plot: str | None = None
    membw_bytes: int = 128 << 20

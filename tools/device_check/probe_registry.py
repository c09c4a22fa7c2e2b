"""The probe's parts and peers by name, for `python -m tools.device_check.probe --part NAME`
and its peers' processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .probe_faults import part_abort_release, part_dead_exporter, peer_exporter
from .probe_gpu import Channel
from .probe_parts import (
    Part,
    part_copy_bandwidth,
    part_host_cost,
    part_ipc,
    part_kernels,
    part_memops,
    part_pingpong,
    part_versions,
    peer_ipc,
    peer_pingpong,
)

__all__ = ["PARTS", "PEERS"]

PARTS: dict[str, Part] = {
    "versions": part_versions,
    "ipc": part_ipc,
    "memops": part_memops,
    "kernels": part_kernels,
    "copy_bandwidth": part_copy_bandwidth,
    "host_cost": part_host_cost,
    "pingpong_memops": lambda rec, s, budget: part_pingpong(rec, s, budget, "memops"),
    "pingpong_kernel": lambda rec, s, budget: part_pingpong(rec, s, budget, "kernel"),
    "pingpong_gpuring": lambda rec, s, budget: part_pingpong(rec, s, budget, "gpuring"),
    "dead_exporter": part_dead_exporter,
    "abort_release": part_abort_release,
    "abort_release_1conn": part_abort_release,
}

PEERS: dict[str, Callable[[Channel, dict[str, Any]], None]] = {
    "ipc": peer_ipc,
    "pingpong": peer_pingpong,
    "exporter": peer_exporter,
}

"""The GPUs of this node and how they connect, read through NVML (nvidia-ml-py): NVLink
between each pair, else the closest PCIe ancestor they share (as `nvidia-smi topo -m` and
NCCL name it: PIX, PXB, PHB, NODE, SYS), whether peer-to-peer access works, and each GPU's
NUMA node. None where NVML is unavailable (no driver, no GPU, no nvidia-ml-py). And the order
in which a ring should visit the ranks' GPUs (`Topology.ring`, `ring_order`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Gpu", "Topology", "read", "ring_order"]

#: NVML's nvmlGpuTopologyLevel_t, by the name nvidia-smi gives it
_LEVELS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
#: how close a PCIe level is, for ordering a ring (any NVLink is closer)
_PCIE = {"PIX": 5, "PXB": 4, "PHB": 3, "NODE": 2, "SYS": 1}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bus_id: str
    numa_node: int | None


@dataclass(frozen=True)
class Topology:
    """`link[i][j]`: how GPU i reaches GPU j ("X" itself, "NV<n>" over n NVLinks, else
    the PCIe level); `p2p[i][j]`: whether GPU i can read GPU j's memory directly."""

    gpus: tuple[Gpu, ...]
    link: tuple[tuple[str, ...], ...]
    p2p: tuple[tuple[bool, ...], ...]

    def lines(self) -> list[str]:
        """The matrix as `nvidia-smi topo -m` prints it, with P2P and NUMA columns."""
        n = len(self.gpus)
        out = ["      " + " ".join(f"{f'GPU{j}':>6}" for j in range(n)) + "   P2P  NUMA"]
        for i, gpu in enumerate(self.gpus):
            p2p = "".join("x" if i == j else "y" if self.p2p[i][j] else "n" for j in range(n))
            numa = "-" if gpu.numa_node is None else str(gpu.numa_node)
            out.append(f"{f'GPU{i}':<6}" + " ".join(f"{self.link[i][j]:>6}" for j in range(n))
                       + f"   {p2p:<4} {numa}")
        return out

    def ring(self, bus_ids: Sequence[str]) -> tuple[int, ...]:
        """The order in which a ring should visit ranks whose GPUs are at `bus_ids` (in rank
        order): the order whose weakest link is strongest, then whose links are strongest in
        all (two ranks on one GPU best, then more NVLinks, then the closer PCIe level), rank
        order where it is as good; () for rank order, or where a GPU is not found. Every
        order of up to 8 ranks is weighed; beyond, each next rank is the best linked one."""
        index = [next((i for i, g in enumerate(self.gpus) if _same_bus(g.bus_id, b)), None)
                 for b in bus_ids]
        if any(i is None for i in index) or len(index) < 3:
            return ()  # (two ranks: one ring whatever the order)
        gpu = [int(i) for i in index if i is not None]
        n = len(gpu)

        def link_weight(a: int, b: int) -> int:
            if gpu[a] == gpu[b]:
                return 10_000
            link = self.link[gpu[a]][gpu[b]]
            return 100 + int(link[2:]) if link.startswith("NV") else _PCIE.get(link, 0)

        weights = [[link_weight(a, b) for b in range(n)] for a in range(n)]

        def weight(a: int, b: int) -> int:
            return weights[a][b]

        def score(order: Sequence[int]) -> tuple[int, int]:
            ring = [weights[order[k - 1]][order[k]] for k in range(n)]
            return min(ring), sum(ring)

        best, best_score = tuple(range(n)), score(range(n))
        if n <= 8:  # (rank 0 first, and each ring in one direction: the second rank lower
            #         than the last)
            candidates: Iterable[tuple[int, ...]] = (
                (0, *rest) for rest in itertools.permutations(range(1, n)) if rest[0] < rest[-1])
        else:
            path = [0]
            while len(path) < n:
                left = [r for r in range(n) if r not in path]
                path.append(max(left, key=lambda r: (weight(path[-1], r), -r)))
            candidates = (tuple(path),)
        for order in candidates:
            found = score(order)
            if found > best_score:
                best, best_score = order, found
        return () if best == tuple(range(n)) else best

    def summary(self) -> str:
        """One line: each pair's link, e.g. `GPU0-GPU1 NV18, GPU0-GPU2 SYS (no P2P)`."""
        pairs = []
        for i in range(len(self.gpus)):
            for j in range(i + 1, len(self.gpus)):
                pairs.append(f"GPU{i}-GPU{j} {self.link[i][j]}"
                             + ("" if self.p2p[i][j] else " (no P2P)"))
        return ", ".join(pairs) if pairs else "one GPU"


def _nvlinks(nvml: Any, handle: Any, bus_ids: Sequence[str]) -> dict[int, int]:
    """GPU index -> active NVLinks from this GPU to it."""
    found: dict[int, int] = {}
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except Exception:  # NVMLError: no such link, or not supported
            continue
        for j, bus in enumerate(bus_ids):
            if _same_bus(bus, remote):
                found[j] = found.get(j, 0) + 1
    return found


def _same_bus(a: str, b: str) -> bool:
    """PCI bus ids compared without the domain's width (00000000:18:00.0 == 0000:18:00.0)."""
    def key(text: str) -> tuple[int, str]:
        domain, _, rest = text.lower().partition(":")
        return (int(domain, 16), rest) if rest.count(":") == 1 else (0, text.lower())
    return key(a) == key(b)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read(nvml: Any = None) -> Topology | None:
    """This node's topology through NVML (`nvml`: the pynvml module, for tests); None where
    NVML cannot tell."""
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return None
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        bus_ids = [_text(nvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        gpus = []
        for i, h in enumerate(handles):
            try:
                numa: int | None = int(nvml.nvmlDeviceGetNumaNodeId(h))
            except Exception:  # older drivers and nvidia-ml-py
                numa = None
            gpus.append(Gpu(i, _text(nvml.nvmlDeviceGetName(h)), bus_ids[i], numa))
        links, p2p = [], []
        for i, h in enumerate(handles):
            nv = _nvlinks(nvml, h, bus_ids)
            row, can = [], []
            for j, other in enumerate(handles):
                if i == j:
                    row.append("X")
                    can.append(True)
                    continue
                if nv.get(j):
                    row.append(f"NV{nv[j]}")
                else:
                    try:
                        level = nvml.nvmlDeviceGetTopologyCommonAncestor(h, other)
                        row.append(_LEVELS.get(int(level), str(level)))
                    except Exception:
                        row.append("?")
                try:
                    status = nvml.nvmlDeviceGetP2PStatus(h, other,
                                                         nvml.NVML_P2P_CAPS_INDEX_READ)
                    can.append(status == nvml.NVML_P2P_STATUS_OK)
                except Exception:
                    can.append(False)
            links.append(tuple(row))
            p2p.append(tuple(can))
        return Topology(tuple(gpus), tuple(links), tuple(p2p))
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def ring_order(bus_ids: list[str]) -> tuple[int, ...]:
    """The ranks (on the GPUs at `bus_ids`, of this host) in the order the ring visits
    them, along NVLink where NVML tells: the same on every rank, which reads the same host's
    topology; () for rank order (one GPU, or no NVML)."""
    if len(set(bus_ids)) < 2:
        return ()
    topology = read()
    return () if topology is None else topology.ring(bus_ids)

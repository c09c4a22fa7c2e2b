"""The node's GPU topology as NVML reports it (a stand-in for nvidia-ml-py here)."""

from __future__ import annotations

import types

from gpuring.devices._topology import read


def fake_nvml(buses: list[str], nvlinks: dict[tuple[int, int], int], levels: dict,
              no_p2p: set[tuple[int, int]]) -> types.SimpleNamespace:
    """pynvml's calls `read` makes, for GPUs on PCI `buses` with `nvlinks[i, j]` links from i
    to j, PCIe `levels[i, j]` (NVML's values) and pairs without P2P."""
    def links(i: int) -> list[int]:
        return [j for (a, j), n in sorted(nvlinks.items()) if a == i for _ in range(n)]

    def state(h: int, link: int) -> int:
        if link >= len(links(h)):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1

    return types.SimpleNamespace(
        NVML_NVLINK_MAX_LINKS=18, NVML_FEATURE_ENABLED=1, NVML_P2P_CAPS_INDEX_READ=0,
        NVML_P2P_STATUS_OK=0, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(buses), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=buses[h].encode()),
        nvmlDeviceGetName=lambda h: b"NVIDIA H200", nvmlDeviceGetNumaNodeId=lambda h: h // 2,
        nvmlDeviceGetNvLinkState=state,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, link: types.SimpleNamespace(
            busId=buses[links(h)[link]].replace("0000", "00000000", 1)),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: levels[min(a, b), max(a, b)],
        nvmlDeviceGetP2PStatus=lambda a, b, caps: 1 if (min(a, b), max(a, b)) in no_p2p
        else 0)


def test_nvlink_pcie_and_p2p() -> None:
    buses = ["0000:18:00.0", "0000:2a:00.0", "0000:9a:00.0"]
    nvml = fake_nvml(buses, {(0, 1): 4, (1, 0): 4}, {(0, 1): 20, (0, 2): 50, (1, 2): 50},
                     {(0, 2)})
    topology = read(nvml)
    assert topology is not None
    assert topology.link[0] == ("X", "NV4", "SYS") and topology.link[1][2] == "SYS"
    assert topology.p2p[0][2] is False and topology.p2p[0][1] is True
    assert [g.numa_node for g in topology.gpus] == [0, 0, 1]
    assert topology.summary() == ("GPU0-GPU1 NV4, GPU0-GPU2 SYS (no P2P), GPU1-GPU2 SYS")
    assert topology.lines()[1].startswith("GPU0") and "xyn" in topology.lines()[1]


def test_no_nvml_no_topology() -> None:
    def fail() -> None:
        raise RuntimeError("NVML_ERROR_LIBRARY_NOT_FOUND")

    assert read(types.SimpleNamespace(nvmlInit=fail)) is None

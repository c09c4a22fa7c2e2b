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


def _made(buses: list[str], nvlinks: dict[tuple[int, int], int], levels: dict):
    both = {**nvlinks, **{(j, i): n for (i, j), n in nvlinks.items()}}
    topology = read(fake_nvml(buses, both, levels, set()))
    assert topology is not None
    return topology


BUSES = ["0000:18:00.0", "0000:2a:00.0", "0000:9a:00.0", "0000:ab:00.0"]


def test_the_ring_follows_nvlink() -> None:
    """GPUs linked 0-2-1-3-0 by NVLink and 0-1, 2-3 only through the CPUs: rank order
    would cross the CPUs twice; the ring goes along the links instead."""
    sys_ = {(i, j): 50 for i in range(4) for j in range(i + 1, 4)}
    topology = _made(BUSES, {(0, 2): 4, (2, 1): 4, (1, 3): 4, (3, 0): 4}, sys_)
    assert topology.ring(BUSES) == (0, 2, 1, 3)
    assert topology.ring([BUSES[i] for i in (0, 2, 1, 3)]) == ()  # rank order is that ring
    # all linked alike (an NVSwitch): rank order
    switch = _made(BUSES, {(i, j): 18 for i in range(4) for j in range(i + 1, 4)}, sys_)
    assert switch.ring(BUSES) == ()
    # two ranks per GPU: each rank next to its GPU's other rank
    two = _made(BUSES[:2], {}, {(0, 1): 50})
    assert two.ring([BUSES[0], BUSES[1], BUSES[0], BUSES[1]]) == (0, 1, 3, 2)
    # a GPU NVML does not list, and two ranks: rank order
    assert topology.ring([*BUSES[:3], "0000:ff:00.0"]) == () and topology.ring(BUSES[:2]) == ()


def test_a_long_ring_is_built_link_by_link() -> None:
    """More than 8 ranks: each next rank the best linked one (NVLink pairs 2k, 2k+1 of
    GPUs crossing PCIe otherwise): still every rank once, along every NVLink."""
    buses = [f"0000:{16 * (i + 1):02x}:00.0" for i in range(10)]
    levels = {(i, j): 20 for i in range(10) for j in range(i + 1, 10)}
    links = {(k, (k + 5) % 10): 2 for k in range(10)}
    topology = _made(buses, links, levels)
    ring = topology.ring(buses)
    assert sorted(ring) == list(range(10)) and ring[0] == 0
    assert all(topology.link[ring[k]][ring[k + 1]].startswith("NV") or k % 2
               for k in range(9)), ring


def test_the_cuda_device_orders_its_ring_by_the_topology(monkeypatch) -> None:
    from gpuring.devices import _topology

    sys_ = {(i, j): 50 for i in range(4) for j in range(i + 1, 4)}
    topology = _made(BUSES, {(0, 2): 4, (2, 1): 4, (1, 3): 4, (3, 0): 4}, sys_)
    monkeypatch.setattr(_topology, "read", lambda: topology)
    assert _topology.ring_order(BUSES) == (0, 2, 1, 3)
    assert _topology.ring_order([BUSES[0]] * 4) == ()  # one GPU: nothing to order
    monkeypatch.setattr(_topology, "read", lambda: None)
    assert _topology.ring_order(BUSES) == ()

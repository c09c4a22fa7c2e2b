"""Nobody else gets in: the control plane wants the job key, shared memory is owner-only."""

from __future__ import annotations

import logging
import os
import stat
import time
from multiprocessing.connection import Client

import pytest

from gpuring.devices.host import HostDevice
from gpuring.rendezvous.store import Hello, StoreServer
from gpuring.rendezvous.store_client import StoreClient


def test_connection_without_the_key_is_refused_and_logged(caplog):
    server = StoreServer(1, b"k" * 32)
    try:
        with caplog.at_level(logging.WARNING, logger="gpuring.rendezvous"):
            with pytest.raises(Exception):  # noqa: B017 - refused in the handshake, any way
                conn = Client(server.address, family="AF_INET", authkey=b"wrong key")
                conn.send(Hello(0, 1))
                conn.recv()
            deadline = time.monotonic() + 10
            while server.refused == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert server.refused == 1
        assert any("refused" in r.getMessage() for r in caplog.records)
    finally:
        server.close()


def test_the_right_key_is_admitted():
    key = os.urandom(32)
    server = StoreServer(1, key)
    try:
        client = StoreClient(0, 1, 0, 1, server.address, key, "job")
        assert client.allgather("hi", timeout=10) == ["hi"]
        client.close()
        assert server.refused == 0
    finally:
        server.close()


def test_listens_on_loopback_by_default():
    server = StoreServer(1, b"k" * 32)
    try:
        assert server.address[0] == "127.0.0.1"
    finally:
        server.close()


def test_shared_memory_is_owner_only_and_unguessable():
    a, b = HostDevice(), HostDevice()
    try:
        m1, m2 = a.alloc(4096), b.alloc(4096)
        for mem in (m1, m2):
            mode = stat.S_IMODE(os.stat(mem.path).st_mode)
            assert mode == 0o600, oct(mode)
        names = {os.path.basename(m1.path), os.path.basename(m2.path)}
        assert len(names) == 2
        assert all(len(name) >= len("gpuring-") + 32 for name in names)
        path = m1.path
        a.seal(m1)  # after every peer mapped it, the name is gone
        assert not os.path.exists(path)
    finally:
        a.close()
        b.close()


def test_the_control_plane_decodes_data_only() -> None:
    """A process that reaches the control plane (with the job's key, or with the key derived
    from the port when none is set) cannot make a rank call anything: the control plane's
    messages are decoded into plain data, NumPy arrays and gpuring's named tuples only."""
    import os
    import pickle
    from multiprocessing import Pipe

    import numpy as np

    from gpuring._call import Signature
    from gpuring._ops import ReduceOp
    from gpuring.rendezvous.store import Post, receive

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo ran",))

    ours, theirs = Pipe()
    theirs.send(Evil())
    with pytest.raises(pickle.UnpicklingError, match="plain data only"):
        receive(ours)
    fine = Post(3, ("a collective", Signature("all_reduce", "cpu", (4,), "float32", "sum", 0)),
                "g", (0, 1))
    theirs.send(fine)
    assert receive(ours) == fine
    theirs.send({"x": np.arange(3), "op": ReduceOp.SUM, "z": 1 + 2j, "s": frozenset({1})})
    got = receive(ours)
    assert got["x"].tolist() == [0, 1, 2] and got["op"] is ReduceOp.SUM and got["z"] == 1 + 2j

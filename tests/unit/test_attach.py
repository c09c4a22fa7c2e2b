"""Cross-memory attach on its own: `_cma`'s reads and writes and its probe, and the host
device's steps over a peer's array that only it reaches (`HostDevice.attach`), here a
"peer" that is this very process (process_vm_readv/writev of one's own pid is allowed)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from gpuring import PeerFailureError, _cma
from gpuring._ops import ReduceOp
from gpuring.devices.base import Arg, CopyI, ReduceNI, Span
from gpuring.devices.host import HostDevice


@pytest.fixture
def device():
    d = HostDevice(timeout=5.0)
    yield d
    d.close()


def _gone_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_write_then_read_moves_the_bytes_and_the_probe_allows_both() -> None:
    rng = np.random.default_rng(1)
    there = rng.standard_normal(100_003)
    data = rng.standard_normal(100_003)
    _cma.write(os.getpid(), int(there.ctypes.data), data, data.nbytes)
    assert there.tobytes() == data.tobytes()
    got = np.empty_like(there)
    _cma.read(os.getpid(), int(there.ctypes.data) + 8, got, there.nbytes - 8)
    assert got[:-1].tobytes() == there[1:].tobytes()
    mine = _cma.probe()
    assert _cma.refusal(mine, writes=True) is None
    assert bytes(_cma.probe().token) == mine.token  # written back as it was


def test_the_probe_of_a_process_that_is_gone_is_refused() -> None:
    why = _cma.refusal(_cma.probe()._replace(pid=_gone_pid()), writes=True)
    assert why is not None and "process_vm_readv refused" in why


def test_capabilities_tell_whether_every_peer_may_be_reached(device) -> None:
    mine = device.export(device.alloc(4096))
    found = device.capabilities([mine, mine])
    assert found.attach and found.attach_refused is None
    gone = (_gone_pid(), *mine[1:3], (_gone_pid(), *mine[3][1:]))
    found = device.capabilities([mine, gone])
    assert found.attach and "refused" in (found.attach_refused or "")


def _peer(device, array: np.ndarray, nbytes: int, pid: int | None = None) -> Span:
    """A span of `array` as a peer's array that only cross-memory attach reaches: its
    address published in a word of a buffer, as the peer would at each call."""
    inbox = device.alloc(4096)
    inbox.i64[3] = int(array.ctypes.data)
    handle = (os.getpid() if pid is None else pid, inbox.path, inbox.nbytes, None)
    return Span(device.attach(1, handle, inbox, 24, nbytes), 0, nbytes)


@pytest.mark.parametrize("inline", [True, False])
def test_steps_read_and_write_a_peer_array_and_fold_it_in_order(device, inline) -> None:
    """Both interpreters of a program (the inline stream's bound steps, the generic one):
    a copy from a peer's array, a copy into one, and a fold whose sources are a peer's
    pieces (read into scratch) and this rank's input: the bits of the binary chain."""
    rng = np.random.default_rng(7)
    n = 70_001
    nbytes = 4 * n
    theirs = rng.standard_normal(n).astype(np.float32)
    others = rng.standard_normal(n).astype(np.float32)
    mine = rng.standard_normal(n).astype(np.float32)
    a, b = _peer(device, theirs, nbytes), _peer(device, others, nbytes)
    stream = device.create_stream(inline=inline)
    out = np.zeros(n, np.float32)
    program = (ReduceNI(Arg(1, 0, nbytes), (a, Arg(0, 0, nbytes), b), 1),)
    device.compile(program, "float32", ReduceOp.SUM, stream)(
        device.wrap(mine), device.wrap(out), 1)
    stream.synchronize()
    assert out.tobytes() == ((theirs + mine) + others).tobytes()
    got = np.zeros(n, np.float32)
    program = (CopyI(Arg(1, 0, nbytes), a), CopyI(b, Arg(0, 0, nbytes)))
    device.compile(program, "float32", ReduceOp.SUM, stream)(
        device.wrap(mine), device.wrap(got), 2)
    stream.synchronize()
    assert got.tobytes() == theirs.tobytes() and others.tobytes() == mine.tobytes()


def test_a_peer_that_is_gone_is_a_peer_failure(device) -> None:
    array = np.ones(1000, np.float64)
    gone = _peer(device, array, array.nbytes, pid=_gone_pid())
    stream = device.create_stream(inline=True)
    program = (CopyI(Arg(1, 0, array.nbytes), gone),)
    run = device.compile(program, "float64", ReduceOp.SUM, stream)
    with pytest.raises(PeerFailureError, match=r"rank 1 \(pid \d+\) is gone: its array "
                                               "could not be read directly") as caught:
        run(device.wrap(array), device.wrap(np.zeros(1000)), 1)
    assert caught.value.peer == 1

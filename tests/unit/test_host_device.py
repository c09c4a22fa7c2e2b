"""HostDevice on its own: memory, ordered streams, flags, timeouts, abort, averaging."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from gpuring._ops import ReduceOp
from gpuring.devices._host_streams import average_into
from gpuring.devices.base import Arg, Flag, FlagWaitAborted, FlagWaitTimeout, ReduceNI, Span
from gpuring.devices.host import HostDevice


@pytest.fixture
def device():
    d = HostDevice(timeout=5.0, jitter=True)
    yield d
    d.close()


def span(mem, offset, nbytes):
    return Span(mem, offset, nbytes)


class Words:
    """Stands in for a mapping's 64-bit words (`HostMemory.i64`) and tells the test what the
    streams do with them: how often a stream read word `watched` (a flag it waits on: a second
    read means it is inside the wait and still waiting), and every write."""

    def __init__(self, mem, watched: int):
        self._words = mem.i64
        self._watched = watched
        self.reads = 0
        self._news = threading.Condition()
        mem.i64 = self

    def __getitem__(self, index: int) -> int:
        value = self._words[index]
        if index == self._watched:
            with self._news:
                self.reads += 1
                self._news.notify_all()
        return value

    def __setitem__(self, index: int, value: int) -> None:
        self._words[index] = value
        self.notify()

    def notify(self) -> None:
        """Have `wait_until` check its condition again (something else changed)."""
        with self._news:
            self._news.notify_all()

    def __getattr__(self, name: str):  # release() at close
        return getattr(self._words, name)

    def wait_until(self, condition, what: str) -> None:
        """Until `condition()` holds, re-checked at every read of the watched word and every
        write. Bounded only so that a broken device fails instead of hanging."""
        with self._news:
            assert self._news.wait_for(condition, timeout=60), what


def test_peer_mapping_sees_the_same_bytes(device):
    mem = device.alloc(4096)
    other = HostDevice()
    try:
        peer = other.open(device.export(mem))
        mem.u8[:4] = [1, 2, 3, 4]
        assert list(peer.u8[:4]) == [1, 2, 3, 4]
        assert device.open(device.export(mem)) is mem  # our own handle: no second mapping
    finally:
        other.close()


@pytest.mark.parametrize("inline", [False, True])
def test_stream_runs_in_order(device, inline):
    mem = device.alloc(1 << 16)
    a = np.arange(100, dtype=np.float32)
    src = device.wrap(a)
    stream = device.create_stream(inline=inline)
    stream.copy(span(mem, 4096, 400), span(src, 0, 400))
    stream.reduce(span(mem, 8192, 400), span(mem, 4096, 400), span(src, 0, 400), "float32",
                  ReduceOp.SUM)
    stream.write_flag(Flag(mem, 0), 7)
    stream.synchronize()
    assert np.array_equal(mem.view(8192, 400, "float32"), 2 * a)
    assert mem.i64[0] == 7


def test_wait_holds_later_operations(device):
    mem = device.alloc(8192)
    words = Words(mem, 0)
    stream = device.create_stream()
    stream.wait_flag(Flag(mem, 0), 5, "test")
    stream.write_flag(Flag(mem, 8), 1)
    # the flag stays 0 until the stream is seen inside its wait (or the write ran)
    words.wait_until(lambda: words.reads >= 2 or words[1] != 0, "the stream never waited")
    assert words[1] == 0, "the write ran before the flag it waits for"
    words[0] = 5
    stream.synchronize()
    assert words[1] == 1


def test_wait_times_out_with_what_it_waited_for():
    device = HostDevice(timeout=0.2)
    try:
        mem = device.alloc(4096)
        stream = device.create_stream()
        stream.wait_flag(Flag(mem, 0), 3, ("peer", 1))
        with pytest.raises(FlagWaitTimeout) as info:
            stream.synchronize()
        assert info.value.value == 3 and info.value.observed == 0 and info.value.tag == ("peer", 1)
    finally:
        device.close()


def test_abort_unblocks_a_waiting_stream(device):
    mem = device.alloc(4096)
    words = Words(mem, 0)
    stream = device.create_stream()
    stream.wait_flag(Flag(mem, 0), 1, "never")
    stream.write_flag(Flag(mem, 8), 1)
    words.wait_until(lambda: words.reads >= 2 or words[1] != 0, "the stream never waited")
    device.abort("stop")  # while the stream is inside its wait, not before it got there
    with pytest.raises(FlagWaitAborted, match="stop"):
        stream.synchronize()
    assert words[1] == 0, "an operation after the aborted wait ran"


def test_events_order_two_streams(device):
    mem = device.alloc(4096)
    words = Words(mem, 0)
    polls = []  # an event wait polls the abort state each time it finds the event not set
    check_aborted = device.check_aborted

    def watched_check(tag):
        check_aborted(tag)
        polls.append(tag)
        words.notify()

    device.check_aborted = watched_check
    first, second = device.create_stream(), device.create_stream()
    first.wait_flag(Flag(mem, 0), 1, "gate")
    first.write_flag(Flag(mem, 8), 2)
    second.wait_event(first.record())
    second.write_flag(Flag(mem, 16), 3)
    # the gate opens only once the first stream is inside its flag wait and the second inside
    # its event wait (it found the event not set), unless a write ran that must not have
    words.wait_until(lambda: (words.reads >= 2 and ("event",) in polls)
                     or words[1] != 0 or words[2] != 0, "a stream never waited")
    assert words[1] == 0 and words[2] == 0, "a write ran before what it waits for"
    words[0] = 1
    second.synchronize()
    assert words[1] == 2 and words[2] == 3


def test_integer_average_rounds_toward_zero():
    x = np.array([-7, 7, -8, 8, 5], np.int32)
    y = np.array([0, 0, 0, 0, -6], np.int32)
    d = np.empty_like(x)
    average_into(d, x, y, 2)
    assert d.tolist() == [-3, 3, -4, 4, 0]
    u = np.array([7, 255], np.uint8)
    du = np.empty_like(u)
    average_into(du, u, np.array([0, 1], np.uint8), 2)
    assert du.tolist() == [3, 0]  # 255 + 1 wraps to 0, as the sum does


def test_float16_average_rounds_once():
    x = np.array([65504, 1e-4], np.float16)
    d = np.empty_like(x)
    average_into(d, x, x, 2)  # the float16 sum would overflow; float32 does not
    assert d.tolist() == x.tolist()


def test_close_removes_files_and_is_idempotent():
    device = HostDevice()
    mem = device.alloc(4096)
    path = mem.path
    assert os.path.exists(path)
    device.close()
    device.close()
    assert not os.path.exists(path)


def test_wrap_refuses_non_contiguous(device):
    with pytest.raises(TypeError):
        device.wrap(np.ones((4, 4))[:, ::2])


def _fold_inputs(dtype: str, nsrc: int, n: int, op: ReduceOp) -> list[np.ndarray]:
    """`nsrc` random arrays of `n` elements for a fold with `op`."""
    rng = np.random.default_rng([nsrc, n, len(dtype)])
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(-100 if dtype[0] == "i" else 0, 100, n).astype(dtype)
                for _ in range(nsrc)]
    # products of factors near 1 stay finite, so every step's rounding counts
    center, scale = (1.0, 0.01) if op is ReduceOp.PROD else (0.0, 10.0)
    return [(center + scale * rng.standard_normal(n)).astype(dtype) for _ in range(nsrc)]


def _chained(device, stream, srcs, dtype, op, divisor):
    """The reference: today's chain of binary reduces on the same stream."""
    nbytes = srcs[0].nbytes
    out = device.alloc(nbytes)
    stream.reduce(span(out, 0, nbytes), span(srcs[0], 0, nbytes), span(srcs[1], 0, nbytes),
                  dtype, op, divisor if len(srcs) == 2 else 1)
    for k in range(2, len(srcs)):
        stream.reduce(span(out, 0, nbytes), span(out, 0, nbytes), span(srcs[k], 0, nbytes),
                      dtype, op, divisor if k == len(srcs) - 1 else 1)
    stream.synchronize()
    return out.view(0, nbytes, dtype).copy()


FOLD_CASES = [(dtype, op) for dtype in ("float16", "int8", "uint32", "float32", "complex64")
              for op in ReduceOp if not (dtype == "complex64" and op in (ReduceOp.MIN,
                                                                           ReduceOp.MAX))]


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("dtype,op", FOLD_CASES)
def test_reduce_n_gives_the_bits_of_the_binary_chain(device, inline, dtype, op):
    """Stream.reduce_n folds in source order, rounding every step, dividing at the last:
    bit for bit what reduce, then reduce into dst, ... gives, for 2 to 9 sources, also in
    place over any one of the sources (registered memory's in-place all_reduce)."""
    divisor = 3 if op is ReduceOp.AVG else 1
    stream = device.create_stream(inline=inline)
    for nsrc in (2, 3, 9):
        arrays = _fold_inputs(dtype, nsrc, 37, op)
        srcs = [device.wrap(a.copy()) for a in arrays]
        want = _chained(device, stream, srcs, dtype, op, divisor)
        nbytes = arrays[0].nbytes
        out = device.alloc(nbytes)
        stream.reduce_n(span(out, 0, nbytes), [span(m, 0, nbytes) for m in srcs], dtype, op,
                        divisor)
        stream.synchronize()
        assert out.view(0, nbytes, dtype).tobytes() == want.tobytes(), nsrc
        for k in range(nsrc):
            srcs = [device.wrap(a.copy()) for a in arrays]
            stream.reduce_n(span(srcs[k], 0, nbytes), [span(m, 0, nbytes) for m in srcs],
                            dtype, op, divisor)
            stream.synchronize()
            assert srcs[k].view(0, nbytes, dtype).tobytes() == want.tobytes(), (nsrc, k)


@pytest.mark.parametrize("inline", [False, True])
def test_compiled_reduce_n_instruction(device, inline):
    """Both interpreters of a program (the generic one, and the inline stream's bound
    steps) run ReduceNI with buffer and argument operands, the divisor at the last step."""
    dtype, op, nsrc, n = "float16", ReduceOp.AVG, 4, 29
    arrays = _fold_inputs(dtype, nsrc, n, op)
    nbytes = arrays[0].nbytes
    buf = device.alloc(nsrc * nbytes)
    for k, a in enumerate(arrays):
        buf.view(k * nbytes, nbytes, dtype)[...] = a
    inp = device.wrap(arrays[0].copy())
    srcs = (Arg(0, 0, nbytes), *(Span(buf, k * nbytes, nbytes) for k in range(1, nsrc)))
    program = (ReduceNI(Arg(1, 0, nbytes), srcs, nsrc),)
    stream = device.create_stream(inline=inline)
    want = _chained(device, stream, [device.wrap(a.copy()) for a in arrays], dtype, op, nsrc)
    result = np.zeros(n, dtype)
    device.compile(program, dtype, op, stream)(inp, device.wrap(result), 1)
    stream.synchronize()
    assert result.tobytes() == want.tobytes()


def test_an_array_over_shared_memory_outlives_the_device():
    """`HostDevice.array` (registered memory): a NumPy array over the mapping, zero-filled,
    whose writes a peer's mapping sees; once the device is closed (its name gone, its own
    references dropped) the array still works: an ordinary array."""
    device = HostDevice(timeout=5.0)
    peer = HostDevice(timeout=5.0)
    mem = device.alloc(4096)
    array = device.array(mem, (16, 32), "float64")
    assert array.shape == (16, 32) and not array.any()
    seen = peer.open(device.export(mem))
    array[3, 4] = 7.5
    assert seen.view(0, 4096, "float64")[3 * 32 + 4] == 7.5
    device.close()
    peer.close()
    array += 1
    assert array[3, 4] == 8.5 and array.sum() == 16 * 32 + 7.5

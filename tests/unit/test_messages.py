"""Point-to-point messages in one process: the rings of two inboxes (records that wrap, room
handed back), and ranks that are threads (tests/unit/threads_world.py) exchanging through
them: rings much smaller than the messages, matching by tag and source, refusals, a timeout
and an abort that end a wait, a group and what it refuses."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import gpuring
from gpuring import _cma
from gpuring._mailbox import DATA, EAGER, GPU_RTS, HEADER_BYTES, Inbox, ShmLane, ring_bytes_for
from gpuring.devices.host import HostDevice

from .threads_world import run_ranks


@pytest.fixture
def lanes():
    """Rank 0's lane to rank 1 and rank 1's to rank 0, with rings of 16 KiB."""
    devices = [HostDevice(), HostDevice()]
    inboxes = [Inbox(devices[r], r, 2, 16 << 10) for r in range(2)]
    yield ShmLane(inboxes[0], 1, inboxes[1].mem), ShmLane(inboxes[1], 0, inboxes[0].mem)
    for device in devices:
        device.close()


def test_records_wrap_and_room_comes_back_once_released(lanes) -> None:
    sender, receiver = lanes
    rng = np.random.default_rng(0)
    sent: list[bytes] = []
    received: list[bytes] = []
    for step in range(400):
        payload = rng.integers(0, 256, int(rng.integers(0, 5000)), dtype=np.uint8).tobytes()
        while not sender.put(EAGER, step, 1, 2, len(payload), b"uint8", payload):
            got = receiver.take()  # full: the receiver must take something first
            assert got is not None, "no room, and nothing to take"
            header, view = got
            received.append(bytes(view[:header.c]))
            receiver.skip(header)
            receiver.release()
        sent.append(payload)
    while (got := receiver.take()) is not None:
        header, view = got
        received.append(bytes(view[:header.c]))
        receiver.skip(header)
    receiver.release()
    assert received == sent
    assert sender.sent > 20 * sender.ring  # (it wrapped many times)


@pytest.mark.parametrize("offset", [128, 4096, 8192, 12288])
def test_an_empty_ring_takes_records_for_at_least_half_of_it(lanes, offset) -> None:
    """Wherever the last record left the writer, an emptied ring takes any record, and then
    records of at least half the ring more before the reader takes one (a WRAP back to the
    ring's start only where that keeps half of it)."""
    sender, receiver = lanes
    filler = b"x" * (offset - HEADER_BYTES)
    assert sender.put(EAGER, 0, 0, 0, len(filler), b"uint8", filler)
    header, _ = receiver.take()
    receiver.skip(header)
    receiver.release()  # empty again, the writer `offset` bytes in
    record = b"y" * (128 - HEADER_BYTES)
    fitted = 0
    while sender.put(EAGER, 1, 0, 0, len(record), b"uint8", record):
        fitted += 1
    assert fitted * 128 >= sender.ring // 2
    biggest = b"z" * (sender.ring // 2 - HEADER_BYTES)
    while (got := receiver.take()) is not None:
        receiver.skip(got[0])
    receiver.release()
    assert sender.put(EAGER, 2, 0, 0, len(biggest), b"uint8", biggest)


def test_a_record_larger_than_the_room_waits_and_none_is_larger_than_half() -> None:
    assert ring_bytes_for(1, None) == 4 << 20
    assert ring_bytes_for(8, None) == 1 << 20
    assert ring_bytes_for(63, None) == 128 << 10
    assert ring_bytes_for(1000, None) == 64 << 10
    assert ring_bytes_for(3, 100_001) == 100_032


def test_data_pieces_are_a_quarter_of_the_ring(lanes) -> None:
    sender, receiver = lanes
    assert sender.piece == sender.ring // 4 - HEADER_BYTES
    data = bytes(range(256)) * 64
    assert sender.put(DATA, 0, 0, 0, sender.piece, b"", data[:sender.piece])
    header, view = receiver.take()
    assert (header.kind, header.c) == (DATA, sender.piece)
    assert bytes(view[:header.c]) == data[:sender.piece]


@pytest.mark.parametrize("attach", [True, False], ids=["attached", "staged"])
def test_messages_much_larger_than_the_ring_in_every_order(monkeypatch, attach) -> None:
    """16 KiB rings: eager messages of up to 4 KiB, the rest read from the sender's memory
    (cross-memory attach) or, where that is refused, in pieces of 4 KiB; sends and receives
    of every size posted in both orders, tags mixed."""
    monkeypatch.setenv("GPURING_MESSAGE_BYTES", "16K")
    if not attach:
        monkeypatch.setattr(_cma, "refusal", lambda probe: "refused by the test")
    sizes = [0, 1, 255, 256, 257, 2000, 5000, 40000, 300000]

    def body(comm: gpuring.Communicator) -> list[int]:
        peer = 1 - comm.rank
        counts = []
        for i, count in enumerate(sizes):
            x = np.arange(count, dtype=np.float64) * (comm.rank + 1) + i
            out = np.zeros(count + 1)
            if (i + comm.rank) % 2:
                received = comm.irecv(out, peer, tag=i % 3)
                sent = comm.isend(x, peer, tag=i % 3)
            else:
                sent = comm.isend(x, peer, tag=i % 3)
                received = comm.irecv(out, peer, tag=i % 3)
            sent.wait()
            received.wait()
            want = np.arange(count, dtype=np.float64) * (peer + 1) + i
            assert np.array_equal(out[:count], want), (count, out[:5], want[:5])
            counts.append(received.count)
        return counts

    assert run_ranks(2, body) == [sizes, sizes]


def test_a_header_is_in_the_peers_ring_before_its_send_returns(monkeypatch) -> None:
    """A CuPy message's header is a record nothing would write once its send returned (the
    host goes on to other work): where the peer's ring is full, the send makes progress
    until the peer took enough. Rank 0 posts three rings' worth of headers and enters a
    barrier; rank 1 waits for every one of them before its own."""
    monkeypatch.setenv("GPURING_MESSAGE_BYTES", "16K")
    count = 400  # (128 bytes each)
    body_bytes = json.dumps({"first": 0, "pieces": 1, "slot_bytes": 4096,
                             "offset": 0}).encode()

    def body(comm: gpuring.Communicator) -> int:
        engine = comm._messages
        if comm.rank == 0:
            for msg in range(count):
                engine.send_record(1, GPU_RTS, msg, 0, 1, 4, b"float32", body_bytes, "send")
        else:
            engine.wait_until(lambda: len(engine.gpu.arrivals) == count, "recv", 0,
                              "rank 0's headers did not all come")
        comm.barrier()
        return len(engine.gpu.arrivals)

    assert run_ranks(2, body, timeout=10) == [0, count]


def test_any_source_and_tags_match_in_posting_order() -> None:
    def body(comm: gpuring.Communicator) -> list[tuple[int, int, float]]:
        if comm.rank != 0:
            comm.send(np.full(2, comm.rank, np.float32), 0, tag=comm.rank % 2)
            comm.send(np.full(2, 10 + comm.rank, np.float32), 0, tag=comm.rank % 2)
            return []
        outs = [np.zeros(2, np.float32) for _ in range(4)]
        works = [comm.irecv(outs[0], None, 1), comm.irecv(outs[1], None, 0),
                 comm.irecv(outs[2], 1, 1), comm.irecv(outs[3], 2, 0)]
        for work in works:
            work.wait()
        return [(w.source, w.tag, float(o[0])) for w, o in zip(works, outs, strict=True)]

    got = run_ranks(3, body)[0]
    # rank 1 sends with tag 1, rank 2 with tag 0: each any-source receive takes that tag's
    # first message, the named ones the second
    assert got == [(1, 1, 1.0), (2, 0, 2.0), (1, 1, 11.0), (2, 0, 12.0)]


def test_refusals_name_the_field_on_both_ranks() -> None:
    def body(comm: gpuring.Communicator) -> list[str]:
        found = []
        for send, buffer in ((np.ones(4), np.ones(4, np.int8)), (np.ones(6), np.ones(5)),
                             (np.ones(300000), np.ones(300000, np.float32))):
            try:
                if comm.rank == 0:
                    comm.send(send, 1)
                    comm.recv(np.zeros(1), 1, tag=9)  # (after the refusal: in order)
                    comm.synchronize()
                else:
                    try:
                        comm.recv(buffer, 0)
                    finally:
                        comm.send(np.zeros(1), 0, tag=9)
            except gpuring.CollectiveMismatchError as exc:
                found.append(",".join(sorted(exc.differences)))
                if comm.rank == 0 and send.size == 300000:
                    comm.recv(np.zeros(1), 1, tag=9)
        return found

    assert run_ranks(2, body) == [["dtype", "count", "dtype"]] * 2


def test_a_wait_times_out_naming_the_rank_and_breaks_the_communicator() -> None:
    def body(comm: gpuring.Communicator) -> tuple[str, int | None, float] | None:
        if comm.rank == 1:
            time.sleep(2.5)  # never sends
            return None
        since = time.monotonic()
        with pytest.raises(gpuring.CollectiveTimeoutError) as caught:
            comm.recv(np.zeros(3), 1)
        with pytest.raises(gpuring.CommunicatorClosedError):
            comm.isend(np.zeros(3), 1)
        return type(caught.value).__name__, caught.value.peer, time.monotonic() - since

    name, peer, after = run_ranks(2, body, timeout=0.5)[0]
    assert (name, peer) == ("CollectiveTimeoutError", 1) and after < 2.0


def test_abort_from_another_thread_ends_a_wait_at_once() -> None:
    def body(comm: gpuring.Communicator) -> float | None:
        if comm.rank == 1:
            time.sleep(1.0)
            return None
        work = comm.irecv(np.zeros(3), 1)
        threading.Timer(0.2, comm.abort, ("stop",)).start()
        since = time.monotonic()
        with pytest.raises(gpuring.CommunicatorClosedError):
            work.wait()
        return time.monotonic() - since

    after = run_ranks(2, body, timeout=60)[0]
    assert after < 5.0


def test_a_group_posts_at_its_end_and_refuses_waits_inside() -> None:
    def body(comm: gpuring.Communicator) -> list[float]:
        peer = 1 - comm.rank
        out = np.zeros(3)
        with comm.group():
            received = comm.irecv(out, peer)
            assert not received.done()
            with pytest.raises(gpuring.GpuringError, match="after the `with comm"):
                received.wait()
            with comm.group():  # nested: the outermost one posts
                comm.isend(np.full(3, comm.rank, np.float64), peer)
        received.wait()
        return list(out)

    assert run_ranks(2, body) == [[1.0] * 3, [0.0] * 3]


def test_batch_checks_its_operations_before_posting_any() -> None:
    def body(comm: gpuring.Communicator) -> None:
        with pytest.raises(ValueError, match="'isend' or 'irecv'"):
            comm.batch([("irecv", np.zeros(2), 1 - comm.rank), ("bcast", np.zeros(2), 0)])
        with pytest.raises(TypeError, match="verb, array, peer"):
            comm.batch([np.zeros(2)])
        comm.barrier()

    run_ranks(2, body)


def test_arguments_are_checked_before_anything_moves() -> None:
    def body(comm: gpuring.Communicator) -> None:
        with pytest.raises(ValueError, match="not a rank"):
            comm.isend(np.zeros(2), 2)
        with pytest.raises(TypeError, match="must be an int"):
            comm.irecv(np.zeros(2), 1.0)
        with pytest.raises(TypeError, match="tag must be an int"):
            comm.isend(np.zeros(2), 0, tag="a")
        with pytest.raises(TypeError, match="C-contiguous"):
            comm.irecv(np.zeros((4, 2))[:, 0], 0)
        with pytest.raises(TypeError, match="plain numbers"):
            comm.isend(np.array([object()]), 0)
        with pytest.raises(ValueError, match="this rank"):
            comm.send(np.zeros(2), comm.rank)

    run_ranks(2, body)


def test_cross_memory_attach_reads_this_process_and_refuses_a_gone_one() -> None:
    mine = _cma.probe()
    assert _cma.refusal(mine) is None
    x = np.arange(1000, dtype=np.float64)
    got = np.zeros(1000)
    _cma.read(mine.pid, int(x.ctypes.data), got, x.nbytes)
    assert np.array_equal(got, x)
    assert _cma.refusal(mine._replace(pid=2 ** 22 + 12345)) is not None


def test_a_groups_pieces_go_by_piece_number_sends_first() -> None:
    """Two sends to one peer (pieces 0-2 and 3-4) and a receive from it (pieces 0-3): by
    piece number, a number's send before its receive (each rank's stream then only waits for
    what comes earlier in the same order on its peer's)."""
    from gpuring._cuda_messages import interleaved

    order = interleaved([("a", 0, 3), ("b", 3, 2)], [("r", 0, 4)])
    assert order == [("send", "a", 0), ("receive", "r", 0), ("send", "a", 1),
                     ("receive", "r", 1), ("send", "a", 2), ("receive", "r", 2),
                     ("send", "b", 0), ("receive", "r", 3), ("send", "b", 1)]

"""The control plane: named exchanges catch ranks out of step, and the launcher's store
releases an exchange that a closed rank will never join."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from gpuring import CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError
from gpuring.rendezvous.base import ControlPlane
from gpuring.rendezvous.store import StoreServer
from gpuring.rendezvous.store_client import StoreClient


class _Scripted(ControlPlane):
    """Rank 0 of two; the other rank's contribution is given."""

    rank, size, local_rank, local_size, job_id = 0, 2, 0, 2, "job"

    def __init__(self, other: Any):
        super().__init__()
        self.other = other

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        return [obj, self.other]

    def close(self) -> None:
        pass


def test_exchange_returns_every_ranks_object() -> None:
    assert _Scripted(("a collective", 7)).exchange("a collective", 5) == [5, 7]


def test_ranks_at_different_steps_raise_a_mismatch() -> None:
    control = _Scripted(("close()", None))
    with pytest.raises(CollectiveMismatchError,
                       match=r"rank 0 is at a collective; rank 1 is at close\(\)") as info:
        control.exchange("a collective", ("all_reduce",))
    assert info.value.differences == {"step": {0: "a collective", 1: "close()"}}
    with pytest.raises(CollectiveMismatchError, match=r"rank 1 is at \?"):
        _Scripted(None).barrier()  # not a named exchange at all


def test_store_releases_an_exchange_a_closed_rank_never_joins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    key = b"k" * 32
    server = StoreServer(2, key)
    try:
        clients = []
        for r in range(2):  # two ranks of one generation (each would be its own process)
            monkeypatch.setattr(StoreClient, "_generation", 0)
            clients.append(StoreClient(r, 2, r, 2, server.address, key, "job"))
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                clients[0].exchange("y", 1, timeout=60)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=waiter)
        start = time.monotonic()
        thread.start()
        time.sleep(0.2)  # rank 0 waits in the exchange
        clients[1].close()  # rank 1 leaves without joining it
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], PeerFailureError), errors
        assert errors[0].peer == 1 and time.monotonic() - start < 10
        with pytest.raises(PeerFailureError):  # a later exchange of rank 0 fails at once too
            clients[0].exchange("z", 2, timeout=60)
        clients[0].close()
    finally:
        server.close()


def _clients(address: tuple[str, int], key: bytes, n: int = 2) -> list[StoreClient]:
    clients = []
    for r in range(n):  # ranks of one generation (each would be its own process)
        StoreClient._generation = 0
        clients.append(StoreClient(r, n, r, n, address, key, "job"))
    return clients


def _exchange_in_thread(client: StoreClient, timeout: float) -> tuple[threading.Thread,
                                                                       list[BaseException]]:
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            client.exchange("y", 1, timeout=timeout)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    return thread, errors


def test_an_exchange_a_rank_never_joins_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StoreClient, "_generation", 0)
    key = b"k" * 32
    server = StoreServer(2, key)
    try:
        clients = _clients(server.address, key)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"exchange #1 timed out after 0.3 s "
                                                         r"on rank 0: rank 1 did not take "
                                                         r"part$") as info:
            clients[0].exchange("y", 1, timeout=0.3)
        assert info.value.peer == 1  # the server said who never posted
        assert time.monotonic() - start < 10
        for client in clients:
            client.close()
    finally:
        server.close()


@pytest.mark.parametrize("how", ["server killed", "server closed", "connection dropped"])
def test_a_lost_launcher_connection_fails_this_and_every_later_exchange(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exchange waiting when the launcher's store goes away, or the connection drops,
    raises PeerFailureError at once (not at its timeout); so does every later one (not an
    OSError, not a wait for the timeout: the one notice of the loss is used up by then)."""
    monkeypatch.setattr(StoreClient, "_generation", 0)
    key = b"k" * 32
    process = None
    if how == "server killed":  # the launcher's process dies
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\n"
             "from gpuring.rendezvous.store import StoreServer\n"
             f"s = StoreServer(2, {key!r})\nprint(s.address[1], flush=True)\ntime.sleep(120)"],
            stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        port = int(process.stdout.readline())
        server = None
        clients = _clients(("127.0.0.1", port), key)
    else:
        server = StoreServer(2, key)
        clients = _clients(server.address, key)
    try:
        thread, errors = _exchange_in_thread(clients[0], timeout=60)
        time.sleep(0.2)  # rank 0 waits in the exchange (if not yet, it fails when it does)
        if process is not None:
            process.kill()
            process.wait()
        elif how == "server closed":
            assert server is not None
            server.close()
        else:
            fd = os.dup(clients[0]._conn.fileno())
            with socket.socket(fileno=fd) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], PeerFailureError), errors
        assert "the launcher's control connection" in str(errors[0])
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(PeerFailureError, match="the launcher's control connection"):
                clients[0].exchange("z", 2, timeout=60)
            assert time.monotonic() - start < 30
        for client in clients:
            client.close()  # no error either
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        if server is not None:
            server.close()


def test_sub_groups_share_the_connection_and_keep_their_exchanges_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks, the group of ranks 2 and 0 (in that order) and the job: exchanges of
    each complete among its members only, in the group's rank order, concurrently; a
    group's failure reaches that group only; a death reaches every group with that rank;
    a member that closes its group releases an exchange waiting there."""
    monkeypatch.setattr(StoreClient, "_generation", 0)
    key = b"k" * 32
    server = StoreServer(3, key)
    try:
        clients = _clients(server.address, key, n=3)
        groups = {r: clients[r].subgroup((2, 0), "job-g") for r in (0, 2)}
        assert (groups[2].rank, groups[0].rank, groups[0].size) == (0, 1, 2)
        assert groups[0].job_id == "job-g" and groups[0].single_node
        results: dict[str, list[Any]] = {}

        def exchange(name: str, control: ControlPlane, value: Any) -> None:
            results[name] = control.exchange("x", value, timeout=30)

        threads = [threading.Thread(target=exchange, args=(f"world{r}", clients[r], r))
                   for r in range(3)]
        threads += [threading.Thread(target=exchange, args=(f"group{r}", groups[r], 10 + r))
                    for r in (0, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert results == {"world0": [0, 1, 2], "world1": [0, 1, 2], "world2": [0, 1, 2],
                           "group0": [12, 10], "group2": [12, 10]}
        failed: list[tuple[int, str]] = []
        groups[0].on_peer_failure(lambda error: failed.append((error.peer, str(error))))
        groups[2].report_failure("gave up")  # the group's failure: not the job's
        deadline = time.monotonic() + 10
        while not failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed == [(0, "rank 0 failed: gave up (rank 2 of the job is rank 0 here)")]
        assert clients[0].failure is None
        with pytest.raises(PeerFailureError, match="gave up"):
            groups[0].exchange("y", 1, timeout=30)
        other = {r: clients[r].subgroup((0, 1), "job-h") for r in (0, 1)}
        thread, errors = _exchange_in_thread(other[0], timeout=60)
        time.sleep(0.2)
        other[1].close()  # rank 1 leaves the group without joining the exchange
        thread.join(timeout=30)
        assert len(errors) == 1 and isinstance(errors[0], PeerFailureError), errors
        assert errors[0].peer == 1
        pair = {r: clients[r].subgroup((2, 0), "job-j") for r in (0, 2)}
        seen: list[PeerFailureError] = []
        pair[0].on_peer_failure(seen.append)
        pair[2].report_failure("gave up", job_peer=1)  # because of rank 1, not in the group
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(e.peer, e.job_peer) for e in seen] == [(0, 1)]  # the reporter; the job's 1
        assert "rank 1 of the job failed, rank 0 here gave up because of it" in str(seen[0])
        with pytest.raises(PeerFailureError) as info:
            pair[0].exchange("y", 1, timeout=30)
        assert (info.value.peer, info.value.job_peer) == (0, 1)
        server.report_failure(2, "rank 2 died", dead=True)  # every group of rank 2's
        with pytest.raises(PeerFailureError, match="rank 2 died"):
            clients[0].exchange("z", 1, timeout=30)
        late = clients[0].subgroup((0, 2), "job-i")  # made after the death: knows it
        with pytest.raises(PeerFailureError, match="rank 2 died") as info:
            late.exchange("z", 1, timeout=30)
        assert info.value.peer == 1
        for client in [*clients, *groups.values(), *pair.values(), other[0], late]:
            client.close()
    finally:
        server.close()


@pytest.mark.slow
def test_a_rank_that_cannot_reach_rank_0_names_the_address_and_says_it_waits(capsys):
    """gpuring.distributed without rank 0: the waiting rank says so after a few seconds,
    and its error names the address and what to check."""
    from gpuring import distributed

    from ..conftest import free_port

    port = free_port()
    with pytest.raises(ConnectionRefusedError, match=rf"127\.0\.0\.1:{port} within 6 s: is "
                                                     r"rank 0 .* running"):
        distributed.init_process_group(2, 1, port=port, timeout=6)
    err = capsys.readouterr().err
    assert f"rank 1 is waiting to reach the control server at 127.0.0.1:{port}" in err

"""The control plane: named exchanges catch ranks out of step, and the launcher's store
releases an exchange that a closed rank will never join."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gpuring import CollectiveMismatchError, PeerFailureError
from gpuring.rendezvous.base import ControlPlane
from gpuring.rendezvous.store import StoreClient, StoreServer


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

"""Many ranks exchanging messages: `worker_messages_scale.py`. Every rank shifts a ring both
ways, then exchanges with every other rank in one group, and counts what that took: the
threads of its process before and after (messages start none), the pairs' communicators
(none for NumPy messages), the lanes of its message engine (one per peer of its node, in the
inboxes mapped once when the communicator was made) and whether the peers of other nodes are
reached by one MPI link. Prints `RANK <rank> threads <before> <after> channels <count>
lanes <count> mpi <0|1> ok` once every result was checked."""

from __future__ import annotations

import threading

import numpy as np

import gpuring


def main() -> None:
    with gpuring.init() as comm:
        rank, n = comm.rank, comm.size
        before = threading.active_count()
        right, left = (rank + 1) % n, (rank - 1) % n
        for step in range(3):
            got = comm.sendrecv(np.full(1000, rank * 10 + step), right, np.zeros(1000, int),
                                left)
            assert np.all(got == left * 10 + step), (step, got[:3])
            got = comm.sendrecv(np.full(300000, rank, np.float32), left,
                                np.zeros(300000, np.float32), right)
            assert np.all(got == right), got[:3]
        outs = {q: np.zeros(4, np.int64) for q in range(n) if q != rank}
        with comm.group():
            works = [comm.irecv(out, q) for q, out in outs.items()]
            works += [comm.isend(np.array([rank, q, 7, 7]), q) for q in outs]
        for work in works:
            work.wait()
        assert all(list(out[:2]) == [q, rank] for q, out in outs.items())
        after = threading.active_count()
        messages = comm._messages
        print(f"RANK {rank} threads {before} {after} channels {len(comm._pairs.channels)} "
              f"lanes {len(messages._shm)} mpi {int(messages._mpi is not None)} ok",
              flush=True)


if __name__ == "__main__":
    main()

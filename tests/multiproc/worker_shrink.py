"""Data-parallel training that loses a rank and goes on: `worker_shrink.py DIR STEPS KILLED
AT`. Linear regression on synthetic data: each rank's batch of a step comes from a seed of
(its rank in the job, the step), so any rank can work out any other's. Rank KILLED SIGKILLs
itself at step AT, after computing its gradient, while the others average theirs in an
all_reduce: they raise PeerFailureError, shrink the communicator (`comm.shrink()`), redo the
step on the survivors and finish the run. Each survivor then works out, in NumPy alone, the
3-rank run from that step's parameters and writes both final losses, the parameters' digest
and how long the recovery took to DIR/result-RANK.json. With SHRINK_DEVICE=cuda the gradients
are averaged as CuPy arrays (one GPU per rank, or the CUDA simulator's)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

import gpuring

DIR, STEPS, KILLED, AT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
FEATURES, BATCH, LR = 512, 64, 0.05


def batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([17, rank, step])
    x = rng.standard_normal((BATCH, FEATURES))
    truth = np.linspace(-1.0, 1.0, FEATURES)
    return x, x @ truth + 0.01 * rng.standard_normal(BATCH)


def gradient(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    x, y = batch(rank, step)
    return 2.0 / BATCH * x.T @ (x @ w - y)


def loss(w: np.ndarray, ranks: list[int], step: int) -> float:
    return float(np.mean([np.mean((x @ w - y) ** 2)
                          for x, y in (batch(r, step) for r in ranks)]))


def main() -> None:
    comm = gpuring.init()
    me = comm.rank  # (its rank in the job: the data it holds follows it)
    print("JOB", comm._control.job_id, flush=True)
    if os.environ.get("SHRINK_DEVICE") == "cuda":
        import cupy

        cupy.cuda.Device(me % cupy.cuda.runtime.getDeviceCount()).use()
        on_device, to_host = cupy.asarray, cupy.asnumpy
    else:
        on_device = to_host = np.asarray
    w = np.zeros(FEATURES)
    averaged = on_device(np.empty(FEATURES))
    recovered_after = None
    at_failure = None
    step = 0
    while step < STEPS:
        g = on_device(gradient(w, me, step))
        if me == KILLED and step == AT:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(g, op="avg", out=averaged)
            comm.synchronize()  # (a GPU's collective fails here where it did not at once)
        except gpuring.PeerFailureError as exc:
            assert exc.peer == KILLED and step == AT, (exc.peer, step)
            failed_at = time.monotonic()
            at_failure = w.copy()  # the step is redone from these parameters
            old, comm = comm, comm.shrink()
            assert (comm.size, comm.rank) == (old.size - 1, me - (me > KILLED))
            old.close()
            comm.all_reduce(on_device(gradient(w, me, step)), op="avg", out=averaged)
            recovered_after = time.monotonic() - failed_at  # (the step again, above)
        w -= LR * to_host(averaged)
        step += 1
    survivors = [r for r in range(comm.size + 1) if r != KILLED]
    reference = at_failure.copy()
    for s in range(AT, STEPS):
        reference -= LR * np.mean([gradient(reference, r, s) for r in survivors], axis=0)
    result = {"loss": loss(w, survivors, STEPS - 1),
              "reference": loss(reference, survivors, STEPS - 1),
              "first_loss": loss(np.zeros(FEATURES), survivors, 0),
              "digest": hashlib.sha256(w.tobytes()).hexdigest(),
              "recovered_after": recovered_after, "size": comm.size}
    comm.close()
    path = os.path.join(DIR, f"result-{me}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()

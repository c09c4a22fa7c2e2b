"""A GPU smoke test for machines without pytest: all_reduce of CuPy arrays across the ranks of
`gpuring run`, checked against a float64 reference of every rank's random input.

    gpuring run -n 2 -- python -m tools.device_check.smoke

Exits non-zero (every rank) when a result is off; rank 0 prints one line per case.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["main", "CASES"]

#: (elements, op): a single element, an odd count, and 4 MiB of float32
CASES: tuple[tuple[int, str], ...] = ((1, "sum"), (4099, "sum"), (1 << 20, "sum"),
                                      (1 << 20, "max"), (4099, "avg"))


def _inputs(ranks: int, count: int, case: int) -> list[np.ndarray]:
    """Every rank's input (each rank rebuilds all of them from the same seeds)."""
    return [np.random.default_rng([case, r]).standard_normal(count).astype(np.float32)
            for r in range(ranks)]


def _reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    wide = np.stack([a.astype(np.float64) for a in inputs])
    if op == "max":
        return wide.max(axis=0)
    total = wide.sum(axis=0)
    return total / len(inputs) if op == "avg" else total


def main() -> int:
    import cupy

    import gpuring

    bad = 0
    with gpuring.init() as comm:
        cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
        for case, (count, op) in enumerate(CASES):
            inputs = _inputs(comm.size, count, case)
            got = cupy.asnumpy(comm.all_reduce(cupy.asarray(inputs[comm.rank]), op=op))
            want = _reference(inputs, op)
            err = float(np.max(np.abs(got.astype(np.float64) - want)))
            ok = got.shape == want.shape and err <= 1e-5 * comm.size * max(1.0, np.abs(want).max())
            bad += not ok
            if comm.rank == 0:
                print(f"smoke all_reduce {op} of {count} float32 on {comm.size} ranks: "
                      f"{'ok' if ok else 'WRONG'} (max abs error {err:.3g})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Data-parallel training of a small MLP with gpuring.

    gpuring run -n 4 python examples/data_parallel.py [--steps 200] [--device cuda]

Every rank builds the same generated regression data set and the same initial weights, takes
its shard of the rows (equal shards), computes the mean-squared-error gradient on the shard,
and averages the gradients over the ranks with one fused `all_reduce_many(op="avg")`. The
average of equal shards' mean gradients is the full batch's mean gradient, so the weights
follow single-process full-batch gradient descent (to float64 rounding) on every rank.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

import gpuring


def make_data(samples: int, features: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of a smooth nonlinear function plus a little noise (float64)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features))
    w = rng.standard_normal((features, 1))
    y = np.sin(x @ w) + 0.1 * x[:, :1] ** 2 + 0.01 * rng.standard_normal((samples, 1))
    return x, y


def init_params(features: int = 8, hidden: int = 32, seed: int = 1) -> list[np.ndarray]:
    """[W1, b1, W2, b2] of a one-hidden-layer tanh network (float64)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((features, hidden)) / np.sqrt(features), np.zeros(hidden),
            rng.standard_normal((hidden, 1)) / np.sqrt(hidden), np.zeros(1)]


def loss_and_gradients(params: list[Any], x: Any, y: Any, xp: Any = np) -> tuple[Any, list[Any]]:
    """Mean squared error over the rows of `x` and its gradient for each parameter."""
    w1, b1, w2, b2 = params
    h = xp.tanh(x @ w1 + b1)
    err = h @ w2 + b2 - y
    loss = (err ** 2).mean()
    d_out = 2.0 * err / x.shape[0]
    d_h = (d_out @ w2.T) * (1.0 - h ** 2)
    return loss, [x.T @ d_h, d_h.sum(axis=0), h.T @ d_out, d_out.sum(axis=0)]


def train(params: list[Any], x: Any, y: Any, *, steps: int, lr: float,
          comm: gpuring.Communicator | None = None, xp: Any = np) -> tuple[list[Any], float]:
    """Plain gradient descent; with `comm`, gradients are averaged over the ranks first.
    Returns the final weights and the last loss (averaged over the ranks)."""
    loss = xp.zeros(1)
    for _ in range(steps):
        loss, grads = loss_and_gradients(params, x, y, xp)
        if comm is not None:
            grads = comm.all_reduce_many(grads, op="avg")
        params = [p - lr * g for p, g in zip(params, grads, strict=True)]
    last = xp.asarray(loss, dtype=xp.float64).reshape(1)
    if comm is not None:
        last = comm.all_reduce(last, op="avg")
    return params, float(last[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--samples", type=int, default=960, help="divisible by the ranks")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", help="directory: each rank saves its final weights there")
    args = parser.parse_args()
    xp: Any = np
    if args.device == "cuda":
        import cupy

        xp = cupy
    with gpuring.init() as comm:
        if args.device == "cuda":
            cupy.cuda.Device(comm.local_rank).use()
        if args.samples % comm.size:
            raise SystemExit(f"--samples {args.samples} must be divisible by {comm.size} ranks")
        x, y = make_data(args.samples)
        shard = slice(comm.rank * args.samples // comm.size,
                      (comm.rank + 1) * args.samples // comm.size)
        params = [xp.asarray(p) for p in init_params(x.shape[1])]
        params, loss = train(params, xp.asarray(x[shard]), xp.asarray(y[shard]),
                             steps=args.steps, lr=args.lr, comm=comm, xp=xp)
        if comm.rank == 0:
            print(f"{comm.size} ranks, {args.steps} steps: loss {loss:.6f}")
        if args.out:
            host = [p.get() if hasattr(p, "get") else p for p in params]
            np.savez(os.path.join(args.out, f"weights-{comm.rank}.npz"), *host)


if __name__ == "__main__":
    main()

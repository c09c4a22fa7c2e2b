"""A process of a job started by hand that checks gpuring.distributed against the contracts
cupyx.distributed documents, method by method and argument form by argument form:
`worker_cupyx_conformance.py RANK N PORT cpu|cuda OUTDIR`.

It joins with `NCCLBackend(numpy.int64(N), numpy.int64(RANK), host, port)` (cupyx's
constructor, NumPy integers), then runs every item of ITEMS in order: each is one id
(`method-form`) whose body calls the method as cupyx's documentation says it may be called
and compares every rank's result with NumPy's, on random inputs every rank rebuilds from a
shared seed. A wrong result is written down and the items go on; an exception ends the run
(the peers may be out of step). Writes OUTDIR/results-RANK.jsonl (one line per id: its
failures, how many results it checked, or why it did not run) and OUTDIR/done-RANK.
Sparse matrices: the CUDA simulator's cupyx.scipy.sparse (on the CPU, the same classes
over NumPy arrays, a scipy-like matrix)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import gpuring
import gpuring.distributed as dist

#: this process's job and arrays (set by `main`; the items read them when they run)
rank = n = 0
device = "cpu"
outdir = Path(".")
xp: Any = np
sparse: Any = None
comm: Any = None


def setup(argv: list[str]) -> None:
    global rank, n, device, outdir, xp, sparse, comm
    rank, n, port, device, outdir = int(argv[1]), int(argv[2]), int(argv[3]), argv[4], \
        Path(argv[5])
    if device == "cuda":
        import cupy

        xp = cupy
        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        from cupyx.scipy import sparse as module
    else:
        where = Path(__file__).parents[1] / "cudasim" / "cupyx" / "scipy" / "sparse.py"
        spec = importlib.util.spec_from_file_location("sim_sparse", where)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    sparse = module
    comm = dist.NCCLBackend(np.int64(n), np.int64(rank), "127.0.0.1", np.int64(port),
                            timeout=60)


class Check:
    """The current item's checks on this rank."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.checked = 0

    def same(self, got: Any, want: np.ndarray, what: str) -> None:
        self.checked += 1
        got = got.get() if hasattr(got, "get") else np.asarray(got)
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
            self.failures.append(f"{what}: got {got!r}, want {want!r}")

    def ok(self, condition: bool, what: str) -> None:
        self.checked += 1
        if not condition:
            self.failures.append(what)

    def raises(self, kinds: tuple[type[BaseException], ...], call: Callable[[], Any],
               what: str) -> None:
        """`call()` raises an exception of every class in `kinds` (cupyx's type and
        gpuring's)."""
        self.checked += 1
        try:
            call()
        except Exception as exc:
            if not all(isinstance(exc, k) for k in kinds):
                self.failures.append(f"{what}: raised {type(exc).__name__} ({exc}), not "
                                     + " and ".join(k.__name__ for k in kinds))
        else:
            self.failures.append(f"{what}: raised nothing")


def inputs(shape: tuple[int, ...], seed: int, dtype: str = "float32") -> list[np.ndarray]:
    """Every rank's input: random integers in `dtype` (exact sums and products)."""
    lo, hi = (1, 4) if dtype != "complex64" else (-3, 4)
    return [np.random.default_rng([seed, r]).integers(lo, hi, shape).astype(dtype)
            for r in range(n)]


def dev(a: np.ndarray, order: str = "C") -> Any:
    """`a` where the arrays live, in `order`."""
    return xp.asarray(np.array(a, order=order))  # (a copy: in-place calls leave `a` alone)


def host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def memory(a: np.ndarray, order: str) -> np.ndarray:
    """`a`'s elements in the order of its memory laid out in `order`."""
    return a.reshape(-1, order=order)


FOLD = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def fold(arrays: list[np.ndarray], op: str) -> np.ndarray:
    if op == "avg":
        return (sum(arrays[1:], arrays[0]) / len(arrays)).astype(arrays[0].dtype)
    return FOLD[op].reduce(np.stack(arrays), axis=0).astype(arrays[0].dtype)


ITEMS: list[tuple[str, Callable[[Check], None]]] = []


def item(name: str) -> Callable[[Callable[[Check], None]], Callable[[Check], None]]:
    def register(body: Callable[[Check], None]) -> Callable[[Check], None]:
        ITEMS.append((name, body))
        return body
    return register


# -- all_reduce -------------------------------------------------------------------------------
for _op in ("sum", "prod", "min", "max", "avg"):
    @item(f"all_reduce-op_{_op}")
    def _all_reduce_op(c: Check, op: str = _op) -> None:
        ins = inputs((3, 4), 1, "float64")
        out = xp.zeros((3, 4), "float64")
        comm.all_reduce(dev(ins[rank]), out, op)
        c.same(out, fold(ins, op), f"all_reduce {op}")


@item("all_reduce-dtypes")
def _all_reduce_dtypes(c: Check) -> None:
    for i, dtype in enumerate(("int8", "uint8", "int32", "int64", "float16", "float32",
                               "complex64", "complex128")):
        ins = inputs((5,), 10 + i, dtype)
        out = xp.zeros(5, dtype)
        comm.all_reduce(dev(ins[rank]), out)
        c.same(out, fold(ins, "sum"), f"all_reduce {dtype}")


@item("all_reduce-fortran_order")
def _all_reduce_f(c: Check) -> None:
    ins = inputs((3, 5), 2)
    out = xp.asarray(np.zeros((3, 5), "float32", order="F"))
    c.ok(out.flags.f_contiguous and not out.flags.c_contiguous, "out is F-ordered")
    comm.all_reduce(dev(ins[rank], "F"), out)
    c.same(out, fold(ins, "sum"), "F in, F out")
    out_c = xp.zeros(15, "float32")  # memory order: F's elements, one after the other
    comm.all_reduce(dev(ins[rank], "F"), out_c)
    c.same(out_c, memory(fold(ins, "sum"), "F"), "F in, C out: memory order")


@item("all_reduce-in_place")
def _all_reduce_in_place(c: Check) -> None:
    ins = inputs((7,), 3)
    x = dev(ins[rank])
    comm.all_reduce(x, x)
    c.same(x, fold(ins, "sum"), "in_array is out_array")


@item("all_reduce-larger_out")
def _all_reduce_larger(c: Check) -> None:
    ins = inputs((6,), 4)
    out = dev(np.full(10, -7, "float32"))
    comm.all_reduce(dev(ins[rank]), out)
    c.same(out, np.concatenate([fold(ins, "sum"), np.full(4, -7, "float32")]),
           "the first in_array.size elements, the rest untouched")


@item("all_reduce-stream")
def _all_reduce_stream(c: Check) -> None:
    ins = inputs((1000,), 5)
    out = xp.zeros(1000, "float32")
    stream = xp.cuda.Stream(non_blocking=True) if device == "cuda" else None
    comm.all_reduce(dev(ins[rank]), out, "sum", stream)
    if stream is not None:
        stream.synchronize()
    c.same(out, fold(ins, "sum"), "on the stream given")


@item("all_reduce-errors")
def _all_reduce_errors(c: Check) -> None:
    x = xp.ones((4, 4), "float32")
    c.raises((RuntimeError,), lambda: comm.all_reduce(x, x, "nop"), "unknown op")
    c.raises((RuntimeError,), lambda: comm.all_reduce(x[:, ::2], xp.ones(8, "float32")),
             "in_array neither C- nor F-contiguous")
    z = xp.ones(4, "complex64")
    c.raises((ValueError,), lambda: comm.all_reduce(z, z, "max"), "max of complex arrays")
    c.raises((RuntimeError,), lambda: comm.all_reduce(x, xp.ones(3, "float32")),
             "out_array too small")


# -- reduce, broadcast ------------------------------------------------------------------------
def root_of(which: str) -> int:
    return 0 if which == "first" else n - 1


for _which in ("first", "last"):
    @item(f"reduce-root_{_which}")
    def _reduce(c: Check, which: str = _which) -> None:
        root = root_of(which)
        for op in ("sum", "prod", "max"):
            ins = inputs((2, 3), 20, "int64")
            out = dev(np.full((2, 3), -1, "int64"))
            comm.reduce(dev(ins[rank]), out, root, op)
            want = fold(ins, op) if rank == root else np.full((2, 3), -1, "int64")
            c.same(out, want, f"reduce {op} to {root} (others' out untouched)")

    @item(f"broadcast-root_{_which}")
    def _broadcast(c: Check, which: str = _which) -> None:
        root = root_of(which)
        ins = inputs((2, 3, 4), 21, "float64")
        x = dev(ins[rank])
        comm.broadcast(x, root)
        c.same(x, ins[root], f"broadcast from {root}")
        y = dev(ins[rank], "F")
        comm.broadcast(y, np.int64(root))
        c.same(y, ins[root], "F order, root a NumPy integer")


# -- reduce_scatter, all_gather (count) -------------------------------------------------------
@item("reduce_scatter-count")
def _reduce_scatter(c: Check) -> None:
    ins = inputs((n, 10), 30)
    out = xp.zeros(10, "float32")
    comm.reduce_scatter(dev(ins[rank]), out, 10)
    c.same(out, fold(ins, "sum")[rank], "in (n, count), out (count,)")
    ins = inputs((n * 4 + 3,), 31)  # more elements than count x n: the first ones
    out = dev(np.full(6, -1, "float32"))
    comm.reduce_scatter(dev(ins[rank]), out, np.int64(4), "max")
    want = fold([a[:n * 4] for a in ins], "max")[rank * 4:(rank + 1) * 4]
    c.same(out, np.concatenate([want, np.full(2, -1, "float32")]),
           "the first count x n of in_array, into out's first count")


@item("all_gather-count")
def _all_gather(c: Check) -> None:
    ins = [(r + 1) * np.arange(n * 10, dtype="float32").reshape(n, 10) for r in range(n)]
    out = xp.zeros((n, 10), "float32")
    comm.all_gather(dev(ins[rank]), out, 10)
    c.same(out, np.stack([a.reshape(-1)[:10] for a in ins]), "the first count elements")
    ins = inputs((3, 2), 32, "int32")
    out = dev(np.full(n * 6 + 1, -1, "int32"))
    comm.all_gather(dev(ins[rank], "F"), out, np.int64(6))
    want = np.concatenate([memory(a, "F") for a in ins] + [np.full(1, -1, "int32")])
    c.same(out, want, "F-ordered in_array, larger out_array")


# -- scatter, gather, all_to_all --------------------------------------------------------------
for _which in ("first", "last"):
    @item(f"scatter-root_{_which}")
    def _scatter(c: Check, which: str = _which) -> None:
        root = root_of(which)
        ins = inputs((n, 2, 5), 40 + root)
        out = xp.zeros(10, "float32")
        comm.scatter(dev(ins[rank]), out, root)
        c.same(out, ins[root][rank].reshape(-1), f"block {rank} of root {root}'s in_array")

    @item(f"gather-root_{_which}")
    def _gather(c: Check, which: str = _which) -> None:
        root = root_of(which)
        ins = inputs((10,), 42 + root, "int64")
        out = dev(np.full((n, 10), -1, "int64"))
        comm.gather(dev(ins[rank]), out, root)
        want = np.stack(ins) if rank == root else np.full((n, 10), -1, "int64")
        c.same(out, want, f"every rank's in_array on root {root}")


@item("all_to_all-blocks")
def _all_to_all(c: Check) -> None:
    ins = inputs((n, 3, 2), 44, "float64")
    out = xp.zeros((n, 3, 2), "float64")
    comm.all_to_all(dev(ins[rank]), out)
    c.same(out, np.stack([ins[q][rank] for q in range(n)]), "block rank of every rank's")


@item("blocks-errors")
def _block_errors(c: Check) -> None:
    wrong, right = xp.zeros((n + 1, 4), "float32"), xp.zeros((n, 4), "float32")
    c.raises((RuntimeError,), lambda: comm.scatter(wrong, xp.zeros(4, "float32"), 0),
             "scatter: in_array's first dimension is not n")
    c.raises((RuntimeError,), lambda: comm.gather(xp.zeros(4, "float32"), wrong, 0),
             "gather: out_array's first dimension is not n")
    c.raises((RuntimeError,), lambda: comm.all_to_all(right, wrong),
             "all_to_all: out_array's first dimension is not n")


# -- point to point ---------------------------------------------------------------------------
@item("send_recv-every_peer")
def _send_recv(c: Check) -> None:
    ins = inputs((2, 5), 50)
    for peer in range(n):  # this rank too: a copy
        out = xp.zeros(10, "float32")
        comm.send_recv(dev(ins[rank]), out, peer)
        c.same(out, ins[peer].reshape(-1), f"send_recv with {peer}")


@item("send-recv")
def _send_and_recv(c: Check) -> None:
    ins = inputs((2, 5), 51, "int64")
    if rank == 0:
        comm.send(dev(ins[0]), 1)
    elif rank == 1:
        out = xp.zeros(10, "int64")
        comm.recv(out, np.int64(0))
        c.same(out, ins[0].reshape(-1), "recv of rank 0's (2, 5) into (10,)")
    c.ok(True, "sent")


# -- barrier ----------------------------------------------------------------------------------
@item("barrier-host_waits")
def _barrier(c: Check) -> None:
    mark = outdir / "barrier-mark"
    comm.barrier()
    if rank == 0:
        time.sleep(0.2)
        mark.write_text("there")
    comm.barrier()
    c.ok(mark.is_file(), "rank 0's write before the barrier is seen after it")


# -- sparse matrices --------------------------------------------------------------------------
def sp(dense: np.ndarray, fmt: str = "csr", kind: str = "matrix") -> Any:
    """A sparse matrix of `dense` where the arrays live."""
    return getattr(sparse, f"{fmt}_{kind}")(dev(dense))


def empty(fmt: str = "csr", dtype: str = "float32") -> Any:
    data, idx = xp.zeros(0, dtype), xp.zeros(0, "int32")
    if fmt == "coo":
        return sparse.coo_matrix((data, (idx, idx.copy())), shape=(0, 0))
    return getattr(sparse, f"{fmt}_matrix")((data, idx, xp.zeros(1, "int32")), shape=(0, 0))


def dense_inputs(seed: int) -> list[np.ndarray]:
    out = []
    for r in range(n):
        rng = np.random.default_rng([seed, r])
        a = rng.integers(1, 4, (4, 4)).astype("float32")
        a[rng.random((4, 4)) < 0.5] = 0
        out.append(a)
    return out


for _fmt in ("csr", "csc", "coo"):
    @item(f"sparse-send_recv-{_fmt}")
    def _sparse_p2p(c: Check, fmt: str = _fmt) -> None:
        ins = dense_inputs(60)
        out = empty(fmt)
        partner = rank ^ 1 if rank ^ 1 < n else rank  # pairs; the odd one out: itself
        comm.send_recv(sp(ins[rank], fmt), out, partner)
        c.same(out.todense(), ins[partner], "send_recv with the partner")
        if n > 1:
            if rank == 0:
                comm.send(sp(ins[0], fmt), 1)
            elif rank == 1:
                got = empty(fmt)
                comm.recv(got, 0)
                c.same(got.todense(), ins[0], "recv from rank 0")

    @item(f"sparse-broadcast-{_fmt}")
    def _sparse_broadcast(c: Check, fmt: str = _fmt) -> None:
        ins = dense_inputs(61)
        m = sp(ins[rank], fmt) if rank == n - 1 else empty(fmt)
        comm.broadcast(m, n - 1)
        c.same(m.todense(), ins[n - 1], "from the last rank")

    @item(f"sparse-reduce-{_fmt}")
    def _sparse_reduce(c: Check, fmt: str = _fmt) -> None:
        ins = dense_inputs(62)
        for op in ("sum", "prod"):
            out = empty(fmt)
            comm.reduce(sp(ins[rank], fmt), out, 0, op)
            if rank == 0:  # prod of spmatrix: the matrix product, in rank order
                want = sum(ins[1:], ins[0]) if op == "sum" else \
                    functools.reduce(np.matmul, ins)
                c.same(out.todense(), want.astype("float32"), f"reduce {op} to 0")
        c.raises((ValueError,), lambda: comm.reduce(sp(ins[rank], fmt), empty(fmt), 0, "max"),
                 "max of sparse matrices")

    @item(f"sparse-all_reduce-{_fmt}")
    def _sparse_all_reduce(c: Check, fmt: str = _fmt) -> None:
        ins = dense_inputs(63)
        out = empty(fmt)
        comm.all_reduce(sp(ins[rank], fmt), out)
        c.same(out.todense(), sum(ins[1:], ins[0]), "all_reduce sum")


@item("sparse-all_reduce-prod_sparray")
def _sparse_all_reduce_array(c: Check) -> None:
    ins = dense_inputs(64)
    out = sparse.csr_array((xp.zeros(0, "float32"), xp.zeros(0, "int32"),
                            xp.zeros(1, "int32")), shape=(0, 0))
    comm.all_reduce(sp(ins[rank], "csr", "array"), out, "prod")
    c.same(out.todense(), fold(ins, "prod"), "prod of sparray: element-wise")


@item("sparse-scatter_gather")
def _sparse_scatter_gather(c: Check) -> None:
    ins = dense_inputs(65)
    out = empty()
    comm.scatter([sp(a) for a in ins] if rank == 0 else [], out, 0)
    c.same(out.todense(), ins[rank], "scatter from 0")
    gathered: list[Any] = []
    comm.gather(sp(ins[rank]), gathered, n - 1)
    if rank == n - 1:
        c.ok(len(gathered) == n, "gather appends n matrices")
        for r, m in enumerate(gathered):
            c.same(m.todense(), ins[r], f"gathered {r}")


@item("sparse-all_gather_all_to_all")
def _sparse_all(c: Check) -> None:
    ins = dense_inputs(66)
    gathered: list[Any] = []
    comm.all_gather(sp(ins[rank]), gathered, 0)
    c.ok(len(gathered) == n, "all_gather appends n matrices")
    for r, m in enumerate(gathered):
        c.same(m.todense(), ins[r], f"all_gathered {r}")
    blocks = [dense_inputs(67 + q) for q in range(n)]  # blocks[j][r]: rank r's for rank j
    swapped: list[Any] = []
    comm.all_to_all([sp(blocks[j][rank]) for j in range(n)], swapped)
    for q, m in enumerate(swapped):
        c.same(m.todense(), blocks[rank][q], f"all_to_all from {q}")


@item("sparse-reduce_scatter")
def _sparse_reduce_scatter(c: Check) -> None:
    blocks = [dense_inputs(80 + j) for j in range(n)]  # blocks[j][r]: rank r's j-th matrix
    out = empty()
    comm.reduce_scatter([sp(blocks[j][rank]) for j in range(n)], out, 0)
    c.same(out.todense(), sum(blocks[rank][1:], blocks[rank][0]), "block rank of the sums")


# -- stop -------------------------------------------------------------------------------------
@item("stop-then_calls_fail")
def _stop(c: Check) -> None:
    comm.stop()
    c.raises((gpuring.CommunicatorClosedError,), lambda: comm.barrier(), "a call after stop")


def main() -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    stopped = None
    with open(outdir / f"results-{rank}.jsonl", "w") as results:
        for name, body in ITEMS:
            record: dict[str, Any] = {"id": name, "failures": [], "checked": 0, "error": None,
                                      "not_run": stopped}
            if stopped is None:
                check = Check()
                try:
                    body(check)
                except Exception:
                    record["error"] = traceback.format_exc(limit=-6)
                    stopped = f"not run: {name} raised on rank {rank}"
                record.update(failures=check.failures, checked=check.checked)
            results.write(json.dumps(record) + "\n")
            results.flush()
    (outdir / f"done-{rank}").write_text("done")


if __name__ == "__main__":
    setup(sys.argv)
    main()
    os._exit(0)  # as a multiprocessing child ends: no atexit

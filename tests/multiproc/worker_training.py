"""Rank program of the training-feature tests: `worker_training.py CASE OUTDIR`.

Cases for async work, fusion, compression, the timeline and interop. Results are checked on
each rank against references rebuilt from shared seeds (see harness.Checker); digests of the
results every rank shares go to OUTDIR/CASE-RANK.txt for the cross-rank comparison.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from harness import Checker, dev, host, run_case

import gpuring
from gpuring._compression import unit_roundoff


def case_async(c: Checker) -> None:
    """Several outstanding async collectives of every kind, waited in any order, with sync
    calls in between; results equal the sync verbs'."""
    comm, n, r = c.comm, c.comm.size, c.comm.rank
    for rep in range(20):
        seed = 10 * rep
        a = c.inputs("float32", (1000 + rep,), seed)
        b = c.inputs("int64", (n * 40,), seed + 1)
        g = c.inputs("int16", (3, 5), seed + 2)
        root = rep % n
        x_bcast = dev(c, g[r].copy())
        ar, br, gr = dev(c, a[r]), dev(c, b[r]), dev(c, g[r])
        works = [
            comm.all_reduce_async(ar),
            comm.reduce_scatter_async(br, op="max"),
            comm.all_gather_async(gr),
            comm.broadcast_async(x_bcast, root=root),
            comm.reduce_async(br, op="sum", root=root),
            comm.all_reduce_async(br, op="avg"),
        ]
        # a sync call while work is outstanding runs after it, on every rank
        c.expect(comm.all_reduce(br, op="min"), c.reduce_reference(b, "min"),
                 f"sync between async {rep}")
        order = list(range(len(works)))
        if rep % 2:
            order.reverse()
        got = {i: works[i].wait() for i in order}
        assert all(w.done() for w in works)
        c.expect(got[0], c.reduce_reference(a, "sum"), f"async all_reduce {rep}")
        c.expect(got[1], c.reduce_reference(b, "max").reshape(n, -1)[r],
                 f"async reduce_scatter {rep}", shared=False)
        c.expect(got[2], np.stack(g), f"async all_gather {rep}", copy=True)
        assert got[3] is x_bcast
        c.expect(got[3], g[root], f"async broadcast {rep}", copy=True)
        if r == root:
            c.expect(got[4], c.reduce_reference(b, "sum"), f"async reduce {rep}", shared=False)
        else:
            assert got[4] is None
        c.expect(got[5], c.reduce_reference(b, "avg"), f"async avg {rep}")
        assert works[0].result() is got[0]
    # many outstanding at once, then the module-level twin
    ins = [c.inputs("int32", (257,), 900 + i) for i in range(50)]
    works = [comm.all_reduce_async(dev(c, x[r])) for x in ins]
    for i in reversed(range(50)):
        c.expect(works[i].wait(timeout=120), c.reduce_reference(ins[i], "sum"), f"burst {i}")
    c.expect(gpuring.all_reduce_async(dev(c, ins[0][r])).wait(),
             c.reduce_reference(ins[0], "sum"), "module all_reduce_async")


def case_async_mismatch(c: Checker) -> None:
    """Async work submitted in a different order on one rank: every rank's wait() raises
    CollectiveMismatchError, and the communicator still works afterwards."""
    comm, r = c.comm, c.comm.rank
    a = dev(c, np.ones(7, np.float32))
    b = dev(c, np.ones(5, np.int32))
    if r == 1:
        works = [comm.all_gather_async(b), comm.all_reduce_async(a)]
    else:
        works = [comm.all_reduce_async(a), comm.all_gather_async(b)]
    for w in works:
        try:
            w.wait()
        except gpuring.CollectiveMismatchError as exc:
            assert "collective" in exc.differences, exc.differences
            c.digests.append("mismatch raised")
        else:
            raise AssertionError("no CollectiveMismatchError from wait()")
    c.expect(comm.all_reduce_async(dev(c, np.full(3, r, np.int64))).wait(),
             np.full(3, sum(range(comm.size)), np.int64), "after async mismatch")


def case_fusion(c: Checker) -> None:
    """all_reduce_many: mixed dtypes and shapes, several buffer sizes; integers identical to
    separate calls, floats within rounding, input order kept."""
    comm, r = c.comm, c.comm.rank
    specs = [("int32", (10,)), ("float32", (33, 3)), ("int64", ()), ("float64", (0,)),
             ("uint8", (7,)), ("int32", (2000,)), ("float32", (5,)), ("float64", (129,)),
             ("int32", (1,)), ("float32", (4000,))]
    for limit in (None, 64, 1000, 1 << 20):
        for op in ("sum", "avg", "max"):
            seed = 300 + (limit or 7) + len(op)
            ins = [c.inputs(dt, shape, seed + i, op) for i, (dt, shape) in enumerate(specs)]
            got = comm.all_reduce_many([dev(c, x[r]) for x in ins], op=op,
                                       fusion_bytes=limit)
            assert len(got) == len(ins)
            for i, (x, res) in enumerate(zip(ins, got, strict=True)):
                assert res.dtype == x[r].dtype and res.shape == x[r].shape
                if res.dtype.kind in "iu":
                    separate = comm.all_reduce(dev(c, x[r]), op=op)
                    assert np.array_equal(host(res), host(separate)), \
                        f"fused {i} differs from separate"
                c.expect(res, c.reduce_reference(x, op), f"fused {limit} {op} {i}")
    c.expect(gpuring.all_reduce_many([dev(c, np.full(2, r, np.int16))])[0],
             np.full(2, sum(range(comm.size)), np.int16), "module all_reduce_many")


def case_compression(c: Checker) -> None:
    """fp16/bf16 wire formats: every element within (n+1)·u·Σ|x_r| of the float64 result."""
    comm, n, r = c.comm, c.comm.size, c.comm.rank
    seed = 500
    try:
        import ml_dtypes  # noqa: F401
        formats = ("fp16", "bf16")
    except ImportError:  # bf16 on the CPU needs ml_dtypes
        formats = ("fp16",)
    for compression in formats:
        u = unit_roundoff(compression)
        for dtype in ("float32", "float64"):
            for op in ("sum", "avg"):
                for size in (1, 1000, 300_001):
                    seed += 1
                    ins = c.inputs(dtype, (size,), seed)
                    want = c.reduce_reference(ins, op)
                    scale = sum(np.abs(x.astype(np.float64)) for x in ins)
                    if op == "avg":
                        scale = scale / n
                    bound = (n + 1) * u * scale + 1e-30
                    x = dev(c, ins[r].copy())
                    got = host(comm.all_reduce(x, op=op, compression=compression,
                                               out=x if size == 1000 else None))
                    assert got.dtype == np.dtype(dtype) and got.shape == want.shape
                    err = np.abs(got.astype(np.float64) - want.value)
                    assert np.all(err <= bound), (compression, dtype, op, size,
                                                  float((err / bound).max()))
                    digest = hashlib.sha256(got.tobytes()).hexdigest()
                    c.digests.append(f"{compression} {dtype} {op} {size} {digest}")
    # fp16 overflows above 65504, as documented
    big = dev(c, np.full(4, 40000.0, np.float32))
    assert np.isinf(host(comm.all_reduce(big, compression="fp16"))).all()


def case_timeline(c: Checker) -> None:
    """start/stop_timeline around collectives of one and several rounds."""
    comm = c.comm
    path = os.path.join(os.path.dirname(c.path), "trace.json")
    comm.start_timeline(path)
    comm.all_reduce(np.ones(10, np.float32))
    comm.all_reduce(np.ones(300_000, np.float32))  # several rounds of the 64K buffer
    comm.all_gather(np.ones(5000, np.int32))
    comm.all_reduce_async(np.ones(100, np.float64)).wait()
    comm.barrier()
    written = comm.stop_timeline()
    assert written == (path if comm.rank == 0 else None), written
    comm.all_reduce(np.ones(10, np.float32))  # not recorded
    c.digests.append("timeline done")


def case_timeline_env(c: Checker) -> None:
    """GPURING_TIMELINE: recording from init(), written at close()."""
    c.comm.all_reduce(np.ones(70_000, np.float32))
    c.comm.reduce_scatter(np.ones(c.comm.size * 10, np.int64))
    c.digests.append("timeline env done")


def case_torch(c: Checker) -> None:
    """torch tensors in and out of the collectives, and allreduce_gradients."""
    import torch

    import gpuring.torch

    comm, n, r = c.comm, c.comm.size, c.comm.rank
    ins = c.inputs("float32", (6, 4), 700)
    t = torch.from_numpy(ins[r].copy())
    got = comm.all_reduce(t)
    assert isinstance(got, torch.Tensor)
    c.expect(got.numpy(), c.reduce_reference(ins, "sum"), "torch all_reduce")
    assert comm.all_reduce(t, out=t) is t
    c.expect(t.numpy(), c.reduce_reference(ins, "sum"), "torch in place")
    gathered = comm.all_gather_async(torch.arange(3) + r).wait()
    assert isinstance(gathered, torch.Tensor)
    c.expect(gathered.numpy(), np.stack([np.arange(3) + k for k in range(n)]),
             "torch all_gather", copy=True)
    b = torch.full((4,), float(r))
    assert comm.broadcast(b, root=n - 1) is b
    c.expect(b.numpy(), np.full(4, n - 1, np.float32), "torch broadcast", copy=True)
    many = comm.all_reduce_many([torch.ones(3) * r, torch.arange(4)], op="sum")
    assert all(isinstance(m, torch.Tensor) for m in many)
    c.expect(many[1].numpy(), np.arange(4) * n, "torch many")

    torch.manual_seed(0)  # same weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    data = [torch.from_numpy(x) for x in c.inputs("float32", (5, 4), 701)]
    model(data[r]).pow(2).sum().backward()
    gpuring.torch.allreduce_gradients(model, fusion_bytes=100)
    for k, param in enumerate(model.parameters()):
        grads = []
        for x in data:  # every rank's gradient, on a fresh copy of the same model
            torch.manual_seed(0)
            ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                      torch.nn.Linear(8, 2))
            ref(x).pow(2).sum().backward()
            grads.append(list(ref.parameters())[k].grad.numpy().copy())
        c.expect(param.grad.numpy(), c.reduce_reference(grads, "avg"), f"torch grad {k}")


def _cuda_torch():
    """torch with CUDA on a GPU; on the CUDA simulator its stand-in (a real torch cannot run
    on simulated devices, and may not even import beside the simulator's driver module)."""
    import cupy

    if not cupy.__version__.endswith("+cudasim"):
        import torch

        return torch
    import fake_torch  # tests/cudasim: installs itself as `torch`

    return fake_torch


def case_torch_stream(c: Checker) -> None:
    """torch CUDA tensors used on a torch stream that is not CuPy's current one: the
    collective starts after the caller's torch work and torch work queued after the call sees
    the result, in place (no DLPack conversion on the way back), out of place and async.
    Rank 1 enters late, so a result read on the torch stream too early reads stale data."""
    import time

    import cupy

    torch = _cuda_torch()
    comm, r = c.comm, c.comm.rank
    c.uses_other_gpus = True  # below, GPU 0 is current while the tensors live elsewhere
    ins = c.inputs("float32", (4096,), 800)
    want = c.reduce_reference(ins, "sum")
    comm.all_reduce(cupy.ones(4096, cupy.float32))  # set up: the ranks meet here, not below
    comm.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = cupy.cuda.ExternalStream(side.cuda_stream, comm.local_rank %
                                           cupy.cuda.runtime.getDeviceCount())
        for how in ("in place", "out of place", "async"):
            with on_side:  # the tensor's data, written on the torch stream
                x = torch.from_dlpack(cupy.asarray(ins[r]))
            if r == 1:
                time.sleep(0.5)  # the collective cannot complete before rank 1 is in
            with cupy.cuda.Device(0):  # the caller's current GPU need not be the tensor's
                if how == "in place":
                    got = comm.all_reduce(x, out=x)
                elif how == "out of place":
                    got = comm.all_reduce(x)
                else:
                    got = comm.all_reduce_async(x, out=x).wait()
            with on_side:  # torch work on the torch stream, queued right after the call
                seen = cupy.from_dlpack(got).copy()
            side.synchronize()
            c.expect(seen, want, f"torch stream, {how}")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main() -> None:
    run_case(CASES)


if __name__ == "__main__":
    main()

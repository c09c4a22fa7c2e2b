"""A process of a torch.distributed job on the "gpuring" backend, set up as torchrun sets
its workers up (`env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE): `worker_torch.py CASE [cpu|cuda]`. `verbs`: every torch.distributed call the
backend serves, checked against NumPy on random integers (exact in the dtypes used);
`ddp`: DistributedDataParallel on "gpuring" beside the same training on a "gloo" group, the
parameters compared after every step. Prints `rank R: CASE ok`."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import gpuring
import gpuring.torch
from gpuring._status import process_alive


def ints(shape, seed, dtype=torch.float32):
    return [torch.from_numpy(np.random.default_rng([seed, r]).integers(-40, 40, shape))
            .to(dtype).to(device) for r in range(n)]


def same(got, want, what):
    assert got.dtype == want.dtype and torch.equal(got, want), (what, got, want)


def verbs() -> None:
    for seed, dtype in enumerate([torch.float32, torch.int64]):
        ins = ints((5, 3), seed, dtype)
        total = sum(ins[1:], ins[0].clone())
        t = ins[rank].clone()
        dist.all_reduce(t)
        same(t, total, "all_reduce")
        t = ins[rank].clone()
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        same(t, torch.stack(ins).amax(0), "all_reduce async max")
        outs = [torch.empty_like(ins[0]) for _ in range(n)]
        dist.all_gather(outs, ins[rank])
        for q in range(n):
            same(outs[q], ins[q], "all_gather list")
        flat = torch.empty((n * 5, 3), dtype=dtype)
        dist.all_gather_single(flat, ins[rank])
        same(flat, torch.cat(ins), "all_gather_single")
        for root in range(n):
            b = ins[rank].clone()
            dist.broadcast(b, src=root)
            same(b, ins[root], "broadcast")
            r = ins[rank].clone()
            dist.reduce(r, dst=root, op=dist.ReduceOp.SUM)
            if rank == root:
                same(r, total, "reduce")
        blocks = ints((n, 4), 10 + seed, dtype)
        out = torch.empty(4, dtype=dtype)
        dist.reduce_scatter(out, list(blocks[rank]))
        same(out, torch.stack(blocks).sum(0)[rank], "reduce_scatter list")
        out = torch.empty(4, dtype=dtype)
        dist.reduce_scatter_single(out, blocks[rank].reshape(-1))
        same(out, torch.stack(blocks).sum(0)[rank], "reduce_scatter_single")
        got = [torch.empty(4, dtype=dtype) for _ in range(n)]
        dist.all_to_all(got, list(blocks[rank]))
        for q in range(n):
            same(got[q], blocks[q][rank], "all_to_all list")
        got = torch.empty((n, 4), dtype=dtype)
        dist.all_to_all_single(got, blocks[rank])
        same(got, torch.stack([blocks[q][rank] for q in range(n)]), "all_to_all_single")
        # uneven: rank q sends (q + j) % 3 + 1 rows to rank j
        rows = [[(q + j) % 3 + 1 for j in range(n)] for q in range(n)]
        sent = [ints((sum(rows[q]), 2), 20 + seed, dtype)[q] for q in range(n)]
        got = torch.empty((sum(rows[q][rank] for q in range(n)), 2), dtype=dtype)
        dist.all_to_all_single(got, sent[rank], [rows[q][rank] for q in range(n)], rows[rank])
        want = [torch.split(sent[q], rows[q])[rank] for q in range(n)]
        same(got, torch.cat(want), "all_to_all_single uneven")
        gathered = [torch.empty(4, dtype=dtype) for _ in range(n)] if rank == 0 else None
        dist.gather(blocks[rank][0], gathered, dst=0)
        if rank == 0:
            for q in range(n):
                same(gathered[q], blocks[q][0], "gather")
        out = torch.empty(4, dtype=dtype)
        dist.scatter(out, list(blocks[n - 1]) if rank == n - 1 else None, src=n - 1)
        same(out, blocks[n - 1][rank], "scatter")
        if n > 1:
            if rank == 0:
                dist.send(ins[0], dst=1)
            elif rank == 1:
                got = torch.empty_like(ins[0])
                dist.recv(got, src=0)
                same(got, ins[0], "recv")
        dist.barrier()
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # beyond gloo
    same(t, torch.full((3,), (n - 1) / 2), "avg")
    evens = dist.new_group([q for q in range(n) if q % 2 == 0], backend="gpuring")
    if rank % 2 == 0:
        t = torch.tensor([rank])
        dist.all_reduce(t, group=evens)
        same(t, torch.tensor([sum(range(0, n, 2))]), "new_group all_reduce")
    if n > 1:
        try:
            dist.all_reduce(torch.ones(3 + (rank == 1)))
        except gpuring.CollectiveMismatchError as exc:
            assert "shape" in exc.differences, exc.differences
        else:
            raise AssertionError("no CollectiveMismatchError for another shape")


def p2p() -> None:
    """Point to point as torch users write it: batch_isend_irecv with the receive listed
    first (a ring shift both ways), isend/irecv with tags received out of order, recv from
    any source (its return value the sender), a receive into a tensor that is not
    contiguous, complex tensors."""
    right, left = (rank + 1) % n, (rank - 1) % n
    for count, dtype in ((7, torch.float32), (300000, torch.int64), (5, torch.complex64)):
        mine = ints((count,), 40 + count, torch.float64)
        x = mine[rank].to(dtype)
        from_left = torch.zeros(count, dtype=dtype)
        from_right = torch.zeros(count, dtype=dtype)
        ops = [dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right),
               dist.P2POp(dist.isend, x, right), dist.P2POp(dist.isend, x, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        same(from_left, mine[left].to(dtype), f"batch_isend_irecv from the left {dtype}")
        same(from_right, mine[right].to(dtype), f"batch_isend_irecv from the right {dtype}")
    if rank == 0:  # tags: rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first
        works = [dist.isend(torch.full((3,), float(k)), dst=1, tag=k) for k in (1, 2)]
        for work in works:
            work.wait()
    elif rank == 1:
        second, first = torch.zeros(3), torch.zeros(3)
        dist.irecv(second, src=0, tag=2).wait()
        dist.irecv(first, src=0, tag=1).wait()
        same(second, torch.full((3,), 2.0), "tag 2 received first")
        same(first, torch.full((3,), 1.0), "tag 1 received second")
    if rank == 0:  # any source: every other rank sends its rank
        senders = set()
        for _ in range(n - 1):
            got = torch.zeros(2, dtype=torch.int64)
            sender = dist.recv(got, tag=9)
            same(got, torch.full((2,), sender, dtype=torch.int64), "recv from any source")
            senders.add(sender)
        assert senders == set(range(1, n)), senders
    else:
        dist.send(torch.full((2,), rank, dtype=torch.int64), dst=0, tag=9)
    strided = torch.zeros((4, 2))[:, 0]
    dist.batch_isend_irecv([dist.P2POp(dist.irecv, strided, left),
                            dist.P2POp(dist.isend, torch.arange(4.0) + rank, right)])[0].wait()
    same(strided, torch.arange(4.0) + left, "irecv into a tensor that is not contiguous")
    dist.barrier()


def ddp() -> None:
    gloo = dist.new_group(backend="gloo")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3))

    ours = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.001)
    theirs = torch.nn.parallel.DistributedDataParallel(model(), process_group=gloo,
                                                       bucket_cap_mb=0.001)
    assert ours.process_group.name() == "gpuring"
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    for step in range(5):
        rng = np.random.default_rng([step, rank])  # every rank its own batch
        x = torch.from_numpy(rng.standard_normal((8, 6)).astype(np.float32))
        y = torch.from_numpy(rng.standard_normal((8, 3)).astype(np.float32))
        for m, opt in zip((ours, theirs), optimizers, strict=True):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            if n <= 2:  # one addition per element: the same bits whatever the order
                same(p.detach(), q.detach(), f"ddp step {step}")
            else:
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    start = [p.detach().clone() for p in ours.parameters()]
    everyone = [[torch.empty_like(p) for _ in range(n)] for p in start]
    for p, gathered in zip(start, everyone, strict=True):
        dist.all_gather(gathered, p, group=gloo)
        for g in gathered:
            same(g, p, "ddp parameters alike on every rank")


def until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def leave() -> None:
    """Rank 0 ends its process right after its last call (`os._exit`: no destroy, as a
    multiprocessing child ends); the others make that call once it is gone and get its data.
    The group's control-plane server, which rank 0 started in a process of its own, serves
    them until they destroy the group, and then ends."""
    server = dist.distributed_c10d._get_default_group()._server  # (rank 0's)
    pids = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(pids, torch.tensor([os.getpid(), server.process.pid if rank == 0 else 0]))
    rank0, served_by = (int(p) for p in pids[0])
    data = torch.from_numpy(np.random.default_rng(7).standard_normal(1000))
    x = data.clone() if rank == 0 else torch.zeros_like(data)
    dist.broadcast(x, 0)  # (agreed with every rank: the next one needs nothing of them)
    x = data * 2 if rank == 0 else torch.zeros_like(data)
    if rank == 0:
        dist.broadcast(x, 0)
        print(f"rank {rank}: {case} ok", flush=True)
        os._exit(0)
    until(lambda: not process_alive(rank0), "rank 0's process did not end")
    time.sleep(0.5)
    assert process_alive(served_by), "the group's server ended with rank 0's process"
    dist.broadcast(x, 0)
    same(x, data * 2, "broadcast after rank 0 ended")
    dist.destroy_process_group()
    until(lambda: not process_alive(served_by), "the group's server outlived every rank's leaving")
    print(f"rank {rank}: {case} ok", flush=True)
    sys.exit(0)


case = sys.argv[1]
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
if device == "cuda":  # tensors on this rank's GPU, made current before the group, as usual
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) %
                          torch.cuda.device_count())
    torch.set_default_device("cuda")
dist.init_process_group("gpuring")
rank, n = dist.get_rank(), dist.get_world_size()
{"verbs": verbs, "ddp": ddp, "p2p": p2p, "leave": leave}[case]()
dist.destroy_process_group()
print(f"rank {rank}: {case} ok", flush=True)

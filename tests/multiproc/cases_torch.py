"""Named items of torch.distributed on the "gpuring" backend against "gloo", in the same
processes: the default group is gpuring's, and a gloo group of every rank stands beside it
(`Twin`); each item makes one torch.distributed call the backend serves on both, with the
same fresh random inputs, and compares gpuring's results with gloo's.

What "the same" means: integers, bools, min and max, and everything that only moves data,
bit for bit. Float sums, products and averages too on 2 ranks (one operation per element,
whatever the order: a + b is b + a); on more ranks the two backends may add up in other
orders, so there each result is held to the exact value of tests/reference.py within its
rounding bound instead (and gloo's as well, which checks the bound). Reductions are held to
the reference on 2 ranks too.

The items follow torch.distributed's documented contracts (the docs of each call), and run
in processes started as torchrun starts them (the launch's group: tests/multiproc/named.py);
the last one destroys the process groups.
"""

from __future__ import annotations

import atexit
import datetime
import re
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from harness import Item, ItemChecker, Plan
from reference import Reduction, reduction

import gpuring
import gpuring.torch

# deprecation notices of calls we make on purpose (all_gather_into_tensor, the coalesced
# verbs), and the sparse constructor's note on invariant checks, would go to stderr
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message="Sparse invariant checks")

R = dist.ReduceOp
#: torch's reduce ops by name, and what each is on the gpuring side of tests/reference.py
OPS = {"SUM": (R.SUM, "sum"), "PRODUCT": (R.PRODUCT, "prod"), "MIN": (R.MIN, "min"),
       "MAX": (R.MAX, "max"), "AVG": (R.AVG, "avg"), "BAND": (R.BAND, None),
       "BOR": (R.BOR, None), "BXOR": (R.BXOR, None)}
#: dtypes each op is checked on (gloo's: AVG only on floats, the bitwise ops on integers)
REAL = ["float32", "float64", "float16", "bfloat16"]
WHOLE = ["int8", "int32", "int64", "uint8", "bool"]
DTYPES_OF = {"SUM": [*REAL, *WHOLE, "complex64"], "PRODUCT": [*REAL, *WHOLE],
             "MIN": [*REAL, *WHOLE], "MAX": [*REAL, *WHOLE], "AVG": [*REAL, "complex64"],
             "BAND": WHOLE, "BOR": WHOLE, "BXOR": WHOLE}
#: what a c10d timeout's message holds (the words torch's own suite looks for)
TIMED_OUT = re.compile(" (Timed out|closed|timeout) ")
TIMEOUT = datetime.timedelta(seconds=60)
#: the timeout of the group made to time out (as torch's suite makes its subgroups')
SHORT = datetime.timedelta(seconds=5)


class Twin:
    """The default group (gpuring's) and a gloo group of the same ranks, made once."""

    made: Twin | None = None

    def __init__(self) -> None:
        dist.init_process_group("gpuring", timeout=TIMEOUT)
        self.ours = dist.group.WORLD
        self.gloo = dist.new_group(backend="gloo", timeout=TIMEOUT)
        self.rank, self.n = dist.get_rank(), dist.get_world_size()

    @classmethod
    def get(cls) -> Twin:
        if cls.made is None:
            cls.made = cls()
            atexit.register(_destroy)  # where the item that destroys them was not selected
        return cls.made


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------ inputs, results

def inputs(c: ItemChecker, dtype: str, shape: tuple[int, ...], seed: int,
           op: str | None = "sum") -> list[np.ndarray]:
    """Every rank's input (random, never all zeros), as NumPy arrays."""
    if dtype == "bool":
        return [np.random.default_rng([seed, r]).integers(0, 2, shape).astype(bool)
                for r in range(c.comm.size)]
    return c.inputs(dtype, shape, seed, op or "sum")


def tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor holding a copy of `a` (bfloat16: ml_dtypes' as torch's)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def array(t: torch.Tensor) -> np.ndarray:
    """A NumPy copy of a CPU tensor (bfloat16 as ml_dtypes'; bools as True and False, whatever
    their bytes: gloo's bool sum leaves 2 for true and true)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8).numpy() != 0
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.numpy().copy()


def order_may_differ(n: int, dtype: torch.dtype, op: str | None) -> bool:
    """Whether two correct backends may round a reduction differently: a float sum, product
    or average of more than 2 ranks."""
    floating = dtype.is_floating_point or dtype.is_complex
    return floating and op in ("sum", "prod", "avg") and n > 2


def alike(c: ItemChecker, ours: torch.Tensor, theirs: torch.Tensor, what: str, *,
          exact: Reduction | None = None, op: str | None = None,
          shared: bool = True, ranks: int | None = None) -> None:
    """gpuring's result `ours` is gloo's `theirs`: bit for bit, unless the order of a float
    reduction (`op`, of `ranks` ranks: by default every rank) may differ (`order_may_differ`);
    and within rounding of the exact reduction (`exact`, when given; gloo's result too, where
    the order may differ)."""
    mine, gloos = array(ours), array(theirs)
    if exact is not None:
        c.expect(mine, exact, f"{what}: gpuring against the exact value", shared=shared)
    if order_may_differ(ranks or c.comm.size, ours.dtype, op):
        assert exact is not None, f"{what}: a float reduction of {c.comm.size} ranks needs " \
            "the exact value to be checked against"
        c.expect(gloos, exact, f"{what}: gloo against the exact value", shared=False)
        return
    c.expect(mine, gloos, f"{what}: gpuring against gloo", shared=shared)


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


def raised(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # what the call raised, to compare
        return exc
    return None


# ----------------------------------------------------------------------------- reductions

def reductions(plan: Plan) -> Iterator[Item]:
    """all_reduce with every ReduceOp on every dtype gloo takes it on (a large array too),
    reduce to every root, reduce_scatter (list form) and reduce_scatter_tensor."""
    n = plan.n
    for name, (torch_op, op) in OPS.items():
        yield Item.one(f"all_reduce-{name}", _all_reduce(name, torch_op, op))
    for name in ("SUM", "PRODUCT", "MAX", "BOR"):
        torch_op, op = OPS[name]
        yield Item.one(f"reduce-{name}", _reduce(n, name, torch_op, op))
    for name in ("SUM", "MIN", "AVG", "BXOR"):
        torch_op, op = OPS[name]
        yield Item.one(f"reduce_scatter-{name}", _reduce_scatter(n, name, torch_op, op, False))
        yield Item.one(f"reduce_scatter_tensor-{name}",
                       _reduce_scatter(n, name, torch_op, op, True))


def _exact(ins: list[np.ndarray], op: str | None) -> Reduction | None:
    """tests/reference.py's reduction, where it has one (not for bools, bitwise ops)."""
    if op is None or ins[0].dtype == bool:
        return None
    return reduction(ins, op)


def _all_reduce(name: str, torch_op: Any, op: str | None) -> Callable[[ItemChecker], None]:
    def body(c: ItemChecker) -> None:
        t = Twin.get()
        cases = [(dtype, (5, 7)) for dtype in DTYPES_OF[name]]
        if name == "SUM":
            cases += [("float32", (70001,)), ("int64", (3, 40000))]  # several buffer rounds
        for k, (dtype, shape) in enumerate(cases):
            ins = inputs(c, dtype, shape, seed_of(name) + k, op)
            results = []
            for group in (t.ours, t.gloo):
                x = tensor(ins[t.rank])
                dist.all_reduce(x, op=torch_op, group=group)
                results.append(x)
            alike(c, *results, f"all_reduce {name} {dtype} {shape}", exact=_exact(ins, op),
                  op=op)

    return body


def _reduce(n: int, name: str, torch_op: Any, op: str | None
            ) -> Callable[[ItemChecker], None]:
    def body(c: ItemChecker) -> None:
        t = Twin.get()
        dtypes = [d for d in ("float32", "int64", "int32", "bfloat16") if d in DTYPES_OF[name]]
        for k, dtype in enumerate(dtypes):
            for root in range(n):
                ins = inputs(c, dtype, (4, 9), seed_of(name) + 10 * k + root, op)
                results = []
                for group in (t.ours, t.gloo):
                    x = tensor(ins[t.rank])
                    dist.reduce(x, dst=root, op=torch_op, group=group)
                    results.append(x)
                if t.rank == root:  # (the others' tensors: unspecified)
                    alike(c, *results, f"reduce {name} {dtype} to {root}",
                          exact=_exact(ins, op), op=op, shared=False)

    return body


def _reduce_scatter(n: int, name: str, torch_op: Any, op: str | None, single: bool
                    ) -> Callable[[ItemChecker], None]:
    def body(c: ItemChecker) -> None:
        t = Twin.get()
        dtypes = [d for d in ("float32", "int32", "int64", "float16") if d in DTYPES_OF[name]]
        for k, dtype in enumerate(dtypes):
            ins = inputs(c, dtype, (n * 6,), seed_of(name) + 100 * single + k, op)
            results = []
            for group in (t.ours, t.gloo):
                out = torch.empty(6, dtype=tensor(ins[0]).dtype)
                x = tensor(ins[t.rank])
                if single:
                    dist.reduce_scatter_tensor(out, x, op=torch_op, group=group)
                else:
                    dist.reduce_scatter(out, list(x.chunk(n)), op=torch_op, group=group)
                results.append(out)
            exact = _exact(ins, op)
            alike(c, *results, f"reduce_scatter {name} {dtype}", op=op, shared=False,
                  exact=None if exact is None else exact.reshape(n, 6)[t.rank])

    return body


# ------------------------------------------------------------------------- moving data

def movement(plan: Plan) -> Iterator[Item]:
    """The calls that move data unreduced, on dtypes of every kind (bool and bfloat16 too):
    broadcast and gather and scatter from every root, all_gather (list and tensor), all_to_all
    (list, single tensor in even blocks and with split sizes), barrier."""
    n = plan.n
    dtypes = ["float32", "int64", "bool", "bfloat16", "complex64", "uint8", "float16"]
    yield Item.one("broadcast", _per_root(n, "broadcast", dtypes, _broadcast))
    yield Item.one("gather", _per_root(n, "gather", [d for d in dtypes if d != "complex64"],
                                       _gather))  # (gloo gathers no complex tensors)
    yield Item.one("scatter", _per_root(n, "scatter", dtypes, _scatter))
    yield Item.one("all_gather", _unrooted("all_gather", dtypes, _all_gather))
    yield Item.one("all_gather_into_tensor",
                   _unrooted("all_gather_into_tensor", dtypes, _all_gather_into_tensor))
    yield Item.one("all_to_all", _unrooted("all_to_all", dtypes, _all_to_all))
    yield Item.one("all_to_all_single-even",
                   _unrooted("all_to_all_single-even", dtypes, _all_to_all_single))
    yield Item.one("all_to_all_single-split_sizes",
                   _unrooted("all_to_all_single-split_sizes", dtypes, _all_to_all_split))
    yield Item.one("barrier", _barrier)


Move = Callable[[Twin, list[np.ndarray], Any, int], list[torch.Tensor]]


def _per_root(n: int, name: str, dtypes: list[str], move: Move
              ) -> Callable[[ItemChecker], None]:
    def body(c: ItemChecker) -> None:
        t = Twin.get()
        for k, dtype in enumerate(dtypes):
            for root in range(n):
                ins = inputs(c, dtype, (n, 3, 4), seed_of(name) + 10 * k + root)
                ours, theirs = (move(t, ins, group, root) for group in (t.ours, t.gloo))
                c.check(len(ours) == len(theirs), f"{name}: {len(ours)} results, gloo "
                        f"{len(theirs)}")
                for q, (a, b) in enumerate(zip(ours, theirs, strict=False)):
                    alike(c, a, b, f"{name} {dtype} from {root}: result {q}", shared=False)

    return body


def _unrooted(name: str, dtypes: list[str], move: Move) -> Callable[[ItemChecker], None]:
    def body(c: ItemChecker) -> None:
        t = Twin.get()
        for k, dtype in enumerate(dtypes):
            ins = inputs(c, dtype, (t.n, 6, 2), seed_of(name) + k)
            ours, theirs = (move(t, ins, group, 0) for group in (t.ours, t.gloo))
            c.check(len(ours) == len(theirs), f"{name}: {len(ours)} results, gloo "
                    f"{len(theirs)}")
            for q, (a, b) in enumerate(zip(ours, theirs, strict=False)):
                alike(c, a, b, f"{name} {dtype}: result {q}", shared=False)

    return body


def _broadcast(t: Twin, ins: list[np.ndarray], group: Any, root: int) -> list[torch.Tensor]:
    x = tensor(ins[t.rank])
    dist.broadcast(x, src=root, group=group)
    return [x]


def _gather(t: Twin, ins: list[np.ndarray], group: Any, root: int) -> list[torch.Tensor]:
    x = tensor(ins[t.rank])
    into = [torch.zeros_like(x) for _ in range(t.n)] if t.rank == root else None
    dist.gather(x, into, dst=root, group=group)
    return into or []


def _scatter(t: Twin, ins: list[np.ndarray], group: Any, root: int) -> list[torch.Tensor]:
    blocks = list(tensor(ins[t.rank]).unbind(0))
    out = torch.zeros_like(blocks[0])
    dist.scatter(out, blocks if t.rank == root else None, src=root, group=group)
    return [out]


def _all_gather(t: Twin, ins: list[np.ndarray], group: Any, _: int) -> list[torch.Tensor]:
    x = tensor(ins[t.rank])
    into = [torch.zeros_like(x) for _ in range(t.n)]
    dist.all_gather(into, x, group=group)
    return into


def _all_gather_into_tensor(t: Twin, ins: list[np.ndarray], group: Any, _: int
                            ) -> list[torch.Tensor]:
    x = tensor(ins[t.rank])
    into = torch.zeros((t.n * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_into_tensor(into, x, group=group)  # (gloo takes no stacked form)
    return [into]


def _all_to_all(t: Twin, ins: list[np.ndarray], group: Any, _: int) -> list[torch.Tensor]:
    blocks = list(tensor(ins[t.rank]).unbind(0))
    into = [torch.zeros_like(b) for b in blocks]
    dist.all_to_all(into, blocks, group=group)
    return into


def _all_to_all_single(t: Twin, ins: list[np.ndarray], group: Any, _: int
                       ) -> list[torch.Tensor]:
    x = tensor(ins[t.rank])
    into = torch.zeros_like(x)
    dist.all_to_all_single(into, x, group=group)
    return [into]


def _all_to_all_split(t: Twin, ins: list[np.ndarray], group: Any, _: int
                      ) -> list[torch.Tensor]:
    """Rank q sends (q + j) % 3 rows to rank j (none where that is 0), of a (6 * n, 2)
    tensor whose first rows go."""
    x = tensor(ins[t.rank]).reshape(-1, 2)
    send = [(t.rank + j) % 3 for j in range(t.n)]
    receive = [(q + t.rank) % 3 for q in range(t.n)]
    into = torch.zeros((sum(receive), 2), dtype=x.dtype)
    dist.all_to_all_single(into, x[:sum(send)], receive, send, group=group)
    return [into]


def _barrier(c: ItemChecker) -> None:
    t = Twin.get()
    for group in (t.ours, t.gloo):
        c.check(dist.barrier(group=group) is None, "barrier returned something")


# ------------------------------------------------------------------------------ coalesced

def coalesced(plan: Plan) -> Iterator[Item]:
    """The coalesced verbs: all_reduce_coalesced and all_gather_coalesced, and the
    coalescing manager's all_reduce, all_gather_into_tensor and reduce_scatter_tensor (which
    torch hands the process group as allreduce_coalesced, allgather_into_tensor_coalesced and
    reduce_scatter_tensor_coalesced), on tensors of several shapes."""
    for name, torch_op, op in (("SUM", R.SUM, "sum"), ("MAX", R.MAX, "max")):
        yield Item.one(f"all_reduce_coalesced-{name}", _all_reduce_coalesced(name, torch_op, op))
    yield Item.one("all_gather_coalesced", _all_gather_coalesced)
    yield Item.one("coalescing_manager-all_reduce", _manager_all_reduce)
    yield Item.one("coalescing_manager-all_gather_into_tensor", _manager_all_gather)
    yield Item.one("coalescing_manager-reduce_scatter_tensor", _manager_reduce_scatter)


SHAPES = [(3, 4), (7,), (2, 2, 5), (1,)]


def _several(c: ItemChecker, dtype: str, seed: int, op: str = "sum",
             shapes: list[tuple[int, ...]] = SHAPES) -> list[list[np.ndarray]]:
    """For each shape, every rank's input."""
    return [inputs(c, dtype, shape, seed + k, op) for k, shape in enumerate(shapes)]


def _all_reduce_coalesced(name: str, torch_op: Any, op: str) -> Callable[[ItemChecker], None]:
    def body(c: ItemChecker) -> None:
        t = Twin.get()
        for k, dtype in enumerate(["float32", "int64", "float16"]):
            ins = _several(c, dtype, seed_of(name) + 10 * k, op)
            results = []
            for group in (t.ours, t.gloo):
                xs = [tensor(each[t.rank]) for each in ins]
                dist.all_reduce_coalesced(xs, op=torch_op, group=group)
                results.append(xs)
            for j, (a, b) in enumerate(zip(*results, strict=True)):
                alike(c, a, b, f"all_reduce_coalesced {name} {dtype} tensor {j}",
                      exact=reduction(ins[j], op), op=op)

    return body


def _all_gather_coalesced(c: ItemChecker) -> None:
    t = Twin.get()
    for k, dtype in enumerate(["float32", "int64", "bool"]):
        ins = _several(c, dtype, seed_of("all_gather_coalesced") + 10 * k)
        results = []
        for group in (t.ours, t.gloo):
            mine = [tensor(each[t.rank]) for each in ins]
            into = [[torch.zeros_like(x) for x in mine] for _ in range(t.n)]
            dist.all_gather_coalesced(into, mine, group=group)
            results.append(into)
        for q in range(t.n):
            for j in range(len(SHAPES)):
                alike(c, results[0][q][j], results[1][q][j],
                      f"all_gather_coalesced {dtype}: rank {q}'s tensor {j}")


def _manager_all_reduce(c: ItemChecker) -> None:
    t = Twin.get()
    for k, dtype in enumerate(["float32", "int32"]):
        ins = _several(c, dtype, seed_of("coalescing_manager-all_reduce") + 10 * k)
        results = []
        for group in (t.ours, t.gloo):
            xs = [tensor(each[t.rank]) for each in ins]
            with dist._coalescing_manager(group=group):
                for x in xs:
                    dist.all_reduce(x, group=group)
            results.append(xs)
        for j, (a, b) in enumerate(zip(*results, strict=True)):
            alike(c, a, b, f"coalesced all_reduce {dtype} tensor {j}",
                  exact=reduction(ins[j], "sum"), op="sum")


def _manager_all_gather(c: ItemChecker) -> None:
    t = Twin.get()
    for k, dtype in enumerate(["float32", "int64", "bfloat16"]):
        ins = _several(c, dtype, seed_of("coalescing_manager-all_gather") + 10 * k)
        results = []
        for group in (t.ours, t.gloo):
            xs = [tensor(each[t.rank]) for each in ins]
            into = [torch.zeros((t.n * x.shape[0], *x.shape[1:]), dtype=x.dtype) for x in xs]
            with dist._coalescing_manager(group=group):
                for out, x in zip(into, xs, strict=True):
                    dist.all_gather_into_tensor(out, x, group=group)
            results.append(into)
        for j, (a, b) in enumerate(zip(*results, strict=True)):
            alike(c, a, b, f"coalesced all_gather_into_tensor {dtype} tensor {j}")


def _manager_reduce_scatter(c: ItemChecker) -> None:
    t = Twin.get()
    shapes = [(t.n * 3,), (t.n, 5), (t.n * 2, 2)]
    for k, dtype in enumerate(["float32", "int64"]):
        ins = _several(c, dtype, seed_of("coalescing_manager-reduce_scatter") + 10 * k,
                       shapes=shapes)
        results = []
        for group in (t.ours, t.gloo):
            xs = [tensor(each[t.rank]) for each in ins]
            into = [torch.zeros((x.shape[0] // t.n, *x.shape[1:]), dtype=x.dtype) for x in xs]
            with dist._coalescing_manager(group=group):
                for out, x in zip(into, xs, strict=True):
                    dist.reduce_scatter_tensor(out, x, group=group)
            results.append(into)
        for j, (a, b) in enumerate(zip(*results, strict=True)):
            exact = reduction(ins[j], "sum")
            alike(c, a, b, f"coalesced reduce_scatter_tensor {dtype} tensor {j}", op="sum",
                  exact=exact.reshape(t.n, *a.shape)[t.rank], shared=False)


# --------------------------------------------------------------------------------- sparse

def sparse(plan: Plan) -> Iterator[Item]:
    """all_reduce of sparse COO tensors (the sum, as gloo serves it): uncoalesced inputs
    with repeated indices, one rank with no entries, a dense dimension; the result replaces
    the tensor's content, coalesced."""
    yield Item.one("all_reduce-sparse", _sparse)


def _sparse_input(rank: int, seed: int, dtype: torch.dtype, size: tuple[int, ...],
                  sparse_dims: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, rank])
    nnz = 0 if rank == 1 else int(rng.integers(1, 12))  # rank 1 holds no entries
    indices = np.stack([rng.integers(0, size[d], nnz) for d in range(sparse_dims)])
    values = rng.integers(-50, 50, (nnz, *size[sparse_dims:]))
    return torch.sparse_coo_tensor(torch.from_numpy(indices), torch.from_numpy(values)
                                   .to(dtype) / (4 if dtype.is_floating_point else 1), size)


def _sparse(c: ItemChecker) -> None:
    t = Twin.get()
    cases = [(torch.float32, (10,), 1), (torch.int64, (6, 5), 2), (torch.float64, (8, 3), 1)]
    for k, (dtype, size, sparse_dims) in enumerate(cases):
        results = []
        for group in (t.ours, t.gloo):
            x = _sparse_input(t.rank, seed_of("sparse") + k, dtype, size, sparse_dims)
            dist.all_reduce(x, group=group)
            results.append(x)
        ours, theirs = results
        what = f"sparse all_reduce {dtype} {size}"
        c.check(ours.is_sparse and ours.is_coalesced(),
                f"{what}: the result is not a coalesced sparse tensor")
        c.expect(ours.indices().numpy(), theirs.indices().numpy(), f"{what}: indices")
        everyone = [_sparse_input(r, seed_of("sparse") + k, dtype, size, sparse_dims)
                    .to_dense().numpy() for r in range(t.n)]
        alike(c, ours.to_dense(), theirs.to_dense(), f"{what}: values",
              exact=reduction(everyone, "sum"), op="sum")


# -------------------------------------------------------------------------------- objects

def objects(plan: Plan) -> Iterator[Item]:
    """The object collectives (pickled Python objects over the group's tensors):
    all_gather_object, gather_object, broadcast_object_list, scatter_object_list."""
    yield Item.one("all_gather_object", _all_gather_object)
    yield Item.one("gather_object", _gather_object)
    yield Item.one("broadcast_object_list", _broadcast_object_list)
    yield Item.one("scatter_object_list", _scatter_object_list)


def _thing(rank: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, rank])
    return {"rank": rank, "values": rng.integers(0, 1000, int(rng.integers(1, 20))).tolist(),
            "name": "x" * int(rng.integers(0, 300)), "tensor": torch.arange(rank + 2)}


def _same_objects(c: ItemChecker, ours: list[Any], theirs: list[Any], what: str) -> None:
    c.check(len(ours) == len(theirs), f"{what}: {len(ours)} objects, gloo {len(theirs)}")
    for q, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        same = a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
            for k in a)
        c.check(same, f"{what}: object {q} is {a!r}, gloo's {b!r}")


def _all_gather_object(c: ItemChecker) -> None:
    t = Twin.get()
    results = []
    for group in (t.ours, t.gloo):
        into: list[Any] = [None] * t.n
        dist.all_gather_object(into, _thing(t.rank, seed_of("all_gather_object")), group=group)
        results.append(into)
    _same_objects(c, *results, "all_gather_object")


def _gather_object(c: ItemChecker) -> None:
    t = Twin.get()
    for root in range(t.n):
        results = []
        for group in (t.ours, t.gloo):
            into: list[Any] | None = [None] * t.n if t.rank == root else None
            dist.gather_object(_thing(t.rank, seed_of("gather_object") + root), into,
                               dst=root, group=group)
            results.append(into or [])
        _same_objects(c, *results, f"gather_object to {root}")


def _broadcast_object_list(c: ItemChecker) -> None:
    t = Twin.get()
    for root in range(t.n):
        results = []
        for group in (t.ours, t.gloo):
            things = [_thing(t.rank, seed_of("broadcast_object_list") + root + j)
                      for j in range(3)]
            dist.broadcast_object_list(things, src=root, group=group)
            results.append(things)
        _same_objects(c, *results, f"broadcast_object_list from {root}")


def _scatter_object_list(c: ItemChecker) -> None:
    t = Twin.get()
    for root in range(t.n):
        results = []
        for group in (t.ours, t.gloo):
            things = [_thing(q, seed_of("scatter_object_list") + root) for q in range(t.n)]
            into: list[Any] = [None]
            dist.scatter_object_list(into, things if t.rank == root else None, src=root,
                                     group=group)
            results.append(into)
        _same_objects(c, *results, f"scatter_object_list from {root}")


# ------------------------------------------------------------------------------ async_op

def asynchronous(plan: Plan) -> Iterator[Item]:
    """async_op=True, as documented: the call returns a work whose wait() returns True,
    after which it is completed and its future holds the output tensors; the outputs are
    gloo's, and so is the future's value where gloo's work has one (its reduce_scatter_tensor
    has no future, nor is it completed after wait(): gpuring's is)."""
    yield Item.one("async_op", _async)


def _async(c: ItemChecker) -> None:
    t = Twin.get()
    ins = inputs(c, "int64", (t.n, 4), seed_of("async_op"))  # exact: compared bit for bit
    calls: dict[str, Callable[[Any, torch.Tensor], tuple[Any, list[torch.Tensor]]]] = {
        "all_reduce": lambda g, x: (dist.all_reduce(x, group=g, async_op=True), [x]),
        "broadcast": lambda g, x: (dist.broadcast(x, src=t.n - 1, group=g, async_op=True),
                                   [x]),
        "all_gather": lambda g, x: _async_all_gather(g, x, t.n),
        "reduce_scatter_tensor": lambda g, x: _async_reduce_scatter(g, x, t.n),
        "all_to_all_single": lambda g, x: _async_all_to_all(g, x),
        "barrier": lambda g, x: (dist.barrier(group=g, async_op=True), []),
    }
    for name, call in calls.items():
        outputs, values = [], []
        for group in (t.ours, t.gloo):
            work, out = call(group, tensor(ins[t.rank]))
            finished = work.wait()
            if group is t.ours:
                c.check(finished is True, f"async {name}: wait() returned {finished!r}")
                c.check(work.is_completed(), f"async {name}: not completed after wait()")
            outputs.append(out)
            try:
                values.append(work.get_future().wait())
            except RuntimeError as exc:  # gloo's reduce_scatter_tensor: no future
                c.check(group is t.gloo, f"async {name}: get_future() raised {exc!r}")
                values.append(None)
        for j, (a, b) in enumerate(zip(*outputs, strict=True)):
            alike(c, a, b, f"async {name}: output {j}", shared=False)
        ours, theirs = values
        if name != "barrier":
            c.check(isinstance(ours, list) and len(ours) == len(outputs[0]) and all(
                torch.equal(a, b) for a, b in zip(ours, outputs[0], strict=False)),
                f"async {name}: the future holds {ours!r}, not the outputs")
        if theirs is not None:
            c.check(type(ours) is type(theirs) and len(ours) == len(theirs),
                    f"async {name}: the future holds {ours!r}, gloo's {theirs!r}")


def _async_all_gather(group: Any, x: torch.Tensor, n: int) -> tuple[Any, list[torch.Tensor]]:
    into = [torch.zeros_like(x) for _ in range(n)]
    return dist.all_gather(into, x, group=group, async_op=True), into


def _async_reduce_scatter(group: Any, x: torch.Tensor, n: int
                          ) -> tuple[Any, list[torch.Tensor]]:
    out = torch.zeros(x.numel() // n, dtype=x.dtype)
    return dist.reduce_scatter_tensor(out, x.reshape(-1), group=group, async_op=True), [out]


def _async_all_to_all(group: Any, x: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
    out = torch.zeros_like(x)
    return dist.all_to_all_single(out, x, group=group, async_op=True), [out]


# -------------------------------------------------------------------------------- groups

def groups(plan: Plan) -> Iterator[Item]:
    """new_group subgroups (some ranks, in another order; every rank) beside gloo's of the
    same ranks: collectives on them, their names and descriptions as torch sets them, and
    destroy_process_group of a subgroup (after which it is gone, its ranks can make another,
    and a group of every rank made after it works)."""
    yield Item.one("new_group-collectives", _subgroup_collectives)
    yield Item.one("new_group-name_and_desc", _names)
    yield Item.one("destroy_process_group-subgroup", _destroy_subgroup)


def _members(n: int) -> list[int]:
    """A subgroup's ranks, given out of order: the last rank and rank 0."""
    return [n - 1, 0]


def _subgroup_collectives(c: ItemChecker) -> None:
    t = Twin.get()
    members = _members(t.n)
    subs = [dist.new_group(members, backend=b, timeout=TIMEOUT) for b in ("gpuring", "gloo")]
    inside = t.rank in members
    c.check(all((s == dist.GroupMember.NON_GROUP_MEMBER) != inside for s in subs),
            f"new_group({members}) on rank {t.rank}: {subs}")
    c.check(dist.get_backend(subs[0]) == "gpuring" if inside else True,
            "the subgroup's backend is not gpuring")
    if inside:
        seed = seed_of("new_group")
        ins = inputs(c, "float32", (3, 5), seed)
        everyone = [ins[q] for q in sorted(members)]
        results = []
        for group in subs:
            x = tensor(ins[t.rank])
            dist.all_reduce(x, group=group)
            b = tensor(ins[t.rank])
            dist.broadcast(b, src=max(members), group=group)  # a global rank
            into = [torch.zeros_like(x) for _ in members]
            dist.all_gather(into, tensor(ins[t.rank]), group=group)
            results.append([x, b, *into])
        for j, (a, b) in enumerate(zip(*results, strict=True)):
            alike(c, a, b, f"subgroup {members}: result {j}", shared=False,
                  exact=reduction(everyone, "sum") if j == 0 else None,
                  op="sum" if j == 0 else None, ranks=len(members))
        c.check(dist.get_rank(subs[0]) == dist.get_rank(subs[1]),
                f"group rank {dist.get_rank(subs[0])}, gloo's {dist.get_rank(subs[1])}")
    for sub in subs:
        dist.destroy_process_group(sub)


def _names(c: ItemChecker) -> None:
    """group_name: what torch names the group, registered as such; group_desc: what the
    caller gave (the default group's: "default_pg")."""
    t = Twin.get()
    ranks = list(range(t.n))
    subs = [dist.new_group(ranks, backend=b, group_desc="conformance", timeout=TIMEOUT)
            for b in ("gpuring", "gloo")]
    for sub, backend in zip(subs, ("gpuring", "gloo"), strict=True):
        c.check(bool(sub.group_name), f"{backend}: no group_name")
        c.check(sub.group_name == dist.distributed_c10d._get_process_group_name(sub),
                f"{backend}: group_name {sub.group_name!r}, torch registered "
                f"{dist.distributed_c10d._get_process_group_name(sub)!r}")
        c.check(sub.group_desc == "conformance",
                f"{backend}: group_desc {sub.group_desc!r}, not the one given")
    c.note(f"the subgroup's name {subs[0].group_name}")  # the same on every rank
    c.check(t.ours.group_desc == "default_pg" == dist.group.WORLD.group_desc,
            f"the default group's group_desc: {t.ours.group_desc!r}")
    c.check(t.ours.group_name == dist.distributed_c10d._get_process_group_name(t.ours),
            f"the default group's group_name: {t.ours.group_name!r}")
    for sub in subs:
        dist.destroy_process_group(sub)


def _destroy_subgroup(c: ItemChecker) -> None:
    t = Twin.get()
    members = _members(t.n)
    for backend in ("gpuring", "gloo"):
        for again in range(2):  # destroyed, then made again with the same ranks
            sub = dist.new_group(members, backend=backend, timeout=TIMEOUT)
            if t.rank in members:
                x = torch.ones(3, dtype=torch.int64)
                dist.all_reduce(x, group=sub)
                c.check(torch.equal(x, torch.full((3,), len(members))),
                        f"{backend}: all_reduce on the subgroup made {again + 1} times: {x}")
            dist.destroy_process_group(sub)
            if t.rank in members:
                error = raised(lambda sub=sub: dist.get_process_group_ranks(sub))
                c.check(error is not None, f"{backend}: a destroyed subgroup still has ranks")
    dist.barrier(group=t.gloo)
    x = torch.ones(2)
    dist.all_reduce(x)  # the default group goes on
    c.check(torch.equal(x, torch.full((2,), float(t.n))), f"the default group: {x}")
    every = dist.new_group(backend="gpuring", timeout=TIMEOUT)  # after groups not all were in
    x = torch.ones(2)
    dist.all_reduce(x, group=every)
    c.check(torch.equal(x, torch.full((2,), float(t.n))), f"a group of every rank: {x}")
    dist.destroy_process_group(every)


# -------------------------------------------------------------------------------- errors

def errors(plan: Plan) -> Iterator[Item]:
    """Failures in c10d's types and words: a collective that times out (on a subgroup of 5
    s, rank 0 alone in a barrier) raises a RuntimeError saying "Timed out" on both backends,
    on gpuring's a DistBackendError and a gpuring.CollectiveTimeoutError (its fields kept),
    with async_op=True at wait();
    mismatched calls raise a DistBackendError that is a gpuring.CollectiveMismatchError on
    every rank (gloo's behaviour there is undefined: not run); a group's monitored_barrier
    (which torch's dist.monitored_barrier refuses for any backend but gloo, and the group
    serves) passes where every rank calls it, and where rank 0 calls it alone raises naming
    the ranks that did not come (all of them with wait_all_ranks), or rank 0 itself when its
    timeout is 0, as gloo's does."""
    yield Item.one("timeout-barrier", _timeout)
    yield Item.one("mismatch-all_reduce", _mismatch)
    yield Item.one("monitored_barrier", _monitored, stderr=GLOO_MONITORED_LOG)


def _timeout(c: ItemChecker) -> None:
    t = Twin.get()
    for backend, asynchronous in (("gpuring", False), ("gpuring", True), ("gloo", False)):
        what = f"{backend}{' async_op=True' if asynchronous else ''}"
        dist.barrier(group=t.gloo)  # every rank makes the group at once (within its timeout)
        sub = dist.new_group(backend=backend, timeout=SHORT)
        if t.rank == 0:  # the others never call
            start = time.monotonic()
            if asynchronous:  # the call returns; its wait() raises, as gloo's does
                work = dist.barrier(group=sub, async_op=True)
                c.check(work.is_completed() and not work.is_success(),
                        f"{what}: the failed barrier's work is not completed and failed")
                error = raised(work.wait)
            else:
                error = raised(lambda sub=sub: dist.barrier(group=sub))
            waited = time.monotonic() - start
            c.check(isinstance(error, RuntimeError) and bool(TIMED_OUT.search(str(error))),
                    f"{what}: a barrier alone raised {error!r}")
            c.check(waited >= SHORT.total_seconds() * 0.9, f"{what}: it raised after "
                    f"{waited:.2f} s, before its timeout of {SHORT}")
            if backend == "gpuring":
                c.check(isinstance(error, dist.DistBackendError)
                        and isinstance(error, gpuring.CollectiveTimeoutError)
                        and f"Timed out waiting {SHORT.seconds * 1000}ms" in str(error),
                        f"{what}: {type(error).__mro__}, {error}")
        dist.barrier(group=t.gloo)  # rank 0 is done waiting
        dist.destroy_process_group(sub)


#: what gloo's monitored_barrier logs on rank 0 as it raises
GLOO_MONITORED_LOG = (r"\[rank0\]:\[E[\d :.]+ProcessGroupGloo\.cpp:\d+\] .*monitoredBarrier.*",
                      r"No ranks successfully processed in monitoredBarrier\.")


def _monitored(c: ItemChecker) -> None:
    t = Twin.get()
    second = datetime.timedelta(seconds=1)
    others = ", ".join(str(q) for q in range(1, t.n))
    alone = [(second, False, "Rank 1 failed to pass monitoredBarrier"),
             (second, True, f"Ranks {others} failed to pass monitoredBarrier"),
             (datetime.timedelta(0), False, "Rank 0 timed out in monitoredBarrier")]
    for backend in ("gpuring", "gloo"):
        sub = dist.new_group(backend=backend, timeout=TIMEOUT)
        for _ in range(2):
            error = raised(lambda sub=sub: sub.monitored_barrier(TIMEOUT))
            c.check(error is None, f"{backend}: monitored_barrier on every rank: {error!r}")
        dist.destroy_process_group(sub)
        for timeout, wait_all, words in alone:
            sub = dist.new_group(backend=backend, timeout=TIMEOUT)
            if t.rank == 0:  # the others never call
                error = raised(lambda sub=sub, timeout=timeout, wait_all=wait_all: (
                    sub.monitored_barrier(timeout, wait_all_ranks=wait_all)))
                c.check(isinstance(error, RuntimeError) and words in str(error),
                        f"{backend}: monitored_barrier({timeout}, wait_all_ranks={wait_all}) "
                        f"on rank 0 alone raised {error!r}, not {words!r}")
            dist.barrier(group=t.gloo)
            dist.destroy_process_group(sub)


def _mismatch(c: ItemChecker) -> None:
    t = Twin.get()
    sub = dist.new_group(backend="gpuring", timeout=TIMEOUT)
    error = raised(lambda: dist.all_reduce(torch.ones(3 + (t.rank == 1)), group=sub))
    c.check(isinstance(error, dist.DistBackendError)
            and isinstance(error, gpuring.CollectiveMismatchError)
            and "shape" in error.differences,
            f"all_reduce of another shape on rank 1 raised {error!r}")
    dist.destroy_process_group(sub)


# ----------------------------------------------------------------------------- the end

def end(plan: Plan) -> Iterator[Item]:
    """destroy_process_group(): every group goes (the launch's last item)."""

    def body(c: ItemChecker) -> None:
        Twin.get()
        dist.destroy_process_group()
        c.check(not dist.is_initialized(), "torch.distributed is still initialized")

    yield Item.one("destroy_process_group-world", body, last=True)


FAMILIES = {"reductions": reductions, "movement": movement, "coalesced": coalesced,
            "sparse": sparse, "objects": objects, "asynchronous": asynchronous,
            "groups": groups, "errors": errors, "end": end}

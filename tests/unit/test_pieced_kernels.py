"""`PiecedKernel` (what a CUDA graph records of a collective larger than a slot) driven
through the host build of kernels/reduce.cu: its launches, with the addresses its `bind`
works out, give every kind's whole result, in place and out of place, on 2 to 4 ranks (each
rank a thread), with ragged last pieces and grids that change from piece to piece."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gpuring._ops import ReduceOp
from gpuring.devices import _kernels
from gpuring.devices._cuda_forms import Slots
from gpuring.devices._cuda_fused import FusedKernel, PiecedKernel, prepare_fused
from gpuring.devices._cuda_memory import CudaMemory
from gpuring.devices.base import Span

from .test_kernels_on_host import _chain, _same

SLOT = 16 << 10  # bytes of a slot: pieces of 4096 float32 (fewer for reduce_scatter)



class _Launcher:
    """gpuring_fused_<dtype>_<op> as CuPy's RawKernel calls it, run by the host build."""

    def __init__(self, lib: ctypes.CDLL, name: str):
        self._lib = lib
        self._address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

    def __call__(self, grid: tuple[int], block: tuple[int], args: tuple[Any, ...],
                 stream: Any = None) -> None:
        self._lib.emu_launch_fused(self._address, grid[0], block[0], *(int(a) for a in args))


class _Rank:
    """What FusedKernel asks of CudaDevice, for one rank: its kernels, grid limit, timeout,
    status and abort words."""

    fused_form = "kernel"
    slots = Slots(kernel=SLOT)
    timeout_ns = 10**10

    def __init__(self, lib: ctypes.CDLL, fused_blocks: int):
        self._lib = lib
        self.fused_blocks = fused_blocks
        self.region = np.zeros(_kernels.fused_region_bytes(SLOT), np.uint8)
        self.status = np.zeros(2, np.int32)
        self.abort = np.zeros(1, np.int32)
        self.status_ptr, self.abort_ptr = self.status.ctypes.data, self.abort.ctypes.data
        self.captured = False
        self.operations = 0

    def fused_kernel(self, dtype: str, op: ReduceOp) -> _Launcher:
        return _Launcher(self._lib, _kernels.fused_kernel_name(dtype, op))

    def check(self) -> None:
        assert self.status[0] == 0 and self.abort[0] == 0, "a wait gave up"

    def scope(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


class _Stream:
    """The caller's stream: counts the events recorded on it (standing for them with
    None: these launches ran by the time one would be recorded)."""

    raw = None

    def __init__(self) -> None:
        self.records = 0

    def record_in_scope(self) -> None:
        self.records += 1


def _memory(array: np.ndarray) -> CudaMemory:
    return CudaMemory(array.ctypes.data, array.nbytes, "borrowed", array)


def _on_threads(ranks: list[_Rank], work: Callable[[int], None]) -> None:
    """`work(r)` for every rank r at once, each on a thread; a rank that fails aborts (its
    peers' waits then end too) and its error is raised."""
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            work(r)
        except BaseException as exc:
            errors.append(exc)
            ranks[r].abort[0] = 1

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _run(lib: ctypes.CDLL, kind: str, inputs: list[np.ndarray], outputs: list[np.ndarray],
         op: ReduceOp, root: int, fused_blocks: int) -> None:
    """Every rank prepares the collective in pieces and runs what it binds, on a thread."""
    nranks = len(inputs)
    ranks = [_Rank(lib, fused_blocks) for _ in range(nranks)]
    regions = [Span(_memory(r.region), 0, r.region.nbytes) for r in ranks]
    divisor = nranks if op is ReduceOp.AVG else 1

    def work(r: int) -> None:
        direct = prepare_fused(ranks[r], kind, regions, r, root,  # type: ignore[arg-type]
                                inputs[r].dtype.name, op, divisor, inputs[r].nbytes,
                                graph=True)
        assert isinstance(direct, PiecedKernel)
        launches = direct.bind(_memory(outputs[r]), _memory(inputs[r]))
        assert len(launches) > 2 and all(isinstance(k, FusedKernel) for k, _ in launches)
        stream = _Stream()
        assert direct.run(stream, launches, captured=True) is None  # type: ignore[arg-type]
        assert ranks[r].captured and stream.records == 0  # no event under capture

    _on_threads(ranks, work)


KINDS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
         "scatter", "all_to_all"]
#: the verbs with an in-place form (x = out, or x = out's block of this rank)
IN_PLACE = KINDS[:5]


def _arrays(kind: str, given: list[np.ndarray], block: int, in_place: bool, root: int
            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each rank's input and output for `given` (`in_place`: the verb's in-place form; a
    gather's output off the root is its input, as the engine binds it)."""
    nranks = len(given)
    inputs, outputs = [], []
    for r, x in enumerate(given):
        x = x.copy()
        if kind == "gather" and r != root:
            out = x
        elif kind in ("all_gather", "gather"):
            out = np.zeros(nranks * block, np.float32)
            if in_place:
                out[r * block:(r + 1) * block] = x
                x = out[r * block:(r + 1) * block]
        elif kind in ("reduce_scatter", "scatter"):
            out = x[r * block:(r + 1) * block] if in_place else np.zeros(block, np.float32)
        else:
            out = x if in_place else np.zeros_like(x)
        inputs.append(x)
        outputs.append(out)
    return inputs, outputs


def _expected(kind: str, given: list[np.ndarray], r: int, root: int, block: int,
              op: ReduceOp, in_place: bool) -> np.ndarray | None:
    """Rank r's output after `kind` of `given` (None: it writes none)."""
    nranks = len(given)
    divisor = nranks if op is ReduceOp.AVG else 1
    if kind == "all_reduce":
        return _chain(given, op, divisor)
    if kind == "reduce_scatter":
        return _chain([x[r * block:(r + 1) * block] for x in given], op, 1)
    if kind == "all_gather" or (kind == "gather" and r == root):
        return np.concatenate(given)
    if kind == "broadcast":
        return given[root]
    if kind == "scatter":
        return given[root][r * block:(r + 1) * block]
    if kind == "all_to_all":
        return np.concatenate([x[r * block:(r + 1) * block] for x in given])
    if kind == "reduce" and r == root:
        return _chain(given, op, 1)
    return None  # off the root a reduce and a gather write nothing


@pytest.mark.parametrize(("kind", "in_place"), [(kind, False) for kind in KINDS] +
                         [(kind, True) for kind in IN_PLACE])
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_pieces_give_the_whole_collective(lib: ctypes.CDLL, kind: str, nranks: int,
                                          in_place: bool) -> None:
    rng = np.random.default_rng(nranks * 10 + len(kind) + in_place)
    block = 10_007  # float32 per rank's block: pieces of 4 blocks of 4 KiB, a ragged last one
    root = nranks - 1
    op = ReduceOp.AVG if kind == "all_reduce" else ReduceOp.SUM
    per_rank = nranks if kind in _kernels.BLOCKED_INPUT_KINDS else 1
    given = [rng.standard_normal(block * per_rank).astype(np.float32) for _ in range(nranks)]
    inputs, outputs = _arrays(kind, given, block, in_place, root)
    untouched = [out.copy() for out in outputs]
    _run(lib, kind, inputs, outputs, op, root, fused_blocks=3)
    for r in range(nranks):
        want = _expected(kind, given, r, root, block, op, in_place)
        assert _same(outputs[r], untouched[r] if want is None else want), f"{kind} rank {r}"
        if not in_place:
            assert _same(inputs[r], given[r]), f"{kind} rank {r} wrote its input"


@pytest.mark.parametrize("kind", ["gather", "scatter", "all_to_all"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_one_kernel_copies_of_blocks(lib: ctypes.CDLL, kind: str, nranks: int) -> None:
    """gather, scatter and all_to_all of a block that fits a slot, on two kernel blocks: one
    launch, as the one-operation path runs them; twice, so the second call runs on the other
    slot."""
    rng = np.random.default_rng(nranks + len(kind))
    block, root = 1333, nranks - 1
    per_rank = nranks if kind in _kernels.BLOCKED_INPUT_KINDS else 1
    ranks = [_Rank(lib, 2) for _ in range(nranks)]
    regions = [Span(_memory(r.region), 0, r.region.nbytes) for r in ranks]
    for call in range(2):
        given = [rng.standard_normal(block * per_rank).astype(np.float32)
                 for _ in range(nranks)]
        inputs, outputs = _arrays(kind, given, block, False, root)
        untouched = [out.copy() for out in outputs]

        def work(r: int, inputs: list[np.ndarray] = inputs,
                 outputs: list[np.ndarray] = outputs) -> None:
            direct = prepare_fused(ranks[r], kind, regions, r,  # type: ignore[arg-type]
                                    root, "float32", ReduceOp.SUM, 1, inputs[r].nbytes)
            assert isinstance(direct, FusedKernel)
            operands = direct.bind(_memory(outputs[r]), _memory(inputs[r]))
            stream = _Stream()
            direct.run(stream, operands)  # type: ignore[arg-type]
            assert stream.records == 1  # the one event, after the launch

        _on_threads(ranks, work)
        for r in range(nranks):
            want = _expected(kind, given, r, root, block, ReduceOp.SUM, False)
            assert _same(outputs[r], untouched[r] if want is None else want), \
                f"{kind} call {call} rank {r}"


@pytest.mark.parametrize("dtype", ["complex128", "int8"])
def test_pieces_of_wide_and_narrow_elements(lib: ctypes.CDLL, dtype: str) -> None:
    """Pieces stay whole packs of 16 elements whatever the element size; all_reduce on 3
    ranks (two-shot pieces, then a one-shot last piece)."""
    rng = np.random.default_rng(len(dtype))
    n = 20_000
    given = [(rng.integers(-50, 50, n) + (1j * rng.integers(-50, 50, n) if dtype ==
              "complex128" else 0)).astype(dtype) for _ in range(3)]
    inputs = [x.copy() for x in given]
    outputs = [np.zeros_like(x) for x in given]
    _run(lib, "all_reduce", inputs, outputs, ReduceOp.SUM, 0, fused_blocks=2)
    want = _chain(given, ReduceOp.SUM, 1)
    for r in range(3):
        assert _same(outputs[r], want), f"{dtype} rank {r}"

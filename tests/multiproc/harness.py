"""The rank side of the multi-process tests: what every case module (cases_*.py) and the
older workers (worker_training.py, worker_persistent.py) build on.

Each rank rebuilds every rank's input from a shared seed (`Checker.inputs`), so it checks its
own results against tests/reference.py by itself, and keeps a digest of every result all
ranks hold, which the test compares across ranks (bitwise identity).

Named items. A case module (cases_*.py) declares families of items (`Item`) in its
FAMILIES: each item has one or more ids that say what it checks (the verb, the dtype, the op,
the placement, ...) and a body that runs on every rank. A test launches the ranks once for a
group of items:

    run_items.py SPEC.json

(SPEC: which families, as "module:family", which of their ids, the device, where to
write). Every rank runs the selected items in their order; a wrong result does not stop an
item (`ItemChecker.expect` writes down the first wrong element and goes on, so that every
rank still makes the same calls); an exception does: it fails the item, and the rank runs no
further item (its peers may be out of step). For each id, each rank appends one JSON line
to OUTDIR/results-RANK.jsonl: the failures, the digests, how many results it checked, what
the rank wrote to stderr meanwhile (the rank's stderr goes to OUTDIR/stderr-RANK.txt). A
rank that ran its items and closed writes OUTDIR/done-RANK.json and exits 0, whatever its
items found (a failing exit status would have the launcher stop its peers, and fail items
that did not fail); any other exit status is a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import gpuring

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:  # tests/reference.py, importable from a rank's script
    sys.path.append(_TESTS)
from reference import (  # noqa: E402
    Reduction,
    first_wrong,
    node_major_fold,
    rank_order_fold,
    reduction,
)

__all__ = ["COMPLEX", "DTYPES", "FLOATS", "INTS", "OPS", "Checker", "Item",
           "ItemChecker", "Plan", "Reduction", "dev", "deterministic_fold", "expect_mismatches",
           "host", "main", "moved_blocks", "rank_order_fold", "run_case", "shape_name",
           "use_attach_refusing_host_device", "use_nonblocking_host_device"]

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]
# bfloat16 arrays come from ml_dtypes, imported by `Checker.inputs` only for a bfloat16 case
# (the import costs a rank about a second)
if importlib.util.find_spec("ml_dtypes") is not None:
    FLOATS.insert(1, "bfloat16")
COMPLEX = ["complex64", "complex128"]
DTYPES = INTS + FLOATS + COMPLEX
OPS = ["sum", "prod", "min", "max", "avg"]
#: the wrong results one id's record tells, on one rank (the first ones)
MOST_FAILURES = 10


def host(x: Any) -> np.ndarray:
    """A NumPy copy of a result (CuPy arrays come back from the GPU)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def shape_name(shape: tuple[int, ...]) -> str:
    """A shape as an id says it: 7x3, 0 (empty), scalar."""
    return "x".join(str(s) for s in shape) if shape else "scalar"


class Checker:
    """Checks one rank's results: `expect` compares a result with tests/reference.py's
    value for it and keeps its digest when every rank holds it (`shared`). This one stops at
    the first wrong result (AssertionError) and writes the digests to OUTDIR/CASE-RANK.txt
    (`finish`): the older workers' single-case runs (`run_case`)."""

    def __init__(self, comm: gpuring.Communicator, case: str, outdir: str, xp: Any = np):
        self.comm = comm
        self.xp = xp
        self.uses_other_gpus = False  # the case itself makes another GPU current
        self.digests: list[str] = []
        self.outdir = outdir
        self.path = os.path.join(outdir, f"{case}-{comm.rank}.txt")
        self.checked = 0

    def inputs(self, dtype: str, shape: tuple[int, ...], seed: int, op: str = "sum"
               ) -> list[np.ndarray]:
        """Every rank's input (list indexed by rank), random and never all zeros."""
        if dtype == "bfloat16":
            import ml_dtypes  # noqa: F401 - gives NumPy the bfloat16 dtype
        out = []
        for r in range(self.comm.size):
            rng = np.random.default_rng([seed, r])
            if dtype in INTS:
                info = np.iinfo(dtype)
                hi = 4 if op == "prod" else min(info.max, 1 << 20)
                lo = -hi if info.min < 0 else 0
                a = rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
            elif dtype in COMPLEX:
                a = (rng.uniform(-1, 1, shape) + 1j * rng.uniform(-1, 1, shape)).astype(dtype)
            else:
                lo, hi = (0.5, 1.5) if op == "prod" else (-2, 2)
                a = rng.uniform(lo, hi, shape).astype(dtype)
            out.append(a)
        return out

    def reduce_reference(self, arrays: list[np.ndarray], op: str) -> Reduction:
        """The reduction of every rank's array (tests/reference.py's `reduction`)."""
        return reduction(arrays, op)

    def expect(self, got: Any, want: np.ndarray | Reduction, what: str, *, copy: bool = False,
               shared: bool = True) -> None:
        """Compare a result with what it must be: a Reduction within its per-element rounding
        bound (exactly for integers, min and max), a plain array (a copy of inputs, `copy`,
        or any exact value: a fold's bits) bit for bit; the dtype and shape must match.
        Results every rank holds (`shared`) go into the digests."""
        got = host(got)
        if isinstance(want, Reduction) and copy:
            raise TypeError(f"{what}: a copy is compared with a plain array")
        wrong = first_wrong(got, want)
        self.checked += 1
        if wrong is not None:
            self.fail(f"{what}: {wrong}")
        if shared:
            self.digests.append(f"{what} {hashlib.sha256(got.tobytes()).hexdigest()}")

    def check(self, ok: bool, what: str) -> None:
        """A condition the result must meet (`what` says what went wrong otherwise)."""
        self.checked += 1
        if not ok:
            self.fail(what)

    def fail(self, message: str) -> None:
        raise AssertionError(message)

    def note(self, text: str) -> None:
        """`text` among the digests: what every rank must find alike."""
        self.digests.append(text)

    def finish(self) -> None:
        with open(self.path, "w") as f:
            f.write("\n".join(self.digests) + "\n")


def dev(c: Checker, a: np.ndarray) -> Any:
    """`a` where the case's arrays live (a CuPy array on the GPU)."""
    return c.xp.asarray(a)


def deterministic_fold(c: Checker, ins: list[np.ndarray], op: str) -> np.ndarray:
    """The bits of deterministic mode: the rank-order fold on one node; across nodes (where
    collectives run in two levels) the node-major fold."""
    if c.comm._path.layout is None:
        return rank_order_fold(ins, op)
    return node_major_fold(ins, op, list(c.comm._control.nodes))


def expect_mismatches(c: Checker, attempts: list[tuple[str, Callable[[], Any]]]) -> None:
    """Each (field, call) raises CollectiveMismatchError naming that field."""
    for field, call in attempts:
        try:
            call()
        except gpuring.CollectiveMismatchError as exc:
            c.check(field in exc.differences,
                    f"the mismatch names {sorted(exc.differences)}, not {field!r}")
        else:
            c.check(False, f"no CollectiveMismatchError for a different {field}")


def moved_blocks() -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, block shape) of the cases that move data unreduced: empty to several buffer
    rounds, each in another dtype."""
    dtypes = ["float32", "int8", "uint64", "complex128", "float16"] + (
        ["bfloat16"] if "bfloat16" in FLOATS else [])
    shapes = [(0,), (1,), (7, 3), (70000,), (3, 250000)]
    return [(dtypes[i % len(dtypes)], shape) for i, shape in enumerate(shapes)]


# ------------------------------------------------------------------------------ named items

@dataclasses.dataclass(frozen=True)
class Plan:
    """What a family's items depend on, known before the ranks start: the rank count, the
    device of the arrays, the group's options (`Group.options` on the test's side) and the
    group's environment (settings such as GPURING_DETERMINISTIC, as the test sets them)."""

    n: int
    device: str = "cpu"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)


@dataclasses.dataclass(frozen=True)
class Item:
    """One piece of a case: `ids` (the first is where its checks go unless the body says
    otherwise with `ItemChecker.into`) and the body every rank runs. `last`: it leaves the
    communicator unusable, or is about closing it, so it runs after every other item of its
    launch, and the communicator's close is part of it (what the close writes to stderr is
    its). `stderr`: what it may write there (regular expressions, each matching whole lines),
    besides nothing."""

    ids: tuple[str, ...]
    body: Callable[[ItemChecker], None]
    last: bool = False
    stderr: tuple[str, ...] = ()

    @classmethod
    def one(cls, name: str, body: Callable[[ItemChecker], None], *, last: bool = False,
            stderr: tuple[str, ...] = ()) -> Item:
        return cls((name,), body, last, stderr)


Family = Callable[[Plan], Iterator[Item]]


@dataclasses.dataclass
class Record:
    """What one rank found for one id."""

    id: str
    failures: list[str] = dataclasses.field(default_factory=list)
    digests: list[str] = dataclasses.field(default_factory=list)
    checked: int = 0
    error: str | None = None
    not_run: str | None = None
    stderr: str = ""
    stderr_allowed: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and self.error is None and self.not_run is None


class ItemChecker(Checker):
    """The Checker of named items: a wrong result is written down (the first wrong element
    of it) in the current id's record, and the body goes on."""

    def __init__(self, comm: gpuring.Communicator, outdir: str, xp: Any = np):
        super().__init__(comm, "items", outdir, xp)
        self.records: dict[str, Record] = {}
        self.current: Record | None = None

    def begin(self, item: Item) -> None:
        for name in item.ids:
            self.records[name] = Record(name)
        self.current = self.records[item.ids[0]]

    @contextlib.contextmanager
    def into(self, name: str) -> Iterator[None]:
        """Checks in this block go to `name`'s record (one of the item's ids)."""
        before, self.current = self.current, self.records[name]
        try:
            yield
        finally:
            self.current = before

    def _record(self) -> Record:
        assert self.current is not None, "a check outside every item"
        return self.current

    def expect(self, got: Any, want: np.ndarray | Reduction, what: str, *, copy: bool = False,
               shared: bool = True) -> None:
        record = self._record()
        digests_before, self.digests = self.digests, record.digests
        checked_before = self.checked
        try:
            super().expect(got, want, what, copy=copy, shared=shared)
        finally:
            record.checked += self.checked - checked_before
            self.digests = digests_before

    def check(self, ok: bool, what: str) -> None:
        self._record().checked += 1
        self.checked += 1
        if not ok:
            self.fail(what)

    def fail(self, message: str) -> None:
        failures = self._record().failures
        if len(failures) < MOST_FAILURES:
            failures.append(message)
        elif len(failures) == MOST_FAILURES:
            failures.append("(more wrong results after these: not told)")

    def note(self, text: str) -> None:
        self._record().digests.append(text)


def _family(name: str) -> Family:
    """A family by its qualified name, "module:family": FAMILIES[family] of that case
    module (tests/multiproc/cases_*.py)."""
    module, _, family = name.partition(":")
    families: Mapping[str, Family] = importlib.import_module(module).FAMILIES
    return families[family]


def _items_of(spec: Mapping[str, Any], plan: Plan) -> list[Item]:
    items = [item for name in spec["families"] for item in _family(name)(plan)]
    names = [name for item in items for name in item.ids]
    assert len(names) == len(set(names)), "ids given twice: " + ", ".join(
        sorted({x for x in names if names.count(x) > 1}))
    if spec.get("select") is not None:
        wanted = set(spec["select"])
        unknown = wanted - set(names)
        assert not unknown, f"no item has the ids {sorted(unknown)}"
        items = [item for item in items if wanted & set(item.ids)]
    lasts = [item for item in items if item.last]
    assert len(lasts) <= 1, f"more than one item that ends the communicator: {lasts}"
    return [item for item in items if not item.last] + lasts


def catalog(families: list[str], plan: Plan) -> list[str]:
    """Every id of these families ("module:family"), in their order: what a test
    parametrizes over."""
    return [name for item in _items_of({"families": families}, plan) for name in item.ids]


class _Stderr:
    """This process's stderr (file descriptor 2, so that native code's writes come too),
    sent to a file, whose offsets tell what was written while an item ran."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stderr.flush()
        os.dup2(fd, 2)
        os.close(fd)

    def offset(self) -> int:
        sys.stderr.flush()
        return os.fstat(2).st_size

    def since(self, offset: int) -> tuple[str, int]:
        """What was written from `offset` on, and the offset of its end."""
        sys.stderr.flush()
        with open(self.path, "rb") as f:
            f.seek(offset)
            written = f.read()
        return written.decode(errors="replace"), offset + len(written)

    def rename(self, path: str) -> None:
        os.replace(self.path, path)  # the descriptor writes on, under the new name
        self.path = path


def _write(results: Any, record: Record) -> None:
    results.write(json.dumps(dataclasses.asdict(record)) + "\n")
    results.flush()


def main() -> None:
    """A rank's program (run_items.py SPEC.json): the selected items of the families SPEC
    names (see the module's docstring)."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    outdir, device = spec["outdir"], spec.get("device", "cpu")
    stderr = _Stderr(os.path.join(outdir, f"stderr-pid{os.getpid()}.txt"))
    if os.environ.get("GPURING_TEST_NONBLOCKING") == "1":
        use_nonblocking_host_device()
    if os.environ.get("GPURING_TEST_ATTACH_REFUSED"):
        use_attach_refusing_host_device(int(os.environ["GPURING_TEST_ATTACH_REFUSED"]))
    xp: Any = np
    if device == "cuda":
        import cupy

        xp = cupy
    gpu = None
    failed = stopped = None
    inside: list[tuple[int, int]] = []  # the stderr written while items ran: (start, end)
    comm = gpuring.init(timeout=float(os.environ.get("GPURING_TIMEOUT", "60")))
    with comm:
        stderr.rename(os.path.join(outdir, f"stderr-{comm.rank}.txt"))
        if device == "cuda":  # the GPU gpuring picks for this rank
            gpu = comm.local_rank % xp.cuda.runtime.getDeviceCount()
            xp.cuda.Device(gpu).use()
        plan = Plan(comm.size, device, spec.get("options", {}), os.environ)
        items = _items_of(spec, plan)
        checker = ItemChecker(comm, outdir, xp)
        marks = os.path.join(outdir, f"marks-{comm.rank}.txt")
        with open(os.path.join(outdir, f"results-{comm.rank}.jsonl"), "w") as results:
            for item in items:
                if stopped is not None:
                    for name in item.ids:
                        _write(results, Record(name, not_run=stopped))
                    continue
                with open(marks, "a") as f:  # where a rank that dies was
                    f.write(item.ids[0] + "\n")
                checker.begin(item)
                start, since = time.monotonic(), stderr.offset()
                try:
                    item.body(checker)
                    if item.last:
                        comm.close()
                except Exception:
                    checker.records[item.ids[0]].error = traceback.format_exc(limit=-8)
                    stopped = f"not run: {item.ids[0]} raised an exception on this rank first"
                written, end = stderr.since(since)
                inside.append((since, end))
                for name in item.ids:
                    record = checker.records[name]
                    record.stderr, record.seconds = written, time.monotonic() - start
                    record.stderr_allowed = item.stderr
                    _write(results, record)
                    if not record.ok and failed is None:
                        failed = name
        print(f"rank {comm.rank}: {len(items)} items, {checker.checked} results checked"
              + (f", failed first: {failed}" if failed else ""), flush=True)
    created = getattr(xp, "contexts_created", None)  # the CUDA simulator tells
    if created is not None and not checker.uses_other_gpus:
        # no thread of gpuring (watchdog, async, abort) touched another GPU
        assert created() == {gpu}, f"CUDA contexts on GPUs {created()}, this rank uses {gpu}"
    with open(os.path.join(outdir, f"done-{comm.rank}.json"), "w") as f:
        json.dump({"failed": failed, "items": inside}, f)


# ------------------------------------------------------------------ the older single cases

def use_nonblocking_host_device() -> None:
    """Run NumPy collectives through the scheduler's non-blocking path (the one GPUs take):
    threaded streams only, completion by events, each collective ordered after the previous
    one by the engine; the caller waits for the final event, as a CUDA stream would. The
    ring and the chains visit the even ranks first, then the odd ones (as a topology may
    order them: `Capabilities.ring`)."""
    from gpuring import devices
    from gpuring.devices.host import HostDevice

    class NonBlockingHostDevice(HostDevice):
        blocking = False
        default_channels = 2

        def create_stream(self, *, inline: bool = False):  # type: ignore[no-untyped-def]
            return super().create_stream(inline=False)

        def capabilities(self, handles):  # type: ignore[no-untyped-def]
            ring = tuple(sorted(range(len(handles)), key=lambda r: (r % 2, r)))
            return super().capabilities(handles)._replace(ring=ring)

        def order_caller_after(self, event) -> None:  # type: ignore[no-untyped-def]
            event.wait(self)

    devices.KINDS["cpu"] = lambda: NonBlockingHostDevice


def use_attach_refusing_host_device(refusing: int) -> None:
    """Rank `refusing` finds, as a kernel that forbids it would say, that it may not reach
    its peers' memory by cross-memory attach: every rank stages its collectives instead."""
    from gpuring import devices
    from gpuring.devices.host import HostDevice

    class RefusingHostDevice(HostDevice):
        def capabilities(self, handles):  # type: ignore[no-untyped-def]
            found = super().capabilities(handles)
            me = [r for r, h in enumerate(handles) if h[0] == os.getpid()]
            if me == [refusing]:
                found = found._replace(attach_refused="process_vm_readv refused (Operation "
                                                      "not permitted), for the test")
            return found

    devices.KINDS["cpu"] = lambda: RefusingHostDevice


def run_case(cases: Mapping[str, Callable[[Checker], None]]) -> None:
    """A rank's program for the older workers: `script CASE OUTDIR [cpu|cuda]` runs
    cases[CASE] on NumPy or CuPy arrays, checked (the first wrong result fails the rank),
    and writes the digests to OUTDIR/CASE-RANK.txt."""
    case, outdir = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    xp: Any = np
    if device == "cuda":
        import cupy

        xp = cupy
    gpu = None
    with gpuring.init(timeout=float(os.environ.get("GPURING_TIMEOUT", "60"))) as comm:
        if device == "cuda":  # the GPU gpuring picks for this rank
            gpu = comm.local_rank % xp.cuda.runtime.getDeviceCount()
            xp.cuda.Device(gpu).use()
        checker = Checker(comm, case, outdir, xp)
        cases[case](checker)
        checker.finish()
        print(f"rank {comm.rank}: {case} ok, {checker.checked} results checked")
    created = getattr(xp, "contexts_created", None)  # the CUDA simulator tells
    if created is not None and not checker.uses_other_gpus:
        assert created() == {gpu}, f"CUDA contexts on GPUs {created()}, this rank uses {gpu}"


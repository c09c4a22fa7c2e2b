"""Persistent collectives, as MPI 4.0 has them (`MPI_Allreduce_init`, `MPI_Start`,
`MPI_Wait`): a collective whose arguments are checked, and which the ranks agree on and
prepare, once, on arrays given once; then started any number of times.

`Communicator.all_reduce_init(x, out=y)` and its twins (one per collective of the family)
are collective calls: every rank makes them alike, in the same order as its other
collectives. Each returns a `PersistentCollective`, whose `start()` runs the prepared call
on those arrays: no argument check, and no look-up of the prepared call.
It is the call path's prepared call (`CallPath.prepare`, kept on the call), held by the user;
a start runs it as `CallPath.run` runs any call that holds its prepared call, less the
look-ups (`CallPath.start`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from . import interop
from ._call import Call

if TYPE_CHECKING:
    from ._protocols import StartPath

__all__ = ["PersistentCollective", "init"]


class PersistentCollective:
    """A collective prepared once (`Communicator.all_reduce_init` and its twins): `start()`
    then `wait()`, or `op()` for both, any number of times, on the arrays given at init.

    Every `start()` is a collective call, made by every rank in the same order as its other
    collectives. The arrays belong to the collective: write the input before `start()`, read
    the output after `wait()`. NumPy collectives complete within `start()`; CuPy ones are
    queued on the current stream, as the plain verbs are, and `wait()` returns the output
    (stream-ordered, without blocking the host). A `start()` after the communicator closed,
    was aborted or failed raises the communicator's error, as a plain call does.
    """

    __slots__ = ("_active", "_before", "_call", "_result", "_run", "_scope", "name")

    def __init__(self, name: str, run: Callable[[Call], Any], call: Call,
                 before: Callable[[], None], result: Any,
                 scope: Callable[[], AbstractContextManager[Any]] | None):
        self.name = name
        self._run = run  # CallPath.start
        self._call = call  # checked, its prepared call kept on it
        self._before = before  # waits for the communicator's async work (order across ranks)
        self._result = result  # what wait() returns: the output as the caller gave it
        self._scope = scope  # the caller's stream, for arrays of other libraries (torch)
        self._active = False

    def __repr__(self) -> str:
        state = "started" if self._active else "idle"
        return f"<gpuring.PersistentCollective {self.name} {state}>"

    def start(self) -> None:
        """Run the collective once (a collective call of every rank). Starting it again
        before `wait()` is an error, as in MPI."""
        if self._active:
            raise RuntimeError(f"{self.name}: start() again before wait(); wait() for the "
                               "collective started last before starting it again")
        self._before()
        if self._scope is None:
            self._run(self._call)
        else:
            with self._scope():
                self._run(self._call)
        self._active = True

    def wait(self) -> Any:
        """The result of the collective started last: the output (None off the root of a
        reduce or gather, and for a barrier); at once where none was started."""
        self._active = False
        return self._result

    def __call__(self) -> Any:
        """`start()` then `wait()`."""
        self.start()
        self._active = False
        return self._result


def init(path: StartPath, before: Callable[[], None], name: str, x: Any, out: Any,
         check: Callable[[Any, Any], Call], returns: bool = True) -> PersistentCollective:
    """The persistent form of `name` on `x` and `out` (arrays of any library gpuring takes):
    `check(x, out)` checks the native views into a call, which the call path prepares now
    (the ranks agree on it). `returns`: False where this rank gets no result (off the root
    of a reduce or gather)."""
    before()
    if x is None:  # a barrier
        call = check(None, None)
        path.prepare(call)
        return PersistentCollective(name, path.start, call, before, None, None)
    native_x = interop.to_native(x)
    native_out = None if out is None else interop.to_native(out)
    call = check(native_x, native_out)
    if call.x is not native_x:
        raise ValueError(f"{name}_init: x must be C-contiguous: a persistent collective reads "
                         "x itself at every start (pass numpy.ascontiguousarray(x), or its "
                         "CuPy twin, and write into that)")
    path.prepare(call)
    result = None
    if returns:
        if call.out is native_out and native_out is not None:
            result = out
        elif call.out is native_x:
            result = x
        else:
            result = interop.from_native(call.out, x)
    scope = None
    if not interop.is_native(x):
        def scope() -> AbstractContextManager[Any]:
            return interop.caller_stream(x)
    return PersistentCollective(name, path.start, call, before, result, scope)

"""LastCalls: a verb's last call is found again only for the very same arrays, layouts and
arguments, and keeps no array alive."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from gpuring._call import Call
from gpuring._lastcalls import LastCalls
from gpuring._ops import ReduceOp

ARGS = ("sum", None, None)


def _ran(x: np.ndarray, out: np.ndarray | None) -> Call:
    """A checked call as the call path leaves it after running: key known, operands bound."""
    call = Call("all_reduce", x, out, ReduceOp.SUM)
    call.key()
    call.bound = ("operands",)
    return call


def test_the_same_arrays_find_the_call_with_what_it_worked_out() -> None:
    last = LastCalls()
    x, out = np.ones(8, np.float32), np.zeros(8, np.float32)
    call = _ran(x, out)
    last.remember("all_reduce", x, out, ARGS, call)
    again = last.find("all_reduce", x, out, ARGS)
    assert again is not None and again is not call
    assert again.x is x and again.out is out
    assert again.known_key == call.known_key and again.bound == ("operands",)
    assert again.op is ReduceOp.SUM


def test_anything_else_is_a_new_call() -> None:
    last = LastCalls()
    x, out = np.ones(8, np.float32), np.zeros(8, np.float32)
    last.remember("all_reduce", x, out, ARGS, _ran(x, out))
    assert last.find("reduce", x, out, ARGS) is None  # another verb
    assert last.find("all_reduce", x, out, ("max", None, None)) is None
    assert last.find("all_reduce", x.copy(), out, ARGS) is None  # equal, not the same
    assert last.find("all_reduce", x, out.copy(), ARGS) is None
    assert last.find("all_reduce", x, None, ARGS) is None
    assert last.find("all_reduce", x, out, ARGS) is not None


def test_arguments_are_the_same_objects() -> None:
    """An equal argument of another type (root=True for root=1, 0.0 for 0) would pass the
    checks of a fresh call only by equality: it is a new call, and its checks raise."""
    last = LastCalls()
    x = np.ones(8, np.float32)
    last.remember("broadcast", x, None, (1, None, None), _ran(x, x))
    assert last.find("broadcast", x, None, (1, None, None)) is not None
    assert last.find("broadcast", x, None, (True, None, None)) is None
    assert last.find("broadcast", x, None, (1.0, None, None)) is None


def test_each_input_array_has_its_last_call() -> None:
    """A step that goes over several buckets finds each bucket's call; the oldest go first
    past the limit."""
    last = LastCalls(limit=4)
    buckets = [np.full(8, i, np.float32) for i in range(6)]
    for bucket in buckets:
        last.remember("all_reduce", bucket, bucket, ARGS, _ran(bucket, bucket))
    found = [last.find("all_reduce", b, b, ARGS) is not None for b in buckets]
    assert found == [False, False, True, True, True, True]


def test_a_layout_changed_in_place_is_a_new_call() -> None:
    """NumPy lets shape and dtype change on the same object."""
    last = LastCalls()
    x, out = np.ones(8, np.float32), np.zeros(8, np.float32)
    last.remember("all_reduce", x, out, ARGS, _ran(x, out))
    x.shape = (2, 4)
    assert last.find("all_reduce", x, out, ARGS) is None
    x.shape = (8,)
    assert last.find("all_reduce", x, out, ARGS) is not None
    out.dtype = np.int32  # type: ignore[misc]  # the same bytes, seen as int32
    assert last.find("all_reduce", x, out, ARGS) is None


def test_no_array_is_kept_alive() -> None:
    last = LastCalls()
    x, out = np.ones(8, np.float32), np.zeros(8, np.float32)
    last.remember("all_reduce", x, out, ARGS, _ran(x, out))
    gone_x, gone_out, where = weakref.ref(x), weakref.ref(out), id(x)
    del x, out
    gc.collect()
    assert gone_x() is None and gone_out() is None
    assert last.find("all_reduce", np.ones(8, np.float32), None, ARGS) is None
    assert ("all_reduce", where) in last._last  # the entry, whose array is gone, finds nothing
    assert last.find("all_reduce", None, None, ARGS) is None


def test_arrays_made_for_the_call_are_not_remembered() -> None:
    """An output allocated for the call, or a contiguous copy of the input, is new on each
    call: such a call is not kept."""
    last = LastCalls()
    x = np.ones(8, np.float32)
    last.remember("all_reduce", x, None, ARGS, _ran(x, np.zeros(8, np.float32)))
    assert last.find("all_reduce", x, None, ARGS) is None
    strided = np.ones(16, np.float32)[::2]
    copy = np.ascontiguousarray(strided)
    last.remember("all_reduce", strided, copy, ARGS, _ran(copy, copy))
    assert last.find("all_reduce", strided, copy, ARGS) is None


def test_in_place_and_no_output_are_kept_as_such() -> None:
    """broadcast without out works in x (the call's output is x); reduce off its root has
    no output."""
    last = LastCalls()
    x = np.ones(8, np.float32)
    last.remember("broadcast", x, None, (0, None, None), _ran(x, x))
    again = last.find("broadcast", x, None, (0, None, None))
    assert again is not None and again.out is x
    y = np.ones(8, np.float32)
    given = np.zeros(8, np.float32)  # off the root, out is not used
    last.remember("reduce", y, given, ARGS, _ran(y, None))
    again = last.find("reduce", y, given, ARGS)
    assert again is not None and again.out is None


def test_a_call_remembered_again_is_the_newest_for_eviction() -> None:
    """At the limit the oldest call is forgotten first, and a call remembered again under a
    key that was there before (an array where a dead one lay has its id) counts as the
    newest: it survives the next calls (a dict keeps a replaced key in its first place)."""
    last = LastCalls(limit=3)
    xs = [np.ones(4, np.float32) for _ in range(3)]
    for x in xs:
        last.remember("all_reduce", x, None, ARGS, _ran(x, None))
    last.remember("all_reduce", xs[0], None, ARGS, _ran(xs[0], None))  # the first, again
    newer = np.ones(4, np.float32)
    last.remember("all_reduce", newer, None, ARGS, _ran(newer, None))  # evicts xs[1]
    assert last.find("all_reduce", xs[0], None, ARGS) is not None
    assert last.find("all_reduce", xs[1], None, ARGS) is None
    assert last.find("all_reduce", newer, None, ARGS) is not None

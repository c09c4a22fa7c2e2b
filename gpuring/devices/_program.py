"""Programs: the instructions a schedule's round compiles to (copies, reductions, flag waits
and writes, on spans of buffers or of the call's arguments), and how a device enqueues them on
a stream by default (`enqueue_program`), one stream operation each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .._ops import ReduceOp
from ._streams import Arg, Flag, Memory, Span, Stream

__all__ = ["Operand", "CopyI", "ReduceI", "ReduceNI", "WaitI", "WriteI", "Instruction",
           "Runner", "enqueue_program", "group_writes"]

Operand = Span | Arg


class CopyI(NamedTuple):
    dst: Operand
    src: Operand


class ReduceI(NamedTuple):
    dst: Operand
    a: Operand
    b: Operand
    divisor: int


class ReduceNI(NamedTuple):
    """dst = srcs[0] op srcs[1] op ... in order (see `Stream.reduce_n`)."""

    dst: Operand
    srcs: tuple[Operand, ...]
    divisor: int


class WaitI(NamedTuple):
    """Wait until `flag` >= value, with value = rel + (seq << shift) for the run's seq."""

    flag: Flag
    rel: int
    shift: int
    tag: Any


class WriteI(NamedTuple):
    """Set `flag` to rel + (seq << shift)."""

    flag: Flag
    rel: int
    shift: int


Instruction = CopyI | ReduceI | ReduceNI | WaitI | WriteI

#: a compiled program: runner(input memory, output memory, seq)
Runner = Callable[[Memory | None, Memory | None, int], None]


def enqueue_program(program: tuple[Instruction, ...], dtype: str, op: ReduceOp,
                    stream: Stream) -> Runner:
    """`program` ready for repeated runs on `stream`: each run enqueues it instruction by
    instruction with the given input and output memory and round number (what
    `Device.compile` does unless a device does better)."""

    def run(inp: Memory | None, out: Memory | None, seq: int) -> None:
        mems = (inp, out)

        def span(o: Operand) -> Span:
            if isinstance(o, Arg):
                mem = mems[o.which]
                assert mem is not None
                return Span(mem, o.offset, o.nbytes)
            return o

        for ins in steps:
            if isinstance(ins, CopyI):
                stream.copy(span(ins.dst), span(ins.src))
            elif isinstance(ins, ReduceI):
                stream.reduce(span(ins.dst), span(ins.a), span(ins.b), dtype, op,
                              ins.divisor)
            elif isinstance(ins, ReduceNI):
                stream.reduce_n(span(ins.dst), [span(s) for s in ins.srcs], dtype, op,
                                ins.divisor)
            elif isinstance(ins, WaitI):  # early credits are <= 0: flags start at 0
                stream.wait_flag(ins.flag, max(0, ins.rel + (seq << ins.shift)), ins.tag)
            else:  # consecutive writes of one value: one call
                stream.write_flags([w.flag for w in ins],
                                   ins[0].rel + (seq << ins[0].shift))

    steps = group_writes(program)
    return run


def group_writes(program: tuple[Instruction, ...]) -> list[Any]:
    """`program` with each run of consecutive WriteI of the same value (rel and shift) as one
    tuple of them, so that a device can set them all in one operation."""
    steps: list[Any] = []
    for ins in program:
        if isinstance(ins, WriteI):
            last = steps[-1] if steps else None
            if isinstance(last, list) and (last[0].rel, last[0].shift) == (ins.rel, ins.shift):
                last.append(ins)
            else:
                steps.append([ins])
        else:
            steps.append(ins)
    return [tuple(s) if isinstance(s, list) else s for s in steps]

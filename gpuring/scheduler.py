"""The scheduler: binds a plan to memory and enqueues it on device streams.

It knows the device interface and the plan vocabulary, nothing of NumPy or CUDA. One `Engine`
per device owns that device's communication buffer, the peers' mapped buffers and the streams.

Buffer layout of every rank (the same on all ranks):

    [flags: READY per channel, DONE | half 0: RS, AG | half 1: RS, AG]

Round `seq` (1, 2, ... across all collectives) uses half `seq % 2`. Flag values are absolute:
READY = seq << 32 | piece index, DONE = seq; both only grow, so nothing is ever reset. Before a
round writes its half it waits until every peer's DONE >= seq - 2, i.e. every peer has finished
reading that half from two rounds ago (the write-after-read hazard across rounds).
"""

from __future__ import annotations

from typing import Any

from ._errors import CollectiveTimeoutError, GpuringError, PeerFailureError
from ._ops import ReduceOp
from .algorithms.plan import BUF, IN, READY, Copy, Loc, Reduce, RoundPlan, Signal, Wait
from .devices.base import Device, Event, Flag, FlagWaitAborted, FlagWaitTimeout, Memory, Span
from .rendezvous.base import ControlPlane

__all__ = ["Engine", "MAX_CHANNELS"]

MAX_CHANNELS = 32
_FLAG_BYTES = 4096
_DONE_OFFSET = MAX_CHANNELS * 8
_SEQ_SHIFT = 32


class Engine:
    """Communication resources of one device, and the enqueueing of rounds on them."""

    def __init__(self, device: Device, control: ControlPlane, *, capacity_bytes: int):
        self.device = device
        self.rank = control.rank
        self.size = control.size
        self.capacity = capacity_bytes
        self._seq = 0
        self._streams = [device.create_stream() for _ in range(1)]
        self._inline = device.create_stream(inline=True)
        local = device.alloc(_FLAG_BYTES + 4 * capacity_bytes)
        handles = control.allgather(device.export(local))
        self._mems: list[Memory] = [
            local if r == self.rank else device.open(h) for r, h in enumerate(handles)]
        control.barrier()  # every peer has mapped every buffer
        device.seal(local)

    @property
    def seq(self) -> int:
        """Rounds run so far."""
        return self._seq

    def _stream(self, c: int) -> Any:
        while len(self._streams) <= c:
            self._streams.append(self.device.create_stream())
        return self._streams[c]

    def run(self, rounds: tuple[RoundPlan, ...], *, name: str, collective_seq: int,
            in_mem: Memory | None, out_mem: Memory | None, dtype: str, itemsize: int,
            op: ReduceOp, inline: bool, after: Event | None = None) -> Event | None:
        """Enqueue every round, after `after` if given. Blocking devices return once the
        result is complete; others return an event that completes with the collective."""
        divisor = self.size if op is ReduceOp.AVG else 1
        used: list[Any] = []
        try:
            for plan in rounds:
                self._seq += 1
                streams = [self._inline if inline else self._stream(c)
                           for c in range(len(plan.channels))]
                for stream in streams:
                    if stream not in used:
                        used.append(stream)
                        if after is not None:
                            stream.wait_event(after)
                self._enqueue_round(plan, streams, in_mem, out_mem, dtype, itemsize, op,
                                    divisor, (name, collective_seq))
            if self.device.blocking:
                for stream in used:
                    stream.synchronize()
                return None
            return used[0].record() if len(used) == 1 else self._join(used)
        except FlagWaitTimeout as exc:
            peer, what = exc.tag[2], exc.tag[3]
            raise CollectiveTimeoutError(
                f"{name} #{collective_seq} timed out after {getattr(self.device, 'timeout', '?')}"
                f" s on rank {self.rank} waiting for rank {peer} ({what}); that rank is "
                f"stalled, dead, or called a different collective",
                collective=name, seq=collective_seq, peer=peer) from None
        except FlagWaitAborted as exc:
            raise PeerFailureError(
                f"{name} #{collective_seq} aborted on rank {self.rank}: {exc.reason}",
                collective=name, seq=collective_seq) from None

    def _join(self, streams: list[Any]) -> Event:
        first = streams[0]
        for other in streams[1:]:
            first.wait_event(other.record())
        return first.record()  # type: ignore[no-any-return]

    def _enqueue_round(self, plan: RoundPlan, streams: list[Any], in_mem: Memory | None,
                       out_mem: Memory | None, dtype: str, itemsize: int, op: ReduceOp,
                       divisor: int, tag: tuple[str, int]) -> None:
        seq = self._seq
        base = _FLAG_BYTES + (seq % 2) * 2 * self.capacity
        ready_base = seq << _SEQ_SHIFT
        mems = self._mems

        def span(loc: Loc, count: int) -> Span:
            nbytes = count * itemsize
            if loc.space == BUF:
                offset = base + loc.region * self.capacity + loc.offset * itemsize
                return Span(mems[loc.rank], offset, nbytes)
            mem = in_mem if loc.space == IN else out_mem
            assert mem is not None
            return Span(mem, loc.offset * itemsize, nbytes)

        for c, (ops, stream) in enumerate(zip(plan.channels, streams)):
            for peer in range(self.size if seq > 2 else 0):
                if peer != self.rank:
                    stream.wait_flag(Flag(mems[peer], _DONE_OFFSET), seq - 2,
                                     (*tag, peer, "buffer credit"))
            ready = Flag(mems[self.rank], c * 8)
            for o in ops:
                if type(o) is Copy:
                    stream.copy(span(o.dst, o.count), span(o.src, o.count))
                elif type(o) is Reduce:
                    stream.reduce(span(o.dst, o.count), span(o.a, o.count),
                                  span(o.b, o.count), dtype, op, divisor if o.last else 1)
                elif type(o) is Wait:
                    assert o.slot == READY
                    stream.wait_flag(Flag(mems[o.peer], c * 8), ready_base + o.value,
                                     (*tag, o.peer, f"piece {o.value} of round {seq}"))
                elif type(o) is Signal:
                    stream.write_flag(ready, ready_base + o.value)
                else:  # pragma: no cover - plans only hold the four kinds
                    raise GpuringError(f"unknown plan operation {o!r}")
        # DONE once every channel's reads of peers' buffers are complete.
        first = streams[0]
        for other in streams[1:]:
            if other is not first:
                first.wait_event(other.record())
        first.write_flag(Flag(mems[self.rank], _DONE_OFFSET), seq)

    def close(self) -> None:
        self.device.close()


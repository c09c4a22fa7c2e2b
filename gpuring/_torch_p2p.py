"""The torch.distributed backend's point-to-point calls (`send`, `recv`, `recv_anysource`):
gpuring's non-blocking messages (tags matched, any source), each returned as a torch `Work`
that completes them when waited for; so `isend`/`irecv` never block, and
`batch_isend_irecv` takes its operations in any order. CPU tensors are NumPy messages; CUDA
tensors CuPy messages on torch's current stream: a send queued when made, a receive when
its work is waited for (between ranks whose GPUs do not map each other's memory they go on
NCCL: then as `send`/`recv`, tag 0, queued when made)."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import interop
from ._communicator import Communicator
from ._errors import GpuringError

__all__ = ["MessageWork", "send", "recv"]

#: torch's stubs give Work's C++ overloads, which a Python work replaces with what torch's
#: trampoline calls
_Work: Any = dist.Work


class MessageWork(_Work):
    """torch's Work of gpuring messages (`works`: each with the tensor it moves): `wait()`
    completes them (a CUDA receive is queued then, on torch's current stream) and copies a
    received message into a tensor that was not contiguous; `_source_rank()` is the rank a
    receive's message came from."""

    def __init__(self, works: Sequence[tuple[Any, torch.Tensor]],
                 tensors: Sequence[torch.Tensor], finish: Callable[[], None] | None = None,
                 source: int | None = None):
        super().__init__()
        self._works = list(works)
        self._tensors = list(tensors)
        self._finish = finish
        self._source = source
        self._error: BaseException | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if not timeout else timeout.total_seconds()
        try:
            for work, tensor in self._works:
                with interop.caller_stream(tensor):
                    work.wait(seconds)
        except TimeoutError:
            raise
        except BaseException as exc:
            self._error = exc
            raise
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return all(work.done() for work, _ in self._works)

    def is_success(self) -> bool:
        if not self.is_completed():
            raise RuntimeError("the message has not completed: wait() for it first")
        try:
            self.wait()
        except Exception:
            return False
        return True

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        if self._source is None:
            for work, _ in self._works:
                self._source = work.source
        if self._source is None:
            raise RuntimeError("the rank a message came from is known once it is received")
        return self._source

    source_rank = _source_rank


def send(comm: Communicator, tensors: list[torch.Tensor], dst: int, tag: int) -> MessageWork:
    """Each tensor (its contiguous data, kept until sent) as a message to rank `dst`."""
    works = []
    for tensor in tensors:
        with interop.caller_stream(tensor):
            array = interop.to_native(tensor.detach().contiguous())
            try:
                works.append((comm.isend(array, dst, tag), tensor))
            except GpuringError:
                if not tensor.is_cuda:
                    raise
                comm.send(array, dst)  # (on NCCL: queued now)
    return MessageWork(works, tensors, source=dst)


def recv(comm: Communicator, tensors: list[torch.Tensor], src: int | None,
         tag: int) -> MessageWork:
    """A message from rank `src` (None: any) with `tag` into each tensor, in order; a
    tensor that is not contiguous gets a contiguous copy's, copied back at `wait()`."""
    works, staged = [], []
    for tensor in tensors:
        into = tensor if tensor.is_contiguous() else tensor.contiguous()
        if into is not tensor:
            staged.append((tensor, into))
        with interop.caller_stream(tensor):
            array = interop.to_native(into.detach())
            try:
                works.append((comm.irecv(array, src, tag), tensor))
            except GpuringError:
                if not tensor.is_cuda:
                    raise
                comm.recv(array, src)  # (on NCCL: queued now)

    def finish() -> None:
        for tensor, into in staged:
            tensor.copy_(into)

    return MessageWork(works, tensors, finish if staged else None, source=src)

"""The shapes in which modules see a communicator and its call path, as Protocols: a module
that serves one of them (`_fusion`, `_uneven`, `_hierarchy`, `_persistent`) depends
on this small module, never on the module that uses it, so the import graph has no circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._call import Call, PreparedCall
    from ._config import Config

__all__ = ["Collectives", "StartPath"]


class Collectives(Protocol):
    """A communicator as the helpers that call its verbs see it (fusion, compression, the
    uneven forms, the levels across nodes)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def config(self) -> Config: ...

    @property
    def all_reduce(self) -> Callable[..., Any]: ...

    @property
    def all_gather(self) -> Callable[..., Any]: ...

    @property
    def all_to_all(self) -> Callable[..., Any]: ...

    @property
    def reduce_scatter(self) -> Callable[..., Any]: ...

    @property
    def close(self) -> Callable[[], None]: ...


class StartPath(Protocol):
    """The call path as a persistent collective sees it: prepare once, run any number of
    times."""

    def prepare(self, call: Call) -> PreparedCall: ...

    def start(self, call: Call) -> Any: ...

"""A world of one rank: no peers, no messages."""

from __future__ import annotations

import secrets
from typing import Any

from .base import ControlPlane

__all__ = ["SingleProcess"]


class SingleProcess(ControlPlane):
    def __init__(self) -> None:
        super().__init__()
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1
        self.job_id = secrets.token_hex(8)

    def subgroup(self, members: tuple[int, ...], name: str) -> SingleProcess:
        group = SingleProcess()
        self.join_subgroup(group, members, name, ("local",))
        return group

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        return [obj]

    def close(self) -> None:
        pass

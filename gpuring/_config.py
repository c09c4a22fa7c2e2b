"""A communicator's settings: the `Config` that `init()` builds from the GPURING_* settings
(declared in `gpuring.settings`) and its own arguments."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from . import settings
from .algorithms.collectives import ALGORITHMS, algorithm_name
from .settings import parse_size

__all__ = ["Config", "parse_size"]

#: the setting each Config field is read from
_FROM = {"timeout": "GPURING_TIMEOUT", "chunk_bytes": "GPURING_CHUNK_BYTES",
         "channels": "GPURING_CHANNELS", "buffer_bytes": "GPURING_BUFFER_BYTES",
         "one_shot_bytes": "GPURING_ONE_SHOT_BYTES", "fused_bytes": "GPURING_FUSED_BYTES",
         "attach_bytes": "GPURING_ATTACH_BYTES",
         "stall_warning_s": "GPURING_STALL_WARNING",
         "verify": "GPURING_VERIFY", "transport": "GPURING_TRANSPORT",
         "algorithm": "GPURING_ALGORITHM", "deterministic": "GPURING_DETERMINISTIC",
         "tuning": "GPURING_TUNING", "trace_entries": "GPURING_TRACE_ENTRIES"}


def _default(field: str) -> Any:
    return settings.SETTINGS[_FROM[field]].default



@dataclass(frozen=True)
class Config:
    """Communicator settings: the GPURING_* setting of the same meaning, by default its
    declared default (gpuring/settings.py, which also says what each means). `None` means:
    the device's default."""

    timeout: float = _default("timeout")
    chunk_bytes: int | None = _default("chunk_bytes")
    channels: int | None = _default("channels")
    buffer_bytes: int | None = _default("buffer_bytes")
    one_shot_bytes: int = _default("one_shot_bytes")
    fused_bytes: int = _default("fused_bytes")
    attach_bytes: int = _default("attach_bytes")
    stall_warning_s: float = _default("stall_warning_s")
    verify: bool = _default("verify")
    transport: str = _default("transport")
    algorithm: str = _default("algorithm")
    deterministic: bool = _default("deterministic")
    tuning: str | None = _default("tuning")
    trace_entries: int = _default("trace_entries")

    @classmethod
    def from_env(cls, **overrides: object) -> Config:
        """The GPURING_* settings (their declared defaults where unset), then explicit
        (non-None) overrides."""
        config = cls()
        env: dict[str, object] = {f.name: settings.get(_FROM[f.name]) for f in fields(cls)}
        for source in (env, overrides):
            changes = {k: v for k, v in source.items() if v is not None}
            if "algorithm" in changes:  # a former name (GPURING_ALGORITHM's is translated)
                changes["algorithm"] = algorithm_name(str(changes["algorithm"]), "init")
            config = replace(config, **changes)  # type: ignore[arg-type]
        config.validate()
        return config

    def validate(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout}")
        if self.chunk_bytes is not None and self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.channels is not None and not 1 <= self.channels <= 32:
            raise ValueError(f"channels must be between 1 and 32, got {self.channels}")
        if self.transport not in ("auto", "mpi", "nccl"):
            raise ValueError(f"transport must be 'auto', 'mpi' or 'nccl', got "
                             f"{self.transport!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, "
                             f"got {self.algorithm!r}")
        if self.deterministic and self.algorithm == "ring":
            raise ValueError("deterministic mode folds in rank order, which the ring does not: "
                             "leave algorithm 'auto' or choose 'two_shot' or 'one_shot'")
        if self.attach_bytes < 0:
            raise ValueError(f"attach_bytes must be 0 (never) or more, got {self.attach_bytes}")
        if self.trace_entries < 0:
            raise ValueError(f"trace_entries must be 0 (off) or more, got {self.trace_entries}")
        if self.buffer_bytes is not None and self.buffer_bytes < 4096:
            raise ValueError(f"buffer_bytes must be at least 4096, got {self.buffer_bytes}")

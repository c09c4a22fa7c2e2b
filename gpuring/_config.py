"""Tunables: defaults, environment variables and size strings."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

__all__ = ["Config", "parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from `8`, `4K`, `64M`, `1G` (binary units; a trailing B or iB is allowed)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be non-negative, got {text}")
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", str(text).upper())
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; write it like 8, 4K, 64M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _env_size(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value in (None, "") else parse_size(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Config:
    """Communicator settings. `None` means: the device's default."""

    #: seconds any wait may take before the collective fails
    timeout: float = 300.0
    #: piece size of the pipeline (bytes)
    chunk_bytes: int | None = None
    #: parallel rings
    channels: int | None = None
    #: size of one buffer region; a collective larger than this runs in several rounds
    buffer_bytes: int | None = None
    #: all_reduce up to this size runs one-shot (one flag hop) instead of the ring
    one_shot_bytes: int = 64 << 10
    #: log which ranks are missing from a collective others have waited in this long
    stall_warning_s: float = 60.0
    #: compare a checksum of every all_reduce, all_gather and broadcast result across ranks
    verify: bool = False
    #: NumPy collectives: "auto" (shared memory on one node, MPI across nodes) or "mpi"
    transport: str = "auto"

    @classmethod
    def from_env(cls, **overrides: object) -> Config:
        """Defaults, then GPURING_* variables, then explicit (non-None) overrides."""
        config = cls()
        env: dict[str, object] = {
            "timeout": float(os.environ["GPURING_TIMEOUT"])
            if os.environ.get("GPURING_TIMEOUT") else None,
            "chunk_bytes": _env_size("GPURING_CHUNK_BYTES"),
            "channels": int(os.environ["GPURING_CHANNELS"])
            if os.environ.get("GPURING_CHANNELS") else None,
            "buffer_bytes": _env_size("GPURING_BUFFER_BYTES"),
            "one_shot_bytes": _env_size("GPURING_ONE_SHOT_BYTES"),
            "stall_warning_s": float(os.environ["GPURING_STALL_WARNING"])
            if os.environ.get("GPURING_STALL_WARNING") else None,
            "verify": os.environ.get("GPURING_VERIFY", "0") not in ("", "0")
            if "GPURING_VERIFY" in os.environ else None,
            "transport": os.environ.get("GPURING_TRANSPORT") or None,
        }
        for source in (env, overrides):
            changes = {k: v for k, v in source.items() if v is not None}
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
        if self.transport not in ("auto", "mpi"):
            raise ValueError(f"transport must be 'auto' or 'mpi', got {self.transport!r}")
        if self.buffer_bytes is not None and self.buffer_bytes < 4096:
            raise ValueError(f"buffer_bytes must be at least 4096, got {self.buffer_bytes}")

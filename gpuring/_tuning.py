"""Tuning tables: which algorithm, piece size and channels a collective takes by default, per
size, as `gpuring tune` measured them on a machine (`GPURING_TUNING=FILE` or
`init(tuning=FILE)`).

A table is JSON:

    {"format": "gpuring-tuning/1", "device": "cpu", "ranks": 2,
     "tables": {"all_reduce": [{"max_bytes": 65536, "algorithm": "one_shot",
                                "chunk_bytes": 1048576, "channels": 1},
                               ...,
                               {"max_bytes": null, "algorithm": "ring", ...}]},
     "machine": {...}, "versions": {...}, "measured": [...]}

Each collective's entries are ordered by `max_bytes`; a call of `nbytes` takes the first entry
with `nbytes <= max_bytes` (null: any size). What a call or the communicator's settings ask
for explicitly wins over the table; a table made for another device or rank count is not
used (a warning says so). An algorithm under its former name (tables written before
`"direct"` became `"two_shot"`) is read as its current name. Every rank must load the same
table: its digest is part of what the ranks agree on before a call first runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from .algorithms.collectives import ALGORITHMS, FORMER_NAMES

__all__ = ["FORMAT", "TUNED", "Choice", "Tuning", "load"]

FORMAT = "gpuring-tuning/1"
#: the collectives a table may tune
TUNED = ("all_reduce", "reduce_scatter", "reduce")


class Choice(NamedTuple):
    """What a table chose for a size range: the largest size it covers (None: any)."""

    max_bytes: int | None
    algorithm: str
    chunk_bytes: int
    channels: int


@dataclass(frozen=True)
class Tuning:
    """A loaded table (see the module docstring)."""

    path: str
    device: str
    ranks: int
    tables: Mapping[str, tuple[Choice, ...]]
    #: sha256 of what the table chooses (not of its measurements): equal tables, equal digest
    digest: str

    def choose(self, collective: str, nbytes: int) -> Choice | None:
        """The table's choice for `collective` of `nbytes` (None: the table has no entry)."""
        for choice in self.tables.get(collective, ()):
            if choice.max_bytes is None or nbytes <= choice.max_bytes:
                return choice
        return None

    def applies(self, device: str, ranks: int) -> bool:
        return device == self.device and ranks == self.ranks


def load(path: str | os.PathLike[str]) -> Tuning:
    """Read and check a table; ValueError says what is wrong with it."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read the tuning table {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the tuning table {path} is not JSON: {exc}") from None
    return from_dict(data, path)


def from_dict(data: Any, path: str = "<table>") -> Tuning:
    """A table from its JSON object (see `load`)."""
    def bad(what: str) -> ValueError:
        return ValueError(f"tuning table {path}: {what}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} table (its \"format\" field)")
    device, ranks, tables = data.get("device"), data.get("ranks"), data.get("tables")
    if device not in ("cpu", "cuda"):
        raise bad(f"device must be \"cpu\" or \"cuda\", not {device!r}")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 2:
        raise bad(f"ranks must be an int >= 2, not {ranks!r}")
    if not isinstance(tables, dict):
        raise bad("\"tables\" must map collectives to lists of entries")
    parsed: dict[str, tuple[Choice, ...]] = {}
    for collective, entries in tables.items():
        if collective not in TUNED:
            raise bad(f"cannot tune {collective!r} (only {', '.join(TUNED)})")
        if not isinstance(entries, list) or not entries:
            raise bad(f"{collective}: a non-empty list of entries is needed")
        choices = []
        for entry in entries:
            try:
                choice = Choice(entry["max_bytes"], entry["algorithm"], entry["chunk_bytes"],
                                entry["channels"])
            except (KeyError, TypeError):
                raise bad(f"{collective}: each entry needs max_bytes, algorithm, chunk_bytes "
                          f"and channels, not {entry!r}") from None
            if isinstance(choice.algorithm, str) and choice.algorithm in FORMER_NAMES:
                # a table written before the rename ("direct": "two_shot")
                choice = choice._replace(algorithm=FORMER_NAMES[choice.algorithm])
            if choice.algorithm not in ALGORITHMS or (
                    choice.algorithm == "one_shot" and collective != "all_reduce"):
                raise bad(f"{collective}: no algorithm {choice.algorithm!r}")
            for name in ("chunk_bytes", "channels"):
                value = getattr(choice, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise bad(f"{collective}: {name} must be a positive int, not {value!r}")
            if choice.channels > 32:
                raise bad(f"{collective}: at most 32 channels, not {choice.channels}")
            if choice.max_bytes is not None and (
                    not isinstance(choice.max_bytes, int) or choice.max_bytes < 0):
                raise bad(f"{collective}: max_bytes must be bytes or null, not "
                          f"{choice.max_bytes!r}")
            choices.append(choice)
        bounds = [c.max_bytes for c in choices[:-1]]
        if None in bounds or bounds != sorted(bounds):  # type: ignore[type-var]
            raise bad(f"{collective}: entries must be ordered by max_bytes, null last")
        parsed[collective] = tuple(choices)
    chosen = json.dumps({"device": device, "ranks": ranks,
                         "tables": {k: [c._asdict() for c in v] for k, v in
                                    sorted(parsed.items())}}, sort_keys=True)
    return Tuning(path, device, ranks, parsed, hashlib.sha256(chosen.encode()).hexdigest()[:16])

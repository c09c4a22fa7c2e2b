"""The files `gpuring bench` writes: the JSON document, the CSV, each replaced whole."""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import IO, Any

from .report import SCHEMA, Floor, Result, avg_busbw, ratios

__all__ = ["to_json", "write_json", "write_csv", "replace_file", "CSV_FLOOR"]


def to_json(*, settings: dict[str, Any], machine: dict[str, Any], bandwidth: dict[str, Any],
            peers: list[str], results: list[Result], floors: list[Floor],
            overlap: list[dict[str, Any]] | None = None,
            complete: bool = True) -> dict[str, Any]:
    """The document --json writes (schema "gpuring.bench/2"): every repeat's results,
    their summary over repeats, the ratios to the peers (per repeat), the floor, the
    overlap; `complete` is False while the run goes on (what was not measured yet is
    missing)."""
    from .stats import summarize

    return {
        "schema": SCHEMA,
        "complete": complete,
        "settings": settings,
        "machine": machine,
        "memory_bandwidth": bandwidth,
        "peers": peers,
        "results": [asdict(r) for r in results],
        "summary": [asdict(r) for r in summarize(results)],
        "ratios": ratios(results),
        "floor": [asdict(f) for f in floors],
        "overlap": overlap or [],
        "avg_busbw_GBps": avg_busbw(results),
        "wrong_total": sum(r.wrong or 0 for r in results),
        "checked": any(r.wrong is not None for r in results),
    }


def replace_file(path: str, write: Callable[[IO[str]], None]) -> None:
    """Write a new file beside `path` with `write`, then rename it over `path`: a reader
    (or a run killed meanwhile) sees the old file or the new one, never half of one."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", newline="") as f:
            write(f)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_json(path: str, document: dict[str, Any]) -> None:
    def write(f: IO[str]) -> None:
        json.dump(document, f, indent=1)
        f.write("\n")

    replace_file(path, write)


#: the CSV's columns after the Result's: the floor of the gpuring row it is of (else empty)
CSV_FLOOR = ("floor_us", "efficiency_pct", "beats_floor", "in_cache")
_PER_RANK = ("rank_us", "rank_p99_us", "rank_max_us")


def write_csv(path: str, results: list[Result], floors: Sequence[Floor] = ()) -> None:
    """One row per result and repeat (the per-rank lists are left out: they are in the
    JSON), with the floor's time, efficiency, `beats_floor` and `in_cache` on the gpuring
    rows each floor is of."""
    names = [k for k in Result.__dataclass_fields__ if k not in _PER_RANK]
    by_row = {(f.size, f.type, f.redop, f.root, f.placement): f for f in floors}

    def write(f: IO[str]) -> None:
        writer = csv.DictWriter(f, fieldnames=[*names, *CSV_FLOOR], extrasaction="ignore")
        writer.writeheader()
        for r in results:
            row = asdict(r)
            floor = (by_row.get((r.size, r.type, r.redop, r.root, r.placement))
                     if r.system == "gpuring" else None)
            if floor is not None:
                row.update(floor_us=floor.floor_us, efficiency_pct=floor.efficiency_pct,
                           beats_floor=floor.beats_floor, in_cache=floor.in_cache)
            writer.writerow(row)

    replace_file(path, write)

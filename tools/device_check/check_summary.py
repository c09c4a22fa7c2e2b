"""summary.txt of the device check (bench/device_check.sh): each step's outcome, the probe's
key numbers, the benchmarks' key rows, and what to look at. Only measured numbers appear
(and arithmetic on them, marked as derived); anything missing is said to be missing.

    python -m tools.device_check.check_summary STAGE PROBE.json NOTES.txt EXIT_STATUS SECONDS

STAGE holds steps.tsv (one line per step: name, status, exit code, seconds, budget, log,
note) and the steps' logs and bench JSON; NOTES.txt is copied under its own heading.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .summary_probe import probe_lines, question_lines
from .summary_units import gbps, size_text, us

__all__ = ["summarize", "main"]

_KEY_SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30)
_LOG_LINES = 6  # lines of a failed step's log quoted in the summary


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------- steps

def _steps(stage: Path) -> list[dict[str, str]]:
    lines = (stage / "steps.tsv").read_text(encoding="utf-8").splitlines() \
        if (stage / "steps.tsv").is_file() else []
    if not lines:
        return []
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=False)) for line in lines[1:]
            if line.strip()]


def _log_tail(stage: Path, log: str) -> list[str]:
    try:
        text = (stage / log).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line[:160] for line in text.strip().splitlines()[-_LOG_LINES:]]


def step_lines(stage: Path, steps: list[dict[str, str]]) -> list[str]:
    out = [f"{'step':<24} {'status':<9} {'time':>6} {'budget':>7}  log (in details.tar.gz)"]
    for s in steps:
        out.append(f"{s.get('step', '?'):<24} {s.get('status', '?'):<9} "
                   f"{s.get('seconds', '?'):>5}s {s.get('budget', '?'):>6}s  {s.get('log', '')}"
                   + (f"  ({s['note']})" if s.get("note") else ""))
    for s in steps:
        if s.get("status") in ("failed", "timeout"):
            out.append(f"-- last lines of {s.get('log')} ({s.get('step')}, {s.get('status')}):")
            out += ["   " + line for line in _log_tail(stage, s.get("log", ""))]
    return out


# ---------------------------------------------------------------------------- benches

def _rows_from_json(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """(system, size) -> out-of-place result (in-place where only that exists)."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in data.get("results") or []:
        if not isinstance(r, dict) or "system" not in r or "size" not in r:
            continue
        key = (str(r["system"]), int(r["size"]))
        if key not in rows or r.get("placement") == "out-of-place":
            rows[key] = r
    return rows


def _rows_from_txt(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """gpuring's rows of a bench table (for a run cut short before its JSON)."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return rows
    for line in lines:
        cols = line.split()
        if len(cols) >= 9 and cols[0].isdigit() and cols[1].isdigit():
            try:
                rows[("gpuring", int(cols[0]))] = {
                    "time_us": float(cols[5]), "busbw_GBps": float(cols[7]),
                    "wrong": int(cols[8])}
            except ValueError:
                continue
    return rows


def _bench(stage: Path, name: str) -> tuple[dict[tuple[str, int], dict[str, Any]],
                                            dict[str, Any] | None, str]:
    data = _read_json(stage / f"{name}.json")
    if data is not None:
        return _rows_from_json(data), data, ""
    rows = _rows_from_txt(stage / f"{name}.txt")
    return rows, None, " (no JSON: gpuring rows of the partial table)" if rows else ""


def _pick_sizes(sizes: list[int]) -> list[int]:
    keys = [s for s in sizes if s in _KEY_SIZES]
    return keys if len(keys) >= 2 else sizes[:: max(1, len(sizes) // 5)]


def bench_lines(stage: Path, steps: list[dict[str, str]]) -> list[str]:
    out: list[str] = []
    for n in (2, 4):
        rows: dict[tuple[str, int], dict[str, Any]] = {}
        notes: list[str] = []
        for name in (f"allreduce-{n}ranks", f"allreduce-{n}ranks-large"):
            found, data, how = _bench(stage, name)
            rows.update(found)
            if how:
                notes.append(f"{name}{how}")
            if data is not None:
                notes += [str(p) for p in data.get("peers") or []]
                bw = (data.get("memory_bandwidth") or {}).get("GBps_per_rank")
                if bw and name.endswith("ranks"):
                    notes.append(f"memory bandwidth per rank (bench): {gbps(bw)}")
        if not rows:
            out.append(f"all_reduce on {n} ranks: no results")
            continue
        systems = sorted({s for s, _ in rows}, key=lambda s: (s != "gpuring", s))
        sizes = _pick_sizes(sorted({size for _, size in rows}))
        wrong = sum(int(r.get("wrong") or 0) for r in rows.values())
        out.append(f"all_reduce float32 sum, {n} ranks on one GPU (time, busbw; "
                   f"wrong elements: {wrong}):")
        out.append(f"  {'size':>8}" + "".join(f"  {s:>24}" for s in systems))
        for size in sizes:
            cells = [(f"{us(r.get('time_us'))}, {gbps(r.get('busbw_GBps'))}"
                      if (r := rows.get((s, size))) else "-") for s in systems]
            out.append(f"  {size_text(size):>8}" + "".join(f"  {c:>24}" for c in cells))
        out += [f"  {note}"[:220] for note in notes]
    return out + small_lines(stage, steps) + tune_lines(stage, steps)


def small_lines(stage: Path, steps: list[dict[str, str]]) -> list[str]:
    """The small all_reduces in the forms the default did not take (`small-*` steps)."""
    out = []
    for name in (s.get("step", "") for s in steps if s.get("step", "").startswith("small-")):
        rows, _, _ = _bench(stage, name)
        cells = [f"{size_text(size)} {system} {us(r.get('time_us'))}"
                 for (system, size), r in sorted(rows.items(), key=lambda i: (i[0][1], i[0][0]))
                 if size in (8, 1 << 10, 64 << 10)]
        out.append(f"  {name.removeprefix('small-'):<18} " + ("; ".join(cells) or "no result"))
    return ["small all_reduce (float32 sum, out-of-place time):", *out] if out else []


def tune_lines(stage: Path, steps: list[dict[str, str]]) -> list[str]:
    out = []
    for name in (s.get("step", "") for s in steps if s.get("step", "").startswith("tune-")):
        rows, data, _ = _bench(stage, name)
        gp = [r for (system, _), r in rows.items() if system == "gpuring"]
        settings = (data or {}).get("settings") or {}
        label = name.removeprefix("tune-")
        if gp:
            r = gp[0]
            out.append(f"  {label:<18} {us(r.get('time_us')):>10}  {gbps(r.get('busbw_GBps'))}"
                       f"  (size {size_text(settings.get('max_bytes', r.get('size')))}, "
                       f"{settings.get('ranks', '?')} ranks)")
        else:
            out.append(f"  {label:<18} no result")
    return ["piece size / channels sweep (gpuring, out-of-place):", *out] if out else []


# ---------------------------------------------------------------------------- the summary

def _notes(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return [f"({path} not found)"]
    kept = [line for line in lines if not line.startswith("#")]
    while kept and not kept[0].strip():
        kept.pop(0)
    return kept or ["(none)"]


def summarize(stage: Path, probe_path: Path, notes: Path, status: int,
              seconds: int) -> str:
    probe = _read_json(probe_path)
    steps = _steps(stage)
    simulated = bool(((probe or {}).get("versions") or {}).get("simulated"))
    bad = [s.get("step", "?") for s in steps
           if s.get("status") not in ("ok", "skipped")]
    lines = [
        "gpuring device check: summary" + ("   [CUDA SIMULATOR: no figure here is a GPU's]"
                                           if simulated else ""),
        f"result: {'PASS' if status == 0 else 'FAIL'} (exit status {status}) in {seconds} s; "
        + (f"not ok: {', '.join(bad)}" if bad else "every step ok"),
        "files: summary.txt, probe.json, details.tar.gz (every log, bench .txt/.json)",
        "", "== steps ==", *step_lines(stage, steps),
        "", "== probe (probe.json) ==", *probe_lines(probe),
        "", "== benchmarks ==", *bench_lines(stage, steps),
        "", "== what to look at ==", *question_lines(probe),
        "", f"== more notes ({notes.name}; edit that file to add questions) ==", *_notes(notes),
        "", "== end of summary ==",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    stage, probe, notes, status, seconds = args
    sys.stdout.write(summarize(Path(stage), Path(probe), Path(notes), int(status),
                               int(seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

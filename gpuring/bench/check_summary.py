"""summary.txt of the device check (bench/device_check.sh): each step's outcome, the probe's
key numbers, the benchmarks' key rows, and what to look at. Only measured numbers appear
(and arithmetic on them, marked as derived); anything missing is said to be missing.

    python -m gpuring.bench.check_summary STAGE PROBE.json NOTES.txt EXIT_STATUS SECONDS

STAGE holds steps.tsv (one line per step: name, status, exit code, seconds, budget, log,
note) and the steps' logs and bench JSON; NOTES.txt is copied under its own heading.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["summarize", "main"]

_KEY_SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30)
_LOG_LINES = 6  # lines of a failed step's log quoted in the summary


# ---------------------------------------------------------------------------- formatting

def _us(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "n/a"
    if value >= 1e6:
        return f"{value / 1e6:.2f} s"
    if value >= 1e3:
        return f"{value / 1e3:.2f} ms"
    return f"{value:.1f} us"


def _size(n: Any) -> str:
    if not isinstance(n, int):
        return str(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _gbps(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "n/a"
    return f"{value:.0f} GB/s" if value >= 100 else f"{value:.{1 if value >= 1 else 3}f} GB/s"


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


# ---------------------------------------------------------------------------- probe

def _part_problem(name: str, part: Any) -> str | None:
    """A line for a part that did not finish normally, else None."""
    if not isinstance(part, dict):
        return f"{name:<10} missing from probe.json"
    status = part.get("status")
    if status == "ok":
        return None
    detail = part.get("error") or part.get("reason") or part.get("phase") or ""
    when = f" after {part['elapsed_s']} s" if "elapsed_s" in part else ""
    return f"{name:<10} {str(status).upper()}{when}: {detail}"[:300]


def _short(value: Any) -> str:
    """A probe value; "n/a" for one the machine could not give ("unavailable: <why>")."""
    text = str(value)
    return "n/a" if text.startswith("unavailable") else text


def _versions_line(probe: dict[str, Any]) -> str:
    v = probe.get("versions") or {}
    host = probe.get("host") or {}
    names = (("driver", "driver"), ("CUDA runtime", "cuda_runtime"), ("CuPy", "cupy"),
             ("cuda-bindings", "cuda_bindings"), ("NCCL", "nccl"))
    return (f"GPU {_short(v.get('gpu', 'n/a'))} (compute capability "
            f"{_short(v.get('compute_capability', '?'))}); "
            + ", ".join(f"{label} {_short(v.get(key, '?'))}" for label, key in names)
            + f"; commit {str(host.get('commit', '?'))[:12]}")


def _pingpong(label: str, part: Any) -> str:
    if not isinstance(part, dict):
        return f"  {label:<14} missing"
    if part.get("status") != "ok" and not part.get("samples"):
        return f"  {label:<14} {part.get('status')}: {part.get('error') or part.get('reason', '')}"
    line = (f"  {label:<14} median {_us(part.get('median_us')):>9}  p99 "
            f"{_us(part.get('p99_us')):>9}  ({part.get('samples')} of "
            f"{part.get('round_trips')} round trips")
    line += ", values right)" if part.get("values_ok") else ")"
    if part.get("status") != "ok":
        line += f" -- {part.get('status')}: {part.get('error', '')}"
    return line


def _host_cost_line(h: dict[str, Any]) -> str:
    parts = [f"reduce kernel {_us(h.get('kernel_launch_us'))}"]
    if "write_value_built_us" in h:
        parts.append(f"cuStreamWriteValue64 built per call {_us(h['write_value_built_us'])}, "
                     f"pre-built {_us(h.get('write_value_prebuilt_us'))}")
        parts.append(f"cuStreamWaitValue64 pre-built {_us(h.get('wait_value_prebuilt_us'))}")
    elif "memops_error" in h:
        parts.append(f"memops: {h['memops_error']}")
    if "gpuring_reduce_us" in h:
        parts.append(f"CudaDevice reduce {_us(h['gpuring_reduce_us'])}, write_flag "
                     f"{_us(h.get('gpuring_write_flag_us'))} ({h.get('gpuring_flags_mode')})")
    elif "gpuring_error" in h:
        parts.append(f"CudaDevice: {h['gpuring_error']}")
    return "; ".join(parts)


def _dead_line(d: dict[str, Any]) -> str:
    def data(key: str) -> str:
        got = d.get(key)
        return f"memcpy {got[0]}, kernel {got[1]}" if isinstance(got, list) and \
            len(got) == 2 else "not read"

    return (f"exporter SIGKILLed; read queued before the kill: {d.get('queued_read', 'n/a')} "
            f"({data('queued_data')}); read queued after: {d.get('later_read', 'n/a')} "
            f"({data('later_data')}); survivor's context: {d.get('context_after', 'n/a')}"
            + (f" [{d['answer']}]" if d.get("answer") else ""))


def probe_lines(probe: dict[str, Any] | None) -> list[str]:
    if probe is None:
        return ["probe.json is missing or unreadable"]
    out = [_versions_line(probe)]
    host = probe.get("host") or {}
    smi = host.get("nvidia_smi")
    out.append(f"nvidia-smi: {smi.get('output', smi) if isinstance(smi, dict) else smi}; "
               f"{host.get('cpus')} CPUs; MPS control: {host.get('mps_control')}")
    ipc = probe.get("ipc") or {}
    if ipc.get("status") == "ok":
        out.append(f"IPC        {'ok' if ipc.get('ok') else 'WRONG DATA'}: "
                   f"{_size(ipc.get('bytes'))} pattern read by the peer and its reply read back;"
                   f" open {ipc.get('open_ms', 0):.2f} ms; copy out of the mapping "
                   f"{_gbps(ipc.get('peer_copy_GBps'))}")
    m = probe.get("memops") or {}
    if m.get("status") == "ok":
        out.append(f"memops     CAN_USE_64_BIT_STREAM_MEM_OPS = {m.get('attribute')}; write then "
                   f"wait on one stream: {m.get('same_stream')}; wait released by another "
                   f"stream: {m.get('cross_stream')}")
    k = probe.get("kernels") or {}
    if k.get("status") == "ok":
        out.append(f"kernels    loaded in {k.get('load_s', 0):.1f} s ({k.get('module')})"
                   + (f"; warnings: {k['warnings']}" if k.get("warnings") else ""))
    c = probe.get("copy_bandwidth") or {}
    if "memcpy_GBps" in c:
        out.append(f"copy       memcpy {_gbps(c.get('memcpy_GBps'))}, gpuring_copy_bytes "
                   f"{_gbps(c.get('kernel_GBps'))} ({_size(c.get('bytes'))}, read + write "
                   "counted)")
    h = probe.get("host_cost") or {}
    if "kernel_launch_us" in h:
        out.append(f"host cost  per enqueue from Python (mean of {h.get('iters')}): "
                   + _host_cost_line(h))
    out.append("ping-pong  GPU time per flag round trip, 2 processes on 1 GPU:")
    out.append(_pingpong("memops", probe.get("pingpong_memops")))
    out.append(_pingpong("spin kernels", probe.get("pingpong_kernel")))
    out.append(_pingpong("gpuring (memops wait, kernel write)", probe.get("pingpong_gpuring")))
    mps = probe.get("mps") or {}
    if mps.get("status") == "ok":
        out.append(_pingpong("MPS memops", mps.get("pingpong_memops")))
        out.append(_pingpong("MPS spin", mps.get("pingpong_kernel")))
        out.append(_pingpong("MPS gpuring", mps.get("pingpong_gpuring")))
    else:
        out.append(f"  MPS: {mps.get('status', 'missing')} "
                   f"({mps.get('reason') or mps.get('error') or mps.get('start', '')})")
    d = probe.get("dead_exporter") or {}
    if "queued_read" in d:
        out.append("dead peer  " + _dead_line(d))
    for name, label in (("abort_release", "default queues"),
                        ("abort_release_1conn", "CUDA_DEVICE_MAX_CONNECTIONS=1")):
        a = probe.get(name) or {}
        if "released" in a:
            out.append(f"abort      12 blocked streams, {label}: "
                       + (f"released in {a.get('release_ms', 0):.1f} ms" if a["released"]
                          else "NOT released (the side-stream release stalled)")
                       + f" ({a.get('flags_mode', '?')} waits)")
    problems = [p for name in ("versions", "ipc", "memops", "kernels", "copy_bandwidth",
                               "host_cost", "pingpong_memops", "pingpong_kernel",
                               "pingpong_gpuring", "dead_exporter", "abort_release",
                               "abort_release_1conn")
                if (p := _part_problem(name, probe.get(name)))]
    out += ["parts that did not finish normally:", *("  " + p for p in problems)] \
        if problems else ["every part finished normally"]
    if not probe.get("complete"):
        out.append(f"the probe did not complete ({probe.get('interrupted', 'cut short')})")
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
                    notes.append(f"memory bandwidth per rank (bench): {_gbps(bw)}")
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
            cells = [(f"{_us(r.get('time_us'))}, {_gbps(r.get('busbw_GBps'))}"
                      if (r := rows.get((s, size))) else "-") for s in systems]
            out.append(f"  {_size(size):>8}" + "".join(f"  {c:>24}" for c in cells))
        out += [f"  {note}"[:220] for note in notes]
    return out + small_lines(stage, steps) + tune_lines(stage, steps)


def small_lines(stage: Path, steps: list[dict[str, str]]) -> list[str]:
    """The small all_reduces in the forms the default did not take (`small-*` steps)."""
    out = []
    for name in (s.get("step", "") for s in steps if s.get("step", "").startswith("small-")):
        rows, _, _ = _bench(stage, name)
        cells = [f"{_size(size)} {system} {_us(r.get('time_us'))}"
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
            out.append(f"  {label:<18} {_us(r.get('time_us')):>10}  {_gbps(r.get('busbw_GBps'))}"
                       f"  (size {_size(settings.get('max_bytes', r.get('size')))}, "
                       f"{settings.get('ranks', '?')} ranks)")
        else:
            out.append(f"  {label:<18} no result")
    return ["piece size / channels sweep (gpuring, out-of-place):", *out] if out else []


# ---------------------------------------------------------------------------- questions

def _ratio(a: Any, b: Any) -> str:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
    return f"{a / b:.1f}x" if ok else "n/a"


def question_lines(probe: dict[str, Any] | None) -> list[str]:
    """Questions only a GPU answers, each beside what this run measured for it."""
    p = probe or {}
    mem, spin = p.get("pingpong_memops") or {}, p.get("pingpong_kernel") or {}
    mps = p.get("mps") or {}
    ipc, dead = p.get("ipc") or {}, p.get("dead_exporter") or {}
    copy, host = p.get("copy_bandwidth") or {}, p.get("host_cost") or {}
    piece_us = (3 * (8 << 20) / (copy["memcpy_GBps"] * 1e3)
                if isinstance(copy.get("memcpy_GBps"), (int, float)) else None)
    per_piece = [x for x in (host.get("gpuring_reduce_us"), host.get("gpuring_write_flag_us"))
                 if isinstance(x, (int, float))]
    host_us = sum(per_piece) if len(per_piece) == 2 else None
    return [
        "- Does a stream blocked in cuStreamWaitValue64 give up the GPU's time slice to the "
        "other process? Round trip median: memops "
        f"{_us(mem.get('median_us'))}, spin kernels {_us(spin.get('median_us'))} (spin/memops "
        f"{_ratio(spin.get('median_us'), mem.get('median_us'))}); under MPS: "
        + (f"memops {_us((mps.get('pingpong_memops') or {}).get('median_us'))}, spin "
           f"{_us((mps.get('pingpong_kernel') or {}).get('median_us'))}"
           if mps.get("status") == "ok" else str(mps.get("status", "not run"))) + ".",
        f"- Can ranks map each other's memory here (CUDA IPC in this container)? ipc: "
        f"{ipc.get('status', 'not run')}{', data right' if ipc.get('ok') else ''}"
        + (f" ({ipc['error']})" if ipc.get("error") else "") + ".",
        "- After a peer dies, may a survivor's queued work still read the dead peer's memory, "
        f"and does the survivor's context survive? queued read: {dead.get('queued_read', 'n/a')}"
        f", later read: {dead.get('later_read', 'n/a')}, context: "
        f"{dead.get('context_after', 'n/a')} (status {dead.get('status', 'not run')})"
        + (f" [{dead['answer']}]." if dead.get("answer") else "."),
        "- Is CudaDevice host-bound at its 8 MiB pieces? Host cost of one reduce + one flag "
        f"write via CudaDevice: {_us(host_us)}; GPU time of one 8 MiB reduce at the measured "
        f"memcpy bandwidth (3 x 8 MiB / bandwidth, derived): {_us(piece_us)}.",
        "- gpuring against NCCL and gloo at each size, and which piece size / channel count "
        "the sweep favours: see the tables above (a peer that could not start says why).",
    ]


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

"""The probe's part of summary.txt (`tools.device_check.check_summary`): its key numbers, a
line per part that did not finish, and the questions only a GPU answers, each beside what the
run measured for it."""

from __future__ import annotations

from typing import Any

from .summary_units import gbps, ratio, size_text, us

__all__ = ["probe_lines", "question_lines"]


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
    line = (f"  {label:<14} median {us(part.get('median_us')):>9}  p99 "
            f"{us(part.get('p99_us')):>9}  ({part.get('samples')} of "
            f"{part.get('round_trips')} round trips")
    line += ", values right)" if part.get("values_ok") else ")"
    if part.get("status") != "ok":
        line += f" -- {part.get('status')}: {part.get('error', '')}"
    return line


def _host_cost_line(h: dict[str, Any]) -> str:
    parts = [f"reduce kernel {us(h.get('kernel_launch_us'))}"]
    if "write_value_built_us" in h:
        parts.append(f"cuStreamWriteValue64 built per call {us(h['write_value_built_us'])}, "
                     f"pre-built {us(h.get('write_value_prebuilt_us'))}")
        parts.append(f"cuStreamWaitValue64 pre-built {us(h.get('wait_value_prebuilt_us'))}")
    elif "memops_error" in h:
        parts.append(f"memops: {h['memops_error']}")
    if "gpuring_reduce_us" in h:
        parts.append(f"CudaDevice reduce {us(h['gpuring_reduce_us'])}, write_flag "
                     f"{us(h.get('gpuring_write_flag_us'))} ({h.get('gpuring_flags_mode')})")
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
                   f"{size_text(ipc.get('bytes'))} pattern read by the peer and its reply "
                   "read back;"
                   f" open {ipc.get('open_ms', 0):.2f} ms; copy out of the mapping "
                   f"{gbps(ipc.get('peer_copy_GBps'))}")
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
        out.append(f"copy       memcpy {gbps(c.get('memcpy_GBps'))}, gpuring_copy_bytes "
                   f"{gbps(c.get('kernel_GBps'))} ({size_text(c.get('bytes'))}, read + write "
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


# ---------------------------------------------------------------------------- questions

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
        f"{us(mem.get('median_us'))}, spin kernels {us(spin.get('median_us'))} (spin/memops "
        f"{ratio(spin.get('median_us'), mem.get('median_us'))}); under MPS: "
        + (f"memops {us((mps.get('pingpong_memops') or {}).get('median_us'))}, spin "
           f"{us((mps.get('pingpong_kernel') or {}).get('median_us'))}"
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
        f"write via CudaDevice: {us(host_us)}; GPU time of one 8 MiB reduce at the measured "
        f"memcpy bandwidth (3 x 8 MiB / bandwidth, derived): {us(piece_us)}.",
        "- gpuring against NCCL and gloo at each size, and which piece size / channel count "
        "the sweep favours: see the tables above (a peer that could not start says why).",
    ]

"""The device probe: what a GPU machine offers gpuring's design, in about a minute.

    python -m tools.device_check.probe OUT.json

from the repository root (or with it on PYTHONPATH, as bench/device_check.sh runs it); the
parts' child processes start the same way, in the same directory and environment.

Each part runs in a child process (or two) with its own time box; a part that fails, hangs or
is killed is recorded as such, and the probe goes on. OUT.json is rewritten after every part,
so a probe killed half way still leaves what it measured. The probe process itself never
touches CUDA.

Parts (keys of OUT.json, in the order they run):
  versions          GPU, driver, CUDA runtime, CuPy, cuda-bindings, NCCL (and "simulated")
  ipc               CUDA IPC between 2 processes on one GPU: a pattern there and a reply back
  memops            CAN_USE_64_BIT_STREAM_MEM_OPS, and whether a write then wait completes
  kernels           loading kernels/reduce.cu (NVRTC compile or the disk cache)
  copy_bandwidth    device-to-device copy, cudaMemcpyAsync and gpuring_copy_bytes (GB/s,
                    read + write counted)
  host_cost         host microseconds per enqueue: a reduce kernel, cuStreamWriteValue64
                    (arguments built per call and pre-built), gpuring's CudaDevice stream ops
  pingpong_memops   2-process flag ping-pong with stream memory operations: per-round-trip
  pingpong_kernel   GPU times (median, p99), and the same with the spin kernels, and
  pingpong_gpuring  with what CudaDevice does (stream memory waits, write kernels)
  dead_exporter     reads of a SIGKILLed exporter's memory, then the survivor's context
  abort_release     CudaDevice.abort releasing 12 streams blocked in flag waits, as found and
                    (abort_release_1conn) with CUDA_DEVICE_MAX_CONNECTIONS=1
  mps               both ping-pongs again under MPS, if nvidia-cuda-mps-control is on PATH
Every part has "status": ok, error (with "error"), timeout (killed at its budget; what it had
recorded is kept), interrupted (the probe got SIGTERM), hang (GPU work it waited for did not
finish), crashed, skipped, or unsupported (on the CUDA simulator: MPS).

Settings (environment, for dry runs): GPURING_PROBE_BUDGET (seconds for all, 75),
GPURING_PROBE_ROUND_TRIPS (1000), GPURING_PROBE_BATCH (100), GPURING_PROBE_COPY_BYTES (1G),
GPURING_PROBE_IPC_BYTES (64M), GPURING_PROBE_HOST_ITERS (2000), GPURING_PROBE_RELEASE_S (how
long the abort parts wait for a release before they call it a hang, 10), GPURING_PROBE_PARTS (a
comma-separated subset), GPURING_PROBE_MPS_DIR (where MPS keeps its pipes and logs; default a
temporary directory), GPURING_DEVICE_CHECK_TIME_SCALE (every time box times this, 1),
GPURING_COMMIT (the commit, where the tree is not a git checkout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "PART_BUDGETS", "run_probe", "main"]

SCHEMA = "gpuring.probe/1"
#: each part's time box in seconds (the probe's total budget may cut it shorter)
PART_BUDGETS: dict[str, float] = {
    "versions": 15, "ipc": 15, "memops": 10, "kernels": 30, "copy_bandwidth": 15,
    "host_cost": 15, "pingpong_memops": 15, "pingpong_kernel": 20, "pingpong_gpuring": 15,
    "dead_exporter": 15, "abort_release": 10, "abort_release_1conn": 10,
}
#: parts run with more in their environment
PART_ENV: dict[str, dict[str, str]] = {"abort_release_1conn": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}
_MPS_RESERVE = 12.0  # seconds kept back to stop MPS
_MIN_PART = 3.0  # a part gets at least this much, or is skipped
_ROOT = Path(__file__).resolve().parents[2]


class _Interrupted(BaseException):
    """SIGTERM (e.g. from `timeout`): stop the running part, stop MPS, write the JSON."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Interrupted(f"signal {signum}")


# ---------------------------------------------------------------------------- one part

@dataclasses.dataclass
class _Running:
    """Child processes of the probe still alive (killed on the way out)."""

    procs: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)

    def kill_all(self) -> None:
        for proc in list(self.procs):
            _kill_group(proc)


_running = _Running()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the part's whole process group (the part and its peer)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _tail(text: str, chars: int = 1500) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def run_part(name: str, budget: float, sink: dict[str, Any],
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run part `name` in a child process (a new session, so it and its peer can be killed
    together) for at most `budget` seconds. Its record (status, time, budget and what it
    measured) goes into sink[name], even when SIGTERM interrupts it, and is returned."""
    interrupted: _Interrupted | None = None
    with tempfile.TemporaryDirectory(prefix=f"gpuring-probe-{name}-") as tmp:
        result, log_path = Path(tmp) / "result.json", Path(tmp) / "log"
        cmd = [sys.executable, "-m", "tools.device_check.probe", "--part", name,
               "--result", str(result), "--budget", f"{budget:.1f}"]
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)
            _running.procs.append(proc)
            try:
                rc: int | None = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                rc = None
            except _Interrupted as exc:
                rc, interrupted = None, exc
            finally:
                _kill_group(proc)  # also a peer left behind
                _running.procs.remove(proc)
        data = _read_json(result)
        if rc is None:
            data["status"] = "interrupted" if interrupted else "timeout"
        elif "status" not in data:
            data["status"] = "ok" if rc == 0 else "crashed"
        if rc not in (0, None):
            data["exit_status"] = rc
        data.update(elapsed_s=round(time.monotonic() - start, 2), budget_s=budget,
                    pid=proc.pid)
        output = log_path.read_text(encoding="utf-8", errors="replace")
    if data["status"] != "ok" and output.strip():
        data["log_tail"] = _tail(output)
    sys.stderr.write(f"---- probe part {name}: {data['status']} in {data['elapsed_s']} s "
                     f"(budget {budget:.0f} s)\n{output}")
    sys.stderr.flush()
    sink[name] = data
    if interrupted is not None:
        raise interrupted
    return data


# ---------------------------------------------------------------------------- MPS

def _command(cmd: list[str], env: dict[str, str], timeout: float,
             stdin: str | None = None) -> dict[str, Any]:
    """Run a short command; its exit status and output (never raises). The output goes
    through a file, not a pipe: a daemon that forks off keeps no pipe of ours open."""
    with tempfile.TemporaryFile("w+") as output:
        try:
            done = subprocess.run(cmd, env=env, input=stdin, stdout=output,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"rc": None, "error": f"{type(exc).__name__}: {exc}"}
        output.seek(0)
        return {"rc": done.returncode, "output": _tail(output.read(), 600)}


@contextlib.contextmanager
def _mps_daemon(exe: str, record: dict[str, Any]) -> Iterator[dict[str, str]]:
    """An MPS control daemon with private pipe and log directories; always stopped (quit)."""
    given = os.environ.get("GPURING_PROBE_MPS_DIR")
    base = Path(given) if given else Path(tempfile.mkdtemp(prefix="gpuring-mps-"))
    pipe, logs = base / "pipe", base / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    record["dir"] = str(base)
    record["start"] = _command([exe, "-d"], env, 10)
    try:
        yield env
    finally:
        record["stop"] = _command([exe], env, 10, stdin="quit\n")
        for log in ("control.log", "server.log"):
            with contextlib.suppress(OSError):
                record[log] = _tail((logs / log).read_text(errors="replace"), 800)
        if not given:
            shutil.rmtree(base, ignore_errors=True)


def run_mps(deadline: float, scale: float, sink: dict[str, Any]) -> dict[str, Any]:
    """Both ping-pongs again with MPS started just for them (skipped without MPS); the record
    is sink["mps"] from the start, so an interrupted run keeps what it had."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return {"status": "skipped", "reason": "nvidia-cuda-mps-control is not on PATH"}
    record: dict[str, Any] = {"status": "ok"}
    sink["mps"] = record
    with _mps_daemon(exe, record) as env:
        if record["start"]["rc"] != 0:
            record.update(status="error", error="nvidia-cuda-mps-control -d failed")
            return record
        for name in ("pingpong_memops", "pingpong_kernel", "pingpong_gpuring"):
            budget = min(PART_BUDGETS[name] * scale,
                         deadline - time.monotonic() - _MPS_RESERVE)
            if budget >= _MIN_PART:
                run_part(name, budget, record, env)
            else:
                record[name] = {"status": "skipped", "reason": "probe budget spent"}
    return record


# ---------------------------------------------------------------------------- the probe

def _host_facts() -> dict[str, Any]:
    """What the probe process learns without CUDA: commit, nvidia-smi, kernel, CPUs."""
    facts: dict[str, Any] = {"python": sys.executable, "cpus": os.cpu_count(),
                             "uname": " ".join(platform.uname())}
    git = _command(["git", "-C", str(_ROOT), "rev-parse", "HEAD"], dict(os.environ), 10)
    facts["commit"] = (git.get("output", "").strip() if git["rc"] == 0
                       else os.environ.get("GPURING_COMMIT", "unknown"))
    smi = shutil.which("nvidia-smi")
    facts["nvidia_smi"] = (
        _command([smi, "--query-gpu=name,driver_version,compute_mode,memory.total,"
                  "clocks.max.sm", "--format=csv,noheader"], dict(os.environ), 15)
        if smi else "not on PATH")
    with contextlib.suppress(OSError):
        facts["proc_version"] = Path("/proc/version").read_text().strip()
    facts["mps_control"] = shutil.which("nvidia-cuda-mps-control") or "not on PATH"
    return facts


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    partial.replace(path)


def _one(name: str, probe: dict[str, Any], deadline: float, scale: float) -> dict[str, Any]:
    """Part `name`'s record: run, or skipped when the budget is spent; MPS is unsupported on
    the CUDA simulator (as the versions part found)."""
    left = deadline - time.monotonic()
    if name != "mps":
        env = dict(os.environ, **PART_ENV[name]) if name in PART_ENV else None
        return (run_part(name, min(PART_BUDGETS[name] * scale, left), probe, env)
                if left >= _MIN_PART else {"status": "skipped", "reason": "probe budget spent"})
    if (probe.get("versions") or {}).get("simulated"):
        return {"status": "unsupported",
                "reason": "unsupported here: the CUDA simulator has no MPS"}
    if left < 2 * _MIN_PART + _MPS_RESERVE:
        return {"status": "skipped", "reason": "probe budget spent"}
    return run_mps(deadline, scale, probe)


def run_probe(out: Path) -> dict[str, Any]:
    """Run every part in turn within the total budget, rewriting `out` after each."""
    from .probe_gpu import Settings

    settings = Settings.from_env()
    wanted = [p for p in (*PART_BUDGETS, "mps") if not settings.parts or p in settings.parts]
    scale = settings.time_scale
    start = time.monotonic()
    deadline = start + settings.budget_s * scale
    probe: dict[str, Any] = {
        "schema": SCHEMA,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": dataclasses.asdict(settings), "part_budgets_s": PART_BUDGETS,
        "complete": False, "host": _host_facts()}
    _write_json(out, probe)
    try:
        for name in wanted:
            probe[name] = _one(name, probe, deadline, scale)
            probe["elapsed_s"] = round(time.monotonic() - start, 2)
            _write_json(out, probe)
        probe["complete"] = True
    except _Interrupted as exc:
        probe["interrupted"] = str(exc)
    finally:
        _running.kill_all()
        probe["elapsed_s"] = round(time.monotonic() - start, 2)
        _write_json(out, probe)
    return probe


# ---------------------------------------------------------------------------- entry points

def _part_main(name: str, result: str, budget: float) -> int:
    """In a part's child process: run the part, recording an error or a hang."""
    from .probe_gpu import Hang, Recorder, Settings, describe
    from .probe_registry import PARTS

    rec = Recorder(result)
    try:
        PARTS[name](rec, Settings.from_env(), budget)
    except Hang as exc:
        rec(status="hang", error=describe(exc))
        sys.stderr.flush()
        os._exit(0)  # a stuck stream may hang the process's exit too
    except Exception as exc:
        traceback.print_exc()
        rec(status="error", error=describe(exc))
        return 1
    return 0


def _peer_main(role: str) -> int:
    """In a peer process: the channel is stdin and the original stdout; stray output from
    libraries goes to stderr instead."""
    from .probe_gpu import Channel, describe
    from .probe_registry import PEERS

    wfile = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    chan = Channel(sys.stdin, wfile)
    try:
        PEERS[role](chan, chan.recv("args"))
    except Exception as exc:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            chan.send("error", error=describe(exc))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 6 and args[0] == "--part" and args[2] == "--result" and \
            args[4] == "--budget":
        return _part_main(args[1], args[3], float(args[5]))
    if len(args) == 2 and args[0] == "--peer":
        return _peer_main(args[1])
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    probe = run_probe(Path(args[0]))
    statuses = {k: v.get("status") for k, v in probe.items() if isinstance(v, dict)
                and "status" in v}
    print(f"probe: {json.dumps(statuses)}; written to {args[0]} in {probe['elapsed_s']} s")
    return 0 if probe.get("complete") else 1


if __name__ == "__main__":
    sys.exit(main())

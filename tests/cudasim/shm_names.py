"""Names of the simulator's /dev/shm files, and the sweep of those dead processes left.

A simulated allocation is the file `gpuring-[JOB-]simPID-TOKEN`: the `gpuring run` launcher
removes a job's files when the job ends, and `sweep_dead_allocations` removes those of
processes that are gone (the simulator runs it at import; CI runs it after the suite with
`python -m tests.cudasim.shm_names --check`, which fails if anything is left).
"""

from __future__ import annotations

import os
import re
import secrets
import sys

SHM = "/dev/shm"
_NAME_PID = re.compile(r"^gpuring-(?:[0-9a-f]+-)?sim(\d+)-[0-9a-f]+$")
#: a peer's mapping of an allocation: `NAME.mapPID` (made by ipcOpenMemHandle)
_MAPPING_PID = re.compile(r"^gpuring-(?:[0-9a-f]+-)?sim\d+-[0-9a-f]+\.map(\d+)$")


def allocation_name() -> str:
    """A /dev/shm name for a new allocation of this process (at most 44 characters, the room
    a 64-byte IPC handle leaves)."""
    job = os.environ.get("GPURING_JOB_ID", "")
    return f"gpuring-{job + '-' if job else ''}sim{os.getpid()}-{secrets.token_hex(3)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def simulator_files() -> list[str]:
    """Names of the simulator's files in /dev/shm."""
    return [name for name in os.listdir(SHM) if _NAME_PID.match(name) or
            _MAPPING_PID.match(name)]


def mapping_marker(name: str, pid: int) -> str:
    """The path that says process `pid` maps allocation `name`."""
    return os.path.join(SHM, f"{name}.map{pid}")


def live_mappers(name: str) -> list[int]:
    """Processes still alive that map allocation `name` (other than this one)."""
    prefix = f"{name}.map"
    pids = [int(entry[len(prefix):]) for entry in os.listdir(SHM)
            if entry.startswith(prefix) and entry[len(prefix):].isdigit()]
    return [pid for pid in pids if pid != os.getpid() and _alive(pid)]


def sweep_dead_allocations() -> list[str]:
    """Remove the files of simulated allocations, and mapping markers, whose process is gone
    (killed before it could free or unmap them); returns their names."""
    removed = []
    for name in simulator_files():
        found = _NAME_PID.match(name) or _MAPPING_PID.match(name)
        if found and not _alive(int(found.group(1))):
            try:
                os.unlink(os.path.join(SHM, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def main() -> int:
    """`--check`: sweep, then fail if simulator files remain (a live process leaked them)."""
    removed = sweep_dead_allocations()
    left = simulator_files()
    print(f"cudasim /dev/shm: removed {len(removed)} files of dead processes, {len(left)} left")
    if "--check" in sys.argv and left:
        print("left behind by live processes: " + ", ".join(left))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

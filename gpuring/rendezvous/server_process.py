"""The control-plane server of a job whose rank 0 serves it (`launchers.serve`), in a process
of its own: it outlives rank 0's process for as long as any rank is still connected, so
that rank 0 may leave (or just exit) after its last collective while its peers finish
theirs, and a rank 0 that dies is reported to its peers like any other rank.

    python -m gpuring.rendezvous.server_process      # started by `launchers.serve`

It reads its job on stdin (one JSON line: size, host, port, the key in hex, the pid of the
process that serves it), answers `ready HOST PORT` (the port it got, where asked for port
0) or `error: ...` on stdout, and serves until that
process has ended and no rank is connected any more. Once that process ended (its end of
stdin closes then) it accepts no new connection: the ranks of a later job on the same port
(a test that starts the same program twice) meet on that job's own server, not on this one
while it waits for the last of its ranks to go. Ctrl-C (SIGINT to the job's process group)
does not stop it: it goes when the ranks have gone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from .store import StoreServer

__all__ = ["main"]

#: seconds between two looks at whether it may stop
_TICK = 0.05


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid  # (a parent that ended leaves this process to another)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job = json.loads(sys.stdin.readline())
    try:
        server = StoreServer(int(job["size"]), bytes.fromhex(job["key"]), job["host"],
                             int(job["port"]))
    except (OSError, OverflowError) as exc:
        print(f"error: {exc}", flush=True)
        return 1
    host, port = server.address
    print(f"ready {host} {port}", flush=True)
    sys.stdout.close()
    parent = int(job["parent"])
    ended = threading.Event()  # stdin ends with the process that started this one

    def watch_stdin() -> None:
        sys.stdin.read()
        ended.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not ended.wait(_TICK) and _alive(parent):
        pass
    server.stop_listening()
    while not server.wait_until_alone(0):
        time.sleep(_TICK)
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

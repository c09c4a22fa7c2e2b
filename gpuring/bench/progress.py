"""Rank 0's output: table lines to stdout and a progress bar (rich) on stderr.

The bar appears only when stderr is a terminal and the run has lasted `delay` seconds.
When `gpuring bench --ranks N` launches the ranks, rank 0 writes JSON lines to a file
(GPURING_BENCH_STREAM) and the launching process prints them and draws the bar: output of
the ranks themselves goes through the launcher, which prefixes every line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import IO, Any

__all__ = ["STREAM_ENV", "ProgressView", "Output", "Follower"]

STREAM_ENV = "GPURING_BENCH_STREAM"


class ProgressView:
    """Prints lines and shows progress in the calling process."""

    def __init__(self, delay: float = 2.0, enabled: bool | None = None):
        self.delay = delay
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def _start(self) -> None:
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            self.enabled = False
            return
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(),
                             console=Console(stderr=True), transient=True,
                             redirect_stdout=False, redirect_stderr=False)
        self._task = self._bar.add_task("gpuring bench", total=None)
        self._bar.start()

    def update(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            if time.monotonic() - self.started < self.delay:
                return
            self._start()
            if self._bar is None:
                return
        self._bar.update(self._task, completed=done, total=total, description=what)

    def print(self, line: str) -> None:
        if self._bar is not None and sys.stdout.isatty():
            self._bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class Output:
    """Where rank 0 sends lines and progress; other ranks make a silent one."""

    def __init__(self, active: bool, stream_path: str | None = None,
                 view: ProgressView | None = None):
        self.active = active
        self._file: IO[str] | None = None
        self._view: ProgressView | None = None
        if not active:
            return
        if stream_path:
            self._file = open(stream_path, "a", buffering=1)
        else:
            self._view = view or ProgressView()

    def _send(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()

    def line(self, text: str) -> None:
        if not self.active:
            return
        if self._file is not None:
            self._send({"line": text})
        elif self._view is not None:
            self._view.print(text)

    def progress(self, done: int, total: int, what: str) -> None:
        if not self.active:
            return
        if self._file is not None:
            self._send({"progress": [done, total, what]})
        elif self._view is not None:
            self._view.update(done, total, what)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._view is not None:
            self._view.close()


class Follower(threading.Thread):
    """Reads the stream file rank 0 writes and replays it in this process."""

    def __init__(self, path: str, view: ProgressView):
        super().__init__(daemon=True)
        self.path = path
        self.view = view
        self.finished = threading.Event()
        self.saw_failure = False

    def run(self) -> None:
        with open(self.path) as f:
            pending = ""
            while True:
                # asked before reading: every line written before `stop` is read after it
                stopping = self.finished.is_set()
                chunk = f.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        self._handle(pending)
                        pending = ""
                    continue
                if stopping:
                    break
                time.sleep(0.05)

    def _handle(self, raw: str) -> None:
        try:
            event = json.loads(raw)
        except json.JSONDecodeError:
            return
        if "line" in event:
            line = str(event["line"])
            self.saw_failure |= line.startswith("# Wrong elements") and "FAILED" in line
            self.view.print(line)
        elif "progress" in event:
            done, total, what = event["progress"]
            self.view.update(int(done), int(total), str(what))

    def stop(self) -> None:
        self.finished.set()
        self.join(timeout=10)
        self.view.close()


def stream_path_from_env() -> str | None:
    return os.environ.get(STREAM_ENV) or None

"""What a CUDA memory handle says about the process that exported it (no GPU needed)."""

from __future__ import annotations

import os

from gpuring.devices import _cuda_memory


def test_a_forked_child_is_another_process() -> None:
    """Ranks forked from one parent (multiprocessing's default on Linux) must not share the
    token that tells a rank its own memory from a peer's."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its token, then leave without running pytest's exit
        os.write(write, _cuda_memory._PROCESS_TOKEN.encode())
        os._exit(0)
    os.close(write)
    theirs = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(theirs) == len(_cuda_memory._PROCESS_TOKEN) and theirs != _cuda_memory._PROCESS_TOKEN

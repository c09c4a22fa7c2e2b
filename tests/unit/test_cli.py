"""The `gpuring` command's usage errors: one line on stderr, exit status 2, before any rank
starts; and `--version`."""

from __future__ import annotations

import pytest

import gpuring
from gpuring._cli import main


@pytest.mark.parametrize(("argv", "says"), [
    (["run", "-n", "0", "python", "x.py"], "-n must be at least 1, got 0"),
    (["run", "-n", "2"], "nothing to run"),
    (["run", "-n", "2", "--"], "nothing to run"),
    (["run", "-n", "2", "gpuring-no-such-program"], "command not found: gpuring-no-such-program"),
    (["run", "-n", "2", "no/such/file.py"], "no such file: no/such/file.py"),
    (["run", "-n", "2", "./no-such-executable"], "not an executable file"),
    (["bench", "--ranks", "2", "-b", "2M", "-e", "1M"], "-b 2M is larger than -e 1M"),
])
def test_a_usage_error_is_one_line_and_exit_status_2(argv, says, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"gpuring {argv[0]}: ") and says in lines[0], lines[0]
    assert "Traceback" not in captured.err and not captured.out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpuring {gpuring.__version__}"


def test_mpiexec_without_mpi4py_says_what_to_install(monkeypatch):
    """Under an MPI launcher without mpi4py, the control plane says to install gpuring[mpi]
    (not a bare ModuleNotFoundError)."""
    import sys

    from gpuring.rendezvous.mpi import MpiControl

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError, match=r'pip install "gpuring\[mpi\]"'):
        MpiControl()

"""Fixtures of the unit tests."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from gpuring._communicator import Communicator
from gpuring.rendezvous.local import SingleProcess

from ..cudasim import kernels_host_build


@pytest.fixture
def comm():
    """A communicator for a world of one rank."""
    c = Communicator(SingleProcess())
    yield c
    c.close()


@pytest.fixture(scope="session")
def lib(host_build_dir: Path) -> ctypes.CDLL:
    """The host build of kernels/reduce.cu (its kernels run on the CPU, bit for bit)."""
    try:
        path = kernels_host_build.build(host_build_dir)
    except kernels_host_build.Unavailable as exc:
        pytest.skip(str(exc))
    return kernels_host_build.load(path)

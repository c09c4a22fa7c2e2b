"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

from gpuring._communicator import Communicator
from gpuring.rendezvous.local import SingleProcess


@pytest.fixture
def comm():
    """A communicator for a world of one rank."""
    c = Communicator(SingleProcess())
    yield c
    c.close()

"""Devices by kind: the table that picks the device for an array's kind ("cpu", "cuda").

A device's module is imported when its kind is first used (CuPy loads with the first CuPy
collective)."""

from __future__ import annotations

from collections.abc import Callable

from .base import Device

__all__ = ["KINDS", "device_class"]


def _host() -> type[Device]:
    from .host import HostDevice

    return HostDevice


def _cuda() -> type[Device]:
    from .cuda import CudaDevice

    return CudaDevice


#: array kind -> the device class that runs its collectives
KINDS: dict[str, Callable[[], type[Device]]] = {"cpu": _host, "cuda": _cuda}


def device_class(kind: str) -> type[Device]:
    return KINDS[kind]()

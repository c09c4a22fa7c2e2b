"""Units of summary.txt (`tools.device_check.check_summary`): each measured value as text,
"n/a" for one that is missing."""

from __future__ import annotations

from typing import Any

from gpuring.bench.report import size_label

__all__ = ["us", "size_text", "gbps", "ratio"]


def us(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "n/a"
    if value >= 1e6:
        return f"{value / 1e6:.2f} s"
    if value >= 1e3:
        return f"{value / 1e3:.2f} ms"
    return f"{value:.1f} us"


def size_text(n: Any) -> str:
    """A byte count as the bench's report labels sizes; anything else as it is."""
    if not isinstance(n, int):
        return str(n)
    return size_label(n) if n else "0 B"


def gbps(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "n/a"
    return f"{value:.0f} GB/s" if value >= 100 else f"{value:.{1 if value >= 1 else 3}f} GB/s"


def ratio(a: Any, b: Any) -> str:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
    return f"{a / b:.1f}x" if ok else "n/a"

"""--plot: bus bandwidth and time per call against size, per system and placement, with the
spread over repeats as error bars and gpuring's floor as a line."""

from __future__ import annotations

from collections.abc import Sequence

from .report import Floor, size_label
from .stats import Summary

__all__ = ["plot"]


def plot(path: str, summary: Sequence[Summary], floors: Sequence[Floor], title: str) -> str:
    """Draw the figure into `path` (PNG); returns a line for the report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter
    except ImportError:
        return (f"--plot {path}: matplotlib is not installed (pip install matplotlib or "
                "gpuring[bench]); no plot written")
    rows = [r for r in summary if r.size > 0]
    if not rows:
        return f"--plot {path}: nothing with a size to draw"
    lines: dict[str, list[Summary]] = {}
    several = len({(r.type, r.redop, r.root) for r in rows}) > 1
    for r in rows:
        label = f"{r.system} {r.placement}"
        if several:
            label += f" {r.type} {r.redop}" + (f" root {r.root}" if r.root >= 0 else "")
        lines.setdefault(label, []).append(r)
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    for label, points in lines.items():
        points = sorted(points, key=lambda r: r.size)
        style = "--" if "in-place" in label else "-"
        sizes = [r.size for r in points]

        def bus(r: Summary, us: float) -> float:
            """busbw had the call taken `us`."""
            return r.busbw_GBps * r.time_us / us if us > 0 else 0.0

        # (bars never below 0: with one repeat, bus(r, slowest) may round above busbw)
        busbw = [r.busbw_GBps for r in points]
        bw.errorbar(sizes, busbw,
                    yerr=[[max(0.0, r.busbw_GBps - bus(r, r.slowest_us)) for r in points],
                          [max(0.0, bus(r, r.fastest_us) - r.busbw_GBps) for r in points]],
                    fmt=style, marker="o", markersize=3, capsize=2, label=label)
        times = [r.time_us for r in points]
        lat.errorbar(sizes, times, yerr=[[max(0.0, r.time_us - r.fastest_us) for r in points],
                                         [max(0.0, r.slowest_us - r.time_us) for r in points]],
                     fmt=style, marker="o", markersize=3, capsize=2, label=label)
    drawn = sorted((f for f in floors if f.floor_us > 0), key=lambda f: f.size)
    if drawn:
        factor_of = {r.size: r.busbw_GBps / r.algbw_GBps for r in rows
                     if r.system == "gpuring" and r.algbw_GBps}
        bw.plot([f.size for f in drawn],
                [f.size / f.floor_us / 1e3 * factor_of.get(f.size, 1.0) for f in drawn],
                ":", color="black", label="floor (required bytes / copy bandwidth)")
        lat.plot([f.size for f in drawn], [f.floor_us for f in drawn], ":", color="black",
                 label="floor")
    ticks = sorted({r.size for r in rows})
    if len(ticks) > 12:
        ticks = ticks[::(len(ticks) + 11) // 12]
    for ax in (bw, lat):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.set_xlabel("size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    repeats = max(len(r.repeats_us) for r in rows)
    bars = (f"bars: fastest to slowest of {repeats} repeats" if repeats > 1
            else "one sweep (-N for error bars)")
    bw.set_ylabel("bus bandwidth (GB/s)")
    bw.set_title(f"bus bandwidth; {bars}", fontsize=10)
    lat.set_yscale("log")
    lat.set_ylabel("time per call (us, log)")
    lat.set_title("time per call", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"# plot written to {path}"

"""A model of all_reduce time past one node: one flat ring over every rank against two levels
(ring reduce_scatter and all_gather inside each node, ring all_reduce between nodes among the
ranks of one local rank, as gpuring's `_hierarchy` runs it). bench/README.md explains it.

    python bench/scaling_model.py [--gpus 8] [--nodes 2,4,8,16,32,64] [--sizes 64K,16M,1G]
                                  [--alpha-intra 5] [--bw-intra 360]
                                  [--alpha-inter 10] [--bw-inter 400]

A ring of p ranks moving S bytes takes 2(p-1) steps, each of latency alpha and of S/p bytes
over the slowest link of the ring. Flat, the slowest link is the network: each node's
network bandwidth `bw_inter` carries the ring's traffic across its boundary. In two levels
the node's G ranks each reduce S/G between nodes at once, so the network carries S/N per
node per step as the flat ring does, but over 2(N-1) steps instead of 2(NG-1).

The defaults are parameters, not measurements: latencies in microseconds, bandwidths in GB/s
(one direction); `--alpha-*` and `--bw-*` take yours.
"""

from __future__ import annotations

import argparse

from gpuring.settings import parse_size


def ring(p: int, nbytes: float, alpha_us: float, bw_gbps: float) -> float:
    """Microseconds of a ring all_reduce of `nbytes` over `p` ranks."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha_us + 2 * (p - 1) / p * nbytes / (bw_gbps * 1e3)


def flat(nodes: int, gpus: int, nbytes: float, a_in: float, b_in: float, a_out: float,
         b_out: float) -> float:
    """One ring over every rank: its steps wait for the network (the slowest link)."""
    if nodes == 1:
        return ring(gpus, nbytes, a_in, b_in)
    return ring(nodes * gpus, nbytes, a_out, min(b_in, b_out))


def two_levels(nodes: int, gpus: int, nbytes: float, a_in: float, b_in: float, a_out: float,
               b_out: float) -> float:
    """reduce_scatter + all_gather in the node (together one ring all_reduce's cost), then
    G concurrent ring all_reduces of S/G between nodes sharing the node's network."""
    return ring(gpus, nbytes, a_in, b_in) + ring(nodes, nbytes, a_out, b_out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8, help="ranks per node")
    p.add_argument("--nodes", default="2,4,8,16,32,64")
    p.add_argument("--sizes", default="64K,16M,1G")
    p.add_argument("--alpha-intra", type=float, default=5.0, help="us per step in a node")
    p.add_argument("--bw-intra", type=float, default=360.0, help="GB/s per rank in a node")
    p.add_argument("--alpha-inter", type=float, default=10.0, help="us per network step")
    p.add_argument("--bw-inter", type=float, default=400.0, help="GB/s of a node's network")
    args = p.parse_args()
    params = (args.alpha_intra, args.bw_intra, args.alpha_inter, args.bw_inter)
    sizes = [(text, parse_size(text)) for text in args.sizes.split(",")]
    print("| nodes x ranks | " + " | ".join(
        f"{text}: flat / two levels (us), ratio" for text, _ in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for nodes in (int(n) for n in args.nodes.split(",")):
        cells = []
        for _, nbytes in sizes:
            f = flat(nodes, args.gpus, nbytes, *params)
            h = two_levels(nodes, args.gpus, nbytes, *params)
            cells.append(f"{f:,.0f} / {h:,.0f}, {f / h:.2f}")
        print(f"| {nodes} x {args.gpus} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""`gpuring bench`: time gpuring's collectives the way nccl-tests does, check every result,
and set the numbers beside MPI, NCCL or Gloo and beside the memory-bandwidth floor.

Quantities (S = the size column in bytes, n ranks, t = time):

* algbw = S / t; busbw = algbw x factor, factor 2(n-1)/n for all_reduce, (n-1)/n for
  reduce_scatter and all_gather (S is the full array: reduce_scatter's input, all_gather's
  output), 1 for broadcast, reduce and messages.
* messages: `sendrecv` (nccl-tests' sendrecv_perf: every rank sends S bytes to the next and
  receives S from the previous in one call) and `pingpong` (OSU's osu_latency: rank 0 sends
  S to rank 1, which sends them back; t is half the round trip, the other ranks idle).
* t, as nccl-tests times it: on each rank one untimed call, one barrier, then `-n` calls
  back to back on the host clock until the last completes, divided by `-n`; the ranks' t
  combined by `-a` (default their average). Every system runs through the same loop, and
  the systems take turns going first from one size to the next. Before the first size,
  each system makes `-w` untimed calls at every size. With `-I` each call is timed on its
  own after a barrier instead, and t is the slowest rank's median (p99 and max beside it).
* floor: the bytes the collective must move on every rank, whatever the algorithm: every
  input byte read once, every output byte written once (all_reduce 2S per rank;
  reduce_scatter and all_gather (n+1)/n x S; broadcast S per rank; reduce S per rank and 2S
  on the root). Ranks whose arrays share a memory (CPU: every rank of a node shares its host
  memory; CUDA: the ranks of a node on GPU local_rank % count share that GPU) move all their
  bytes through it, so for each memory the floor is the sum over its ranks of those bytes /
  its bandwidth, and the floor is the largest of these. A memory's bandwidth is measured in
  the same run at the same size: every rank copies S bytes (a working set of 2S) about 64 MiB
  in all, all ranks at once (a NumPy copy on the CPU, a CuPy device copy on a GPU, read +
  write counted, host clock to the end of the last copy), and the bytes all ranks of the
  memory copied are divided by the longest of their times; sampled before and after each
  size's measurements in every repeat, the fastest sample counts. Efficiency is floor / t; above
  100 % beyond noise would mean the count or the bandwidth is wrong. The bytes gpuring's own
  plan moves are reported beside it (`plan`, `plan_bytes`): a copy of k bytes moves 2k, a
  reduction 3k; the 2-rank ring all_reduce 4.5S per rank, the one-shot (n+3)S.
  On a GPU reads of a peer's buffer cross the link, not only local memory, so there the
  floor is a lower bound rather than a tight one.
"""

from __future__ import annotations

__all__ = ["add_arguments", "main"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from . import cli

        return getattr(cli, name)
    raise AttributeError(name)

"""`gpuring bench`: time gpuring's collectives the way nccl-tests does, check every result,
and set the numbers beside MPI, NCCL or Gloo and beside the memory-bandwidth floor.

Quantities (S = the size column in bytes, n ranks, t = time):

* algbw = S / t; busbw = algbw x factor, factor 2(n-1)/n for all_reduce, (n-1)/n for
  reduce_scatter and all_gather (S is the full array: reduce_scatter's input, all_gather's
  output), 1 for broadcast and reduce.
* t, as nccl-tests times it: on each rank one untimed call, one barrier, then `-n` calls
  back to back on the host clock until the last completes, divided by `-n`; the ranks' t
  combined by `-a` (default their average). Every system runs through the same loop, and
  the systems take turns going first from one size to the next. Before the first size,
  each system makes `-w` untimed calls at every size. With `-I` each call is timed on its
  own after a barrier instead, and t is the slowest rank's median (p99 and max beside it).
* floor: ranks whose arrays share a memory (CPU: every rank of a node shares its host
  memory; CUDA: the ranks of a node on GPU local_rank % count share that GPU) move all their
  bytes through it, so for each memory the floor is the sum over its ranks of the bytes each
  moves (k ranks moving the same: k x bytes per rank) / its bandwidth, and the floor is the
  largest of these. A memory's bandwidth is measured in the same run: every rank copies
  128 MiB five times in a row at once (a NumPy copy on the CPU, a CuPy device copy on a GPU,
  read + write counted, host clock to the end of the last copy), and the bytes all ranks of
  the memory copied are divided by the longest of their times: ranks time-sliced on one GPU
  take turns, ranks of one node's CPU copy side by side. Efficiency is floor / t. The bytes
  are counted from gpuring's own plan: a copy of k bytes moves 2k
  (read + write), a reduction 3k (two reads, one write), an avg's final division 2k more.
  For the ring all_reduce this gives per rank (5(n-1)/n + 2) x S = (7n-5)/n x S: staging
  copy 2S/n, n-1 reductions 3S/n each, the copy of the own final segment to the output
  2S/n, n-2 all-gather forwards 4S/n each (into the buffer, then to the output) and the
  last 2S/n. The one-shot all_reduce of small sizes moves (n+3) x S: the staging copy 2S,
  then one n-input reduction (n reads, one write: (n+1)k for k bytes); reduce_scatter
  (3n-1)/n x S; all_gather (4n-2)/n x S; broadcast up to 4S (2S on 2 ranks); reduce 3S.
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

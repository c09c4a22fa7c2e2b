"""`gpuring bench`: time gpuring's collectives the way nccl-tests does, check every result,
and set the numbers beside MPI, NCCL or Gloo and beside the memory-bandwidth floor.

Quantities (S = the size column in bytes, n ranks, t = time):

* algbw = S / t; busbw = algbw x factor, factor 2(n-1)/n for all_reduce, (n-1)/n for
  reduce_scatter and all_gather (S is the full array: reduce_scatter's input, all_gather's
  output), 1 for broadcast and reduce.
* t is the median over the timed iterations on each rank, then the slowest rank's median.
* floor = bytes the algorithm moves through memory on the busiest rank / memory bandwidth
  per rank, measured in the same run (CPU: a NumPy copy of 128 MiB on every rank at once,
  read + write counted; GPU: a CuPy device-to-device copy timed with events). Efficiency is
  floor / t. The bytes are counted from gpuring's own plan: a copy of k bytes moves 2k
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

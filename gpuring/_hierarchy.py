"""Collectives across nodes in two levels, as Horovod's hierarchical all-reduce and NCCL's own
split between the links inside a node and the network do: inside each node the ranks' own
engine (shared memory for NumPy arrays), between nodes the engine for that device (MPI for
NumPy arrays), each rank talking across the network only to the ranks of its own local rank.

    all_reduce      reduce_scatter in the node -> all_reduce of the shard across nodes
                    -> all_gather in the node
    reduce_scatter  reduce_scatter in the node (blocks ordered so that local rank j holds
                    the blocks of every node's local rank j) -> reduce_scatter across nodes
    all_gather      all_gather across nodes -> all_gather in the node
    broadcast       across nodes among the root's local rank -> in every node
    reduce          in the node to the root's local rank -> across nodes to the root
    barrier         the agreement every call across nodes begins with (a control-plane
                    exchange of every rank)

Each rank sends and receives across the network what a flat algorithm of its node's share
would: 1/local_size of the data for all_reduce and reduce_scatter, and every other node's data
once per node for all_gather.

Deterministic mode: the reductions between nodes are not MPI's (whose order is its own) but
an all_gather of the shards and a fold in node order, so every element is the fold over nodes,
in the order of their lowest rank, of the fold over the node's ranks in rank order ("node
major"); avg divides that sum by the size.

Used where every node runs the same number of ranks, and more than one (`Layout.of`);
otherwise collectives across nodes run flat (MPI).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import _arrays
from ._call import Call
from ._errors import GpuringError, PeerFailureError, in_ranks
from ._failures import Unraised
from ._ops import ReduceOp, divide_toward_zero, fold
from ._status import outside
from .rendezvous.base import ControlPlane

if TYPE_CHECKING:
    from ._protocols import Collectives
    from ._watchdog import Watchdog

__all__ = ["Layout", "Levels", "HIERARCHICAL"]

#: the collectives that run in two levels (the others run flat across nodes; a barrier across
#: nodes is the agreement every call across nodes begins with)
HIERARCHICAL = frozenset({"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"})


@dataclass(frozen=True)
class Layout:
    """Where a job's ranks run: `ranks[node][local]` is the rank of local rank `local` on
    node `node` (nodes in the order of their lowest rank, local ranks in rank order); `node`
    and `local` are this rank's."""

    ranks: tuple[tuple[int, ...], ...]
    node: int
    local: int

    @classmethod
    def of(cls, nodes: Sequence[str], rank: int) -> Layout | None:
        """The layout of ranks on `nodes` (each rank's node name), seen from `rank`; None
        where two levels do not apply: one node, one rank per node, or nodes with different
        numbers of ranks."""
        order = list(dict.fromkeys(nodes))
        ranks = tuple(tuple(r for r, name in enumerate(nodes) if name == node)
                      for node in order)
        sizes = {len(members) for members in ranks}
        if len(order) < 2 or len(sizes) != 1 or sizes == {1}:
            return None
        node = order.index(nodes[rank])
        return cls(ranks, node, ranks[node].index(rank))

    @property
    def nodes(self) -> int:
        return len(self.ranks)

    @property
    def local_size(self) -> int:
        return len(self.ranks[0])

    def node_major(self) -> list[int]:
        """Ranks grouped by local rank, each group in node order: position j*nodes + k
        holds the rank of local rank j on node k."""
        return [self.ranks[k][j] for j in range(self.local_size) for k in range(self.nodes)]


class Tune(NamedTuple):
    """A call's tuning, for its collectives inside the node (None: the communicator's)."""

    chunk_bytes: int | None
    channels: int | None


class LevelParts(NamedTuple):
    """A level's communicator, as the communicator that makes it hands it over: the
    communicator, how to abort it telling its peers whom it gave up because of, and its
    watchdog (None until its first collective)."""

    comm: Collectives
    abort: Callable[[str, int | None], None]
    watchdog: Callable[[], Watchdog | None]


class _Level:
    """One level's communicator; its errors name ranks of the job (`ranks[i]` is its rank
    i) and say which level raised them."""

    def __init__(self, parts: LevelParts, control: ControlPlane, ranks: tuple[int, ...],
                 what: str, job_ranks: tuple[int, ...]):
        self.comm, self.ranks, self.what = parts.comm, ranks, what
        self.parts, self.control = parts, control
        self.job_ranks = job_ranks  #: the ranks of the job's communicator in the launcher's

    def run(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.comm, verb)(*args, **kwargs)
        except GpuringError as exc:
            raise in_ranks(exc, self.ranks, f"{verb} {self.what} (ranks {list(self.ranks)} "
                                            "of the job)", self.job_ranks) from None


class Levels:
    """The two communicators of a rank: `intra` (its node's ranks, in local rank order) and
    `inter` (every node's rank of its local rank, in node order), made from sub-groups of
    the job's control plane without a meeting (every rank knows every rank's node)."""

    def __init__(self, control: ControlPlane, layout: Layout, deterministic: bool,
                 make: Callable[[ControlPlane], LevelParts]):
        self.layout = layout
        self.deterministic = deterministic
        job, node, local = control.job_id, layout.ranks[layout.node], layout.local
        self.job_ranks = control.job_ranks
        sub = control.subgroup(node, f"{job}-n{layout.node}")
        self.intra = _Level(make(sub), sub, node, "in the node", control.job_ranks)
        with contextlib.ExitStack() as undo:
            undo.callback(self.intra.comm.close)
            undo.callback(self.intra.parts.abort,
                          "the communicator across nodes could not be made", None)
            across = tuple(members[local] for members in layout.ranks)
            sub = control.subgroup(across, f"{job}-l{local}")
            self.inter = _Level(make(sub), sub, across, "between nodes", control.job_ranks)
            undo.pop_all()
        # waits between nodes (this rank's job and the level between nodes) also end when
        # a rank of this node dies or gives up (its status board tells)
        control.watch(self.node_failure)
        for level in (self.intra, self.inter):  # the job giving up ends both levels' waits
            level.control.follow(control)
        self.inter.control.watch(lambda: self.node_failure(named=False))

    def node_failure(self, named: bool = True) -> PeerFailureError | None:
        """A rank of this node that died or gave up, as the node's status board shows it,
        named in the job's ranks (`named`: as the error's `peer` too; always as its
        `job_peer`, the launcher's rank, by which the level between nodes, which has no rank
        for it, tells its peers whom it gave up because of); None if none did or the board
        is not made yet. A rank that closed its communicator is no failure: it
        took part in every collective (one that closed too early leaves its node's peers
        failing in the node's level, which tells the job)."""
        watchdog = self.intra.parts.watchdog()
        if watchdog is None:
            return None
        trouble = watchdog.board.troubled_peer(departures=True)
        if trouble is None:
            return None
        peer, _state, reason, culprit = trouble
        elsewhere = outside(culprit)  # a rank of another node, that this node's rank names
        if elsewhere is not None:
            rank = self.job_ranks.index(elsewhere) if elsewhere in self.job_ranks else None
            who = f"rank {elsewhere} of the job" if rank is None else f"rank {rank}"
            return PeerFailureError(
                f"{who} failed (rank {peer} of this node gave up because of it: {reason})",
                peer=rank if named else None, job_peer=elsewhere)
        blamed = culprit if 0 <= culprit < len(self.intra.ranks) else peer
        rank = self.intra.ranks[blamed]
        return PeerFailureError(f"rank {rank} failed (rank {blamed} of its node: {reason})",
                                peer=rank if named else None, job_peer=self.job_ranks[rank])

    # -- the collectives ------------------------------------------------------------------
    def run(self, call: Call, size: int) -> Any:
        """Run `call` (one of HIERARCHICAL, agreed by the job's ranks) of a job of `size`
        ranks; returns what the verb returns."""
        name = call.collective
        x, out, op = call.x, call.out, call.op
        if x.size == 0:
            return out
        tune = Tune(call.chunk_bytes, call.channels)
        step = ReduceOp.SUM if op is ReduceOp.AVG else op
        if name == "all_gather":
            self._all_gather(x, out, tune)
            return out
        if name == "broadcast":
            return self._broadcast(x, out, call.root, tune)
        result: Any | None
        if name == "all_reduce":
            result = self._all_reduce(x, step, tune)
        elif name == "reduce_scatter":
            result = self._reduce_scatter(x, step, size, tune)
        else:
            result = self._reduce(x, step, call.root, tune)
        if out is None or result is None:  # a reduce off its root
            return None
        out[...] = result.reshape(out.shape)
        if op is ReduceOp.AVG:
            _divide(out, size)
        return out

    def _across(self, shard: Any, op: ReduceOp) -> Any:
        """The reduction of `shard` over the nodes, the same bits on every node."""
        if not self.deterministic:
            return self.inter.run("all_reduce", shard, op=op)
        return fold(list(self.inter.run("all_gather", shard)), op)

    def _all_reduce(self, x: Any, op: ReduceOp, tune: Tune) -> Any:
        layout, count = self.layout, x.size
        per = -(-count // layout.local_size)
        padded = x.reshape(-1)
        if per * layout.local_size != count:
            padded = _arrays.array_module(x).zeros(per * layout.local_size, x.dtype)
            padded[:count] = x.reshape(-1)
        shard = self.intra.run("reduce_scatter", padded, op=op, **tune._asdict())
        whole = self.intra.run("all_gather", self._across(shard, op), **tune._asdict())
        return whole.reshape(-1)[:count]

    def _reduce_scatter(self, x: Any, op: ReduceOp, size: int, tune: Tune
                        ) -> Any:
        layout = self.layout
        blocks = x.reshape(size, -1)[layout.node_major()]  # a copy, local rank major
        # every node's block of this local rank, reduced over this node:
        mine = self.intra.run("reduce_scatter", blocks.reshape(-1), op=op, **tune._asdict())
        if not self.deterministic:
            return self.inter.run("reduce_scatter", mine, op=op)
        gathered = self.inter.run("all_gather", mine).reshape(layout.nodes, layout.nodes, -1)
        return fold(list(gathered[:, layout.node]), op)

    def _all_gather(self, x: Any, out: Any, tune: Tune) -> None:
        layout = self.layout
        across = self.inter.run("all_gather", _arrays.contiguous(x))  # (nodes, *x.shape)
        every = self.intra.run("all_gather", across, **tune._asdict())  # (local, nodes, ..)
        out.reshape(len(layout.node_major()), -1)[layout.node_major()] = \
            every.reshape(len(layout.node_major()), -1)

    def _broadcast(self, x: Any, out: Any, root: int, tune: Tune
                   ) -> Any:
        layout = self.layout
        node, local = _where(layout, root)
        if out is not x and (layout.node, layout.local) == (node, local):
            out[...] = x
        if layout.local == local:
            self.inter.run("broadcast", out, root=node)
        self.intra.run("broadcast", out, root=local, **tune._asdict())
        return out

    def _reduce(self, x: Any, op: ReduceOp, root: int, tune: Tune
                ) -> Any | None:
        layout = self.layout
        node, local = _where(layout, root)
        partial = self.intra.run("reduce", x, op=op, root=local, **tune._asdict())
        if layout.local != local:
            return None
        if not self.deterministic:
            return self.inter.run("reduce", partial, op=op, root=node)
        gathered = self.inter.run("all_gather", partial)
        return fold(list(gathered), op) if layout.node == node else None

    # -- lifetime ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for both levels' collectives (CuPy collectives return once queued)."""
        for level in (self.intra, self.inter):
            level.run("synchronize")

    def abort(self, reason: str, job_peer: int | None = None) -> None:
        """Abort both levels; each tells its peers (`job_peer`: the rank of the job it gave
        up because of, where known, so that a peer on another node names it, not this rank)."""
        for level in (self.intra, self.inter):
            level.parts.abort(reason, job_peer)

    def close(self) -> BaseException | None:
        """Close both levels (intra first, on every rank); the first failure, unraised."""
        kept = Unraised()
        for level in (self.intra, self.inter):
            with kept.step():
                level.comm.close()
        return kept.error


def _where(layout: Layout, rank: int) -> tuple[int, int]:
    """(node, local rank) of `rank`."""
    for node, members in enumerate(layout.ranks):
        if rank in members:
            return node, members.index(rank)
    raise ValueError(f"rank {rank} is on no node")


def _divide(a: Any, n: int) -> None:
    """a /= n in place (avg, after the sum); integers rounded toward zero, 16-bit floats
    divided in float32 and rounded once (NumPy or CuPy arrays)."""
    if a.dtype.name in ("float16", "bfloat16"):
        a[...] = (a.astype(np.float32) / np.float32(n)).astype(a.dtype)
    elif a.dtype.kind in "fc":
        a /= n
    else:
        divide_toward_zero(a, n)

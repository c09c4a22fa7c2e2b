"""Preparing a checked call, once per key (`CallPath.run`): agree with the peers on its
signature (every setting that shapes the plan included), pick its route, and for gpuring's
own engines, the engine and the plan."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import _arrays, _failures
from . import _transport_routes as _routes
from ._call import Call, PreparedCall, Route, Signature
from ._choices import FOLDS
from ._config import Config
from ._errors import GpuringError
from ._registry import Placement
from ._route import choose
from ._status import signature_hash
from .algorithms.collectives import plan_collective
from .devices import device_class

if TYPE_CHECKING:
    from ._engine import Engine
    from ._transport_routes import RoutePath

__all__ = ["prepare", "ATTACH_KINDS"]

log = logging.getLogger("gpuring")

#: the collectives on plain arrays whose ranks may reach each other's arrays where they lie
#: (`Engine.attached_peers`), as registered rounds over them
ATTACH_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def prepare(path: RoutePath, call: Call) -> PreparedCall:
    """Agree with the peers on the call's signature (every setting that shapes the plan
    included), pick its route, and for the engine, the engine and the plan."""
    name, x, config = call.collective, call.x, path.config
    chunk: int | None
    if x is None:  # a barrier: no array, on an engine this rank has (else the host's)
        kind = next(iter(path.engines), "cpu")
        plain = Signature(name, None, (), None, None, 0)
        dtype, shape, count, itemsize, chunk, nchannels = "uint8", (), 0, 1, 1, 1
    else:
        kind, dtype = _arrays.device_kind(x), _arrays.dtype_name(x)
        shape, count, itemsize = tuple(x.shape), x.size, x.dtype.itemsize
        plain = Signature(name, kind, shape, dtype, call.op.value, call.root,
                          deterministic=config.deterministic)
    picked = path.choices.pick(call, kind, count * itemsize)
    algorithm = picked.algorithm
    plain = plain._replace(algorithm=algorithm, tuning=path.choices.digest,
                           transport=config.transport)
    if path.size > 1 and x is not None and _routes.asks_reach(path, kind):  # (once per kind)
        path.ensure_watchdog(name)  # (whichever route follows: the ranks share a node)
        path.agree(plain, remember=False)  # (every rank asks on the same call)
        path.mappable[kind] = _routes.peers_reachable(path, kind, name)
    route, schedule, refusal = choose(path.facts, name, None if x is None else kind,
                                      algorithm, mappable=path.mappable.get(kind, True))
    if route is Route.NODES:  # every call agrees as it runs (`_transport_routes.run_nodes`)
        if x is not None:
            plain = plain._replace(chunk_bytes=call.chunk_bytes, channels=call.channels)
        if refusal is None:
            return PreparedCall(route, schedule=schedule, signature=plain)
    if route is not Route.ENGINE:
        path.agree(plain, remember=refusal is None)
        if refusal is not None:  # refused on every rank once agreed (the communicator goes on)
            raise GpuringError(refusal)
        return PreparedCall(route, schedule=schedule)
    devices = device_class(kind)
    if x is not None:  # chunk None: the engine's default (the device's, for this job)
        chunk = picked.chunk_bytes
        nchannels = picked.channels or devices.default_channels
        Config(chunk_bytes=chunk, channels=nchannels).validate()
    capacity = path.capacity(kind)
    placement = call.placement
    if x is None:
        signature = plain._replace(chunk_bytes=1, channels=1, verify=config.verify)
    else:
        signature = plain._replace(chunk_bytes=chunk, channels=nchannels,
                                   one_shot_bytes=config.one_shot_bytes,
                                   fused_bytes=config.fused_bytes,
                                   attach_bytes=config.attach_bytes,
                                   buffer_bytes=capacity, verify=config.verify,
                                   device_settings=devices.capability_settings())
        if placement is not None:
            signature = signature._replace(registered=placement)
    path.ensure_watchdog(name)
    path.agree(signature, remember=refusal is None)
    if refusal is not None:  # agreed: every rank refuses it
        raise GpuringError(refusal)
    with _failures.giving_up(path, name):  # after agreement the peers go on: tell them
        engine = path.engine(kind, capacity)
        piece = chunk or engine.default_chunk_bytes
        where = placement or _PLAIN
        peer_in, peer_out = where.inp is not None, where.out is not None
        in_place = call.in_place or (peer_in and where.inp == where.out)
        folds = engine.device.in_place_fold_sources
        if name in FOLDS and 0 < folds < path.size:  # an in-place fold could not run
            peer_in = peer_out = False  # (staged on every rank, in place or not)
        attached = placement is None and _attaches(
            engine, name, count, itemsize, nchannels, algorithm, config.attach_bytes,
            path.size)
        if attached:  # every rank's plain arrays, read and written where they lie
            peer_in = peer_out = True
        rounds = plan_collective(
            name, path.size, path.rank, count, itemsize=itemsize,
            capacity_bytes=capacity, chunk_bytes=piece, channels=nchannels,
            root=call.root, one_shot_bytes=config.one_shot_bytes, in_place=in_place,
            algorithm=algorithm, peer_in=peer_in, peer_out=peer_out, order=engine.ring)
        registered = any(plan.registered for plan in rounds)
        attached = attached and registered
        if attached:
            rounds = tuple(r._replace(schedule=r.schedule.replace("registered", "attached"))
                           for r in rounds)
            peers = engine.attached_peers(count * itemsize)
        else:
            peers = path.registry.peer_arrays(where, path.size, count * itemsize) \
                if registered else ()
        fused = name in engine.fused_kinds and algorithm != "ring" and \
            0 < count * itemsize <= engine.fused_bytes
        launch = engine.prepare(rounds, dtype=dtype, itemsize=itemsize, op=call.op,
                                inline=nchannels == 1, fused=fused, collective=name,
                                root=call.root, nbytes=count * itemsize, peers=peers,
                                attached=attached)
        # what a CUDA graph records (made now, outside any capture)
        captured = None if config.verify or x is None else \
            engine.prepare_captured(launch, count * itemsize)
    text = "barrier()" if x is None else (
        f"{name}(shape={shape}, dtype={dtype}, op={call.op.value}, root={call.root}, "
        f"device={kind}, chunk_bytes={piece}, channels={nchannels}, "
        f"algorithm={algorithm})")
    if fused:
        text += " fused"
    elif attached:
        text += " attached"
    elif registered:
        text += f" in registered memory {tuple(where)}"
    schedule = "fused" if fused else rounds[0].schedule if rounds else "nothing"
    return PreparedCall(Route.ENGINE, launch, text, signature_hash(text), captured,
                        schedule)


def _attaches(engine: Engine, name: str, count: int, itemsize: int, channels: int,
              algorithm: str, least: int, n: int) -> bool:
    """Whether collective `name` on plain arrays reaches its peers' arrays where they lie:
    one of `ATTACH_KINDS` with an input of at least `least` bytes (0: never), on one channel,
    two-shot or as the communicator picks (not the ring; nor one-shot, which is wrong in
    place: a prepared all_reduce serves calls in place and not alike), where every rank may
    (`Engine.attach_refused`; the first such call on a communicator says why not, once, on
    rank 0).
    The same on every rank: it depends on the agreed call, settings and engine only."""
    if name not in ATTACH_KINDS or not 0 < least <= count * itemsize or channels != 1 \
            or algorithm not in ("auto", "two_shot") \
            or (name == "reduce_scatter" and count % n):
        return False
    if engine.attach_refused is not None:
        if not engine.attach_told:
            engine.attach_told = True
            if engine.rank == 0:  # (once: every rank knows the same reason)
                log.info("gpuring: collectives of plain arrays of %d bytes and more stage "
                         "through the shared buffers: the ranks may not reach each other's "
                         "arrays by cross-memory attach (%s)", least, engine.attach_refused)
        return False
    return True


#: where a call on plain arrays lies: nowhere registered
_PLAIN = Placement(None, None)

"""Tensor fusion: many small all_reduces packed into a few large ones.

`all_reduce_many` groups the arrays by device and dtype, packs each group in input order into
flat buffers of at most `fusion_bytes` (an array larger than that runs alone, unpacked), runs
one all_reduce per buffer, and returns views of the reduced buffers in input order.

Integer results are identical to separate calls. Float results differ within rounding: the
ring splits a buffer into one segment per rank and reduces each segment along a chain that
starts at a different rank, so packing moves an element to another segment and changes the
order in which the ranks' values are added. Every rank still gets the same bits. In
deterministic mode (the two-shot schedule: every element one fold in rank order) the results
are identical to separate calls, floats too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _arrays, interop, settings
from ._ops import ReduceOp

if TYPE_CHECKING:
    from ._protocols import Collectives

__all__ = [
    "DEFAULT_FUSION_BYTES", "Bucket", "default_fusion_bytes", "plan_buckets", "all_reduce_many",
]

DEFAULT_FUSION_BYTES: int = settings.SETTINGS["GPURING_FUSION_BYTES"].default


class Bucket(NamedTuple):
    """Arrays (by input index) reduced together; `packed` False: one array, reduced as is."""

    indices: tuple[int, ...]
    packed: bool


def default_fusion_bytes() -> int:
    """The fusion buffer size: GPURING_FUSION_BYTES (e.g. 16M), else 64 MiB."""
    size: int = settings.get("GPURING_FUSION_BYTES")
    if size <= 0:
        raise ValueError(f"GPURING_FUSION_BYTES must be positive, got {size}")
    return size


def plan_buckets(groups: Sequence[Any], nbytes: Sequence[int], limit: int) -> list[Bucket]:
    """Buckets for arrays with group keys `groups` (device, dtype) and sizes `nbytes`: per
    group in order of first appearance, arrays in input order, each bucket at most `limit`
    bytes; an array of `limit` bytes or more gets a bucket of its own, unpacked."""
    if limit <= 0:
        raise ValueError(f"fusion_bytes must be positive, got {limit}")
    order: dict[Any, list[int]] = {}
    for i, key in enumerate(groups):
        order.setdefault(key, []).append(i)
    buckets: list[Bucket] = []
    for indices in order.values():
        current: list[int] = []
        used = 0
        for i in indices:
            alone = nbytes[i] >= limit
            if current and (alone or used + nbytes[i] > limit):
                buckets.append(Bucket(tuple(current), len(current) > 1))
                current, used = [], 0
            if alone:
                buckets.append(Bucket((i,), False))
                continue
            current.append(i)
            used += nbytes[i]
        if current:
            buckets.append(Bucket(tuple(current), len(current) > 1))
    return buckets


def all_reduce_many(comm: Collectives, arrays: Sequence[Any], *, op: ReduceOp | str = "sum",
                    fusion_bytes: int | None = None) -> list[Any]:
    """`comm.all_reduce` of every array, fused; results in input order, each array's type."""
    if not arrays:
        return []
    with interop.caller_stream(arrays[0]):  # torch tensors: on torch's current stream
        return _all_reduce_many(comm, arrays, ReduceOp.parse(op), fusion_bytes)


def _all_reduce_many(comm: Collectives, arrays: Sequence[Any], rop: ReduceOp,
                     fusion_bytes: int | None) -> list[Any]:
    limit = default_fusion_bytes() if fusion_bytes is None else fusion_bytes
    native = [_arrays.contiguous(interop.to_native(a)) for a in arrays]
    groups = [(_arrays.device_kind(a), _arrays.dtype_name(a)) for a in native]
    results: list[Any] = [None] * len(native)
    for bucket in plan_buckets(groups, [a.nbytes for a in native], limit):
        if not bucket.packed:
            i = bucket.indices[0]
            results[i] = comm.all_reduce(native[i], op=rop)
            continue
        parts = [native[i] for i in bucket.indices]
        xp = _arrays.array_module(parts[0])
        flat = xp.concatenate([a.reshape(-1) for a in parts])
        comm.all_reduce(flat, op=rop, out=flat)
        start = 0
        for i, a in zip(bucket.indices, parts, strict=True):
            results[i] = flat[start:start + a.size].reshape(a.shape)
            start += a.size
    return [interop.from_native(r, a) for r, a in zip(results, arrays, strict=True)]

"""torch.distributed on the "gpuring" backend against "gloo" in the same processes: every call
the backend serves, on 2 ranks and 3, each compared with gloo's result
(tests/multiproc/cases_torch.py says how). One launch per rank count, started as torchrun
starts its workers."""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed", reason="torch is not installed")

from .named import Group, params

FAMILIES = tuple(f"cases_torch:{family}" for family in (
    "reductions", "movement", "coalesced", "sparse", "objects", "asynchronous", "groups",
    "errors", "end"))
TWO = Group(FAMILIES, 2, launcher="torchrun", tag="torchrun", timeout=600)
THREE = Group(FAMILIES, 3, launcher="torchrun", tag="torchrun", timeout=600, slow=True)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["reductions"]))
def test_reductions(group, item, named_launches):
    """all_reduce with every ReduceOp (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR) on every
    dtype gloo takes it on, reduce, reduce_scatter, reduce_scatter_tensor."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["movement"]))
def test_data_movement(group, item, named_launches):
    """broadcast, gather, scatter, all_gather, all_gather_into_tensor, all_to_all,
    all_to_all_single (even, split sizes), barrier."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["coalesced"]))
def test_coalesced_verbs(group, item, named_launches):
    """all_reduce_coalesced, all_gather_coalesced, and the coalescing manager's all_reduce,
    all_gather_into_tensor and reduce_scatter_tensor."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["sparse"]))
def test_sparse_all_reduce(group, item, named_launches):
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["objects"]))
def test_object_collectives(group, item, named_launches):
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["asynchronous"]))
def test_async_op(group, item, named_launches):
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["groups", "end"]))
def test_groups(group, item, named_launches):
    """new_group subgroups, their names and descriptions, destroy_process_group of a
    subgroup and of every group."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(TWO, THREE, families=["errors"]))
def test_errors_in_c10d_terms(group, item, named_launches):
    """A timeout and a mismatch raise c10d's types (DistBackendError) in c10d's words, and
    are gpuring's errors too."""
    named_launches.check(group, item)

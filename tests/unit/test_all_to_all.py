"""all_to_all without sockets: split sizes, plans, the check every rank runs on every plan, and
the hub's side (the op's geometry and header checks)."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar import ops
from gradstar.client import all_to_all as a2a
from gradstar.coordinator.collective.matching import Limits, check_agrees, describe, validate
from gradstar.errors import CollectiveMismatchError, InvalidCollectiveError
from gradstar.proto.v1 import collective_pb2 as pb

F32, I64 = pb.DTYPE_FLOAT32, pb.DTYPE_INT64
LIMITS = Limits(max_tensor_bytes=1 << 30, max_chunk_bytes=4 << 20)


# -- split sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [None, []])
def test_no_split_sizes_means_equal_splits(sizes):
    assert a2a.split_sizes(sizes, 12, 4, "input_split_sizes") == [3, 3, 3, 3]


def test_split_sizes_may_be_uneven_and_zero():
    assert a2a.split_sizes([0, 5, 1], 6, 3, "input_split_sizes") == [0, 5, 1]
    assert a2a.split_sizes((np.int64(2), 0), 2, 2, "x") == [2, 0]
    assert a2a.split_sizes([4, 1], None, 2, "output_split_sizes") == [4, 1]  # no sum to check


@pytest.mark.parametrize("sizes, rows, message", [
    (None, 10, "input_split_sizes is None, so dim 0 (10) must be divisible by world_size 4"),
    ([1, 2, 3], 6, "input_split_sizes has 3 entries; it needs one per rank (4)"),
    ([1, 2, 3, -1], 5, "input_split_sizes must be non-negative ints, got [1, 2, 3, -1]"),
    ([1, 2, 3, 1.0], 7, "must be non-negative ints"),
    ([1, 2, 3, True], 7, "must be non-negative ints"),
    ([1, 2, 3, 4], 11, "input_split_sizes [1, 2, 3, 4] sums to 10, but dim 0 of the tensor "
                       "is 11"),
])
def test_bad_split_sizes_are_invalid_collectives_that_say_why(sizes, rows, message):
    with pytest.raises(InvalidCollectiveError) as info:
        a2a.split_sizes(sizes, rows, 4, "input_split_sizes")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_equal_splits_need_the_rows():
    with pytest.raises(InvalidCollectiveError, match="rows are not known"):
        a2a.split_sizes(None, None, 2, "output_split_sizes")


def test_offsets_and_row_elements():
    assert a2a.offsets([2, 0, 3]) == [0, 2, 2, 5]
    assert a2a.row_elements((7, 3, 4)) == 12
    assert a2a.row_elements((7,)) == 1


def test_payload_tags_are_never_user_tags():
    from gradstar.client.peer import tag_key

    tag = a2a.payload_tag(3)
    assert tag == "all_to_all 3"
    assert tag not in {tag_key(t) for t in ("all_to_all 3", 3, ("all_to_all", 3))}


# -- plans -----------------------------------------------------------------------------------------


def plan(sends, expects, *, form=a2a.SINGLE, dtype=F32, row=2) -> a2a.Plan:
    return a2a.Plan(form, dtype, row, tuple(sends), tuple(expects))


def test_a_plan_round_trips_through_its_int64_encoding():
    p = plan([1, 0, 7], [2, 2, a2a.ANY], form=a2a.LIST, dtype=I64, row=1)
    encoded = p.encode()
    assert encoded.dtype == np.int64 and encoded.shape == (ops.plan_length(3),)
    assert a2a.Plan.decode(encoded, 3) == p


def consistent(sends_by_rank):
    """Plans in which every rank expects exactly what the others send it."""
    world = len(sends_by_rank)
    return [plan(sends_by_rank[r], [sends_by_rank[s][r] for s in range(world)])
            for r in range(world)]


def test_consistent_plans_pass():
    a2a.check_plans(consistent([[1, 2, 3], [0, 4, 1], [2, 2, 0]]), "all_to_all_single call 1")
    anything = [plan([1, 2], [a2a.ANY, a2a.ANY], form=a2a.LIST, row=1),
                plan([5, 0], [a2a.ANY, a2a.ANY], form=a2a.LIST, row=1)]
    a2a.check_plans(anything, "all_to_all call 1")


def test_mismatched_splits_name_both_ranks_and_both_sizes():
    plans = consistent([[1, 2, 3], [0, 4, 1], [2, 2, 0]])
    plans[2] = plan([2, 2, 0], [3, 2, 0])  # rank 2 expects 2 rows from rank 1, which sends 1
    with pytest.raises(CollectiveMismatchError) as info:
        a2a.check_plans(plans, "all_to_all_single call 4")
    assert str(info.value) == (
        "ranks disagree on all_to_all_single call 4: rank 1 sends 1 rows to rank 2 (its "
        "input_split_sizes[2] = 1) but rank 2 expects 2 from rank 1 (its "
        "output_split_sizes[1] = 2) (split sizes differ); every rank must pass matching "
        "arguments")
    assert info.value.rank == 2 and info.value.field == "split sizes"


@pytest.mark.parametrize("change, field, detail", [
    ({"form": a2a.LIST}, "op", "rank 1 called all_to_all but rank 0 called all_to_all_single"),
    ({"dtype": I64}, "dtype", "rank 1 passes int64 but rank 0 passes float32"),
    ({"row": 3}, "shape", "rank 1's rows (dim 0) have 3 elements but rank 0's have 2"),
])
def test_ranks_that_disagree_on_form_dtype_or_row_size_are_named(change, field, detail):
    plans = [plan([1, 1], [1, 1]), plan([1, 1], [1, 1], **change)]
    with pytest.raises(CollectiveMismatchError) as info:
        a2a.check_plans(plans, "all_to_all_single call 2")
    assert info.value.field == field and info.value.rank == 1
    assert detail in str(info.value)


# -- the hub's side --------------------------------------------------------------------------------


def test_all_to_all_plans_have_the_geometry_of_an_all_gather():
    nbytes = 8 * ops.plan_length(4)
    for rank in range(4):
        g = ops.geometry(ops.ALL_TO_ALL, 4, rank, nbytes, 16)
        ag = ops.geometry(ops.ALL_GATHER, 4, rank, nbytes, 16)
        assert (g.layout, g.sends, g.receives) == (ag.layout, ag.sends, ag.receives)
    assert ops.ALL_TO_ALL not in ops.REDUCING
    assert ops.op_name(ops.ALL_TO_ALL) == "all_to_all"


def header(op=ops.ALL_TO_ALL, dtype=I64, shape=None, rank=0):
    shape = (ops.plan_length(3),) if shape is None else shape
    return pb.CollectiveHeader(job="j", generation=1, seq=5, rank=rank, op=op, dtype=dtype,
                               shape=shape, chunk_bytes=1024)


def test_the_hub_accepts_a_plan_of_the_groups_length():
    validate(header(), 3, LIMITS)


@pytest.mark.parametrize("h", [header(dtype=F32), header(shape=(ops.plan_length(4),)),
                               header(shape=(3, 3))])
def test_the_hub_refuses_a_plan_of_another_shape_or_dtype(h):
    with pytest.raises(InvalidCollectiveError, match="all_to_all plan"):
        validate(h, 3, LIMITS)


def test_a_rank_calling_all_to_all_while_another_calls_all_reduce_is_named():
    other = pb.CollectiveHeader(job="j", generation=1, seq=5, rank=1, op=ops.ALL_REDUCE,
                                reduce_op=pb.REDUCE_OP_SUM, dtype=F32, shape=(4,),
                                chunk_bytes=1024)
    with pytest.raises(CollectiveMismatchError) as info:
        check_agrees(other, header(), "j")
    assert "rank 1 called all_reduce(op='sum', dtype=float32, shape=(4,)) but rank 0 called " \
           "all_to_all (or all_to_all_single)" in str(info.value)
    assert describe(header()) == "all_to_all (or all_to_all_single)"

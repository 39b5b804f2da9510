"""Every value of the wire's enums has its row (as hivemind's compression registry checks its
own): a collective op in gradstar.ops, a reduce op in its names and the hub's reducers, a dtype
in gradstar.wire.dtypes, a wire format in gradstar.wire.formats, an averaging rule in its names.
A proto enum value without a row fails here, before any rank sends it. docs/development.md's
checklists ("Adding a collective op", "Adding a wire format") say what each row needs."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar import errors, ops
from gradstar.coordinator.collective import reduce
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import dtype_from_wire
from gradstar.wire.formats import FORMATS, error_bound, format_from_wire, roundtrip


def values(enum, prefix: str) -> list[tuple[str, int]]:
    """(name without the prefix, value) of every value of ``enum`` but UNSPECIFIED."""
    return [(name.removeprefix(prefix).lower(), value) for name, value in enum.items()
            if value != 0]


@pytest.mark.parametrize(("name", "value"), values(pb.CollectiveOp, "COLLECTIVE_OP_"))
def test_every_collective_op_has_a_record(name, value):
    record = ops.OPS.get(value)
    assert record is not None, f"collective.proto's {name} has no row in gradstar.ops.table.OPS"
    assert (record.name, record.wire) == (name, value)
    assert record.takes_wire <= record.reduces  # the hub decodes formats only to reduce them
    geometry = ops.geometry(value, 4, 1, 4 * 64, 64)  # every record's geometry is computable
    assert geometry.op == value


@pytest.mark.parametrize(("name", "value"), values(pb.CollectiveOp, "COLLECTIVE_OP_"))
@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize(("nbytes", "chunk_bytes"), [(4 * 64, 64), (4 * 100, 48), (0, 64)])
def test_send_bytes_is_what_the_sent_chunks_hold(name, value, rank, nbytes, chunk_bytes):
    g = ops.geometry(value, 4, rank, nbytes, chunk_bytes, root=2)
    assert g.send_bytes == sum(g.layout.span(i)[1] for i in g.sends)
    assert g.send_bytes == g.send_bytes  # derived once, the same after


def test_the_records_name_each_op_once():
    assert len({op.name for op in ops.OPS.values()}) == len(ops.OPS)
    assert ops.REDUCING == {op.wire for op in ops.OPS.values() if op.reduces}


@pytest.mark.parametrize(("name", "value"), values(pb.ReduceOp, "REDUCE_OP_"))
def test_every_reduce_op_has_a_name_and_a_reducer(name, value):
    assert ops.REDUCE_OP_NAMES.get(value) == name
    assert ops.reduce_op(name) == value
    assert reduce.ChunkReducer(value, dtype_from_wire(pb.DTYPE_FLOAT32), 2,
                               reduce.BufferPool()) is not None


@pytest.mark.parametrize(("name", "value"), values(pb.DType, "DTYPE_"))
def test_every_dtype_has_a_row(name, value):
    assert dtype_from_wire(value).name == name


@pytest.mark.parametrize(("name", "value"), values(pb.WireFormat, "WIRE_FORMAT_"))
def test_every_wire_format_has_a_row_and_a_bound(name, value):
    fmt = format_from_wire(value)
    assert fmt is not None and FORMATS[fmt.name] is fmt and fmt.name == name
    x = np.linspace(-3, 3, 4 * max(fmt.block, 1), dtype=np.float32)
    assert (np.abs(roundtrip(fmt, x) - x) <= error_bound(fmt, x)).all()


@pytest.mark.parametrize(("name", "value"), values(pb.AveragingRule, "AVERAGING_RULE_"))
def test_every_averaging_rule_has_a_name(name, value):
    assert ops.RULE_NAMES.get(value) == name
    assert ops.averaging_rule(name) == value


@pytest.mark.parametrize("error", [errors.InvalidCollectiveError, errors.ConfigurationError])
def test_a_precondition_is_one_sentence_raised_with_the_callers_class(error):
    facts = ops.Facts((6, 2), "float32", 4, root=4, rank=1)
    with pytest.raises(error, match=r"^broadcast src=4 is out of range for world_size 4$"):
        ops.check_preconditions(ops.BROADCAST, facts, error)
    with pytest.raises(error, match=r"^reduce_scatter needs dim 0 divisible by world_size 4, "
                                    r"got shape \(6, 2\)$"):
        ops.check_preconditions(ops.REDUCE_SCATTER, facts, error)
    with pytest.raises(error, match=r"a plan is int64 of shape \(11,\)$"):
        ops.check_preconditions(ops.ALL_TO_ALL, facts, error)
    ops.check_preconditions(ops.ALL_REDUCE, facts, error)


def test_the_in_place_rule_is_the_records():
    for op in ops.OPS.values():
        h = pb.CollectiveHeader(op=op.wire, reduce_op=pb.REDUCE_OP_SUM, dtype=pb.DTYPE_INT64,
                                shape=[4 if op.wire != ops.ALL_TO_ALL else 11],
                                chunk_bytes=64, rank=1)
        call = ops.CollectiveCall.of(h, 4)
        inputs = call.geometry.layout.total_bytes
        assert (call.result_offset() == 0) == (op.in_place or inputs == 0)
        assert call.result_fits(0, 1 << 20) == (op.in_place or inputs == 0)
        assert call.result_fits(call.result_offset(), 1 << 20)

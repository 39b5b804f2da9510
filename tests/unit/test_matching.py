"""Header checks of the hub (coordinator/collective/matching.py), without sockets."""

from __future__ import annotations

import pytest

from gradstar import errors
from gradstar.coordinator.collective.matching import (
    Limits,
    ValidatedCalls,
    check_agrees,
    describe,
    field_values,
    validate,
)
from gradstar.proto.v1 import collective_pb2 as pb

LIMITS = Limits(max_tensor_bytes=1 << 20, max_chunk_bytes=1 << 16)


def header(**fields) -> pb.CollectiveHeader:
    base = dict(job="j", generation=1, group="default", seq=3, rank=0,
                op=pb.COLLECTIVE_OP_ALL_REDUCE, reduce_op=pb.REDUCE_OP_SUM,
                dtype=pb.DTYPE_FLOAT32, shape=[4, 6], chunk_bytes=1024)
    base.update(fields)
    return pb.CollectiveHeader(**base)


def test_describe_reads_like_the_call():
    assert describe(header()) == "all_reduce(op='sum', dtype=float32, shape=(4, 6))"
    assert describe(header(op=pb.COLLECTIVE_OP_BROADCAST, root=2)) == \
        "broadcast(dtype=float32, shape=(4, 6), src=2)"
    assert describe(header(op=99)) == "op 99(dtype=float32, shape=(4, 6))"


def test_a_valid_header_passes():
    validate(header(), 4, LIMITS)


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"op": 42}, errors.InvalidCollectiveError, "unknown collective op 42"),
    ({"chunk_bytes": 6}, errors.InvalidCollectiveError,
     "chunk_bytes 6 must be a multiple of the element size 4 and at most 65536"),
    ({"chunk_bytes": 1 << 17}, errors.InvalidCollectiveError, "and at most 65536"),
    ({"shape": [1 << 19]}, errors.PayloadTooLargeError,
     "payload of 2097152 bytes, over the coordinator's limit of 1048576 bytes"),
    ({"op": pb.COLLECTIVE_OP_BROADCAST, "root": 4}, errors.InvalidCollectiveError,
     "broadcast src=4 is out of range for world_size 4"),
    ({"averaging": pb.AveragingSpec(model="m", rule=pb.AVERAGING_RULE_AVERAGE)},
     errors.InvalidCollectiveError, "an averaging round must be an all_reduce with op='mean'"),
    ({"op": pb.COLLECTIVE_OP_REDUCE_SCATTER, "shape": [6, 2]}, errors.InvalidCollectiveError,
     "reduce_scatter needs dim 0 divisible by world_size 4, got shape (6, 2)"),
    ({"stripe": 2, "stripes": 2}, errors.InvalidCollectiveError,
     "rank 0 sent stripe 2 of a collective striped 2 ways"),
    ({"dtype": 77}, errors.ProtocolError, "unknown dtype 77"),
])
def test_each_invalid_header_is_named(fields, error, message):
    with pytest.raises(error) as raised:
        validate(header(**fields), 4, LIMITS)
    assert message in str(raised.value)


def test_agreeing_headers_pass():
    check_agrees(header(rank=1), header(), "j")


@pytest.mark.parametrize(("fields", "field"), [
    ({"op": pb.COLLECTIVE_OP_BROADCAST}, "op"),
    ({"reduce_op": pb.REDUCE_OP_MAX}, "reduce op"),
    ({"dtype": pb.DTYPE_FLOAT64}, "dtype"),
    ({"shape": [4, 7]}, "shape"),
    ({"chunk_bytes": 2048}, "chunk_bytes"),
    ({"stripe": 1, "stripes": 2}, "stripe"),
])
def test_a_mismatch_names_the_field_and_both_ranks(fields, field):
    with pytest.raises(errors.CollectiveMismatchError) as raised:
        check_agrees(header(rank=2, **fields), header(rank=0), "j")
    error = raised.value
    assert (error.rank, error.field) == (2, field)
    assert "ranks disagree on collective seq 3 of job 'j'" in str(error)
    assert f"rank 2 called {describe(header(rank=2, **fields))}" in str(error)
    assert f"rank 0 called {describe(header())}" in str(error)
    assert f"({field} differs)" in str(error)


def test_op_is_reported_first_even_when_other_fields_differ_too():
    with pytest.raises(errors.CollectiveMismatchError) as raised:
        check_agrees(header(op=pb.COLLECTIVE_OP_ALL_GATHER, shape=[9]), header(), "j")
    assert raised.value.field == "op"


def test_the_root_matters_only_for_broadcast():
    names = [name for name, _ in field_values(header(root=1))]
    assert "root" not in names
    assert "root" in [name for name, _ in field_values(header(op=pb.COLLECTIVE_OP_BROADCAST))]


def _changed(h: pb.CollectiveHeader, target, field) -> pb.CollectiveHeader:
    """``h`` with one scalar ``field`` of ``target`` (h or its averaging) set to another value."""
    value = getattr(target, field.name)
    if field.is_repeated:
        getattr(target, field.name).append(7)
    elif isinstance(value, bool):
        setattr(target, field.name, not value)
    elif isinstance(value, (int, float)):
        setattr(target, field.name, value + 1)
    else:
        setattr(target, field.name, value + "x")
    return h


def _scalar_fields(descriptor):
    return [f for f in descriptor.fields if f.message_type is None]


@pytest.mark.parametrize("op", [pb.COLLECTIVE_OP_ALL_REDUCE, pb.COLLECTIVE_OP_BROADCAST,
                                pb.COLLECTIVE_OP_ALL_GATHER])
@pytest.mark.parametrize("where", ["header", "averaging"])
def test_agreement_is_decided_by_the_named_fields_whichever_field_differs(op, where):
    # check_agrees skips naming the fields when the raw fields are equal: every field that
    # field_values reads must be among them, whatever field a later change adds.
    descriptor = (pb.CollectiveHeader if where == "header" else pb.AveragingSpec).DESCRIPTOR
    for field in _scalar_fields(descriptor):
        first = header(op=op, averaging=pb.AveragingSpec(model="m", rule=1, outer_lr=0.5))
        h = header(op=op, rank=1, averaging=pb.AveragingSpec(model="m", rule=1, outer_lr=0.5))
        h = _changed(h, h if where == "header" else h.averaging, field)
        disagree = h.op != first.op or field_values(h) != field_values(first)
        if disagree:
            with pytest.raises(errors.CollectiveMismatchError):
                check_agrees(h, first, "j")
        else:
            check_agrees(h, first, "j")


def test_a_field_the_op_ignores_may_differ():
    check_agrees(header(rank=1, root=1), header(root=0), "j")
    gather = pb.COLLECTIVE_OP_ALL_GATHER
    check_agrees(header(op=gather, rank=1, reduce_op=pb.REDUCE_OP_MAX), header(op=gather), "j")
    check_agrees(header(rank=1, stripes=0), header(stripes=1), "j")


def test_a_header_seen_before_gets_the_remembered_call_with_its_own_header():
    calls = ValidatedCalls(LIMITS)
    first = calls.call(header(seq=1), 2)
    again = calls.call(header(seq=2, timeout_seconds=9), 2)
    assert again.header.seq == 2 and again.header.timeout_seconds == 9
    assert again.geometry is first.geometry and len(calls) == 1
    assert again == validate(header(seq=2, timeout_seconds=9), 2, LIMITS)


@pytest.mark.parametrize("fields", [{"rank": 1}, {"shape": [4, 7]}, {"chunk_bytes": 512},
                                    {"op": pb.COLLECTIVE_OP_BROADCAST, "root": 1}])
def test_what_a_call_depends_on_is_derived_again(fields):
    calls = ValidatedCalls(LIMITS)
    calls.call(header(), 2)
    call = calls.call(header(**fields), 2)
    assert call == validate(header(**fields), 2, LIMITS) and len(calls) == 2
    assert calls.call(header(), 3).world_size == 3


def test_a_callers_key_stands_for_the_headers_fields():
    # A rank's group names each call by what it built the header from (ops.CallCache.call's
    # key): the same key gets the remembered call with its own header, another key a new one,
    # and a header without a key is remembered apart.
    calls = ValidatedCalls(LIMITS)
    first = calls.call(header(seq=1), 2, key=("allreduce", 24))
    again = calls.call(header(seq=2), 2, key=("allreduce", 24))
    other = calls.call(header(seq=3, shape=[5]), 2, key=("allreduce", 5))
    plain = calls.call(header(seq=4), 2)
    assert again.header.seq == 2 and again.geometry is first.geometry
    assert other.header.shape == [5] and other.nbytes == 20
    assert plain.geometry is not first.geometry and len(calls) == 3
    assert again.fields == plain.fields  # the header's own fields, whatever the key


def test_an_invalid_header_is_refused_every_time_and_not_remembered():
    calls = ValidatedCalls(LIMITS)
    calls.call(header(), 2)
    for _ in range(2):
        with pytest.raises(errors.InvalidCollectiveError):
            calls.call(header(chunk_bytes=1023), 2)
        with pytest.raises(errors.InvalidCollectiveError):
            calls.call(header(op=pb.COLLECTIVE_OP_BROADCAST, root=5), 2)
    assert len(calls) == 1


def test_at_most_size_headers_are_remembered():
    calls = ValidatedCalls(LIMITS, size=4)
    for n in range(1, 10):
        calls.call(header(shape=[n]), 2)
    assert len(calls) == 4
    assert calls.call(header(shape=[9]), 2).header.shape == [9]

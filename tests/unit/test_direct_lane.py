"""Which collectives the blocking API's direct lane takes (gradstar.client.collective.direct):
exactly those whose rank side fits one message on the stream, in the tensor's own dtype."""

from __future__ import annotations

import pytest

from gradstar import ops
from gradstar.client.collective.direct import DirectLane
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import MAX_BATCHED_CHUNK_BYTES, aligned_chunk_bytes, dtype_info
from gradstar.wire.formats import FORMATS


def call(op: int, elements: int, *, world: int = 2, dtype: str = "float32", wire: str = "",
         averaging: bool = False, chunk_bytes: int = 2 << 20) -> ops.CollectiveCall:
    import numpy as np

    info = dtype_info(np.dtype(dtype))
    header = pb.CollectiveHeader(
        job="j", generation=1, group="default", seq=1, rank=0, op=op,
        reduce_op=pb.REDUCE_OP_MEAN if averaging else pb.REDUCE_OP_SUM, dtype=info.wire,
        shape=(elements,), chunk_bytes=aligned_chunk_bytes(chunk_bytes, info.numpy.itemsize),
        timeout_seconds=30, wire=FORMATS[wire].wire if wire else 0)
    if averaging:
        header.averaging.CopyFrom(pb.AveragingSpec(model="m", rule=pb.AVERAGING_RULE_AVERAGE))
    return ops.CollectiveCall.of(header, world)


@pytest.mark.parametrize("op", [ops.ALL_REDUCE, ops.BROADCAST, ops.ALL_GATHER,
                                ops.REDUCE_SCATTER])
def test_a_payload_up_to_one_message_takes_the_lane(op):
    at_most = MAX_BATCHED_CHUNK_BYTES // 4
    assert DirectLane.takes(call(op, at_most))
    assert DirectLane.takes(call(op, 2))


def test_a_barrier_takes_the_lane():
    assert DirectLane.takes(call(ops.BARRIER, 0))


def test_one_element_more_than_one_message_stays_on_the_loop():
    assert not DirectLane.takes(call(ops.ALL_REDUCE, MAX_BATCHED_CHUNK_BYTES // 4 + 1))


def test_too_many_chunks_for_one_message_stay_on_the_loop():
    # 4 KiB of payload in 16-byte chunks: 256 chunk frames, more than a batch holds.
    assert not DirectLane.takes(call(ops.ALL_REDUCE, 1024, chunk_bytes=16))


def test_a_wire_format_or_an_averaging_round_stays_on_the_loop():
    assert not DirectLane.takes(call(ops.ALL_REDUCE, 25, wire="bf16"))
    assert not DirectLane.takes(call(ops.ALL_REDUCE, 25, averaging=True))

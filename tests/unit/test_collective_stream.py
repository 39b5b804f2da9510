"""The rank's half of the Collective stream, without sockets: plans from ``ops.geometry`` and the
:class:`StreamReceiver` state machine fed the frames a hub would send."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar import ops
from gradstar.client.collective import CollectivePlan, Phase, StreamReceiver
from gradstar.errors import CollectiveTimeoutError, ProtocolError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import (
    CHUNK_HEADER_BYTES,
    KIND_ACCEPT,
    KIND_END,
    as_byte_view,
    encode_error,
    encode_message,
    iter_chunk_frames,
)

WORLD = 3


def header(op: int, rank: int, shape, chunk_bytes: int = 8, root: int = 0):
    return pb.CollectiveHeader(seq=1, rank=rank, op=op, dtype=pb.DTYPE_FLOAT32, shape=shape,
                               chunk_bytes=chunk_bytes, root=root)


def accept(chunks: int) -> bytes:
    return encode_message(KIND_ACCEPT, pb.CollectiveAccept(output_chunks=chunks))


def end(chunks: int, nbytes: int) -> bytes:
    return encode_message(KIND_END, pb.CollectiveEnd(chunks=chunks, bytes=nbytes))


def receiver_for(plan: CollectivePlan, receives: frozenset[int]) -> StreamReceiver:
    return StreamReceiver("collective seq 1", "coordinator", plan.geometry.out_layout,
                          receives, as_byte_view(plan.out))


def all_receives(plan: CollectivePlan) -> frozenset[int]:
    return plan.out_indices(i for r in plan.geometry.receives for i in r)


def feed_result(receiver: StreamReceiver, result: np.ndarray, indices) -> None:
    """What the hub sends: ACCEPT, the result chunks ``indices`` (output indices), END."""
    frames = list(iter_chunk_frames(as_byte_view(result), receiver.tracker.layout,
                                    sorted(indices)))
    receiver.on_frame(accept(len(frames)))
    for frame in reversed(frames):  # any order
        receiver.on_frame(frame)
    receiver.on_frame(end(len(frames), sum(len(f) - CHUNK_HEADER_BYTES for f in frames)))


@pytest.mark.parametrize("rank", range(WORLD))
def test_all_gather_fills_every_segment_but_its_own(rank):
    inputs = [np.arange(5, dtype=np.float32) + 10 * r for r in range(WORLD)]
    out = np.zeros((WORLD, 5), np.float32)
    out[rank] = inputs[rank]
    plan = CollectivePlan.for_header(header(ops.ALL_GATHER, rank, [5]), WORLD, out, out)
    receiver = receiver_for(plan, all_receives(plan))
    feed_result(receiver, np.stack(inputs), all_receives(plan))
    assert receiver.phase is Phase.COMPLETE
    assert np.array_equal(out, np.stack(inputs))


def test_all_gather_refuses_the_ranks_own_chunk_back():
    out = np.zeros((WORLD, 4), np.float32)
    plan = CollectivePlan.for_header(header(ops.ALL_GATHER, 1, [4]), WORLD, out, out)
    receiver = receiver_for(plan, all_receives(plan))
    receiver.on_frame(accept(receiver.tracker.expected))
    own = next(iter_chunk_frames(as_byte_view(out), plan.geometry.layout, plan.geometry.sends))
    with pytest.raises(ProtocolError, match="does not belong on this stream"):
        receiver.on_frame(own)


@pytest.mark.parametrize("rank", range(WORLD))
def test_reduce_scatter_receives_output_indices_of_its_segment(rank):
    arr = np.arange(WORLD * 6, dtype=np.float32)
    out = np.zeros(6, np.float32)
    plan = CollectivePlan.for_header(header(ops.REDUCE_SCATTER, rank, [WORLD * 6]), WORLD,
                                     arr, out)
    assert all_receives(plan) == frozenset(range(plan.geometry.out_layout.count))
    receiver = receiver_for(plan, all_receives(plan))
    shard = arr[rank * 6:(rank + 1) * 6] * WORLD
    feed_result(receiver, shard, all_receives(plan))
    assert np.array_equal(out, shard)


def test_broadcast_root_expects_nothing():
    arr = np.ones(4, np.float32)
    plan = CollectivePlan.for_header(header(ops.BROADCAST, 2, [4], root=2), WORLD, arr,
                                     arr.copy())
    receiver = receiver_for(plan, all_receives(plan))
    receiver.on_frame(accept(0))
    receiver.on_frame(end(0, 0))
    assert receiver.phase is Phase.COMPLETE


def test_stripes_fill_one_buffer_from_concurrent_streams():
    """K hub shards: stream k carries the chunks ops.in_stripe(..., k, K) into a shared out."""
    arr = np.arange(40, dtype=np.float32)
    out = np.zeros_like(arr)
    plan = CollectivePlan.for_header(header(ops.ALL_REDUCE, 0, [40]), WORLD, arr, out)
    shards = ops.active_shards(plan.geometry.layout, 3)
    receivers = []
    for k in range(shards):
        receives = plan.out_indices(ops.in_stripe(plan.geometry.receives, k, shards))
        receivers.append((receiver_for(plan, receives), receives))
    for receiver, receives in receivers:
        feed_result(receiver, arr * 2, receives)
    assert np.array_equal(out, arr * 2)


@pytest.mark.parametrize("ranges", [(range(0, 40),), (range(3, 17), range(20, 21), range(25, 40)),
                                    (range(5, 5), range(7, 30))])
@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_a_stripes_indices_as_ranges_are_the_stripes_chunks(ranges, shards):
    # The hub keeps a stripe's indices as ranges (a set of 2^20 would take tens of MiB).
    for k in range(shards):
        listed = ops.in_stripe(ranges, k, shards)
        held = ops.stripe_indices(ranges, k, shards)
        assert list(held) == listed and len(held) == len(listed)
        assert [i for i in range(-3, 45) if i in held] == listed
        assert all(i % shards == k for i in held)


def test_a_chunk_before_the_accept_is_a_protocol_error():
    arr = np.ones(4, np.float32)
    plan = CollectivePlan.for_header(header(ops.ALL_REDUCE, 0, [4]), WORLD, arr,
                                     np.empty_like(arr))
    receiver = receiver_for(plan, all_receives(plan))
    chunk = next(iter_chunk_frames(as_byte_view(arr), plan.geometry.layout))
    with pytest.raises(ProtocolError, match="collective seq 1: unexpected frame of kind 3"):
        receiver.on_frame(chunk)


def test_an_accept_for_the_wrong_chunk_count_is_a_protocol_error():
    arr = np.ones(4, np.float32)
    plan = CollectivePlan.for_header(header(ops.ALL_REDUCE, 0, [4]), WORLD, arr,
                                     np.empty_like(arr))
    receiver = receiver_for(plan, all_receives(plan))
    with pytest.raises(ProtocolError, match="will send 5 chunks, this rank expects 2"):
        receiver.on_frame(accept(5))


def test_an_error_frame_raises_the_hubs_verdict_in_any_phase():
    arr = np.ones(4, np.float32)
    plan = CollectivePlan.for_header(header(ops.ALL_REDUCE, 0, [4]), WORLD, arr,
                                     np.empty_like(arr))
    receiver = receiver_for(plan, all_receives(plan))
    receiver.on_frame(accept(2))
    with pytest.raises(CollectiveTimeoutError, match="ranks 2 never arrived"):
        receiver.on_frame(encode_error(CollectiveTimeoutError("ranks 2 never arrived")))


def test_an_end_marker_short_of_chunks_is_a_protocol_error():
    arr = np.ones(4, np.float32)
    plan = CollectivePlan.for_header(header(ops.ALL_REDUCE, 0, [4]), WORLD, arr,
                                     np.empty_like(arr))
    receiver = receiver_for(plan, all_receives(plan))
    receiver.on_frame(accept(2))
    receiver.on_frame(next(iter_chunk_frames(as_byte_view(arr), plan.geometry.layout)))
    with pytest.raises(ProtocolError, match="stream ended after 1 of 2 chunks"):
        receiver.on_frame(end(1, 8))
    assert receiver.phase is Phase.RECEIVING


def test_a_batch_from_the_hub_is_taken_frame_by_frame():
    """The hub sends frames that are ready together as one message (wire.encode_batch)."""
    from gradstar.wire import KIND_SHM_ATTACH, encode_batch, encode_shm_chunk

    arr = np.arange(4, dtype=np.float32)
    out = np.zeros_like(arr)
    plan = CollectivePlan.for_header(header(ops.ALL_REDUCE, 0, [4]), WORLD, arr, out)
    segment = bytearray(as_byte_view(arr * 3))
    receiver = StreamReceiver("collective seq 1", "coordinator", plan.geometry.out_layout,
                              all_receives(plan), as_byte_view(out), memoryview(segment))
    receiver.on_frame(encode_batch([
        encode_message(KIND_SHM_ATTACH, pb.ShmAttach(attached=True)), accept(2)]))
    assert receiver.attached and receiver.phase is Phase.RECEIVING
    receiver.on_frame(encode_shm_chunk(1))
    receiver.on_frame(encode_batch([encode_shm_chunk(0), end(2, 16)]))
    assert receiver.phase is Phase.COMPLETE
    assert np.array_equal(out, arr * 3)

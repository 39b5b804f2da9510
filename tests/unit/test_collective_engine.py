"""The hub's half of the Collective stream without sockets: the engine (coordinator/collective/
engine.py) fed the frames ranks would send, its answers read from each participant's outbox.
The twin of tests/unit/test_collective_stream.py (the rank's half); end to end over real
sockets in tests/integration/test_collectives.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar import errors, ops
from gradstar.coordinator.collective import CollectiveEngine
from gradstar.coordinator.collective.window import CLOSE
from gradstar.coordinator.rendezvous import Rendezvous
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import (
    KIND_ACCEPT,
    KIND_CHUNK,
    KIND_END,
    as_byte_view,
    decode_chunk,
    decode_message,
    encode_message,
    frame_kind,
    iter_chunk_frames,
)

WORLD = 3
BOUND = 10.0


async def members(job: str, world: int = WORLD):
    rdv = Rendezvous(heartbeat_timeout=60)
    joined = await asyncio.wait_for(asyncio.gather(
        *(rdv.join(job, world, r, f"10.0.0.{r}:1", timeout=BOUND) for r in range(world))), BOUND)
    engine = CollectiveEngine(rdv, max_tensor_bytes=1 << 20, max_chunk_bytes=1 << 16,
                              max_timeout=BOUND)
    return engine, joined


def header(m, op: int, shape, *, reduce_op=pb.REDUCE_OP_SUM, root: int = 0,
           chunk_bytes: int = 8, dtype=pb.DTYPE_FLOAT32) -> pb.CollectiveHeader:
    return pb.CollectiveHeader(job=m.job,
                               generation=m.generation.number, group="default", seq=1,
                               rank=m.rank, member_id=m.member_id, op=op, reduce_op=reduce_op,
                               dtype=dtype, shape=shape, root=root, chunk_bytes=chunk_bytes)


def send_all(engine, headers, inputs):
    """Every rank's header, then its chunks (as :class:`CollectivePlan` would cut them) and END;
    returns the participants."""
    arrived = [engine.arrive(h) for h in headers]
    for (coll, p), h, x in zip(arrived, headers, inputs, strict=True):
        g = ops.CollectiveCall.of(h, len(headers)).geometry
        sent = 0
        for frame in iter_chunk_frames(as_byte_view(x), g.layout, g.sends):
            coll.on_chunk(p, frame)
            sent += g.layout.span(decode_chunk(frame)[0])[1]
        coll.on_end(p, encode_message(KIND_END, pb.CollectiveEnd(chunks=len(g.sends),
                                                                 bytes=sent)))
    return arrived


def drain(p) -> list:
    items = []
    while not p.outbox.empty():
        items.append(p.outbox.get_nowait())
    return items


def result_of(items, out: np.ndarray, layout) -> np.ndarray:
    """What a rank would assemble from its outbox: ACCEPT, chunks into ``out``, END, CLOSE."""
    assert frame_kind(items[0]) == KIND_ACCEPT and items[-1] is CLOSE
    view = as_byte_view(out)
    for frame in items[1:-2]:
        assert frame_kind(frame) == KIND_CHUNK
        index, payload = decode_chunk(frame)
        offset, length = layout.span(index)
        view[offset:offset + length] = payload
    end = decode_message(items[-2], KIND_END, pb.CollectiveEnd)
    assert end.chunks == len(items) - 3
    return out


async def test_an_all_reduce_reaches_every_rank_reduced():
    engine, ms = await members("sum")
    inputs = [np.arange(7, dtype=np.float32) * (r + 1) for r in range(WORLD)]
    arrived = send_all(engine, [header(m, ops.ALL_REDUCE, [7]) for m in ms], inputs)
    for coll, p in arrived:
        layout = coll.layout
        got = result_of(drain(p), np.empty(7, np.float32), layout)
        np.testing.assert_array_equal(got, sum(inputs))


async def test_a_broadcast_forwards_the_roots_chunks_to_the_others():
    engine, ms = await members("bcast")
    inputs = [np.full(5, r, np.float32) for r in range(WORLD)]
    arrived = send_all(engine, [header(m, ops.BROADCAST, [5], root=1) for m in ms], inputs)
    for rank, (coll, p) in enumerate(arrived):
        items = drain(p)
        if rank == 1:  # the root receives nothing but the accept and the end
            assert [frame_kind(i) for i in items[:-1]] == [KIND_ACCEPT, KIND_END]
            continue
        np.testing.assert_array_equal(result_of(items, np.empty(5, np.float32), coll.layout),
                                      inputs[1])


async def test_a_reduce_scatter_gives_each_rank_its_reduced_segment():
    engine, ms = await members("rs")
    inputs = [np.arange(12, dtype=np.float32) + r for r in range(WORLD)]
    arrived = send_all(engine, [header(m, ops.REDUCE_SCATTER, [12]) for m in ms], inputs)
    total = sum(inputs)
    for rank, (_, p) in enumerate(arrived):
        g = ops.CollectiveCall.of(header(ms[rank], ops.REDUCE_SCATTER, [12]), WORLD).geometry
        got = result_of(drain(p), np.empty(4, np.float32), g.out_layout)
        np.testing.assert_array_equal(got, total[4 * rank:4 * rank + 4])


async def test_a_header_is_validated_once_and_its_call_carried():
    engine, ms = await members("once")
    h = header(ms[0], ops.ALL_REDUCE, [7])
    coll, p = engine.arrive(h)
    assert coll.layout == ops.CollectiveCall.of(h, WORLD).geometry.layout
    assert (p.input_count, p.output_count) == (4, 4)


async def test_a_disagreeing_rank_fails_the_collective_on_every_rank():
    engine, ms = await members("mismatch")
    _, first = engine.arrive(header(ms[0], ops.ALL_REDUCE, [7]))
    with pytest.raises(errors.CollectiveMismatchError, match=r"\(shape differs\)"):
        engine.arrive(header(ms[1], ops.ALL_REDUCE, [8]))
    error = drain(first)[-1]
    assert isinstance(error, errors.CollectiveMismatchError)
    with pytest.raises(errors.CollectiveMismatchError):  # a later rank hears the same
        engine.arrive(header(ms[2], ops.ALL_REDUCE, [7]))


async def test_a_precondition_of_the_op_record_is_the_hubs_refusal():
    engine, ms = await members("pre")
    with pytest.raises(errors.InvalidCollectiveError,
                       match=r"^broadcast src=5 is out of range for world_size 3$"):
        engine.arrive(header(ms[0], ops.BROADCAST, [4], root=5))
    with pytest.raises(errors.InvalidCollectiveError):  # kept for the ranks that come later
        engine.arrive(header(ms[1], ops.BROADCAST, [4], root=5))


async def test_a_chunk_outside_a_ranks_range_is_a_protocol_error():
    engine, ms = await members("range")
    hs = [header(m, ops.ALL_GATHER, [2]) for m in ms]
    coll, p = engine.arrive(hs[0])
    frame = next(iter_chunk_frames(as_byte_view(np.zeros(6, np.float32)), coll.layout, [2]))
    with pytest.raises(errors.ProtocolError, match="rank 0 sent chunk 2, outside its range"):
        coll.on_chunk(p, frame)
    coll.fail(errors.ProtocolError("done"))
    assert isinstance(drain(p)[-1], errors.ProtocolError)

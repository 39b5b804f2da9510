"""The same-host fast path: collective payloads through the ranks' shared-memory segments.

Real coordinator (and hub shard processes) on 127.0.0.1:0 and ranks on the same host, so the hub
attaches the segments the ranks offer. Every collective must be bit-identical to the same
collective on the stream (the path ranks on other hosts take), and a hub that does not attach
a segment must cost nothing but speed.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar import errors
from gradstar.client.collective import Target
from gradstar.client.collective import stream as collective_stream
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.transport import shm
from gradstar.wire import KIND_HEADER, decode_message, frame_kind, frames_of

from .conftest import close_all, join_all
from .test_shards import DTYPES, SHAPE, as_bytes, exact_inputs, run_every_collective


@pytest.mark.parametrize("shards", [0, 2])
async def test_every_collective_through_shared_memory_equals_the_stream(start_coordinator,
                                                                       shards):
    hub = await start_coordinator(shards=shards)
    for dtype in DTYPES:
        name = np.dtype(dtype).name
        offers: list = []
        got = await run_every_collective(hub.address, dtype, f"shm-{name}", offers)
        want = await run_every_collective(hub.address, dtype, f"stream-{name}",
                                          shared_memory=False)
        assert got.keys() == want.keys()
        for op in want:
            assert as_bytes(got[op]) == as_bytes(want[op]), (op, name)
        np.testing.assert_array_equal(got["all_reduce/sum"][0], sum(exact_inputs(dtype, SHAPE)))
        # Every target attached every segment offered: none refused (a refusal ends offers).
        assert offers and all(o.enabled and not o.refused for o in offers), offers
    if not shards:
        assert hub.collectives.segments.mapped_bytes > 0


async def test_a_hub_that_does_not_attach_segments_gets_chunks_on_the_stream(start_coordinator):
    hub = await start_coordinator(shared_memory=False)
    offers: list = []
    got = await run_every_collective(hub.address, np.float32, "refused", offers)
    xs = exact_inputs(np.float32, SHAPE)
    np.testing.assert_array_equal(got["all_reduce/sum"][1], sum(xs))
    np.testing.assert_array_equal(got["broadcast"][0], xs[1])
    # The first refusal ended this rank's offers to that hub, with the hub's reason kept.
    assert offers and all(not o.enabled for o in offers)
    assert all("shared memory is turned off on this hub" in o.refused for o in offers)
    assert hub.collectives.segments is None


class _Recording:
    """Wraps a group's coordinator target: keeps the header of every collective it carries
    (a stream carries collectives one after another) and counts the streams it opens."""

    def __init__(self, group):
        self.headers: list = []
        self.streams = 0
        real = group._plane.coordinator

        def stream(requests, **kwargs):
            self.streams += 1

            async def recorded():
                async for message in requests:
                    # A small collective's header comes first in a batch with the rest.
                    frame = frames_of(message)[0]
                    if frame_kind(frame) == KIND_HEADER:
                        self.headers.append(decode_message(frame, KIND_HEADER,
                                                           pb.CollectiveHeader))
                    yield message

            return real.stream(recorded(), **kwargs)

        group._plane.coordinator = Target(stream, real.address, real.name, real.shm)


async def test_a_segment_the_hub_attached_before_is_offered_eagerly(coordinator, monkeypatch):
    # A fresh pool and one rank: every collective is handed the same segment.
    monkeypatch.setattr(collective_stream, "SEGMENTS", shm.SegmentPool())
    (group,) = await join_all(coordinator.address, 1, job="eager")
    try:
        recording = _Recording(group)
        x = np.arange(1000, dtype=np.float32)
        for step in range(3):
            result = await asyncio.wait_for(group.all_reduce(x * step), 20)
            np.testing.assert_array_equal(result, x * step)
        # The first offer of the segment waits for the hub's verdict; later ones do not.
        assert [h.shm.eager for h in recording.headers] == [False, True, True]
        assert len({h.shm.inode for h in recording.headers}) == 1
    finally:
        await close_all([group])


class _Everything(set):
    def __contains__(self, item) -> bool:
        return True


async def test_an_eager_offer_the_hub_refuses_fails_once_on_every_rank_then_streams(
        start_coordinator):
    """A hub that refuses a segment a rank believed attached (it cannot, short of running out
    of memory or descriptors; forced here) cannot take the chunks already announced: the
    collective fails with a named error on every rank, and the next one goes on the stream."""
    hub = await start_coordinator(shared_memory=False)
    groups = await join_all(hub.address, 2, job="refused-eager")
    try:
        for g in groups:
            g._plane.coordinator.shm.attached = _Everything()
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(g.all_reduce(np.ones(100, np.float32)) for g in groups),
            return_exceptions=True), 20)
        for outcome in outcomes:
            assert isinstance(outcome, errors.ProtocolError), outcome
            assert "segment the hub did not attach" in str(outcome)
        assert all(not g.shared_memory for g in groups)
        results = await asyncio.wait_for(asyncio.gather(
            *(g.all_reduce(np.full(3, g.rank + 1.0)) for g in groups)), 20)
        assert [r.tolist() for r in results] == [[3.0, 3.0, 3.0]] * 2
    finally:
        await close_all(groups)


async def test_a_rank_that_dies_before_the_hub_attaches_its_eager_segment_is_lost(
        start_coordinator, monkeypatch):
    """A rank writes its chunks into a segment the hub attached before, announces them, and is
    killed before the hub opens the segment again (seen with an agent restarting a SIGKILLed
    rank): the others must hear RankLostError naming it, which elastic recovery acts on, not
    the ProtocolError its announced chunks would otherwise raise. Rank 1's offer is made to
    name a process that has exited, eagerly."""
    exited = await asyncio.create_subprocess_exec("true")
    await asyncio.wait_for(exited.wait(), 10)
    real = collective_stream._offering

    def offering(call, target, segment):
        offer = real(call, target, segment)
        if offer.rank == 1 and offer.HasField("shm"):
            offer.shm.pid, offer.shm.eager = exited.pid, True
        return offer

    monkeypatch.setattr(collective_stream, "_offering", offering)
    hub = await start_coordinator()
    groups = await join_all(hub.address, 2, job="died-eager")
    try:
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(g.all_reduce(np.ones(100, np.float32)) for g in groups),
            return_exceptions=True), 20)
        assert isinstance(outcomes[0], errors.RankLostError), outcomes[0]
        assert outcomes[0].rank == 1
        assert "exited before the hub could attach" in str(outcomes[0])
    finally:
        await close_all(groups)

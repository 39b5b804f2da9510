"""A rank keeps its Collective streams open between collectives (one call set-up per stream, not
per collective): collectives in turn share one stream, collectives at once each have their own,
and a stream whose collective did not end cleanly is never used again."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar import errors
from gradstar.client.collective import stream as collective_stream
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import KIND_END, KIND_ERROR, decode_error, encode_message, frame_kind

from .conftest import close_all, join_all
from .test_shared_memory import _Recording


async def test_collectives_in_turn_share_one_stream(coordinator):
    groups = await join_all(coordinator.address, 2, job="reuse")
    try:
        recordings = [_Recording(g) for g in groups]
        x = np.arange(1000, dtype=np.float32)
        for step in range(4):
            reduced, gathered, sent = await asyncio.wait_for(asyncio.gather(
                asyncio.gather(*(g.all_reduce(x * (g.rank + step)) for g in groups)),
                asyncio.gather(*(g.all_gather(x[:10] + g.rank) for g in groups)),
                asyncio.gather(*(g.broadcast(x * step + g.rank, src=1) for g in groups)),
            ), 30)
            for result in reduced:
                np.testing.assert_array_equal(result, x * (1 + 2 * step))
            for parts in gathered:
                np.testing.assert_array_equal(np.stack(parts), [x[:10], x[:10] + 1])
            for result in sent:
                np.testing.assert_array_equal(result, x * step + 1)
            await asyncio.wait_for(asyncio.gather(*(g.barrier() for g in groups)), 20)
        for recording in recordings:
            # 16 collectives; 3 issued at once per step, then a barrier: 3 streams at most.
            assert len(recording.headers) == 16
            assert 1 <= recording.streams <= 3
    finally:
        await close_all(groups)


async def test_a_failed_collective_ends_its_stream_and_the_next_one_opens_another(coordinator):
    groups = await join_all(coordinator.address, 2, job="reuse-fail")
    try:
        recordings = [_Recording(g) for g in groups]
        x = np.ones(64, dtype=np.float32)
        await asyncio.wait_for(asyncio.gather(*(g.all_reduce(x) for g in groups)), 20)
        assert [r.streams for r in recordings] == [1, 1]
        # The ranks disagree on the shape: the collective fails on both, with the error named.
        outcomes = await asyncio.wait_for(asyncio.gather(
            groups[0].all_reduce(np.ones(64, dtype=np.float32)),
            groups[1].all_reduce(np.ones(65, dtype=np.float32)),
            return_exceptions=True), 20)
        assert all(isinstance(o, errors.CollectiveMismatchError) for o in outcomes), outcomes
        # A mismatch does not break the generation: the next collective runs on a new stream.
        results = await asyncio.wait_for(asyncio.gather(*(g.all_reduce(x * 3) for g in groups)),
                                         20)
        for result in results:
            np.testing.assert_array_equal(result, x * 6)
        assert [r.streams for r in recordings] == [2, 2]
        assert [len(r.headers) for r in recordings] == [3, 3]
    finally:
        await close_all(groups)


async def test_closing_the_group_ends_its_idle_streams(coordinator):
    groups = await join_all(coordinator.address, 2, job="reuse-close")
    x = np.ones(8, dtype=np.float32)
    await asyncio.wait_for(asyncio.gather(*(g.all_reduce(x) for g in groups)), 20)
    idle = [s for g in groups for s in g._plane.coordinator.idle]
    assert len(idle) == 2 and all(s.usable for s in idle)
    calls = [s.call for s in idle]
    await close_all(groups)
    assert all(not g._plane.coordinator.idle for g in groups)
    await asyncio.wait_for(asyncio.gather(*(c.wait_for_connection() for c in calls),
                                          return_exceptions=True), 5)
    assert all(c.done() for c in calls)
    # And let go of them: an ended call keeps its TCP connection while it is referenced.
    assert all(s.call is None and not s.usable for s in idle)


def test_idle_streams_are_bounded():
    class _Call:
        cancelled = False

        def done(self):
            return self.cancelled

        def cancel(self):
            self.cancelled = True

    target = collective_stream.Target(lambda requests, **kwargs: _Call(), "nowhere")
    streams = [target.open(None) for _ in range(collective_stream.MAX_IDLE_STREAMS + 3)]
    calls = {id(s): s.call for s in streams}  # a closed stream lets go of its call
    assert len({id(s) for s in streams}) == len(streams)  # none idle yet: each one is new
    for stream in streams:
        target.put_back(stream)
    assert len(target.idle) == collective_stream.MAX_IDLE_STREAMS
    assert sum(calls[id(s)].cancelled for s in streams) == 3
    assert sum(s.call is None for s in streams) == 3
    kept = list(target.idle)
    kept[-1].call.cancel()  # an idle stream whose call ended is not handed out again
    handed = target.open(None)
    assert handed is kept[-2] and not handed.call.cancelled
    assert len(target.idle) == collective_stream.MAX_IDLE_STREAMS - 2
    target.close()  # ends the idle ones; the one handed out is its collective's to end
    assert not target.idle and all(calls[id(s)].cancelled for s in kept if s is not handed)


async def test_a_bad_header_after_a_clean_collective_is_refused_on_that_stream_only(coordinator):
    (group,) = await join_all(coordinator.address, 1, job="reuse-bad")
    try:
        x = np.arange(16, dtype=np.float32)
        np.testing.assert_array_equal(await asyncio.wait_for(group.all_reduce(x), 20), x)
        target = group._plane.coordinator
        (stream,) = target.idle
        reused = target.open(group._metadata)
        assert reused is stream

        async def garbage():
            yield encode_message(KIND_END, pb.CollectiveEnd(chunks=0, bytes=0))

        reused.send(garbage())
        try:
            frame = await asyncio.wait_for(reused.read(), 10)
            assert frame_kind(frame) == KIND_ERROR
            with pytest.raises(errors.ProtocolError):
                raise decode_error(frame)
        finally:
            reused.close()
        # The hub and the group are unharmed: the next collective opens a stream and runs.
        np.testing.assert_array_equal(await asyncio.wait_for(group.all_reduce(x * 2), 20),
                                      x * 2)
        assert target.idle and target.idle[0] is not stream
    finally:
        await close_all([group])

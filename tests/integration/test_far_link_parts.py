"""A large all_reduce runs as parts in flight at once, over several connections to its target
(:mod:`gradstar.client.process_group.parts`, :mod:`gradstar.client.collective.connections`),
with real sockets: the result is bit-identical to the unsplit sum, each part rides its own
connection, and ranks that cut differently get a named error instead of a wrong tensor."""

from __future__ import annotations

import asyncio

import numpy as np

import gradstar
from gradstar import errors

from .conftest import close_all, join_all

N = (48 << 20) // 4 + 5  # float32 elements: 48 MiB and a bit, three parts, the last one short


def _inputs(world_size: int) -> list[np.ndarray]:
    return [np.random.default_rng(seed).standard_normal(N).astype(np.float32)
            for seed in range(world_size)]


def _count_streams(group) -> list[int]:
    """Wrap each connection of ``group``'s coordinator target to count the streams it opens."""
    target = group._plane.coordinator
    opened = [0] * len(target.connections)

    def counting(c, call):
        def stream(requests, **kwargs):
            opened[c] += 1
            return call(requests, **kwargs)
        return stream

    target.connections[:] = [counting(c, call) for c, call in enumerate(target.connections)]
    return opened


async def test_a_split_all_reduce_is_exact_and_each_part_rides_its_own_connection(coordinator):
    groups = await join_all(coordinator.address, 2, job="parts", connections=3)
    try:
        assert [len(g._plane.coordinator.connections) for g in groups] == [3, 3]
        opened = [_count_streams(g) for g in groups]
        xs = _inputs(2)
        results = await asyncio.wait_for(asyncio.gather(
            *(g.all_reduce(xs[g.rank], op="sum") for g in groups)), 60)
        for result in results:
            assert np.array_equal(result, xs[0] + xs[1])
        # Three parts at once: one stream on each connection.
        assert opened == [[1, 1, 1], [1, 1, 1]]
        outs = [np.empty_like(x) for x in xs]
        await asyncio.wait_for(asyncio.gather(
            *(g.all_reduce(xs[g.rank], op="mean", out=outs[g.rank]) for g in groups)), 60)
        for out in outs:
            np.testing.assert_array_equal(out, (xs[0] + xs[1]) / np.float32(2))
        # The same streams again (kept open), no new ones.
        assert opened == [[1, 1, 1], [1, 1, 1]]
    finally:
        await close_all(groups)


async def test_ranks_that_cut_differently_fail_by_name(coordinator):
    # Rank 0 never splits, rank 1 does: the first part meets the whole and mismatches; the
    # other parts are cancelled with it, so neither rank waits out its timeout.
    a, b = await asyncio.wait_for(asyncio.gather(*(
        gradstar.init_process_group_async(coordinator=coordinator.address, job="cut",
                                          world_size=2, rank=r, timeout=20, join_timeout=20,
                                          split_bytes=split)
        for r, split in ((0, 0), (1, 32 << 20)))), 30)
    try:
        xs = _inputs(2)
        outcomes = await asyncio.wait_for(asyncio.gather(
            a.all_reduce(xs[0]), b.all_reduce(xs[1]), return_exceptions=True), 15)
        assert all(isinstance(o, errors.CollectiveMismatchError) for o in outcomes), outcomes
    finally:
        await close_all([a, b])

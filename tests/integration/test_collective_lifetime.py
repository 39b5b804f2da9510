"""A collective the hub has finished with is freed by reference counting alone: nothing it
holds (the ranks' shared-memory segments, accumulators, queued frames) waits for the cyclic
garbage collector, which may not run for a long time in an idle hub.

The cyclic collector is turned off for each test; a finished collective that is part of a
reference cycle then stays reachable, and the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

import numpy as np
import pytest

from gradstar.errors import CollectiveMismatchError, CollectiveTimeoutError

from .conftest import close_all, join_all

#: How long after its end a collective may still be referenced (the servicer's stream task
#: lets go of it when its generator and reader finish, a few event-loop turns later).
FREED_WITHIN_S = 5.0
POLL_S = 0.05


@contextlib.contextmanager
def no_cyclic_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def record_collectives(coordinator) -> list[weakref.ref]:
    """Weak references to every collective the coordinator's engine opens from now on."""
    refs: list[weakref.ref] = []
    engine = coordinator.engine
    arrive = engine.arrive

    def recording(header, shm=None):
        coll, participant = arrive(header, shm)
        refs.append(weakref.ref(coll))
        return coll, participant

    engine.arrive = recording
    return refs


async def still_alive(refs: list[weakref.ref]) -> int:
    """Collectives of ``refs`` still reachable after FREED_WITHIN_S at most."""
    for _ in range(int(FREED_WITHIN_S / POLL_S)):
        if all(r() is None for r in refs):
            break
        await asyncio.sleep(POLL_S)
    return sum(r() is not None for r in refs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["stream", "shm"])
async def test_a_finished_collective_is_freed_without_the_cyclic_collector(coordinator,
                                                                          shared_memory):
    refs = record_collectives(coordinator)
    with no_cyclic_gc():
        groups = await join_all(coordinator.address, 2, shared_memory=shared_memory)
        try:
            x = np.arange(3 << 20, dtype=np.float32)  # several chunks
            results = await asyncio.wait_for(
                asyncio.gather(*(g.all_reduce(x) for g in groups)), 30)
            assert all(np.array_equal(r, 2 * x) for r in results)
            assert refs, "the engine opened no collective"
            alive = await still_alive(refs)
        finally:
            await close_all(groups)
    assert alive == 0, (f"{alive} of {len(refs)} finished collectives still reachable "
                        f"{FREED_WITHIN_S:g} s after they ended, with the cyclic GC off")


@pytest.mark.timeout(60)
async def test_a_failed_collective_is_freed_without_the_cyclic_collector(coordinator):
    refs = record_collectives(coordinator)
    with no_cyclic_gc():
        groups = await join_all(coordinator.address, 2)
        try:
            # Rank 1 never comes: the collective times out, and its error is kept for rank 1.
            with pytest.raises(CollectiveTimeoutError, match="ranks \\[1\\] never arrived"):
                await asyncio.wait_for(groups[0].all_reduce(np.ones(1 << 20, np.float32),
                                                            timeout=1), 30)
            alive = await still_alive(refs)
        finally:
            await close_all(groups)
    assert refs and alive == 0, (f"{alive} of {len(refs)} failed collectives still reachable "
                                 f"{FREED_WITHIN_S:g} s after they ended, with the cyclic GC off")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared_memory", [False, True], ids=["stream", "shm"])
async def test_a_mismatched_collective_is_freed_without_the_cyclic_collector(coordinator,
                                                                            shared_memory):
    refs = record_collectives(coordinator)
    with no_cyclic_gc():
        groups = await join_all(coordinator.address, 2, shared_memory=shared_memory)
        try:
            # The second header disagrees: its error is raised through the hub's frames, and
            # kept for the ranks that come later, without keeping the collective.
            calls = [groups[0].all_reduce(np.ones(1 << 20, np.float32)),
                     groups[1].all_reduce(np.ones(1 << 19, np.float32))]
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
            assert all(isinstance(o, CollectiveMismatchError) for o in outcomes), outcomes
            alive = await still_alive(refs)
        finally:
            await close_all(groups)
    assert refs and alive == 0, (f"{alive} of {len(refs)} mismatched collectives still "
                                 f"reachable {FREED_WITHIN_S:g} s after they ended, with the "
                                 "cyclic GC off")

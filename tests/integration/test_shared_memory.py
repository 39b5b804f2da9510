"""The same-host fast path: collective payloads through the ranks' shared-memory segments.

Real coordinator (and hub shard processes) on 127.0.0.1:0 and ranks on the same host, so the hub
attaches the segments the ranks offer. Every collective must be bit-identical to the same
collective on the stream (the path ranks on other hosts take), and a hub that does not attach
a segment must cost nothing but speed.
"""

from __future__ import annotations

import numpy as np
import pytest

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

"""Streaming DiLoCo rides through a restart of its coordinator: the replicas' Rounds calls retry
while it is away (client/outer/rounds.py), and the coordinator, started again on the same port
with the same --state-dir, goes on from the global models saved there. Two real replica
processes; their rounds equal the single-process reference of the same algorithm."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar.coordinator.views import rounds_view

from .test_streaming_diloco import Replica, reference, replicas  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(240)


async def test_streaming_diloco_rides_through_a_coordinator_restart(start_coordinator,
                                                                    replicas, tmp_path):  # noqa: F811
    state = tmp_path / "state"
    first = await start_coordinator(state_dir=state)
    sdl = dict(h=6, p=3, tau=2, alpha=0.5, min_replicas=2, round_timeout=60, steps=30)
    for i in range(2):
        replicas.append(await Replica.start(tmp_path, first.address, i, **sdl))
    await replicas[0].reach(12)
    port = first.port
    await first.stop(grace=0)
    await asyncio.sleep(0.5)
    second = await start_coordinator(state_dir=state, port=port)
    results = [await r.result() for r in replicas]
    glob, local = reference(2, 30, 6, 3, 2, 0.5)
    for i, res in enumerate(results):
        assert res["rounds"] == [5, 5, 5], res["rounds"]
        np.testing.assert_allclose(res["global"], glob, rtol=0, atol=2e-6)
        np.testing.assert_allclose(res["params"], local[i], rtol=0, atol=2e-6)
    # The restarted coordinator carried the rounds after the restart, from the saved models on.
    assert [f.rounds for f in rounds_view(second.rounds, "sdl").fragments] == [5, 5, 5]

"""Streaming DiLoCo rides through a restart of its coordinator: the replicas' Rounds calls retry
while it is away (client/outer/rounds.py), and the coordinator, started again on the same port
with the same --state-dir, goes on from the global models saved there; and through a takeover
by a standby coordinator (--ha, a real etcd) sharing that --state-dir, the replicas given both
addresses. Two real replica processes; their rounds equal the single-process reference of the
same algorithm."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from gradstar.coordinator.views import rounds_view

from .conftest import etcd_server, next_line, spawn_standby
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


async def test_streaming_diloco_rides_through_a_takeover_by_a_standby(replicas, tmp_path):  # noqa: F811
    sdl = dict(h=6, p=3, tau=2, alpha=0.5, min_replicas=2, round_timeout=60, steps=30)
    async with etcd_server(tmp_path) as etcd:
        flags = ("--ha-ttl", "2", "--state-dir", str(tmp_path / "state"))
        hubs = [await spawn_standby(etcd, *flags) for _ in range(2)]
        try:
            (old, leader, _), (new, standby, role) = hubs
            assert role == "standby"
            for i in range(2):
                replicas.append(await Replica.start(tmp_path, f"{leader},{standby}", i, **sdl))
            await replicas[0].reach(12)
            old.kill()
            await old.wait()
            await asyncio.wait_for(next_line(new, "gradstar coordinator listening on "), 20)
            results = [await r.result() for r in replicas]
        finally:
            for proc, _, _ in hubs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
    glob, local = reference(2, 30, 6, 3, 2, 0.5)
    for i, res in enumerate(results):
        assert res["rounds"] == [5, 5, 5], res["rounds"]
        np.testing.assert_allclose(res["global"], glob, rtol=0, atol=2e-6)
        np.testing.assert_allclose(res["params"], local[i], rtol=0, atol=2e-6)

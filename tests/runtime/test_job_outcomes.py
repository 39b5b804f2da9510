"""Job outcomes as an operator reads them: ``completed`` when every rank closed its group
cleanly, ``failed`` only for a real failure — in ``gradstar admin`` and in /metrics alike."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from tests.integration.conftest import close_all, join_all

from .conftest import http_get, run_gradstar
from .test_metrics import samples


async def test_clean_close_is_completed_and_a_lost_rank_is_failed(start_coordinator):
    hub = await start_coordinator(metrics_port=0)
    good = await join_all(hub.address, 2, job="good")
    await asyncio.gather(*(g.all_reduce(np.ones(8, np.float32)) for g in good))
    await close_all(good)

    bad = await join_all(hub.address, 2, job="bad")
    # Rank 1's session stream breaks without a goodbye, as when its process dies: a real
    # failure, unlike a close.
    bad[1]._session._call.cancel()
    for _ in range(100):
        if hub.rendezvous.jobs["bad"].state == "failed":
            break
        await asyncio.sleep(0.05)
    await close_all(bad)

    code, out, err = await run_gradstar("admin", "jobs", "--coordinator", hub.address,
                                        "--json", timeout=30)
    assert code == 0, err
    states = {j["job"]: j["state"] for j in json.loads(out)}
    assert states == {"good": "completed", "bad": "failed"}

    code, out, err = await run_gradstar("admin", "status", "--coordinator", hub.address,
                                        "--job", "good", "--interval", "0", timeout=30)
    assert code == 0, err
    assert "job good: completed" in out
    assert "failure" not in out

    status, _, body = await http_get(hub.metrics_port, "/metrics")
    assert status == 200
    got = samples(body.decode())
    assert got[("gradstar_jobs", frozenset({("state", "completed")}))] == 1
    assert got[("gradstar_jobs", frozenset({("state", "failed")}))] == 1

"""gradstar's Quorum communication hook on torch's own DDP over backend "gradstar": 4 real rank
processes of ``torch_backend_script.py``, one of them slow. Its late buckets are dropped, nobody
waits for it, and every rank applies the same means: the replicas stay identical."""

from __future__ import annotations

import asyncio

import pytest

from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator

from . import torch_backend_script as script
from .test_torch_backend import run_ranks

WORLD = 4
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    async def play():
        hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
        await hub.start()
        try:
            return await run_ranks(WORLD, lambda rank: [
                "ranks", "--backend", "gradstar", "--init-method",
                f"gradstar://{hub.address}?job=quorum-hook&timeout=60", "--rank", str(rank),
                "--world-size", str(WORLD), "ddp_quorum_hook"], timeout=200)
        finally:
            await hub.stop(grace=0)

    return [by_scenario["ddp_quorum_hook"] for by_scenario in asyncio.run(play())]


def test_every_rank_applies_the_same_means(reports):
    first = reports[0]["params"]
    assert all(r["params"] == first for r in reports), "replicas differ"
    # Not the rank-0 init it started from: the steps moved the parameters.
    assert first != script.params_of(script.make_mlp(0))


def test_the_slow_ranks_late_buckets_are_dropped(reports):
    slow = reports[WORLD - 1]
    print({r["rank"]: (r["dropped"], r["sent"]) for r in reports})
    assert all(r["sent"] == slow["sent"] > 0 for r in reports)
    # Any rank may be late now and then on a shared machine; the sleeping one is late most.
    assert slow["dropped"] >= 1
    assert slow["dropped"] >= max(r["dropped"] for r in reports[:WORLD - 1])

"""Joins that never form cannot fill the coordinator's job table or its /metrics page.

A token holder can join many distinct jobs and walk away. Such jobs hold nothing worth keeping:
they leave the table with their last joiner, are evicted first when the table is full, and have
no metric series. /metrics stays under its byte bound whatever the number of jobs.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gradstar.proto.v1 import rendezvous_pb2 as rpb
from gradstar.proto.v1 import rendezvous_pb2_grpc
from tests.integration.conftest import close_all, join_all

from .conftest import http_get

#: Joins in flight at once during a flood.
FLOOD_CONCURRENCY = 50


async def abandoned_join(stub, job: str) -> grpc.StatusCode:
    """Join ``job`` (world size 2) alone with a 50 ms join timeout: the status it ends with."""
    request = rpb.SessionRequest(join=rpb.JoinRequest(
        job=job, world_size=2, rank=0, peer_address="", timeout_seconds=0.05))
    call = stub.Session(iter([request]), timeout=10)
    try:
        await call.read()
    except grpc.aio.AioRpcError as error:
        return error.code()
    finally:
        call.cancel()
    return grpc.StatusCode.OK


async def flood(address: str, count: int, prefix: str = "abandoned") -> dict:
    """``count`` abandoned joins of distinct jobs: how many ended with each status."""
    codes: dict[grpc.StatusCode, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        for start in range(0, count, FLOOD_CONCURRENCY):
            batch = range(start, min(start + FLOOD_CONCURRENCY, count))
            for code in await asyncio.gather(*(abandoned_join(stub, f"{prefix}-{i}")
                                               for i in batch)):
                codes[code] = codes.get(code, 0) + 1
    return codes


@pytest.mark.timeout(120)
async def test_a_flood_of_abandoned_joins_never_locks_a_new_job_out(start_coordinator):
    hub = await start_coordinator(max_jobs=20)
    codes = await asyncio.wait_for(flood(hub.address, 600), 90)
    # Each one ran into its own join timeout, or was evicted (more of them wait at once than
    # the table holds): the flood itself never leaves the table full.
    assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(hub.rendezvous.jobs) == 0
    groups = await join_all(hub.address, 2, job="after-the-flood", join_timeout=10)
    try:
        x = np.arange(1000, dtype=np.float32)
        results = await asyncio.wait_for(asyncio.gather(*(g.all_reduce(x) for g in groups)), 20)
    finally:
        await close_all(groups)
    assert all(np.array_equal(r, 2 * x) for r in results)


@pytest.mark.timeout(120)
async def test_metrics_stay_under_their_bound_under_a_flood_and_many_jobs(start_coordinator):
    bound = 64 << 10
    hub = await start_coordinator(metrics_port=0, metrics_max_bytes=bound)
    await asyncio.wait_for(flood(hub.address, 1000), 90)
    # Joins still waiting (never to form) during the scrape, too.
    waiting = asyncio.ensure_future(flood(hub.address, 20, prefix="waiting"))
    # Real jobs, each with series per rank: more of them than fit in the bound.
    for i in range(24):
        (g,) = await join_all(hub.address, 1, job=f"real-{i}")
        await asyncio.wait_for(g.all_reduce(np.ones(10, np.float32)), 20)
        await close_all([g])
    status, _, body = await http_get(hub.metrics_port, "/metrics")
    await asyncio.wait_for(waiting, 30)
    text = body.decode()
    assert status == 200
    assert len(body) <= bound, f"/metrics is {len(body)} bytes, over its bound of {bound}"
    assert 'job="abandoned-' not in text and 'job="waiting-' not in text
    got = {(s.name, frozenset(s.labels.items())): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    shown = {labels["job"] for (name, labels) in
             ((n, dict(ls)) for n, ls in got) if name == "gradstar_job_world_size"}
    omitted = got[("gradstar_metrics_jobs_omitted", frozenset())]
    assert omitted > 0 and len(shown) + omitted == 24, (len(shown), omitted)
    # A job is shown whole or not at all.
    assert {dict(ls)["job"] for n, ls in got
            if n == "gradstar_rank_last_arrivals_total"} == shown

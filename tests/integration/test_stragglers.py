"""Naming the straggler: three real rank processes, one of which sleeps a fixed delay before
every all_reduce, on a plain coordinator and on one whose collectives are striped over two hub
shards (``--shards 2``: the shards measure and report, the coordinator merges).

What must hold wherever the collectives ran: the late rank is first and the only one flagged,
with a lag close to the delay (a loose band: scheduling noise, never a timing claim) in every
view — Admin.GetStragglers, /metrics, /status.json, the ranks' own ``pg.straggler_stats()`` —
each collective counted once, and each rank's log names it, once in its window.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import grpc
import pytest

from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc

from .conftest import finish, spawn_ranks

WORLD = 3
SLOW = 2
DELAY = 0.2
ROUNDS = 10


async def http_get(port: int, path: str) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return (await asyncio.wait_for(reader.read(), 10)).decode().partition("\r\n\r\n")[2]
    finally:
        writer.close()


async def stragglers(coordinator, job: str) -> admin_pb2.GetStragglersResponse:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        return await admin_pb2_grpc.AdminStub(channel).GetStragglers(
            admin_pb2.GetStragglersRequest(job=job), timeout=5)


def check_ranks(ranks, world: int = WORLD) -> None:
    """``ranks`` (messages or dicts, slowest first) name SLOW alone, with its delay."""
    get = (lambda r, f: r[f]) if isinstance(ranks[0], dict) else getattr
    assert get(ranks[0], "rank") == SLOW
    assert [get(r, "rank") for r in ranks if get(r, "flagged")] == [SLOW]
    assert sorted(get(r, "rank") for r in ranks) == list(range(world))
    assert all(get(r, "collectives") == ROUNDS for r in ranks)  # each collective once
    slow = ranks[0]
    assert 0.7 * DELAY <= get(slow, "median_lag_seconds") <= DELAY + 0.15
    assert 0.7 * DELAY <= get(slow, "ewma_lag_seconds") <= DELAY + 0.15
    assert get(slow, "last_share") >= 0.8
    assert 0.7 * DELAY * ROUNDS <= get(slow, "waited_seconds") <= (DELAY + 0.15) * ROUNDS
    assert get(slow, "host") == socket.gethostname()
    for other in ranks[1:]:
        assert get(other, "median_lag_seconds") < DELAY / 2
        assert get(other, "waited_seconds") < DELAY


@pytest.mark.parametrize("shards", [0, 2])
async def test_a_late_rank_is_named_wherever_its_collectives_run(start_coordinator, shards):
    coordinator = await start_coordinator(shards=shards, metrics_port=0)
    job = f"late-{shards}"
    procs = await spawn_ranks("late_rank", coordinator.address, WORLD, job, str(SLOW),
                              str(DELAY), str(ROUNDS), GRADSTAR_CHUNK_BYTES=256,
                              GRADSTAR_STRAGGLER_LOG_SECONDS=DELAY / 2,
                              GRADSTAR_STRAGGLER_LOG_WINDOW=600)
    results = [await finish(p, 60) for p in procs]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    if shards:
        assert len(coordinator.shards.up) == shards
        # Striped over both shards: they measured it (stripe 0's), not the coordinator.
        assert coordinator.engine.metrics.arrivals.ranks(job) == {}
    # What each rank read through pg.straggler_stats().
    for _, out, _ in results:
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["job"] == job and seen["ranks_total"] == WORLD
        check_ranks(seen["ranks"])
    # The admin view (the coordinator's merge of its own and its shards' measurements).
    deadline = time.monotonic() + 5
    while True:
        reply = await stragglers(coordinator, job)
        if all(r.collectives == ROUNDS for r in reply.ranks) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    check_ranks(list(reply.ranks))
    # /status.json and /metrics show the same.
    status = json.loads(await http_get(coordinator.metrics_port, "/status.json"))
    (mine,) = [j for j in status["jobs"] if j["name"] == job]
    check_ranks(mine["stragglers"])
    page = await http_get(coordinator.metrics_port, "/metrics")
    lasts = {int(m[1]): int(m[2]) for m in re.finditer(
        rf'gradstar_rank_last_arrivals_total{{job="{job}",rank="(\d+)"}} (\d+)', page)}
    assert lasts[SLOW] >= 0.8 * ROUNDS and sum(lasts.values()) == ROUNDS
    counts = re.findall(rf'gradstar_rank_arrival_lag_seconds_count{{job="{job}",rank="\d+"}} '
                        rf"{ROUNDS}\b", page)
    assert len(counts) == WORLD
    # Every rank's log names the late rank and its host, once in its (long) window.
    for _, _, err in results:
        lines = [line for line in err.splitlines() if "waited for rank" in line]
        assert len(lines) == 1, err[-3000:]
        assert f"of job '{job}' waited for rank {SLOW} (host {socket.gethostname()})" in lines[0]
        assert "rank 0 " not in lines[0] and "rank 1 " not in lines[0]

"""Real rank processes against a real coordinator: exact results, and a rank killed mid-flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .conftest import finish, spawn_coordinator, spawn_ranks


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


async def test_four_rank_processes_get_exact_results_for_every_collective(coordinator):
    procs = await spawn_ranks("collectives", coordinator.address, 4, "exact")
    results = [await finish(p, 90) for p in procs]
    for code, out, err in results:
        assert code == 0, f"rank failed: {out}\n{err[-2000:]}"
        report = last_json(out)
        assert all(report["checks"].values()), report
    assert sorted(last_json(out)["rank"] for _, out, _ in results) == [0, 1, 2, 3]


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return reply.status


#: The hub's heartbeat timeout in these tests, and the bound on "at once": a lost rank or hub is
#: named through its broken stream (or missed keepalive pings, ~3 s), which a loaded machine
#: delays by a second or two; only a heartbeat timeout (or the collective's, 300 s) would take
#: longer than SOON. (A wall-clock bound only as far as it tells those two apart.)
HEARTBEAT = 30.0
SOON = HEARTBEAT / 2

async def test_a_sender_killed_mid_message_fails_the_receive_with_rank_lost_at_once(
        start_coordinator):
    # Without the kill landing mid-message the receive would fail the same way; with it, the
    # peer stream ends half-way through a message, which must read as the sender lost (not a
    # protocol error) and deliver nothing of the cut message.
    coordinator = await start_coordinator(heartbeat_timeout=HEARTBEAT)
    procs = await spawn_ranks("recv_until_error", coordinator.address, 2, "kill-sender")
    sender = procs[1]
    try:
        for _ in range(2):  # two messages through: the stream is warm, the next one is going
            progress = await asyncio.wait_for(sender.stdout.readline(), 60)
            assert b"progress" in progress
        await asyncio.sleep(0.05)
        sender.send_signal(signal.SIGKILL)
        lost_at = time.time()
        code, out, err = await finish(procs[0], 30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            sender.kill()
        await sender.communicate()
    assert code == 0, err[-2000:]
    report = last_json(out)
    assert report["error"] == "RankLostError", report
    assert report["lost_rank"] == 1, report
    assert report["failed_at"] - lost_at < SOON, report


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_rank_lost_mid_allreduce_fails_survivors_before_any_timeout(start_coordinator, how):
    # A frozen (SIGSTOP) rank answers no keepalive ping: the transport is dropped within ~3 s,
    # long before the 30 s heartbeat timeout set here could fire.
    coordinator = await start_coordinator(heartbeat_timeout=HEARTBEAT)
    procs = await spawn_ranks("allreduce_until_error", coordinator.address, 4, "kill")
    for report in await survivors_of_a_lost_rank(procs, 2, how):
        assert "rank 2" in report["message"]
    assert await health_status(coordinator.address) == health_pb2.HealthCheckResponse.SERVING


async def survivors_of_a_lost_rank(procs: list[asyncio.subprocess.Process], victim: int,
                                   how: signal.Signals) -> list[dict]:
    """Once rank ``victim`` (an ``allreduce_until_error`` rank) is mid-loop, kill or freeze it
    with ``how``; every other rank must end cleanly, reporting RankLostError naming it
    ``SOON`` (the hub's heartbeat timeout must be ``HEARTBEAT``). Their reports."""
    proc = procs[victim]
    assert b"progress" in await asyncio.wait_for(proc.stdout.readline(), 60)
    await asyncio.sleep(0.2)
    proc.send_signal(how)
    lost_at = time.time()
    try:
        survivors = [await finish(p, 30) for i, p in enumerate(procs) if i != victim]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.communicate()
    reports = []
    for code, out, err in survivors:
        assert code == 0, err[-2000:]
        report = last_json(out)
        assert report["error"] == "RankLostError", report
        assert report["lost_rank"] == victim, report
        assert report["failed_at"] - lost_at < SOON, report
        reports.append(report)
    return reports


async def test_coordinator_death_gives_ranks_a_named_error_quickly():
    await ranks_named_a_lost_coordinator(signal.SIGKILL, within=SOON)


async def ranks_named_a_lost_coordinator(how: signal.Signals, *args: str, within: float) -> None:
    """A coordinator process with 2 ``allreduce_until_error`` ranks (``args`` passed on) that
    do not ride through restarts (``reconnect_timeout`` 0: tests/integration/test_ride_through.py
    has those) is killed or frozen with ``how`` mid-loop: every rank must end cleanly, reporting
    CoordinatorUnavailableError naming its address within ``within`` seconds."""
    proc, address = await spawn_coordinator()
    ranks = await spawn_ranks("allreduce_until_error", address, 2, "orphans", *args,
                              GRADSTAR_RECONNECT_TIMEOUT=0)
    try:
        await asyncio.wait_for(ranks[0].stdout.readline(), 60)
        proc.send_signal(how)
        lost_at = time.time()
        for code, out, err in [await finish(r, 30 + within) for r in ranks]:
            assert code == 0, err[-2000:]
            report = last_json(out)
            assert report["error"] == "CoordinatorUnavailableError", report
            assert address in report["message"]
            assert report["failed_at"] - lost_at < within, report
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                r.kill()

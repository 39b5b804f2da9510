"""One failure policy for every road a collective takes (gradstar.client.collective.failure):
the same fault ends a small all_reduce with the same named error whether it ran on the group's
loop (the stream road), on the caller's thread (the direct lane) or as torch's waited
``dist.all_reduce(t)`` over backend "gradstar". Real coordinator and rank processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import pytest

from .conftest import finish, rank_env, spawn_coordinator
from .test_multiprocess import HEARTBEAT, last_json

SCRIPT = Path(__file__).with_name("roads_script.py")
ROADS = ["stream", "direct", "torch"]
#: What every rank that fails reports, by fault: the same on every road. A killed hub that
#: never comes back is ridden through for RECONNECT seconds, then named (client/reconnect.py).
NAMED = {"mismatch": "CollectiveMismatchError", "timeout": "CollectiveTimeoutError",
         "rank": "RankLostError", "hub": "CoordinatorLostError"}
RECONNECT = 2.0

pytestmark = pytest.mark.timeout(180)


async def spawn(road: str, fault: str, address: str) -> list[asyncio.subprocess.Process]:
    return [await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), road, fault,
        env=rank_env(address, f"{road}-{fault}", 2, r, GRADSTAR_RECONNECT_TIMEOUT=RECONNECT),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE) for r in range(2)]


async def progressed(proc: asyncio.subprocess.Process) -> None:
    """Wait until ``proc`` printed its first progress line (a round went through)."""
    line = await asyncio.wait_for(proc.stdout.readline(), 90)
    assert b"progress" in line, line


def reported(result: tuple[int, str, str]) -> dict:
    code, out, err = result
    assert code == 0, err[-2000:]
    return last_json(out)


async def run_fault(road: str, fault: str) -> list[dict]:
    """Two ranks on ``road`` against a coordinator process, ``fault`` injected: the reports of
    the ranks that see it fail (both, or rank 0 where rank 1 is the fault)."""
    hub, address = await spawn_coordinator("--heartbeat-timeout", str(HEARTBEAT))
    ranks = await spawn(road, fault, address)
    try:
        if fault == "rank":
            await progressed(ranks[1])
            ranks[1].send_signal(signal.SIGKILL)
            return [reported(await finish(ranks[0], 60))]
        if fault == "hub":
            await progressed(ranks[0])
            hub.send_signal(signal.SIGKILL)
            return [reported(await finish(r, 60)) for r in ranks]
        if fault == "timeout":
            first = reported(await finish(ranks[0], 60))
            ranks[1].stdin.write(b"go\n")  # rank 0 has failed: rank 1 may leave
            assert reported(await finish(ranks[1], 60))["error"] is None
            return [first]
        return [reported(await finish(r, 60)) for r in ranks]
    finally:
        for proc in (hub, *ranks):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


@pytest.mark.parametrize("fault", list(NAMED))
@pytest.mark.parametrize("road", ROADS)
async def test_the_same_fault_ends_every_road_with_the_same_named_error(road, fault):
    for report in await run_fault(road, fault):
        assert report["error"] == NAMED[fault], report
        if fault == "rank":
            assert report["lost_rank"] == 1, report
        if fault == "timeout":
            assert "Timed out" in report["message"], report
        if road != "torch" and report["rounds"]:  # the rounds before took the road named
            assert (report["direct"] > 0) == (road == "direct"), report

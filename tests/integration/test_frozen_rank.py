"""A rank frozen (SIGSTOP) long enough for the hub to give up on it, then thawed, learns that
it was lost from its generation: a named error naming itself, never a bare transport status
such as INTERNAL ("Internal error from Core") or a claim that the coordinator went away.

Heartbeats time out after 2 s here, so a freeze of 4 s is past the hub's heartbeat timeout and
one of 8 s past its keepalive too (1 s pings, a 4 s ping timeout); the two freezes cover the
hub ending the session by either before the rank thaws.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import pytest

from .conftest import finish, spawn_ranks


@pytest.mark.timeout(90)
@pytest.mark.parametrize("freeze_s", [4.0, 8.0])
async def test_a_rank_thawed_after_the_hub_ended_its_session_gets_a_named_error(
        start_coordinator, freeze_s):
    coordinator = await start_coordinator(heartbeat_timeout=2.0)
    ranks = await spawn_ranks("allreduce_until_error", coordinator.address, 2, "frozen")
    try:
        for _ in range(2):  # a couple of collectives first: both ranks are in step
            line = await asyncio.wait_for(ranks[1].stdout.readline(), 60)
            assert b"progress" in line, line
        ranks[1].send_signal(signal.SIGSTOP)
        await asyncio.sleep(freeze_s)
        ranks[1].send_signal(signal.SIGCONT)
        reports = []
        for rank in ranks:
            code, out, err = await finish(rank, 60)
            reports.append(json.loads(out.strip().splitlines()[-1]))
            assert code == 0, err[-2000:]
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                rank.send_signal(signal.SIGCONT)
                rank.kill()
            await rank.wait()
    survivor, thawed = reports
    assert survivor["error"] == "RankLostError" and survivor["lost_rank"] == 1, survivor
    assert "INTERNAL" not in thawed["message"], thawed
    assert thawed["error"] == "RankLostError", thawed
    assert thawed["lost_rank"] == 1, thawed
    assert "rank 1 of job 'frozen'" in thawed["message"], thawed

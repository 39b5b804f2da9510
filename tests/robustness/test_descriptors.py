"""The hub's open descriptors return to their count before a soak of failed collectives: ranks
killed with SIGKILL in the middle of all_reduces, and collectives cancelled by their caller in a
process that then closes its groups and keeps the group objects (as a training script holds its
``pg`` after ``pg.close()``).

Before the fix, each closed group of a live process kept its session's TCP connection open (an
ended gRPC call still references its transport until the call object is freed, and the group kept
the call), so the hub held one socket per closed group for as long as the group object lived:
+6 descriptors after this soak, 25 s after its last collective. The coordinator runs as its own
process (``conftest.start_hub``) and its descriptors are read from ``/proc/PID/fd``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import numpy as np
import pytest

import gradstar

from ..integration.conftest import finish, spawn_ranks

#: Rounds of the soak: each kills a rank mid-collective and cancels a collective in-process.
ROUNDS = 3
#: How long the hub may take to let go of what the soak left (its sweep runs every 0.5 s; gRPC
#: notices a closed connection at once), with room for a loaded machine.
RELEASE_WITHIN_S = 20.0


def descriptors(pid: int) -> dict[int, str]:
    """Process ``pid``'s open descriptors and what each refers to (``/proc/PID/fd``)."""
    held = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            held[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return held


async def kill_a_rank_mid_collective(address: str, job: str) -> None:
    ranks = await spawn_ranks("allreduce_until_error", address, 2, job)
    try:
        for _ in range(2):
            line = await asyncio.wait_for(ranks[1].stdout.readline(), 60)
            assert b"progress" in line, line
        ranks[1].send_signal(signal.SIGKILL)
        _, out, _ = await finish(ranks[0], 60)
        assert json.loads(out.strip().splitlines()[-1])["error"] == "RankLostError"
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                rank.kill()
            await rank.wait()


async def cancel_collectives(address: str, job: str) -> list:
    """Two ranks in this process: rank 0's all_reduce is cancelled before rank 1 joins it,
    then both start one and both are cancelled; the groups are closed and returned."""
    groups = await asyncio.wait_for(asyncio.gather(*(
        gradstar.init_process_group_async(coordinator=address, job=job, world_size=2, rank=r,
                                          timeout=30, join_timeout=20) for r in range(2))), 30)
    x = np.ones(4 << 20, np.float32)
    for callers in ((groups[0],), groups):
        calls = [asyncio.ensure_future(g.all_reduce(x)) for g in callers]
        await asyncio.sleep(0.2)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    await asyncio.wait_for(asyncio.gather(*(g.close() for g in groups)), 20)
    return groups


@pytest.mark.timeout(150)
async def test_hub_descriptors_return_to_baseline_after_killed_and_cancelled_collectives(hub):
    proc, address = hub
    baseline = descriptors(proc.pid)
    # Held until the test ends, as a script holds its closed groups.
    closed_groups: list = []
    for i in range(ROUNDS):
        await kill_a_rank_mid_collective(address, f"fd-soak-killed-{i}")
        closed_groups += await cancel_collectives(address, f"fd-soak-cancelled-{i}")
    for _ in range(int(RELEASE_WITHIN_S / 0.2)):
        if len(held := descriptors(proc.pid)) <= len(baseline):
            break
        await asyncio.sleep(0.2)
    extra = {fd: what for fd, what in held.items() if baseline.get(fd) != what}
    assert len(held) <= len(baseline), (
        f"{RELEASE_WITHIN_S:g} s after the soak the hub holds {len(held)} descriptors, "
        f"{len(baseline)} before it; new: {extra}")

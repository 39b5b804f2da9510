"""Synchronous DDP across takeovers by standby coordinators (``gradstar coordinator --ha``,
coordinator/leadership/): a real etcd, two coordinator processes sharing a ``--state-dir``,
three DDP rank processes given both addresses. The leader is killed (SIGKILL) after step 4,
the standby takes over and the killed one is started again on its port as the new standby;
as soon as it stands by, the new leader is killed and the first one takes over again (the
steps are paced so that the job is still training then). No rank process
exits or raises, each rides through twice (one log line each), and every rank's final
parameters are bitwise those of the others and, within float32 rounding, those of one
process trained on every rank's batches: what an undisturbed run ends with."""

from __future__ import annotations

import asyncio
import sys

import pytest

from gradstar.worker.admin.client import AdminClient
from tests.integration.conftest import etcd_server, next_line, spawn_standby

from .conftest import finish, kill_all, kill_coordinators, rank_env, rank_lines
from .test_ride_through_ddp import SCRIPT, WORLD, ended_as_the_reference, rode_through_once

pytestmark = pytest.mark.timeout(300)

#: Steps, and seconds between them: long enough (10 s) to outlast the first takeover and the
#: killed coordinator's start as standby (a few seconds on a loaded machine).
STEPS, PAUSE = 24, 0.4
#: The step after which the first leader is killed, the takeovers, the lease of each leader.
FIRST_KILL, KILLS, TTL = 4, 2, 2


async def train_across_takeovers(tmp_path) -> tuple[list[list[dict]], list[str]]:
    """Each rank's JSON lines and its stderr, over the run the module docstring describes."""
    async with etcd_server(tmp_path) as etcd:
        flags = ("--ha-ttl", str(TTL), "--state-dir", str(tmp_path / "state"))
        hubs = [await spawn_standby(etcd, *flags) for _ in range(2)]
        assert [role for _, _, role in hubs] == ["leader", "standby"]
        addresses = [address for _, address, _ in hubs]
        procs = []
        try:
            for rank in range(WORLD):
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, str(SCRIPT), str(STEPS), str(PAUSE),
                    env=rank_env(",".join(addresses), "standby-ddp", WORLD, rank,
                                 GRADSTAR_RECONNECT_TIMEOUT=60),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
            for _ in range(FIRST_KILL + 1):
                line = await asyncio.wait_for(procs[0].stdout.readline(), 90)
                assert line.startswith(b"step"), line
            for k in range(KILLS):
                leader, standby = k % 2, (k + 1) % 2
                hubs[leader][0].kill()
                await hubs[leader][0].wait()
                await asyncio.wait_for(next_line(hubs[standby][0],
                                                 "gradstar coordinator listening on "), 30)
                port = addresses[leader].rsplit(":", 1)[1]
                hubs[leader] = await spawn_standby(etcd, *flags, "--port", port)
                assert hubs[leader][1:] == (addresses[leader], "standby")
                # Every rank back (the new leader rebuilt the generation) before the next kill:
                # else a slow rank's one ride through would span both takeovers.
                await until_rebuilt(addresses[standby])
            results = await asyncio.gather(*(finish(p, 120) for p in procs),
                                           return_exceptions=True)
        finally:
            await kill_all(procs)
            await kill_coordinators(hubs)
    lines = [rank_lines(rank, result) for rank, result in enumerate(results)]
    return lines, [result[2] for result in results]


async def until_rebuilt(address: str, seconds: float = 60) -> None:
    """Wait until the leader at ``address`` took the job's generation back from its ranks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    async with AdminClient(address) as admin:
        while (await admin.leadership()).rebuilds < 1:
            assert loop.time() < deadline, f"no rebuild at {address} within {seconds:g} s"
            await asyncio.sleep(0.1)


def test_synchronous_ddp_trains_on_across_two_takeovers(tmp_path):
    lines, stderrs = asyncio.run(train_across_takeovers(tmp_path))
    rode_through_once(lines, stderrs, times=KILLS)
    ended_as_the_reference(lines, STEPS)

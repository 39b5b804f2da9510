"""Synchronous DDP across takeovers by standby coordinators (``gradstar coordinator --ha``,
coordinator/leadership/): a real etcd, two coordinator processes sharing a ``--state-dir``,
three DDP rank processes given both addresses. The leader is killed (SIGKILL) after step 4,
the standby takes over and the killed one is started again on its port as the new standby;
after step 9 the new leader is killed and the first one takes over again. No rank process
exits or raises, each rides through twice (one log line each), and every rank's final
parameters are bitwise those of the others and, within float32 rounding, those of one
process trained on every rank's batches: what an undisturbed run ends with."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import numpy as np
import pytest

from tests.integration.conftest import etcd_server, next_line, spawn_standby

from .conftest import finish, kill_all, rank_env, rank_lines
from .test_ride_through_ddp import PAUSE, SCRIPT, STEPS, WORLD, reference

pytestmark = pytest.mark.timeout(300)

#: The steps after which the leader of the moment is killed; the lease of each leader.
KILLS, TTL = (4, 9), 2


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
            done = 0
            for k, after in enumerate(KILLS):
                for _ in range(after + 1 - done):
                    line = await asyncio.wait_for(procs[0].stdout.readline(), 90)
                    assert line.startswith(b"step"), line
                done = after + 1
                leader, standby = k % 2, (k + 1) % 2
                hubs[leader][0].kill()
                await hubs[leader][0].wait()
                await asyncio.wait_for(next_line(hubs[standby][0],
                                                 "gradstar coordinator listening on "), 30)
                port = addresses[leader].rsplit(":", 1)[1]
                hubs[leader] = await spawn_standby(etcd, *flags, "--port", port)
                assert hubs[leader][1:] == (addresses[leader], "standby")
            results = await asyncio.gather(*(finish(p, 120) for p in procs),
                                           return_exceptions=True)
        finally:
            await kill_all(procs)
            for proc, _, _ in hubs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGKILL)
                await proc.wait()
    lines = [rank_lines(rank, result) for rank, result in enumerate(results)]
    return lines, [result[2] for result in results]


def test_synchronous_ddp_trains_on_across_two_takeovers(tmp_path):
    lines, stderrs = asyncio.run(train_across_takeovers(tmp_path))
    for report, err in zip(lines, stderrs, strict=True):
        assert len(report[-1]["reconnects"]) == len(KILLS), report[-1]["reconnects"]
        assert err.count("rejoined the coordinator at") == len(KILLS), err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    finals = [[np.array(p, np.float32) for p in rank[-1]["params"]] for rank in lines]
    for rank in range(WORLD):
        assert all(np.array_equal(a, b) for a, b in zip(finals[0], finals[rank], strict=True))
    expected = asyncio.run(reference())
    for got, want in zip(finals[0], expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

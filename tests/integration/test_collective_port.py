"""The coordinator's collective port: collectives' tensors on a server of their own.

Its connections keep a long keepalive, so that pings queued behind MBs of tensors on a full link
do not drop them, while the sessions' port keeps the 2 s pings that find lost ranks (why:
gradstar.transport.channels; measured with benchmarks/cluster.py, hub on rank 0's host, 4 hosts
x 2 ranks, 64 MiB). Here: ranks are told the port and use it, it asks for the job token as the
main port does, a taken port is named, and a rank told nothing still reaches the main port.
"""

from __future__ import annotations

import asyncio
import socket
import sys

import grpc
import numpy as np
import pytest

from gradstar.client.collective import DataPlane
from gradstar.config import ClientSettings, CoordinatorSettings
from gradstar.coordinator import Coordinator

from .conftest import close_all, join_all
from .test_auth import write_then_read


async def test_ranks_send_collectives_to_the_port_the_coordinator_names(coordinator):
    assert coordinator.collective_port not in (None, 0, coordinator.port)
    groups = await join_all(coordinator.address, 2, job="port")
    try:
        for g in groups:
            assert g._plane.collectives == f"127.0.0.1:{coordinator.collective_port}"
        sums = await asyncio.gather(*(g.all_reduce(np.full(1000, g.rank + 1.0, np.float32))
                                      for g in groups))
        for s in sums:
            np.testing.assert_array_equal(s, np.full(1000, 3.0, np.float32))
    finally:
        await close_all(groups)


async def test_the_collective_port_asks_for_the_job_token(start_coordinator):
    coordinator = await start_coordinator(token="job-token")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.collective_port}") as channel:
        code, detail = await write_then_read(channel)
    assert code == grpc.StatusCode.UNAUTHENTICATED, detail


async def test_a_taken_collective_port_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        coordinator = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0,
                                                      collective_port=port))
        with pytest.raises(OSError, match="collective port"):
            await coordinator.start()
        await coordinator.stop(grace=0)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port",
            "0", "--collective-port", str(port), stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0
    assert "--collective-port" in err.decode(), err.decode()


async def test_a_rank_told_no_collective_port_uses_the_coordinators_own(coordinator):
    # A coordinator of an earlier version names no port: the rank's collectives go where its
    # session goes, and the coordinator still serves them there.
    settings = ClientSettings(coordinator=coordinator.address, job="old", world_size=1, rank=0)
    plane = DataPlane(settings, [], "")
    try:
        assert plane.collectives == coordinator.address
        await plane.connect(10)
    finally:
        await plane.close()
    groups = await join_all(coordinator.address, 1, job="old")
    try:
        groups[0]._plane = DataPlane(groups[0]._plane.settings, [], "")
        out = await groups[0].all_reduce(np.arange(10, dtype=np.int64))
        np.testing.assert_array_equal(out, np.arange(10))
    finally:
        await close_all(groups)

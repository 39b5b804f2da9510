"""Node-local shards register with the job token (ShardControl.RegisterForJob).

Whatever starts a job's ranks on a host starts a shard for that job there (gradstar.node_shard),
holding the tokens the ranks hold. A coordinator with an admin token of its own opens
``Register`` to that token only, so node-local shards used to be refused wherever ranks had no
admin token (docker-compose's workers, pods of a Kubernetes job), and every byte went through
the coordinator's link. A shard for one job carries only that job's generations — nothing a
rank of the job cannot see — so the job token registers it; a shard for every job still needs
the admin token, and a job-token shard never takes over a slot another shard left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import numpy as np
import pytest

from gradstar.proto.v1 import shard_pb2 as spb
from gradstar.proto.v1 import shard_pb2_grpc
from gradstar.transport.auth import bearer

from .conftest import close_all, join_all

JOB, ADMIN = "job-secret", "admin-secret"


async def start_shard(coordinator: str, *args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "shard", "--coordinator", coordinator,
        "--host", "127.0.0.1", "--port", "0", *args, env={**env, "GRADSTAR_TOKEN": JOB},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def wait_for(condition, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_shard_for_one_job_registers_with_the_job_token_and_carries_that_job(
        start_coordinator):
    coordinator = await start_coordinator(token=JOB, admin_token=ADMIN)
    shard = await start_shard(coordinator.address, "--for-job", "train")
    try:
        await wait_for(lambda: len(coordinator.shards.up) == 1, 30)
        record = coordinator.shards.up[0]
        assert record.job == "train"
        groups = await join_all(coordinator.address, 2, job="train", token=JOB)
        others = await join_all(coordinator.address, 2, job="another", token=JOB)
        try:
            assert all(g.shards == [record.address] for g in groups)
            assert all(g.shards == [] for g in others)  # the coordinator carries other jobs
            sums = await asyncio.gather(*(g.all_reduce(np.arange(5000, dtype=np.int64) * g.rank)
                                          for g in groups))
            for s in sums:
                np.testing.assert_array_equal(s, np.arange(5000))
        finally:
            await close_all(groups + others)
        await wait_for(lambda: record.stats.bytes_in > 0, 5)
    finally:
        shard.send_signal(signal.SIGTERM)
        await asyncio.wait_for(shard.wait(), 10)


async def test_the_job_token_registers_no_shard_for_every_job(start_coordinator):
    coordinator = await start_coordinator(token=JOB, admin_token=ADMIN)
    shard = await start_shard(coordinator.address)
    _, err = await asyncio.wait_for(shard.communicate(), 30)
    assert shard.returncode == 1
    assert "refused" in err.decode() and "admin token wrong" in err.decode(), err.decode()
    assert coordinator.shards.slots == {}


async def test_a_job_shard_names_its_job_and_never_takes_a_slot_another_shard_left(
        start_coordinator):
    coordinator = await start_coordinator(token=JOB, admin_token=ADMIN)
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = shard_pb2_grpc.ShardControlStub(channel)

        def hello(**fields):
            return iter([spb.ShardReport(hello=spb.ShardHello(**fields))])

        everyone = stub.Register(hello(address="127.0.0.1:1", slot=0),
                                 metadata=bearer(ADMIN), timeout=20)
        assert (await everyone.read()).accepted.slot == 0
        everyone.cancel()  # its stream ends: slot 0 is lost, kept for the shard to come back
        await wait_for(lambda: coordinator.shards.slots[0].state == "lost", 10)

        for_job = stub.RegisterForJob(hello(address="127.0.0.1:2", slot=0, job="train"),
                                      metadata=bearer(JOB), timeout=20)
        assert (await for_job.read()).accepted.slot == 1
        for_job.cancel()

        nameless = stub.RegisterForJob(hello(address="127.0.0.1:3", slot=-1),
                                       metadata=bearer(JOB), timeout=20)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await nameless.read()
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS  # ProtocolError's code
    assert "names no job" in refused.value.details()

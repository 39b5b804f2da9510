"""The Steps service (DDP sync modes) keeps its memory inside ``--max-steps-bytes``, measured on
a real hub process: uploads that announce more than they send (snapshot headers, stalled
gradient streams) reserve their declared size before anything is allocated and are refused
past the job's share; another job's steps go on meanwhile; and once the uploads are gone the
hub hands the memory back to the system."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np
import pytest

from gradstar.client.steps import StepsClient
from gradstar.proto.v1 import steps_pb2 as pb
from gradstar.proto.v1 import steps_pb2_grpc
from gradstar.sync_modes import Quorum
from tests.integration.conftest import until

from .test_memory import MIB, RssSampler, groups_of, rss

T = 20.0  # every call's deadline
BOUND = 64 * MIB  # --max-steps-bytes; a job's share is half of it
SNAPSHOT = 8 * MIB  # each stalled snapshot upload announces this much
GRADIENT = MIB  # values each stalled gradient announces (4 MiB)
MODE = Quorum(min_ranks=2, timeout=30.0)


def key_of(pg, model: str) -> pb.StepsKey:
    return pb.StepsKey(job=pg.job, model=model, rank=pg.rank, generation=pg.generation,
                       member_id=pg.member_id)


async def stalled_snapshot(stub, key: pb.StepsKey, hold: asyncio.Event):
    async def parts():
        yield pb.SnapshotPart(header=pb.SnapshotHeader(key=key, steps=0, layout="{}",
                                                       nbytes=SNAPSHOT))
        await hold.wait()  # never sends the data

    return await stub.PutSnapshot(parts(), timeout=60)


async def stalled_gradient(stub, key: pb.StepsKey, hold: asyncio.Event):
    async def parts():
        # A sixteenth of it, in its opening message: a refusal answers the header at once, and
        # a write still in flight then would fail as INTERNAL (grpc/grpc#36066). (What gRPC
        # itself buffers per stream before the handler reads it is its window's business.)
        yield pb.ContributionPart(header=pb.ContributionHeader(
            key=key, mode=MODE.message(), numel=GRADIENT, base=0, weight=1.0),
            data=np.ones(GRADIENT // 16, np.float32).tobytes())
        await hold.wait()

    return [p async for p in stub.Contribute(parts(), timeout=60)]


async def refusals(tasks, count: int) -> None:
    """Wait until ``count`` of ``tasks`` failed (refused); each refusal must say the job's
    share is full."""
    await until(lambda: sum(t.done() for t in tasks) >= count, f"{count} refusals", T)
    for task in (t for t in tasks if t.done()):
        error = task.exception()
        assert isinstance(error, grpc.RpcError), error
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert "its share" in error.details(), error.details()


@pytest.mark.timeout(120)
async def test_stalled_uploads_stay_inside_the_bound_and_memory_returns(start_hub):
    proc, address = await start_hub("--max-steps-bytes", str(BOUND), "--steps-job-share",
                                    "0.5")
    async with groups_of(address, 2, "greedy", False) as greedy, \
            groups_of(address, 2, "honest", False) as honest:
        clients = [StepsClient.for_group(pg, "m") for pg in honest]
        try:
            # One honest step first, so that the baseline holds what a working hub holds.
            for c, v in zip(clients, (1.0, 3.0), strict=True):
                await c.contribute(MODE, 0, 0, 1.0, np.full(1024, v, np.float32), T)
            await clients[0].fetch(0, 1, T)
            baseline = rss(proc.pid)
            hold = asyncio.Event()
            async with grpc.aio.insecure_channel(greedy[0].collective_address) as channel:
                stub = steps_pb2_grpc.StepsStub(channel)
                with RssSampler(proc.pid) as sampler:
                    # Ten snapshot headers of 8 MiB, no data: three fit the job's 32 MiB.
                    snapshots = [asyncio.create_task(stalled_snapshot(
                        stub, key_of(greedy[i % 2], f"s{i}"), hold)) for i in range(10)]
                    await refusals(snapshots, 7)
                    # Twenty gradients of 4 MiB, stalled: one more fits the share.
                    gradients = [asyncio.create_task(stalled_gradient(
                        stub, key_of(greedy[i % 2], f"g{i}"), hold)) for i in range(20)]
                    await refusals(gradients, 19)
                    assert sum(not t.done() for t in snapshots + gradients) == 4
                    # The other job's steps go on, exact, beside the full share.
                    for c, v in zip(clients, (5.0, 7.0), strict=True):
                        await c.contribute(MODE, 0, 1, 3.0, np.full(1024, v, np.float32), T)
                    got = await clients[1].fetch(1, 2, T)
                    np.testing.assert_array_equal(got.values[0], np.full(1024, 6.0))
                    await clients[0].put_snapshot(2, "{}", bytes(MIB), T)
                    for task in snapshots + gradients:
                        task.cancel()
                    for task in snapshots + gradients:
                        with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                            await task
                # Before the bound, 10 x 8 MiB of snapshots were zero-filled at their headers
                # alone, past the bound, and the gradients' parts held besides.
                assert sampler.growth < BOUND, f"+{sampler.growth / MIB:.0f} MiB"

            # The hub's sweep trims the heap once the uploads are gone.
            await until(lambda: rss(proc.pid) <= baseline + 16 * MIB,
                        f"the hub's memory back within 16 MiB of its baseline (peak "
                        f"+{sampler.growth / MIB:.0f} MiB)", T)
        finally:
            for c in clients:
                await c.close()

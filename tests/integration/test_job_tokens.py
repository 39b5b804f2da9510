"""Per-job tokens over real sockets: a coordinator given a job secret lets job A's own token
run job A (collectives exact, peer send/recv) and refuses it, with JobAccessError
(PERMISSION_DENIED) naming job B, on every service that names job B: joining, a Collective
stream (on both ports, and on a hub shard), each Steps and Rounds RPC, GetStragglers and
RegisterForJob. The shared token still reaches every job, a refused call leaves B as it was
(B's ranks go on with exact results), and the hub stays SERVING throughout."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import gradstar
from gradstar.errors import AuthenticationError, JobAccessError
from gradstar.proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    rounds_pb2_grpc,
    shard_pb2_grpc,
    steps_pb2_grpc,
)
from gradstar.proto.v1 import collective_pb2 as cpb
from gradstar.proto.v1 import rounds_pb2 as rpb
from gradstar.proto.v1 import shard_pb2 as shardpb
from gradstar.proto.v1 import steps_pb2 as stepspb
from gradstar.transport.auth import bearer
from gradstar.transport.job_tokens import JobSecret
from gradstar.transport.status import error_from_rpc
from gradstar.wire import COLLECTIVE_METHOD, KIND_END, KIND_HEADER, decode_error, encode_message

from .conftest import close_all, join_all

SECRET = b"an operator's job secret, 32+ bytes long"
SHARED = "shared-job-token-7c1e"
ADMIN = "admin-token-40b2"
T = 10.0  # every call's deadline
X = np.arange(8, dtype=np.float32)


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "job-secret"
    path.write_bytes(SECRET + b"\n")
    return path


def token(job: str) -> str:
    return JobSecret(SECRET).token_for(job)


class HealthWatch:
    """Asks the coordinator's grpc health every 20 ms while the test runs; every answer."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.answers: list[str] = []
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=T)
                self.answers.append(health_pb2.HealthCheckResponse.ServingStatus.Name(
                    reply.status))
                await asyncio.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        self._task = asyncio.ensure_future(self._watch())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()

    async def stopped(self) -> list[str]:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        return self.answers


def refused(error: grpc.aio.AioRpcError, address: str) -> JobAccessError:
    """The JobAccessError a refused call stands for (PERMISSION_DENIED, naming its class)."""
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (error.code(), error.details())
    rebuilt = error_from_rpc(error, "a call", address)
    assert isinstance(rebuilt, JobAccessError), rebuilt
    return rebuilt


async def collective_verdict(address: str, metadata, header: cpb.CollectiveHeader):
    """A raw Collective stream with ``header`` and an end marker: the hub's in-band verdict
    (an ERROR frame) and the call's status."""

    async def frames():
        yield encode_message(KIND_HEADER, header)
        yield encode_message(KIND_END, cpb.CollectiveEnd())

    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(COLLECTIVE_METHOD)(frames(), metadata=metadata, timeout=T)
        verdict = decode_error(await call.read())
        return verdict, await call.code()


def header_of(g, **fields) -> cpb.CollectiveHeader:
    """A header of ``g``'s next all_reduce of 4 float32 values, with ``fields`` changed."""
    base = dict(job=g.job, generation=g.generation, group="default", seq=10_000, rank=g.rank,
                member_id=g.member_id, op=cpb.COLLECTIVE_OP_ALL_REDUCE,
                reduce_op=cpb.REDUCE_OP_SUM, dtype=cpb.DTYPE_FLOAT32, shape=[4],
                chunk_bytes=1 << 20, timeout_seconds=T)
    return cpb.CollectiveHeader(**{**base, **fields})


async def steps_calls(address: str, metadata, job: str) -> list[grpc.aio.AioRpcError]:
    """Every Steps RPC for ``job`` with ``metadata``: the error each ended with."""
    key = stepspb.StepsKey(job=job, model="m", rank=0, world_size=2)
    errors = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = steps_pb2_grpc.StepsStub(channel)

        async def contribution():
            yield stepspb.ContributionPart(header=stepspb.ContributionHeader(
                key=key, numel=2, weight=1.0), data=np.ones(2, np.float32).tobytes())

        async def snapshot():
            yield stepspb.SnapshotPart(header=stepspb.SnapshotHeader(
                key=key, steps=0, layout="{}", nbytes=4), data=b"\0" * 4)

        calls = [
            lambda: _drain(stub.Contribute(contribution(), metadata=metadata, timeout=T)),
            lambda: _drain(stub.Fetch(stepspb.FetchStepsRequest(key=key), metadata=metadata,
                                      timeout=T)),
            lambda: stub.Heartbeat(stepspb.StepsHeartbeat(key=key), metadata=metadata,
                                   timeout=T),
            lambda: stub.Synchronize(stepspb.SynchronizeRequest(key=key, barrier=1),
                                     metadata=metadata, timeout=T),
            lambda: stub.PutSnapshot(snapshot(), metadata=metadata, timeout=T),
            lambda: _drain(stub.GetSnapshot(stepspb.SnapshotRequest(key=key),
                                            metadata=metadata, timeout=T)),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            errors.append(info.value)
    return errors


async def rounds_calls(address: str, metadata, job: str) -> list[grpc.aio.AioRpcError]:
    """Every Rounds RPC for ``job`` with ``metadata``: the error each ended with."""
    key = rpb.RoundsKey(job=job, model="m", fragment=0, replica="x")
    errors = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rounds_pb2_grpc.RoundsStub(channel)

        async def tensor():
            yield rpb.TensorPart(header=rpb.TensorHeader(key=key, numel=4),
                                 data=np.ones(4, np.float32).tobytes())

        calls = [
            lambda: stub.Seed(tensor(), metadata=metadata, timeout=T),
            lambda: stub.Contribute(tensor(), metadata=metadata, timeout=T),
            lambda: _drain(stub.Fetch(rpb.FetchRequest(key=key), metadata=metadata, timeout=T)),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            errors.append(info.value)
    return errors


async def stragglers(address: str, metadata, job: str) -> admin_pb2.GetStragglersResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await admin_pb2_grpc.AdminStub(channel).GetStragglers(
            admin_pb2.GetStragglersRequest(job=job), metadata=metadata, timeout=T)


async def register_for_job(address: str, metadata, job: str) -> grpc.aio.AioRpcError:
    async def reports():
        yield shardpb.ShardReport(hello=shardpb.ShardHello(address="127.0.0.1:1", slot=-1, job=job))
        await asyncio.sleep(T)  # a shard keeps its control stream open

    async with grpc.aio.insecure_channel(address) as channel:
        call = shard_pb2_grpc.ShardControlStub(channel).RegisterForJob(
            reports(), metadata=metadata, timeout=T)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        return info.value


async def _drain(call) -> None:
    async for _ in call:
        pass


async def test_a_jobs_own_token_reaches_its_job_only(start_coordinator, secret_file):
    hub = await start_coordinator(token=SHARED, admin_token=ADMIN, job_secret_file=secret_file)
    bulk = f"127.0.0.1:{hub.collective_port}"
    as_a, as_b = bearer(token("A")), bearer(token("B"))
    with HealthWatch(hub.address) as health:
        a = await join_all(hub.address, 2, job="A", token=token("A"))
        b = await join_all(hub.address, 2, job="B", token=token("B"))
        try:
            for groups in (a, b):
                results = await asyncio.wait_for(asyncio.gather(
                    *(g.all_reduce(X * (g.rank + 1)) for g in groups)), 30)
                for result in results:
                    np.testing.assert_array_equal(result, X * 3)
            # Peer streams: every rank of A presents A's token to the other's peer server.
            sent = np.array([1.5, -2.0], dtype=np.float32)
            _, received = await asyncio.wait_for(asyncio.gather(
                a[0].send(sent, dst=1), a[1].recv(src=0)), 30)
            np.testing.assert_array_equal(received, sent)
            assert (await stragglers(hub.address, as_a, "A")).job == "A"
            rows_before = hub.steps.summaries("B"), sorted(hub.rounds.jobs())
            slots_before = dict(hub.shards.slots)

            # Job A's token, on everything that names job B:
            with pytest.raises(JobAccessError, match="not job 'B'") as joined:
                await gradstar.init_process_group_async(
                    coordinator=hub.address, job="B", world_size=2, rank=0,
                    token=token("A"), join_timeout=T, connect_timeout=T)
            assert joined.value.job == "B"
            for address in (hub.address, bulk):
                verdict, code = await collective_verdict(address, as_a, header_of(b[0]))
                assert isinstance(verdict, JobAccessError) and "not job 'B'" in str(verdict)
                assert code == grpc.StatusCode.PERMISSION_DENIED
            for error in await steps_calls(bulk, as_a, "B"):
                assert "not job 'B'" in str(refused(error, bulk))
            for error in [*await rounds_calls(bulk, as_a, "B"),
                          *await rounds_calls(hub.address, as_a, "B")]:
                assert "not job 'B'" in str(refused(error, bulk))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stragglers(hub.address, as_a, "B")
            assert "not job 'B'" in str(refused(info.value, hub.address))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stragglers(hub.address, as_a, "no-such-job")  # not even whether it exists
            refused(info.value, hub.address)
            refused(await register_for_job(hub.address, as_a, "B"), hub.address)
            # ...and a job token opens no admin-only call at all.
            async with grpc.aio.insecure_channel(hub.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await admin_pb2_grpc.AdminStub(channel).ListJobs(
                        admin_pb2.ListJobsRequest(), metadata=as_a, timeout=T)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # B as it was: no ledger, no rounds, no shard, the same members; its ranks go on.
            assert (hub.steps.summaries("B"), sorted(hub.rounds.jobs())) == rows_before
            assert dict(hub.shards.slots) == slots_before
            assert sorted(hub.rendezvous.jobs["B"].generation.members) == [0, 1]
            results = await asyncio.wait_for(asyncio.gather(
                *(g.all_reduce(X + g.rank) for g in b)), 30)
            for result in results:
                np.testing.assert_array_equal(result, 2 * X + 1)
            np.testing.assert_array_equal(
                (await asyncio.gather(*(g.all_reduce(X) for g in a)))[0], 2 * X)

            # B's own token and the shared token both reach B; the shared token any job.
            assert (await stragglers(hub.address, as_b, "B")).job == "B"
            assert (await stragglers(hub.address, bearer(SHARED), "B")).job == "B"
            assert (await stragglers(hub.address, bearer(ADMIN), "A")).job == "A"
            async with await gradstar.init_process_group_async(
                    coordinator=hub.address, job="C", world_size=1, token=SHARED,
                    join_timeout=T) as c:
                np.testing.assert_array_equal(await c.all_reduce(X), X)
        finally:
            await close_all([*a, *b])
        answers = await health.stopped()
    assert answers and set(answers) == {"SERVING"}, answers


async def test_without_a_shared_token_every_job_call_needs_a_job_token_of_its_job(
        start_coordinator, secret_file):
    hub = await start_coordinator(admin_token=ADMIN, job_secret_file=secret_file)
    for wrong in (None, "guess", JobSecret(b"another operator's secret!!").token_for("A")):
        with pytest.raises(AuthenticationError) as info:
            await gradstar.init_process_group_async(
                coordinator=hub.address, job="A", world_size=1, token=wrong, join_timeout=T,
                connect_timeout=T)
        assert not isinstance(info.value, JobAccessError)
        assert "your job's own token" in str(info.value)
    async with await gradstar.init_process_group_async(
            coordinator=hub.address, job="A", world_size=1, token=token("A"),
            join_timeout=T) as g:
        np.testing.assert_array_equal(await g.all_reduce(X), X)
        assert (await stragglers(hub.address, bearer(ADMIN), "A")).job == "A"
    # The groups a job's ranks join as jobs of their own (torch's new_group, the two-level
    # all_reduce's per-host groups) are named under it: its token opens them, and no job
    # whose name merely starts the same.
    async with await gradstar.init_process_group_async(
            coordinator=hub.address, job="A/group1", world_size=1, token=token("A"),
            join_timeout=T) as g:
        np.testing.assert_array_equal(await g.all_reduce(X), X)
    for other in ("AB", "A-2", "B/A"):
        with pytest.raises(JobAccessError, match=f"not job {other!r}"):
            await gradstar.init_process_group_async(
                coordinator=hub.address, job=other, world_size=1, token=token("A"),
                join_timeout=T, connect_timeout=T)
    with pytest.raises(JobAccessError, match="not job 'A'"):
        await gradstar.init_process_group_async(
            coordinator=hub.address, job="A", world_size=1, token=token("A/group1"),
            join_timeout=T, connect_timeout=T)


async def test_hub_shards_take_job_tokens_for_their_own_job_only(start_coordinator,
                                                                 secret_file):
    hub = await start_coordinator(token=SHARED, admin_token=ADMIN, job_secret_file=secret_file,
                                  shards=1)
    a = await join_all(hub.address, 2, job="A", token=token("A"))
    b = await join_all(hub.address, 2, job="B", token=token("B"))
    try:
        (shard,) = a[0]._plane.targets()
        assert shard.name != "coordinator"
        for groups in (a, b):
            results = await asyncio.wait_for(asyncio.gather(
                *(g.all_reduce(X * (g.rank + 1)) for g in groups)), 30)
            for result in results:
                np.testing.assert_array_equal(result, X * 3)

        async def frames():
            yield encode_message(KIND_HEADER, header_of(b[0]))
            yield encode_message(KIND_END, cpb.CollectiveEnd())

        call = shard.stream(frames(), metadata=bearer(token("A")), timeout=T)
        try:
            verdict = decode_error(await call.read())
        finally:
            call.cancel()
        assert isinstance(verdict, JobAccessError) and "not job 'B'" in str(verdict)
        results = await asyncio.wait_for(asyncio.gather(*(g.all_reduce(X) for g in b)), 30)
        for result in results:
            np.testing.assert_array_equal(result, 2 * X)
    finally:
        await close_all([*a, *b])

"""Who may call the Steps service (DDP sync modes), over real sockets: every call is bound to a
member of the job's current generation (generation, rank, member id, as the rendezvous issued
them). A member of another job, a process that joined nothing, a member speaking for another
rank, an old generation and a replaced (elastic) rank are refused on every RPC, naming why;
nothing of theirs reaches the ledger, no ledger is made for them, and the honest ranks' step
stays exact."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import gradstar
from gradstar.client.steps import StepsClient
from gradstar.errors import ConfigurationError, RendezvousError
from gradstar.proto.v1 import steps_pb2 as pb
from gradstar.proto.v1 import steps_pb2_grpc
from gradstar.sync_modes import Asynchronous, Quorum
from gradstar.transport.status import error_from_rpc

from .conftest import close_all, join_all

T = 10.0  # every call's deadline
MODE = Quorum(min_ranks=2, timeout=30.0)


def g(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def every_call(stub: steps_pb2_grpc.StepsStub, key: pb.StepsKey):
    """(name, call) for each Steps RPC, each well formed but for ``key``."""
    data = g(9, 9).tobytes()

    async def contribute():
        async def parts():
            yield pb.ContributionPart(header=pb.ContributionHeader(
                key=key, mode=MODE.message(), numel=2, base=0, weight=1.0), data=data)
        return [p async for p in stub.Contribute(parts(), timeout=T)]

    async def put_snapshot():
        async def parts():
            yield pb.SnapshotPart(header=pb.SnapshotHeader(key=key, steps=0, layout="{}",
                                                           nbytes=len(data)), data=data)
        return await stub.PutSnapshot(parts(), timeout=T)

    async def fetch():
        return [p async for p in stub.Fetch(pb.FetchStepsRequest(key=key, have=0), timeout=T)]

    async def get_snapshot():
        return [p async for p in stub.GetSnapshot(pb.SnapshotRequest(key=key), timeout=T)]

    return [
        ("Contribute", contribute),
        ("Fetch", fetch),
        ("Heartbeat", lambda: stub.Heartbeat(pb.StepsHeartbeat(key=key, leave=True),
                                             timeout=T)),
        ("Synchronize", lambda: stub.Synchronize(pb.SynchronizeRequest(
            key=key, barrier=2**64 - 1, next_mode=Asynchronous().message()), timeout=T)),
        ("PutSnapshot", put_snapshot),
        ("GetSnapshot", get_snapshot),
    ]


async def refused_everywhere(stub, key: pb.StepsKey, words: str) -> None:
    for name, call in every_call(stub, key):
        with pytest.raises(grpc.RpcError) as raised:
            await call()
        error = error_from_rpc(raised.value, name, "hub")
        assert isinstance(error, RendezvousError), (name, error)
        assert words in str(error), (name, str(error))


def key_of(pg, model: str = "m", **override) -> pb.StepsKey:
    fields = {"job": pg.job, "model": model, "rank": pg.rank, "generation": pg.generation,
              "member_id": pg.member_id, **override}
    return pb.StepsKey(**fields)


async def honest_step(clients, values=(1.0, 3.0)) -> np.ndarray:
    """Both ranks contribute to the next step; the aggregate every rank fetches."""
    have = (await clients[0].heartbeat(0)).steps
    for client, value in zip(clients, values, strict=True):
        await client.contribute(MODE, 0, have, 1.0, g(value, value), T)
    got = [await c.fetch(have, have + 1, T) for c in clients]
    np.testing.assert_array_equal(got[0].values[0], got[1].values[0])
    return got[0].values[-1]


@pytest.fixture
async def two_jobs(coordinator):
    a, b = await asyncio.gather(join_all(coordinator.address, 2, job="a"),
                                join_all(coordinator.address, 2, job="b"))
    clients = [StepsClient.for_group(pg, "m") for pg in b]
    yield a, b, clients
    for client in clients:
        await client.close()
    await close_all(a + b)


async def test_no_caller_but_the_member_itself_reaches_a_ledger(coordinator, two_jobs):
    a, b, clients = two_jobs
    np.testing.assert_array_equal(await honest_step(clients), g(2, 2))
    ledger = coordinator.steps.ledgers[("b", "m")]
    before = (ledger.steps, ledger.mode, ledger.mode_epoch, sorted(ledger.live()),
              ledger.barrier_done, ledger.snapshot)
    async with grpc.aio.insecure_channel(b[0].collective_address) as channel:
        stub = steps_pb2_grpc.StepsStub(channel)
        # A member of job A, with its own credentials, names job B.
        await refused_everywhere(stub, key_of(a[1], job="b"), "not rank 1 of job 'b'")
        # A process that joined nothing, with a made-up member id.
        await refused_everywhere(stub, key_of(b[1], member_id="0" * 32), "not rank 1")
        # Rank 0 of job B speaking for rank 1 (its own member id, the other's rank).
        await refused_everywhere(stub, key_of(b[0], rank=1), "not rank 1 of job 'b'")
        # An old generation of job B, and a job that has no members at all.
        await refused_everywhere(stub, key_of(b[1], generation=b[1].generation - 1),
                                 "only a member of the job's current generation")
        await refused_everywhere(stub, key_of(a[0], job="ghost"), "no generation")
        # A claimed world size is not the ledger's: the generation's is.
        reply = await stub.Heartbeat(pb.StepsHeartbeat(
            key=key_of(b[1], world_size=2**32 - 1)), timeout=T)
        assert list(reply.live) == [0, 1]
    assert (ledger.steps, ledger.mode, ledger.mode_epoch, sorted(ledger.live()),
            ledger.barrier_done, ledger.snapshot) == before
    assert ledger.world_size == 2 and ledger.ranks[1].barrier == 0
    assert set(coordinator.steps.ledgers) == {("b", "m")}  # none made for the refused
    np.testing.assert_array_equal(await honest_step(clients, (5.0, 7.0)), g(6, 6))
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=T)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_heartbeats_for_a_job_without_members_make_no_ledger(coordinator):
    (pg,) = await join_all(coordinator.address, 1, job="real")
    try:
        async with grpc.aio.insecure_channel(pg.collective_address) as channel:
            stub = steps_pb2_grpc.StepsStub(channel)

            async def beat(i: int) -> None:
                key = key_of(pg, job="ghost", model=f"m{i}")
                with pytest.raises(grpc.RpcError) as raised:
                    await stub.Heartbeat(pb.StepsHeartbeat(key=key), timeout=T)
                assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            for start in range(0, 10_000, 200):
                await asyncio.gather(*(beat(i) for i in range(start, start + 200)))
        assert coordinator.steps.ledgers == {}
    finally:
        await close_all([pg])


async def test_a_claimed_world_size_of_two_to_the_32_is_refused_at_once(coordinator):
    with pytest.raises(ConfigurationError, match="world_size must be between 1 and 65536"):
        await asyncio.wait_for(gradstar.init_process_group_async(
            coordinator=coordinator.address, job="huge", world_size=2**32 - 1, rank=0,
            timeout=T, join_timeout=T), T)
    assert "huge" not in coordinator.rendezvous.jobs


async def test_a_replaced_ranks_identity_moves_to_its_replacement(coordinator):
    groups = await join_all(coordinator.address, 2, job="el")
    old = StepsClient.for_group(groups[1], "m")
    keep = StepsClient.for_group(groups[0], "m")
    try:
        await old.heartbeat(0)  # a member: taken
        # The hub loses rank 1 (as after missed heartbeats); a restarted process takes its
        # place in the running generation.
        gen = coordinator.rendezvous.jobs["el"].generation
        coordinator.rendezvous.lost(gen.members[1], "test: missed heartbeats")
        newcomer = await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="el", world_size=2, rank=1, elastic=True,
            timeout=T, join_timeout=T)
        groups.append(newcomer)
        assert newcomer.replacement and newcomer.generation == groups[1].generation
        async with grpc.aio.insecure_channel(groups[0].collective_address) as channel:
            await refused_everywhere(steps_pb2_grpc.StepsStub(channel), old.key, "not rank 1")
        new = StepsClient.for_group(newcomer, "m")
        try:
            assert list((await new.heartbeat(0)).live) == [0, 1]
            await keep.contribute(MODE, 0, 0, 1.0, g(2, 2), T)
            await new.contribute(MODE, 0, 0, 1.0, g(4, 4), T)
            np.testing.assert_array_equal((await keep.fetch(0, 1, T)).values[0], g(3, 3))
        finally:
            await new.close()
    finally:
        await old.close()
        await keep.close()
        await close_all(groups)


async def test_a_refused_header_changes_neither_mode_nor_epoch(coordinator, two_jobs):
    """A member's header saying Asynchronous at mode epoch 2^64-1, then too few bytes: refused
    (ProtocolError), and the honest ranks go on in their mode at their epoch."""
    _, b, clients = two_jobs
    async with grpc.aio.insecure_channel(b[1].collective_address) as channel:
        stub = steps_pb2_grpc.StepsStub(channel)

        async def parts():
            yield pb.ContributionPart(header=pb.ContributionHeader(
                key=key_of(b[1]), mode=Asynchronous().message(), mode_epoch=2**64 - 1,
                numel=2, base=0, weight=1.0), data=b"\0" * 3)

        with pytest.raises(grpc.RpcError) as raised:
            [p async for p in stub.Contribute(parts(), timeout=T)]
    assert raised.value.code() != grpc.StatusCode.OK
    ledger = coordinator.steps.ledgers.get(("b", "m"))
    assert ledger is None or (ledger.mode, ledger.mode_epoch) in ((None, 0), (MODE, 0))
    np.testing.assert_array_equal(await honest_step(clients), g(2, 2))
    ledger = coordinator.steps.ledgers[("b", "m")]
    assert (ledger.mode, ledger.mode_epoch, ledger.steps) == (MODE, 0, 1)

"""The Steps service (DDP sync modes) over real sockets: a contribution the hub refuses gets a
named error for its sender only and the others' step goes on, a cut stream leaves nothing
behind, a barrier closes the open step, tokens are checked."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from gradstar.client.steps import StepsClient
from gradstar.config import ClientSettings
from gradstar.errors import AuthenticationError, ProtocolError, StepMismatchError
from gradstar.proto.v1 import steps_pb2 as pb
from gradstar.proto.v1 import steps_pb2_grpc
from gradstar.sync_modes import Asynchronous, Quorum
from gradstar.transport.status import error_from_rpc

QUORUM = Quorum(min_ranks=2, timeout=30.0)
T = 10.0  # every call's deadline


@pytest.fixture
async def ranks(coordinator):
    made: list[StepsClient] = []

    def make(rank: int, world: int = 2, **settings) -> StepsClient:
        address = f"127.0.0.1:{coordinator.collective_port}"
        made.append(StepsClient(ClientSettings(coordinator=coordinator.address, job="j",
                                               **settings), address, "m", rank, world))
        return made[-1]

    yield make
    for client in made:
        await client.close()


def g(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


async def test_a_step_closes_with_the_weighted_mean_and_every_rank_fetches_it(ranks):
    r0, r1 = ranks(0), ranks(1)
    first = await r0.contribute(QUORUM, 0, 0, 1.0, g(1, 2), T)
    assert (first.accepted, first.step, first.steps) == (True, 1, 0)
    second = await r1.contribute(QUORUM, 0, 0, 3.0, g(5, 6), T)
    assert (second.accepted, second.step, second.steps) == (True, 1, 1)
    for client in (r0, r1):
        got = await client.fetch(0, 1, T)
        assert got.steps == 1 and list(got.records[0].ranks) == [0, 1]
        assert list(got.records[0].weights) == [1.0, 3.0]
        np.testing.assert_array_equal(got.values[0], (g(1, 2) + g(5, 6) * 3) / 4)


async def test_a_refused_contribution_is_named_for_its_sender_and_the_step_goes_on(ranks):
    r0, r1 = ranks(0), ranks(1)
    await r0.contribute(QUORUM, 0, 0, 1.0, g(1, 1), T)
    refusals = [
        (lambda: r1.contribute(QUORUM, 0, 0, -1.0, g(9, 9), T), "weight"),
        (lambda: r1.contribute(QUORUM, 0, 0, float("nan"), g(9, 9), T), "weight"),
        (lambda: r1.contribute(Asynchronous(), 0, 0, 1.0, g(9, 9), T), "same mode"),
        (lambda: r1.contribute(Quorum(min_ranks=2, timeout=1.0), 0, 0, 1.0, g(9, 9), T),
         "same mode"),
        (lambda: r1.contribute(QUORUM, 0, 4, 1.0, g(9, 9), T), "only 0 steps"),
        (lambda: r1.contribute(QUORUM, 0, 0, 1.0, g(9, 9, 9), T), "values"),
        (lambda: r0.contribute(QUORUM, 0, 0, 1.0, g(9, 9), T), "twice"),
    ]
    for call, words in refusals:
        with pytest.raises(StepMismatchError, match=words):
            await call()
    await r1.contribute(QUORUM, 0, 0, 1.0, g(3, 3), T)
    got = await r0.fetch(0, 1, T)
    np.testing.assert_array_equal(got.values[0], g(2, 2))  # nothing refused got in


async def test_a_cut_stream_leaves_nothing_in_the_step(coordinator, ranks):
    r0, r1 = ranks(0), ranks(1)
    header = pb.ContributionHeader(key=r1.key, mode=QUORUM.message(), numel=4, base=0,
                                   weight=1.0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.collective_port}") as ch:
        stub = steps_pb2_grpc.StepsStub(ch)

        async def parts():
            yield pb.ContributionPart(header=header, data=g(7, 7).tobytes())  # half of it

        with pytest.raises(grpc.RpcError) as raised:
            await stub.Contribute(parts(), timeout=T)
    assert isinstance(error_from_rpc(raised.value, "contribute", "hub"), ProtocolError)
    await r0.contribute(QUORUM, 0, 0, 1.0, g(1, 1, 1, 1), T)
    await r1.contribute(QUORUM, 0, 0, 1.0, g(3, 3, 3, 3), T)
    got = await r0.fetch(0, 1, T)
    np.testing.assert_array_equal(got.values[0], g(2, 2, 2, 2))


async def test_synchronize_closes_the_open_step_for_every_rank(ranks):
    r0, r1 = ranks(0), ranks(1)
    slow = Quorum(min_ranks=2, timeout=600.0)
    await r0.contribute(slow, 0, 0, 1.0, g(4), T)
    steps = await asyncio.gather(r0.synchronize(1, T), r1.synchronize(1, T))
    assert steps == [1, 1]  # rank 1 contributed nothing: the step closed with rank 0 alone
    got = await r1.fetch(0, 1, T)
    np.testing.assert_array_equal(got.values[0], g(4))


async def test_a_steps_call_without_the_job_token_is_refused(start_coordinator):
    hub = await start_coordinator(token="steps-token-123456")
    address = f"127.0.0.1:{hub.collective_port}"
    stranger = StepsClient(ClientSettings(coordinator=hub.address, job="j"), address, "m", 0, 1)
    try:
        with pytest.raises(AuthenticationError):
            await stranger.heartbeat(0)
    finally:
        await stranger.close()

"""Token refusals over real sockets: every refused call ends UNAUTHENTICATED on the client.

A refused streaming call used to end while its client was still writing; grpc-python then
failed the client's pending write and reported INTERNAL instead of the server's status.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc
from gradstar.wire import COLLECTIVE_METHOD, KIND_CHUNK

WRONG = (("authorization", "Bearer wrong-token"),)
# Well past HTTP/2's initial 64 KiB window, so the client is blocked writing when refused.
FRAME = bytes([KIND_CHUNK]) + bytes(64 * 1024)
FRAMES = 32
DEADLINE = 20.0


async def write_then_read(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """A Collective stream written frame by frame, as the server refuses it."""
    call = channel.stream_stream(COLLECTIVE_METHOD)(metadata=WRONG, timeout=DEADLINE)
    try:
        for _ in range(FRAMES):
            await call.write(FRAME)
        await call.done_writing()
        await call.read()
    except grpc.aio.AioRpcError as error:
        return error.code()
    except asyncio.InvalidStateError:  # a write after the status arrived
        pass
    return await call.code()


async def iterate(channel: grpc.aio.Channel) -> grpc.StatusCode:
    """A Collective stream fed by a request iterator, as the rank's own client feeds it."""

    async def frames():
        for _ in range(FRAMES):
            yield FRAME

    call = channel.stream_stream(COLLECTIVE_METHOD)(frames(), metadata=WRONG, timeout=DEADLINE)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return await call.code()


async def list_jobs(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await admin_pb2_grpc.AdminStub(channel).ListJobs(
            admin_pb2.ListJobsRequest(), metadata=WRONG, timeout=DEADLINE)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(120)
async def test_a_thousand_wrong_token_calls_are_all_unauthenticated(start_coordinator):
    coordinator = await start_coordinator(token="job-token", admin_token="admin-token")
    calls = [write_then_read, iterate, list_jobs, list_jobs, write_then_read] * 200
    codes: collections.Counter = collections.Counter()
    limit = asyncio.Semaphore(16)
    async with grpc.aio.insecure_channel(coordinator.address) as channel:

        async def one(call) -> None:
            async with limit:
                codes[(call.__name__, (await call(channel)).name)] += 1

        await asyncio.wait_for(asyncio.gather(*(one(call) for call in calls)), 90)
    assert sum(codes.values()) == 1000
    internal = sum(n for (_, code), n in codes.items() if code == "INTERNAL")
    assert internal == 0, f"{internal} of 1000 refusals surfaced as INTERNAL: {dict(codes)}"
    assert {code for _, code in codes} == {"UNAUTHENTICATED"}, dict(codes)


async def test_a_refused_stream_that_waits_is_answered_without_the_full_drain(
        start_coordinator):
    # A client that wrote one frame and waits has no write in flight: it hears at once.
    coordinator = await start_coordinator(token="job-token")
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        call = channel.stream_stream(COLLECTIVE_METHOD)(metadata=WRONG, timeout=DEADLINE)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.write(FRAME)
            await call.read()
        assert loop.time() - started < 1.5
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "job token wrong" in info.value.details()

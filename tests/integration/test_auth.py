"""Token refusals over real sockets: every refused call ends UNAUTHENTICATED on the client.

A refused streaming call used to end while its client was still writing; grpc-python then
failed the client's pending write and reported INTERNAL ("Internal error from Core", debug
string ``Failed "execute_batch": (SendMessageOperation,)``) instead of the server's status. The
server now drains the call until the client half-closes or, after no more than its opening
message, stops writing; these tests hold it to that when the event loop stalls between two
writes (once in ~10 full runs a stall of the loop the client shares with the coordinator, or a
starved transport, made a writing client look like one waiting for its answer) and for unknown
methods.
"""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest

from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc
from gradstar.transport import auth
from gradstar.transport.auth import DENIAL_QUIET_SECONDS
from gradstar.wire import COLLECTIVE_METHOD, KIND_CHUNK

WRONG = (("authorization", "Bearer wrong-token"),)
# Well past HTTP/2's initial 64 KiB window, so the client is blocked writing when refused.
FRAME = bytes([KIND_CHUNK]) + bytes(64 * 1024)
FRAMES = 32
DEADLINE = 20.0
WAITING_DEADLINE = 10.0

Outcome = tuple[grpc.StatusCode, str]


def failed(error: grpc.aio.AioRpcError, where: str) -> Outcome:
    """The code, and for the report where it surfaced with details and Core's debug string
    (which names the failed operation: ``SendMessageOperation`` for a write)."""
    return error.code(), f"{where}: {error.details()} [{error.debug_error_string()}]"


async def write_then_read(channel: grpc.aio.Channel, method: str = COLLECTIVE_METHOD,
                          stall_after: int | None = None) -> Outcome:
    """A stream written frame by frame, as the server refuses it; with ``stall_after``, the
    event loop stalls past the quiet time once that many frames were written."""
    call = channel.stream_stream(method)(metadata=WRONG, timeout=DEADLINE)
    where = "write"
    try:
        for i in range(FRAMES):
            if i == stall_after:
                await stall_the_loop()
            await call.write(FRAME)
        where = "done_writing"
        await call.done_writing()
        where = "read"
        await call.read()
    except grpc.aio.AioRpcError as error:
        return failed(error, where)
    except asyncio.InvalidStateError:  # a write after the status arrived
        pass
    return await call.code(), f"{where}: {await call.details()}"


async def stall_the_loop() -> None:
    """Block the event loop (as a full garbage collection of a big heap, or a starved CPU,
    does) for longer than the quiet time, with this task's next step queued behind it."""
    await asyncio.sleep(0.05)  # the server has read what was written: its quiet time runs
    asyncio.get_running_loop().call_soon(time.sleep, DENIAL_QUIET_SECONDS + 0.1)
    await asyncio.sleep(0.01)


async def iterate(channel: grpc.aio.Channel) -> Outcome:
    """A Collective stream fed by a request iterator, as the rank's own client feeds it."""

    async def frames():
        for _ in range(FRAMES):
            yield FRAME

    call = channel.stream_stream(COLLECTIVE_METHOD)(frames(), metadata=WRONG, timeout=DEADLINE)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        return failed(error, "read")
    return await call.code(), await call.details()


async def list_jobs(channel: grpc.aio.Channel) -> Outcome:
    try:
        await admin_pb2_grpc.AdminStub(channel).ListJobs(
            admin_pb2.ListJobsRequest(), metadata=WRONG, timeout=DEADLINE)
    except grpc.aio.AioRpcError as error:
        return failed(error, "call")
    return grpc.StatusCode.OK, ""


@pytest.mark.timeout(120)
async def test_a_thousand_wrong_token_calls_are_all_unauthenticated(start_coordinator):
    coordinator = await start_coordinator(token="job-token", admin_token="admin-token")
    calls = [write_then_read, iterate, list_jobs, list_jobs, write_then_read] * 200
    codes: collections.Counter = collections.Counter()
    odd: list[str] = []
    limit = asyncio.Semaphore(16)
    async with grpc.aio.insecure_channel(coordinator.address) as channel:

        async def one(call) -> None:
            async with limit:
                started = time.monotonic()  # for the report only: a call past the drain or not
                code, detail = await call(channel)
                took = time.monotonic() - started
            codes[(call.__name__, code.name)] += 1
            if code != grpc.StatusCode.UNAUTHENTICATED:
                odd.append(f"{call.__name__} {code.name} after {took:.2f} s, {detail}")

        await asyncio.wait_for(asyncio.gather(*(one(call) for call in calls)), 90)
    assert sum(codes.values()) == 1000
    assert not odd, f"{len(odd)} of 1000 refusals were not UNAUTHENTICATED: {dict(codes)}; " + \
        "; ".join(odd[:5])


@pytest.mark.parametrize("stall_after", [1, 8], ids=["after its opening message", "mid-stream"])
async def test_a_refused_stream_stays_unauthenticated_when_the_loop_stalls_between_writes(
        start_coordinator, stall_after):
    # The client and the coordinator share this loop: during a stall neither runs, so the
    # client's silence says nothing. Before silence was judged only on a loop that kept time
    # (and only after a client's opening message), the refusal went out as the loop resumed,
    # ahead of the client's next write: INTERNAL, every time.
    coordinator = await start_coordinator(token="job-token")
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        for _ in range(2):
            code, detail = await write_then_read(channel, stall_after=stall_after)
            assert code == grpc.StatusCode.UNAUTHENTICATED, detail


async def test_a_refused_stream_to_an_unknown_method_is_unauthenticated(start_coordinator):
    # Unknown methods were refused with a unary handler, which answers after the first message:
    # a client still streaming then got INTERNAL (grpc/grpc#36066's shape).
    coordinator = await start_coordinator(token="job-token")
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        for _ in range(3):
            code, detail = await write_then_read(channel, "/gradstar.proto.v1.Nothing/Stream")
            assert code == grpc.StatusCode.UNAUTHENTICATED, detail
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/gradstar.proto.v1.Nothing/Call")(
                b"", metadata=WRONG, timeout=DEADLINE)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "job token wrong" in info.value.details()


async def test_a_refused_stream_that_waits_is_answered_without_the_full_drain(
        start_coordinator, monkeypatch):
    # A client that wrote one frame and waits has no write in flight: it hears once it has been
    # quiet, not at the end of the drain. With the drain longer than the call's deadline, an
    # answer at all (rather than DEADLINE_EXCEEDED) shows which rule gave it.
    monkeypatch.setattr(auth, "DENIAL_DRAIN_SECONDS", 10 * WAITING_DEADLINE)
    coordinator = await start_coordinator(token="job-token")
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        call = channel.stream_stream(COLLECTIVE_METHOD)(metadata=WRONG, timeout=WAITING_DEADLINE)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.write(FRAME)
            await call.read()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "job token wrong" in info.value.details()

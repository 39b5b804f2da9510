"""Every failure a user can cause or suffer ends in a named error, quickly, on every rank."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

import gradstar
from gradstar import errors
from gradstar.config import ClientSettings
from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc, rendezvous_pb2_grpc
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.proto.v1 import rendezvous_pb2 as rpb
from gradstar.wire import KIND_END, KIND_HEADER, encode_batch, encode_chunk, encode_message

from .conftest import close_all, join_all, until


@pytest.fixture
async def trio(coordinator):
    groups = await join_all(coordinator.address, 3)
    yield groups
    await close_all(groups)


async def gather_outcomes(*calls, timeout=10):
    return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout)


MISMATCHES = {
    # field: (what ranks 0 and 1 call, what rank 2 calls, values both named in the message)
    "op": (lambda g: g.all_reduce(np.ones(4, np.float32)),
           lambda g: g.all_gather(np.ones(4, np.float32)), ("all_reduce", "all_gather")),
    "reduce op": (lambda g: g.all_reduce(np.ones(4, np.float32), op="sum"),
                  lambda g: g.all_reduce(np.ones(4, np.float32), op="max"), ("'sum'", "'max'")),
    "dtype": (lambda g: g.all_reduce(np.ones(4, np.float32)),
              lambda g: g.all_reduce(np.ones(4, np.float64)), ("float32", "float64")),
    "shape": (lambda g: g.all_reduce(np.ones((4, 2), np.float32)),
              lambda g: g.all_reduce(np.ones((2, 4), np.float32)), ("(4, 2)", "(2, 4)")),
    "root": (lambda g: g.broadcast(np.ones(4, np.float32), src=0),
             lambda g: g.broadcast(np.ones(4, np.float32), src=1), ("src=0", "src=1")),
}


@pytest.mark.parametrize("field", MISMATCHES)
async def test_mismatch_fails_every_rank_naming_rank_and_values(trio, field):
    same, odd, values = MISMATCHES[field]
    # At once, not by a timeout (the collectives' 300 s default, far past gather_outcomes'
    # 10 s; a timeout would be CollectiveTimeoutError): no wall-clock claim needed.
    outcomes = await gather_outcomes(*(odd(g) if g.rank == 2 else same(g) for g in trio))
    for outcome in outcomes:
        assert isinstance(outcome, errors.CollectiveMismatchError), outcome
        message = str(outcome)
        assert "rank 2" in message and f"{field} differs" in message, message
        assert all(v in message for v in values), message
        assert outcome.field == field
    # No rank got a result, and the next correct collective works on every rank.
    x = np.arange(6, dtype=np.int64)
    results = await gather_outcomes(*(g.all_reduce(x) for g in trio))
    for r in results:
        np.testing.assert_array_equal(r, 3 * x)


async def test_collective_some_ranks_never_reach_times_out_naming_them(trio):
    g0, g1, g2 = trio
    outcomes = await gather_outcomes(g0.all_reduce(np.ones(3), timeout=1.0),
                                     g1.all_reduce(np.ones(3), timeout=1.0))
    for outcome in outcomes:
        assert isinstance(outcome, errors.CollectiveTimeoutError), outcome
        assert outcome.missing_ranks == [2]
        assert str(outcome).startswith("Timed out after 1 s: ")
        assert "ranks [2] never arrived" in str(outcome)
    # The late rank gets the same verdict for that collective rather than waiting alone...
    late = await gather_outcomes(g2.all_reduce(np.ones(3), timeout=1.0))
    assert isinstance(late[0], errors.CollectiveTimeoutError)
    # ...and the ranks are in step again for the next one.
    results = await gather_outcomes(*(g.all_reduce(np.ones(3)) for g in trio))
    for r in results:
        np.testing.assert_array_equal(r, np.full(3, 3.0))


async def test_rank_that_finishes_fails_the_collectives_that_need_it_naming_it(trio):
    g0, g1, g2 = trio
    pending = [asyncio.ensure_future(g.all_reduce(np.ones(3))) for g in (g0, g1)]
    await asyncio.sleep(0.2)
    await g2.close()
    outcomes = await gather_outcomes(*pending, timeout=5)
    for outcome in outcomes:
        assert isinstance(outcome, errors.RankFinishedError), outcome
        assert outcome.rank == 2
        assert str(outcome).startswith("rank 2 of job 'test' finished (closed its process group)")
    # Later collectives need rank 2 too: they fail at once with the same named error...
    with pytest.raises(errors.RankFinishedError, match="rank 2"):
        await asyncio.wait_for(g0.barrier(), 5)
    # ...but the generation did not fail: the remaining ranks still talk to each other.
    sent = np.arange(5, dtype=np.float32)
    _, received = await gather_outcomes(g0.send(sent, dst=1), g1.recv(src=0))
    np.testing.assert_array_equal(received, sent)


def raw_all_reduce_header(g, elements: int) -> pb.CollectiveHeader:
    """The header ``g``'s next all_reduce would send, for tests that speak the wire by hand."""
    return pb.CollectiveHeader(
        job=g.job, generation=g.generation, group="default", seq=next(g._seq), rank=g.rank,
        member_id=g.member_id, op=pb.COLLECTIVE_OP_ALL_REDUCE, reduce_op=pb.REDUCE_OP_SUM,
        dtype=pb.DTYPE_FLOAT32, shape=[elements], chunk_bytes=g.settings.chunk_bytes,
        timeout_seconds=10,
    )


async def test_stream_cut_before_end_marker_commits_nothing(coordinator, trio):
    """A rank whose stream ends without END fails the collective; no rank gets a result."""
    g0, g1, g2 = trio
    pending = [asyncio.ensure_future(g.all_reduce(np.ones(1000, np.float32))) for g in (g0, g1)]
    header = raw_all_reduce_header(g2, 1000)

    async def cut_short():
        yield encode_message(KIND_HEADER, header)
        yield encode_chunk(0, np.ones(1000, np.float32))
        # no END frame: the stream just closes

    call = g2._plane.coordinator.stream(cut_short(), metadata=g2._metadata, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.ABORTED
    for outcome in await gather_outcomes(*pending, timeout=5):
        assert isinstance(outcome, errors.RankLostError), outcome
        assert "rank 2" in str(outcome) and "end marker" in str(outcome)


@pytest.mark.parametrize("damage, whole", [
    ("checksum", False), ("length", False), ("chunk count", False), ("batch", False),
    ("checksum", True), ("length", True), ("chunk count", True),
], ids=lambda v: {True: "one message", False: "frames"}.get(v, v))
async def test_corrupt_frames_fail_the_collective_with_protocol_error(trio, damage, whole):
    """A damaged chunk or end marker fails the collective on every rank, whether it came in
    frames of its own or, as a small collective's do, in one message with the header."""
    g0, g1, g2 = trio
    pending = [asyncio.ensure_future(g.all_reduce(np.ones(1000, np.float32))) for g in (g0, g1)]
    header = raw_all_reduce_header(g2, 1000)
    chunk = bytearray(encode_chunk(0, np.ones(1000, np.float32)))
    end = pb.CollectiveEnd(chunks=1, bytes=4000)
    if damage == "checksum":
        chunk[-1] ^= 0x40
    elif damage == "length":
        chunk = chunk[:-4]
    elif damage == "chunk count":
        end.chunks = 2
    last = encode_message(KIND_END, end)
    if damage == "batch":  # the end marker in a batch cut one byte short
        last = encode_batch([last])[:-1]

    async def frames():
        if whole:
            yield encode_batch([encode_message(KIND_HEADER, header), bytes(chunk), last])
            return
        yield encode_message(KIND_HEADER, header)
        yield bytes(chunk)
        yield last

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in g2._plane.coordinator.stream(frames(), metadata=g2._metadata, timeout=10):
            pass
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    for outcome in await gather_outcomes(*pending, timeout=5):
        assert isinstance(outcome, errors.ProtocolError), outcome
        assert "rank 2" in str(outcome)
    results = await gather_outcomes(*(g.all_reduce(np.ones(2)) for g in trio))
    assert all(np.array_equal(r, np.full(2, 3.0)) for r in results)


async def test_unreachable_coordinator_fails_fast():
    # A port nothing listens on: bind and close a socket to find one.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(errors.CoordinatorUnavailableError, match=f"127.0.0.1:{port}"):
        await gradstar.init_process_group_async(coordinator=f"127.0.0.1:{port}", job="j",
                                                world_size=2, connect_timeout=2)
    # Within its connect_timeout, not the default's 10 s (a bound far from both: load only
    # adds a little to 2 s).
    assert time.monotonic() - started < ClientSettings.model_fields["connect_timeout"].default


async def list_jobs(address: str, token: str | None) -> list[str]:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await admin_pb2_grpc.AdminStub(channel).ListJobs(
            admin_pb2.ListJobsRequest(), metadata=metadata, timeout=5)
    return [j.job for j in reply.jobs]


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
async def test_bad_token_is_unauthenticated_and_changes_nothing(start_coordinator, token):
    coordinator = await start_coordinator(token="right-token", admin_token="admin-token")
    with pytest.raises(errors.AuthenticationError, match="job token"):
        await gradstar.init_process_group_async(coordinator=coordinator.address, job="j",
                                                world_size=1, token=token, connect_timeout=5)
    assert await list_jobs(coordinator.address, "admin-token") == []
    async with await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="j", world_size=1, token="right-token") as g:
        np.testing.assert_array_equal(await g.all_reduce(np.ones(2)), np.ones(2))
    assert await list_jobs(coordinator.address, "admin-token") == ["j"]


async def test_admin_calls_need_the_admin_token(start_coordinator):
    coordinator = await start_coordinator(token="job-token", admin_token="admin-token")
    for presented in (None, "job-token"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await list_jobs(coordinator.address, presented)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "admin token" in info.value.details()


async def test_duplicate_rank_is_refused(coordinator):
    first = asyncio.ensure_future(gradstar.init_process_group_async(
        coordinator=coordinator.address, job="dup", world_size=2, rank=0, join_timeout=10))
    await until(lambda: "dup" in coordinator.rendezvous.jobs, "the first join is waiting")
    with pytest.raises(errors.DuplicateRankError, match="rank 0 of job 'dup'"):
        await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="dup", world_size=2, rank=0, join_timeout=10)
    second = await gradstar.init_process_group_async(
        coordinator=coordinator.address, job="dup", world_size=2, rank=1, join_timeout=10)
    groups = [await asyncio.wait_for(first, 10), second]
    assert sorted(g.rank for g in groups) == [0, 1]
    await close_all(groups)


async def test_world_size_disagreement_is_refused_and_the_waiting_rank_told(coordinator):
    first = asyncio.ensure_future(gradstar.init_process_group_async(
        coordinator=coordinator.address, job="ws", world_size=2, join_timeout=60))
    await until(lambda: "ws" in coordinator.rendezvous.jobs, "the first join is waiting")
    with pytest.raises(errors.WorldSizeMismatchError, match=r"world_size 2.*asked for 3"):
        await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="ws", world_size=3, join_timeout=10)
    # The rank already waiting hears of the dispute now, not after its 60 s join timeout.
    with pytest.raises(errors.WorldSizeMismatchError,
                       match=r"forming with world_size 2, but another rank asked for 3"):
        await asyncio.wait_for(first, 5)


@pytest.mark.parametrize(("job", "limit"), [("", "must not be empty"),
                                             ("j" * 257, "at most 256 characters"),
                                             ("evil\nINFO forged", "control characters")])
async def test_bad_job_names_are_invalid_argument(coordinator, job, limit):
    join = rpb.SessionRequest(join=rpb.JoinRequest(job=job, world_size=1, rank=-1))
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in rendezvous_pb2_grpc.RendezvousStub(channel).Session(
                    iter([join]), timeout=5):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert limit in info.value.details()
    assert coordinator.rendezvous.jobs == {}


async def test_join_timeout_names_who_joined(coordinator):
    started = time.monotonic()
    with pytest.raises(errors.JoinTimeoutError, match=r"only 1 of 3 ranks joined within 0.5 s"):
        await gradstar.init_process_group_async(
            coordinator=coordinator.address, job="lonely", world_size=3, rank=1,
            join_timeout=0.5)
    # Its own 0.5 s, not the default join timeout's 300 s (the message names 0.5 s as well).
    assert time.monotonic() - started < 60


async def test_payload_over_limit_is_refused_on_every_rank(start_coordinator):
    coordinator = await start_coordinator(max_tensor_bytes=4096)
    groups = await join_all(coordinator.address, 2)
    try:
        outcomes = await gather_outcomes(*(g.all_reduce(np.ones(2048, np.float32))
                                           for g in groups))
        for outcome in outcomes:
            assert isinstance(outcome, errors.PayloadTooLargeError), outcome
            assert "8192 bytes" in str(outcome) and "limit of 4096" in str(outcome)
        ok = await gather_outcomes(*(g.all_reduce(np.ones(1024, np.float32)) for g in groups))
        assert all(np.array_equal(r, np.full(1024, 2.0)) for r in ok)
    finally:
        await close_all(groups)


async def test_invalid_arguments_raise_before_anything_is_sent(trio):
    g = trio[0]
    with pytest.raises(errors.ConfigurationError, match="unknown reduce op 'median'"):
        g.all_reduce(np.ones(2), op="median")
    with pytest.raises(errors.ConfigurationError, match="dtype complex64 is not supported"):
        g.all_reduce(np.ones(2, np.complex64))
    with pytest.raises(errors.ConfigurationError, match="expected a numpy array"):
        g.all_reduce([1.0, 2.0])
    with pytest.raises(errors.InvalidCollectiveError, match="src=5 is out of range"):
        g.broadcast(np.ones(2), src=5)
    with pytest.raises(errors.InvalidCollectiveError, match="dim 0 divisible by world_size 3"):
        g.reduce_scatter(np.ones(4))
    # Nothing was issued, so the ranks are still in step.
    results = await gather_outcomes(*(x.all_reduce(np.ones(2)) for x in trio))
    assert all(np.array_equal(r, np.full(2, 3.0)) for r in results)


async def test_closed_group_raises(coordinator):
    (g,) = await join_all(coordinator.address, 1, job="solo")
    await g.close()
    with pytest.raises(errors.ProcessGroupClosedError, match="closed"):
        g.all_reduce(np.ones(2))


async def test_a_collective_cancelled_before_its_header_left_fails_every_rank_promptly(
        coordinator, trio):
    g0, g1, g2 = trio
    real = g2._plane.coordinator
    calls = []

    def first_call_held_back(requests, **kwargs):
        # The first call's header never leaves this process; later calls go as usual.
        calls.append(kwargs)
        if len(calls) == 1:
            async def never():
                await asyncio.Event().wait()
                yield b""

            requests = never()
        return real.stream(requests, **kwargs)

    g2._plane.coordinator = type(real)(first_call_held_back, real.address, real.name)
    pending = [asyncio.ensure_future(g.all_reduce(np.ones(3), timeout=120)) for g in (g0, g1)]
    cancelled = asyncio.ensure_future(g2.all_reduce(np.ones(3), timeout=120))
    gen = coordinator.rendezvous.jobs["test"].generation
    await until(lambda: [sorted(c.participants) for c in gen.collectives.values()] == [[0, 1]],
                "ranks 0 and 1 arrived at the hub")
    await until(lambda: calls, "rank 2's call opened (its header held back)")
    cancelled.cancel()
    for outcome in await gather_outcomes(*pending, timeout=10):  # not the 120 s timeout
        assert isinstance(outcome, errors.RankLostError), outcome
        assert "rank 2" in str(outcome) and "end marker" in str(outcome)
    # The ranks stay in step: their next collective matches.
    results = await gather_outcomes(*(g.all_reduce(np.ones(2)) for g in trio))
    assert [r.tolist() for r in results] == [[3.0, 3.0]] * 3


async def test_a_collective_cancelled_before_it_ever_ran_fails_every_rank_promptly(trio):
    g0, g1, g2 = trio
    pending = [asyncio.ensure_future(g.all_reduce(np.ones(3), timeout=120)) for g in (g0, g1)]
    withdrawn = g2.all_reduce(np.ones(3), timeout=120)
    withdrawn.cancel()  # before the loop ever ran it: nothing of it has left this process
    for outcome in await gather_outcomes(*pending, timeout=10):  # not the 120 s timeout
        assert isinstance(outcome, errors.RankLostError), outcome
        assert "rank 2" in str(outcome), outcome
    with pytest.raises(asyncio.CancelledError):
        await withdrawn
    results = await gather_outcomes(*(g.all_reduce(np.ones(2)) for g in trio))
    assert [r.tolist() for r in results] == [[3.0, 3.0]] * 3


async def test_a_collective_is_issued_when_called_even_if_never_awaited(trio):
    g0, g1, g2 = trio
    x = np.arange(4, dtype=np.float32)
    g2.all_reduce(x * 10)  # called and dropped: it still takes part
    results = await gather_outcomes(g0.all_reduce(x), g1.all_reduce(x))
    assert [r.tolist() for r in results] == [(x * 12).tolist()] * 2
    later = await gather_outcomes(*(g.all_reduce(np.ones(2)) for g in trio))
    assert [r.tolist() for r in later] == [[3.0, 3.0]] * 3

"""The Steps service (DDP sync modes) over real sockets: a contribution the hub refuses gets a
named error for its sender only and the others' step goes on, a cut stream leaves nothing
behind, a barrier closes the open step, tokens are checked; wire formats travel both ways and
a wrong encoded size or format is named."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import numpy as np
import pytest

from gradstar.client.steps import StepsClient
from gradstar.client.steps.client import _connected
from gradstar.config import ClientSettings
from gradstar.errors import AuthenticationError, ProtocolError, StepMismatchError, StepTimeoutError
from gradstar.proto.v1 import steps_pb2 as pb
from gradstar.proto.v1 import steps_pb2_grpc
from gradstar.sync_modes import Asynchronous, Quorum
from gradstar.transport.status import error_from_rpc
from gradstar.wire.formats import FORMATS, roundtrip

from .conftest import close_all, join_all, until

QUORUM = Quorum(min_ranks=2, timeout=30.0)
T = 10.0  # every call's deadline


@pytest.fixture
async def members(coordinator):
    """The two members of job "j" (real joins): the Steps service takes calls from members
    only."""
    groups = await join_all(coordinator.address, 2, job="j")
    yield groups
    await close_all(groups)


@pytest.fixture
async def ranks(members):
    made: list[StepsClient] = []

    def make(rank: int) -> StepsClient:
        made.append(StepsClient.for_group(members[rank], "m"))
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
            [p async for p in stub.Contribute(parts(), timeout=T)]
    assert isinstance(error_from_rpc(raised.value, "contribute", "hub"), ProtocolError)
    await r0.contribute(QUORUM, 0, 0, 1.0, g(1, 1, 1, 1), T)
    await r1.contribute(QUORUM, 0, 0, 1.0, g(3, 3, 3, 3), T)
    got = await r0.fetch(0, 1, T)
    np.testing.assert_array_equal(got.values[0], g(2, 2, 2, 2))


async def test_synchronize_closes_the_open_step_for_every_rank(ranks):
    r0, r1 = ranks(0), ranks(1)
    slow = Quorum(min_ranks=2, timeout=600.0)
    await r0.contribute(slow, 0, 0, 1.0, g(4), T)
    replies = await asyncio.gather(r0.synchronize(1, T), r1.synchronize(1, T))
    # Rank 1 contributed nothing: the step closed with rank 0 alone, half a full step of
    # min_ranks = 2 (Quorum's default scaling, "share").
    assert [r.steps for r in replies] == [1, 1]
    got = await r1.fetch(0, 1, T)
    np.testing.assert_array_equal(got.values[0], g(2))


async def test_a_steps_call_without_the_job_token_is_refused(start_coordinator):
    hub = await start_coordinator(token="steps-token-123456")
    address = f"127.0.0.1:{hub.collective_port}"
    stranger = StepsClient(ClientSettings(coordinator=hub.address, job="j"), address, "m",
                           job="j", rank=0, generation=1, member_id="not-a-member")
    try:
        with pytest.raises(AuthenticationError):
            await stranger.heartbeat(0)
    finally:
        await stranger.close()


async def test_int8_contributions_travel_encoded_and_every_rank_decodes_the_same_aggregate(
        ranks):
    int8 = FORMATS["int8"]
    r0, r1 = ranks(0), ranks(1)
    a, b = np.linspace(-1, 1, 100, dtype=np.float32), np.linspace(3, -2, 100, dtype=np.float32)
    await r0.contribute(QUORUM, 0, 0, 1.0, a, T, wire=int8)
    await r1.contribute(QUORUM, 0, 0, 3.0, b, T, wire=int8)
    assert r0.bytes_sent == int8.encoded_nbytes(100) == 108
    sent = [roundtrip(int8, a), roundtrip(int8, b)]
    expected = roundtrip(int8, (sent[0] + sent[1] * np.float32(3)) / np.float32(4))
    got = [await client.fetch(0, 1, T) for client in (r0, r1)]
    np.testing.assert_array_equal(got[0].values[0], expected)
    np.testing.assert_array_equal(got[1].values[0], got[0].values[0])
    assert r1.bytes_received == 108


async def test_a_wrong_encoded_size_or_another_format_is_named_and_the_step_goes_on(
        coordinator, ranks):
    int8 = FORMATS["int8"]
    r0, r1 = ranks(0), ranks(1)
    await r0.contribute(QUORUM, 0, 0, 1.0, g(*[1.0] * 64), T, wire=int8)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.collective_port}") as ch:
        stub = steps_pb2_grpc.StepsStub(ch)
        # 64 int8 values take 4 + 64 bytes: one short, one over, and float32's 256.
        for nbytes in (67, 69, 256):
            header = pb.ContributionHeader(key=r1.key, mode=QUORUM.message(), numel=64,
                                           base=0, weight=1.0, wire=int8.wire)

            async def parts(header=header, nbytes=nbytes):
                yield pb.ContributionPart(header=header, data=bytes(nbytes))

            with pytest.raises(grpc.RpcError) as raised:
                [p async for p in stub.Contribute(parts(), timeout=T)]
            error = error_from_rpc(raised.value, "contribute", "hub")
            assert isinstance(error, ProtocolError), error
            assert "int8" in str(error)
    for other in (None, FORMATS["bf16"]):
        with pytest.raises(StepMismatchError, match="same wire format"):
            await r1.contribute(QUORUM, 0, 0, 1.0, g(*[9.0] * 64), T, wire=other)
    await r1.contribute(QUORUM, 0, 0, 1.0, g(*[3.0] * 64), T, wire=int8)
    got = await r0.fetch(0, 1, T)
    # Nothing refused got in: the int8 mean of 1 and 3.
    ones, threes = roundtrip(int8, g(*[1.0] * 64)), roundtrip(int8, g(*[3.0] * 64))
    np.testing.assert_array_equal(got.values[0],
                                  roundtrip(int8, (ones + threes) / np.float32(2)))


async def test_a_contribution_answer_brings_the_aggregates_the_rank_lacks(coordinator,
                                                                         ranks):
    """One round trip per training step: the answer carries every aggregate after the
    contribution's base (at most fetch_limit); with await_step it first waits for the step the
    gradient joined, and says how long it waited."""
    asy = Asynchronous()
    r0, r1 = ranks(0), ranks(1)
    verdict, got = await r0.exchange(asy, 0, 0, 1.0, g(1, 1), T, fetch_limit=16)
    assert verdict.accepted and verdict.step == 1 and got is not None
    assert (got.steps, len(got.records)) == (0, 0)  # nothing closed yet
    await r1.contribute(asy, 0, 0, 1.0, g(3, 3), T)  # step 1 closes: every live rank is in it
    # r1 runs ahead: its second gradient closes step 2 (r1 alone) and joins step 3.
    for value in (5.0, 7.0):
        await r1.contribute(asy, 0, 1, 1.0, g(value, value), T)
    verdict, got = await r0.exchange(asy, 0, 1, 1.0, g(9, 9), T, fetch_limit=1)
    assert (verdict.accepted, verdict.step, verdict.staleness) == (True, 3, 1)
    # Step 3 closed with r0's gradient (every live rank in it); the answer is capped at one
    # aggregate: step 2 only, and says that 3 steps closed (the rank fetches the rest).
    assert [r.step for r in got.records] == [2] and got.steps == 3
    # r1 alone of 2 live ranks: half a full step (the default scaling), and the record says so.
    assert list(got.records[0].factors) == [0.5]
    np.testing.assert_array_equal(got.values[0], g(2.5, 2.5))

    slow, q0, q1 = Quorum(min_ranks=2, timeout=30.0), ranks(0), ranks(1)
    q0.key.model, q1.key.model = "quorum", "quorum"
    waiting = asyncio.create_task(q0.exchange(slow, 0, 0, 2.0, g(2, 4), T, fetch_limit=16,
                                              await_step=5.0))
    # The hub's wait starts when it holds q0's gradient (a new client connects first): watched
    # on the hub's own loop (the coordinator runs in this process), it began between the last
    # look that missed it and the first that saw it.
    loop = asyncio.get_running_loop()
    looks = [loop.time()]

    def holds_it() -> bool:
        looks.append(loop.time())
        ledger = coordinator.steps.ledgers.get(("j", "quorum"))
        return ledger is not None and 0 in ledger.open.contributions

    await until(holds_it, "the hub holds q0's gradient", T)
    missed = looks[-2]
    await asyncio.sleep(0.3)
    assert not waiting.done()  # its step is open until q1's gradient arrives
    await q1.contribute(slow, 0, 0, 2.0, g(4, 8), T)
    verdict, got = await asyncio.wait_for(waiting, T)
    assert verdict.step == 1
    assert 0.3 - 1e-6 <= verdict.waited_seconds <= loop.time() - missed  # asyncio's timers
    assert [r.step for r in got.records] == [1]
    np.testing.assert_array_equal(got.values[0], g(3, 6))


async def test_a_contribution_on_the_callers_thread_answers_refuses_and_times_out_as_the_loops(
        ranks):
    # exchange_here (DDP's path: a blocking stream on the training thread) against the same
    # hub: the verdict and the aggregates as exchange's, a refusal named, a deadline kept.
    r0, r1 = ranks(0), ranks(1)
    here = asyncio.to_thread  # the caller's thread is not the loop's

    first, got = await here(r0.exchange_here, QUORUM, 0, 0, 1.0, g(1, 2), T, fetch_limit=4)
    assert (first.accepted, first.step) == (True, 1) and got.steps == 0 and not got.records
    with pytest.raises(StepMismatchError, match="twice"):
        await here(r0.exchange_here, QUORUM, 0, 0, 1.0, g(9, 9), T)
    second, got = await here(r1.exchange_here, QUORUM, 0, 0, 3.0, g(5, 6), T, fetch_limit=4,
                             await_step=5.0)
    assert second.accepted and got.steps == 1 and list(got.records[0].ranks) == [0, 1]
    np.testing.assert_array_equal(got.values[0], (g(1, 2) + g(5, 6) * 3) / 4)
    assert r1.bytes_sent == 8 and r1.bytes_received == 8
    # Step 2 waits for rank 1 (Quorum's 30 s timeout): rank 0's call, asking to wait for its
    # step, ends at its own 0.3 s deadline with StepTimeoutError, not a hang.
    with pytest.raises(StepTimeoutError, match=r"within 0\.3 s"):
        await here(r0.exchange_here, QUORUM, 0, 1, 1.0, g(1, 1), 0.3, fetch_limit=4,
                   await_step=5.0)


async def test_a_streamed_contribute_call_carries_one_contribution_after_another(coordinator,
                                                                                ranks):
    """ContributionHeader.streamed: the hub reads exactly the announced data, answers (the
    first data part in the header's message), and reads the next contribution on the same
    call; the rank's half-close ends it OK."""
    r0, r1 = ranks(0), ranks(1)
    requests: asyncio.Queue = asyncio.Queue()

    def contribution(base: int, *values: float) -> pb.ContributionPart:
        return pb.ContributionPart(data=g(*values).tobytes(), header=pb.ContributionHeader(
            key=r0.key, mode=QUORUM.message(), numel=len(values), base=base, weight=1.0,
            fetch_limit=4, streamed=True))

    async def parts():
        while (part := await requests.get()) is not None:
            yield part

    await r1.contribute(QUORUM, 0, 0, 1.0, g(3, 3), T)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.collective_port}") as ch:
        call = steps_pb2_grpc.StepsStub(ch).Contribute(parts(), timeout=T)
        await requests.put(contribution(0, 1, 1))  # closes step 1 (both ranks in it)
        first = await call.read()
        assert first.header.contributed.step == 1 and first.header.ready
        assert [r.step for r in first.header.records] == [1]
        np.testing.assert_array_equal(np.frombuffer(first.data, "<f4"), g(2, 2))
        await requests.put(contribution(1, 5, 5))  # step 2, open: rank 1 has not sent
        second = await call.read()
        assert (second.header.contributed.step, second.header.steps) == (2, 1)
        assert second.header.ready and not second.header.records and not second.data
        await requests.put(None)  # half-close
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("second", ["another caller", "more data", "not streamed"])
async def test_a_streamed_call_that_breaks_its_framing_is_refused_and_keeps_nothing(
        coordinator, ranks, second):
    r0, r1 = ranks(0), ranks(1)

    def header(key, base: int, streamed: bool = True) -> pb.ContributionHeader:
        return pb.ContributionHeader(key=key, mode=QUORUM.message(), numel=2, base=base,
                                     weight=1.0, fetch_limit=4, streamed=streamed)

    first = pb.ContributionPart(header=header(r0.key, 0), data=g(1, 1).tobytes())
    follows = {
        "another caller": [pb.ContributionPart(header=header(r1.key, 0),
                                               data=g(9, 9).tobytes())],
        "more data": [pb.ContributionPart(data=g(9).tobytes())],  # past the first's data
        "not streamed": [pb.ContributionPart(header=header(r0.key, 0, streamed=False),
                                             data=g(9, 9).tobytes())],
    }[second]

    async def parts():
        yield first
        for part in follows:
            yield part

    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.collective_port}") as ch:
        call = steps_pb2_grpc.StepsStub(ch).Contribute(parts(), timeout=T)
        answer = await call.read()
        assert answer.header.contributed.step == 1  # the first contribution was taken
        assert not answer.header.records  # its step waits for rank 1 (Quorum of 2)
        with pytest.raises(grpc.RpcError) as raised:
            await call.read()
    assert isinstance(error_from_rpc(raised.value, "contribute", "hub"), ProtocolError)
    # Nothing of what followed reached the step: rank 1's own gradient closes it.
    await r1.contribute(QUORUM, 0, 0, 1.0, g(3, 3), T)
    got = await r1.fetch(0, 1, T)
    np.testing.assert_array_equal(got.values[0], g(2, 2))


class _Relay:
    """A TCP relay to the hub whose connections the test can cut (a dropped connection, as a
    restarted hub leaves it)."""

    def __init__(self, port: int) -> None:
        self.port, self.writers, self.server = port, [], None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [writer, up_writer]

        async def pump(source, sink) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(1 << 16):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.cut()
        self.server.close()
        await self.server.wait_closed()


async def test_a_kept_stream_whose_connection_dropped_is_not_used_again(coordinator, members):
    """exchange_here keeps its stream from call to call; once its connection dropped (the
    channel knows it), the next contribution goes on a new stream instead of failing on the
    dead one, which the hub never read from."""
    relay = _Relay(coordinator.collective_port)
    pg = members[0]
    client = StepsClient(pg.settings, await relay.start(), "m", job=pg.job, rank=pg.rank,
                         generation=pg.generation, member_id=pg.member_id)
    push, here = Asynchronous(timeout=0), asyncio.to_thread
    try:
        first, _ = await here(client.exchange_here, push, 0, 0, 1.0, g(1, 1), T, fetch_limit=4)
        relay.cut()
        await until(lambda: not _connected(client._blocking), "the channel saw the drop", T)
        second, got = await here(client.exchange_here, push, 0, 0, 1.0, g(3, 3), T,
                                 fetch_limit=4)
        # The second gradient reached the hub: its step 2 closed step 1 (rank 0's own).
        assert (first.step, second.step) == (1, 2) and got.steps == 1
        np.testing.assert_array_equal(got.values[0], g(0.5, 0.5))  # 1 of 2 live ranks
    finally:
        await client.close()
        await relay.close()

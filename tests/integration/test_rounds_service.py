"""The Rounds service over real sockets: bad input gets a named error and changes nothing, a
replica that dies mid-stream leaves no partial data, tokens are checked."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from gradstar.client.outer.rounds import RoundPolicySpec, RoundsClient
from gradstar.config import ClientSettings
from gradstar.errors import (
    AuthenticationError,
    HubCapacityError,
    ProtocolError,
    RoundMismatchError,
    RoundTimeoutError,
)
from gradstar.proto.v1 import rounds_pb2 as pb
from gradstar.proto.v1 import rounds_pb2_grpc
from gradstar.transport.channels import PART_BYTES
from gradstar.transport.status import error_from_rpc
from gradstar.wire.formats import roundtrip, wire_format

from .conftest import until

POLICY = RoundPolicySpec(outer_lr=0.5, outer_momentum=0.0, min_replicas=2, round_timeout=30)


@pytest.fixture
async def clients(coordinator):
    made: list[RoundsClient] = []

    def make(replica: str, **settings) -> RoundsClient:
        made.append(RoundsClient(ClientSettings(coordinator=coordinator.address, job="j",
                                                **settings), replica))
        return made[-1]

    yield make
    for client in made:
        await client.close()


async def raw_contribute(address: str, parts, timeout: float = 10):
    """A Contribute call of hand-made parts; the gradstar error the hub answered."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rounds_pb2_grpc.RoundsStub(channel)

        async def stream():
            for part in parts:
                yield part

        try:
            return await stub.Contribute(stream(), timeout=timeout)
        except grpc.RpcError as rpc:
            return error_from_rpc(rpc, "contributing", address)


def header(numel: int, **fields) -> pb.TensorHeader:
    return pb.TensorHeader(key=pb.RoundsKey(job="j", model="m", fragment=0, replica="x"),
                           numel=numel, policy=POLICY.message(), **fields)


@pytest.mark.parametrize(("parts", "error", "match"), [
    ([pb.TensorPart(data=b"\0" * 16)], ProtocolError, "must begin with its header"),
    ([pb.TensorPart(header=header(4), data=b"\0" * 12)], ProtocolError, "sent 12 bytes"),
    ([pb.TensorPart(header=header(4), data=b"\0" * 20)], ProtocolError, "more data"),
    ([pb.TensorPart(header=header(4), data=np.full(4, np.nan, np.float32).tobytes())],
     ProtocolError, "NaN or infinite"),
    ([pb.TensorPart(header=header(4, wire_format="q4"), data=b"\0" * 16)], ProtocolError,
     "knows no wire format 'q4'"),
    ([pb.TensorPart(header=header(4, wire_format="int8"), data=b"\0" * 4)], ProtocolError,
     "announced 4 int8 values but sent 4 bytes"),
    ([pb.TensorPart(header=header(1 << 40))], HubCapacityError, "over this coordinator's limit"),
    ([pb.TensorPart(header=header(3), data=b"\0" * 12)], RoundMismatchError, "sent 3 values"),
    ([pb.TensorPart(header=header(4, round=7), data=b"\0" * 16)], RoundMismatchError,
     "only 0 rounds completed"),
])
async def test_bad_contributions_get_named_errors_and_change_nothing(coordinator, clients,
                                                                     parts, error, match):
    seeder = clients("a")
    await seeder.seed("m", 0, np.ones(4, np.float32), 10)
    answer = await raw_contribute(coordinator.address, parts)
    assert isinstance(answer, error) and match in str(answer), answer
    frag = coordinator.rounds.fragments[("j", "m", 0)]
    assert frag.open is None and coordinator.rounds.held_bytes == 0
    rounds, params = await seeder.fetch("m", 0, 0, 10)
    assert rounds == 0 and params.tolist() == [1, 1, 1, 1]


async def test_a_replica_dying_mid_stream_leaves_no_partial_contribution(coordinator, clients):
    a = clients("a")
    numel = PART_BYTES // 4 * 3
    await a.seed("m", 0, np.zeros(numel, np.float32), 10)
    sent = asyncio.Event()

    async def cut_stream():
        yield pb.TensorPart(header=header(numel), data=b"\0" * PART_BYTES)
        sent.set()
        await asyncio.sleep(3600)  # the process dies here: the call is cancelled

    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        call = rounds_pb2_grpc.RoundsStub(channel).Contribute(cut_stream(), timeout=30)
        await asyncio.wait_for(sent.wait(), 10)
        await asyncio.sleep(0.2)
        call.cancel()
    await until(lambda: coordinator.rounds.fragments[("j", "m", 0)].open is None
                and coordinator.rounds.held_bytes == 0, "the hub let go of the cut contribution")
    # The round goes on with the replicas that complete their contributions.
    b = clients("b")
    await b.seed("m", 0, np.zeros(numel, np.float32), 10)
    delta = np.ones(numel, np.float32)
    results = await asyncio.gather(
        a.round("m", 0, 0, POLICY, delta, 20), b.round("m", 0, 0, POLICY, delta, 20))
    for accepted, rounds, params in results:
        assert accepted and rounds == 1
        np.testing.assert_array_equal(params, np.full(numel, -0.5, np.float32))


async def test_too_few_replicas_time_the_waiting_one_out_with_a_named_error(clients):
    a = clients("a")
    await a.seed("m", 0, np.zeros(4, np.float32), 10)
    with pytest.raises(RoundTimeoutError, match="did not close within 1 s"):
        await a.round("m", 0, 0, POLICY, np.ones(4, np.float32), 1)


async def test_rounds_need_the_job_token(start_coordinator):
    coordinator = await start_coordinator(token="job-token")
    wrong = RoundsClient(ClientSettings(coordinator=coordinator.address, job="j",
                                        token="wrong"), "a")
    right = RoundsClient(ClientSettings(coordinator=coordinator.address, job="j",
                                        token="job-token"), "a")
    try:
        with pytest.raises(AuthenticationError, match="job token wrong"):
            await wrong.seed("m", 0, np.zeros(4, np.float32), 10)
        assert await right.seed("m", 0, np.zeros(4, np.float32), 10) == 0
    finally:
        await wrong.close()
        await right.close()


async def test_rounds_carry_tensors_on_the_collective_port(coordinator, clients):
    # The Seed reply names the port whose connections tolerate full links; Contribute and
    # Fetch go there (the control port serves them too, for a coordinator that restarted).
    a = clients("a")
    await a.seed("m", 0, np.zeros(4, np.float32), 10)
    assert a._bulk_channel is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.collective_port}") as ch:
        stub = rounds_pb2_grpc.RoundsStub(ch)
        first = await anext(stub.Fetch(pb.FetchRequest(
            key=pb.RoundsKey(job="j", model="m", fragment=0, replica="x")), timeout=10)
            .__aiter__())
    assert first.header.ready and first.header.numel == 4
    policy = RoundPolicySpec(outer_lr=1.0, outer_momentum=0.0, min_replicas=1)
    accepted, rounds, params = await a.round("m", 0, 0, policy, np.ones(4, np.float32), 10)
    assert accepted and rounds == 1 and params.tolist() == [-1, -1, -1, -1]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
async def test_contributions_in_a_wire_format_are_decoded_and_the_model_stays_float32(
        coordinator, clients, fmt):
    numel = 5000  # not a multiple of the 64-value blocks: an uneven tail
    a, b = clients("a"), clients("b")
    for c in (a, b):
        await c.seed("m", 0, np.zeros(numel, np.float32), 10)
    rng = np.random.default_rng(3)
    deltas = {c: rng.standard_normal(numel).astype(np.float32) for c in (a, b)}
    results = await asyncio.gather(*(
        c.round("m", 0, 0, POLICY, d, 20, wire=wire_format(fmt)) for c, d in deltas.items()))
    # outer SGD, lr 0.5, no momentum, on the mean of what each replica's encoding kept
    kept = [roundtrip(fmt, d) for d in deltas.values()]
    want = np.float32(-0.5) * ((kept[0] + kept[1]) / np.float32(2))
    for accepted, rounds, params in results:
        assert accepted and rounds == 1 and params.dtype == np.float32
        np.testing.assert_allclose(params, want, rtol=1e-6, atol=1e-7)
    encoded = wire_format(fmt).encoded_nbytes(numel)
    assert a.bytes_sent == numel * 4 + encoded  # the seed in float32, the round encoded
    assert encoded < numel * 4


async def test_a_seed_in_a_wire_format_is_refused(coordinator):
    part = pb.TensorPart(header=pb.TensorHeader(
        key=pb.RoundsKey(job="j", model="m", fragment=0, replica="x"), numel=64,
        wire_format="int8"), data=b"\0" * 68)
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        async def stream():
            yield part

        with pytest.raises(grpc.RpcError) as refused:
            await rounds_pb2_grpc.RoundsStub(channel).Seed(stream(), timeout=10)
    error = error_from_rpc(refused.value, "seeding", coordinator.address)
    assert isinstance(error, ProtocolError) and "raw float32" in str(error)
    assert ("j", "m", 0) not in coordinator.rounds.fragments

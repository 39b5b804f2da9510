"""Peer streams to a rank that takes no inbound connections, through the coordinator's relay,
over real sockets: the rank says it is outbound-only at join (as a host behind NAT does, or as
its node-local shard's failed probe says for it), and a rank on another host reaches it over
calls both dial to the coordinator; the same messages, tags and errors as a direct stream. A
relay call is bound to its caller: another rank's identity, or a made-up one, is refused.

Hosts are told apart by the host key each rank announces; here two ranks of one process
announce two (the test patches the key for the outbound-only rank's join)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

import gradstar
from gradstar.client import session
from gradstar.errors import ProtocolError, RendezvousError
from gradstar.transport.relay import relay_metadata
from gradstar.transport.status import error_from_rpc
from gradstar.wire import PUNCH_METHOD, RELAY_METHOD

from .conftest import close_all

T = 10.0


@pytest.fixture
async def behind_nat(coordinator, monkeypatch):
    """Rank 0 on host "here", rank 1 on host "far" and outbound-only."""
    def join(rank: int, **options):
        return asyncio.ensure_future(gradstar.init_process_group_async(
            coordinator=coordinator.address, job="nat", world_size=2, rank=rank, timeout=T,
            join_timeout=T, chunk_bytes=4096, **options))

    monkeypatch.setattr(session.shm, "host_key", lambda: "here")
    first = join(0)
    await asyncio.sleep(0.2)  # its join request is out, with its host key
    monkeypatch.setattr(session.shm, "host_key", lambda: "far")
    second = join(1, outbound_only=True)
    groups = await asyncio.wait_for(asyncio.gather(first, second), 2 * T)
    yield groups
    await close_all(groups)


async def test_a_rank_behind_nat_receives_through_the_relay(behind_nat):
    here, far = behind_nat
    assert here._peer_endpoint.closed_to_me == {1: "far"}  # rank 0 relays to rank 1
    assert far._peer_endpoint.closed_to_me == {}  # rank 1 dials rank 0 directly
    big = np.arange(50_000, dtype=np.float32)  # many chunks of 4 KiB
    for tag, payload in ((0, big), (7, np.arange(6, dtype=np.int64).reshape(2, 3))):
        sent = asyncio.ensure_future(here.send(payload, 1, tag=tag))
        got = await asyncio.wait_for(far.recv(0, tag=tag), T)
        await asyncio.wait_for(sent, T)
        np.testing.assert_array_equal(got, payload)
        assert got.dtype == payload.dtype
    back = asyncio.ensure_future(far.send(big * 2, 0))
    np.testing.assert_array_equal(await asyncio.wait_for(here.recv(1), T), big * 2)
    await back
    link = here._peer_endpoint._links[1].result()
    assert link.address == here.collective_address  # through the coordinator, not rank 1's


async def test_a_relay_call_is_bound_to_its_caller(coordinator, behind_nat):
    here, far = behind_nat
    async with grpc.aio.insecure_channel(here.collective_address) as channel:
        relay = channel.stream_stream(RELAY_METHOD)
        for metadata, words in [
            # Rank 0's member id as rank 1, listening in its place.
            (relay_metadata("nat", far.generation, 1, here.member_id, "listen"), "not rank 1"),
            # A made-up member sending.
            (relay_metadata("nat", here.generation, 0, "0" * 32, "send", 1), "not rank 0"),
            # Another job.
            (relay_metadata("other", here.generation, 0, here.member_id, "send", 1),
             "no generation"),
        ]:
            call = relay(metadata=metadata, timeout=T)
            with pytest.raises(grpc.RpcError) as raised:
                await call.read()
            error = error_from_rpc(raised.value, "relay", "hub")
            assert isinstance(error, RendezvousError) and words in str(error), error
    # A punch (NAT traversal to a hub shard) is bound the same way, and a member's own asks
    # for a stripe its generation does not have (this coordinator has no shards).
    async with grpc.aio.insecure_channel(here.collective_address) as channel:
        punch = channel.unary_unary(PUNCH_METHOD)
        for metadata, body, words in [
            (relay_metadata("nat", here.generation, 0, "0" * 32, "punch", 0), b"\x10\x00",
             "not rank 0"),
            (relay_metadata("nat", here.generation, 0, here.member_id, "punch", 0), b"\x10\x00",
             "no stripe 0"),
        ]:
            with pytest.raises(grpc.RpcError) as raised:
                await punch(body, metadata=metadata, timeout=T)
            error = error_from_rpc(raised.value, "punch", "hub")
            assert isinstance(error, RendezvousError) and words in str(error), error
        with pytest.raises(grpc.RpcError) as raised:  # no port: refused before anything
            await punch(b"", metadata=relay_metadata("nat", here.generation, 0, here.member_id,
                                                     "punch", 0), timeout=T)
        assert isinstance(error_from_rpc(raised.value, "punch", "hub"), ProtocolError)
    # The real pair still talks.
    sent = asyncio.ensure_future(here.send(np.ones(3, np.float32), 1))
    np.testing.assert_array_equal(await asyncio.wait_for(far.recv(0), T), np.ones(3))
    await sent

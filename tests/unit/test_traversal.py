"""NAT traversal (:mod:`gradstar.transport.traversal`) and the coordinator's part in it
(:meth:`ShardRegistry.traversal`, :meth:`ShardRegistry.punch`, ``PeerRelay/Punch``).

The punch itself across two hosts behind NAT (nftables dropping new inbound TCP) is proved on
the emulated cluster (tests/cluster/test_outbound_hosts.py); here, on the loopback, every
piece on its own: a route's connection carries bytes both ways unchanged, a refused or
unanswered punch fails within its deadline with the reason kept, and the registry makes a
shard dial the caller's own host only, for a stripe of the caller's own generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket

import pytest

from gradstar.coordinator.rendezvous import Rendezvous
from gradstar.coordinator.shards import ShardRegistry
from gradstar.errors import ProtocolError, RendezvousError
from gradstar.proto.v1 import shard_pb2 as spb
from gradstar.transport.traversal import PunchedRoute, Tunnel, answer, punch, reusable_socket

pytestmark = pytest.mark.timeout(60)


async def _echo_server() -> tuple[asyncio.AbstractServer, int]:
    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_route_carries_bytes_both_ways_unchanged_through_a_punched_connection():
    """The rank's route asks (as the coordinator would) the other end to answer from its
    punch port; the connection gRPC would open carries 8 MB there and back unchanged."""
    async def main():
        server, port = await _echo_server()
        reserved = reusable_socket()  # the shard keeps its punch port bound
        punch_port = reserved.getsockname()[1]
        asked: list[int] = []
        answers: list[asyncio.Future] = []

        async def ask(their_port: int) -> None:
            asked.append(their_port)
            answers.append(asyncio.ensure_future(answer(
                punch_port, ("127.0.0.1", their_port), ("127.0.0.1", port), timeout=5)))

        route = PunchedRoute(("127.0.0.1", punch_port), ask, timeout=5).start()
        host, local = route.address.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(local)), 5)
        payload = os.urandom(8 << 20)
        writer.write(payload)
        await writer.drain()
        back = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
        assert hashlib.sha256(back).digest() == hashlib.sha256(payload).digest()
        assert len(asked) == 1 and route.last_error == ""
        (await answers[0]).close()
        writer.close()
        await route.close()
        reserved.close()
        server.close()

    asyncio.run(main())


def test_a_refused_punch_closes_the_connection_and_names_why():
    """The coordinator refusing (here: the ask raising) ends gRPC's connection at once; the
    route keeps the reason for the error that names the shard."""
    async def main():
        async def ask(port: int) -> None:
            raise RendezvousError("hub shard 1 is dialed directly, not through NAT")

        route = PunchedRoute(("127.0.0.1", 9), ask, timeout=5).start()
        host, local = route.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(local))
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, not hung
        assert "dialed directly" in route.last_error
        writer.close()
        await route.close()

    asyncio.run(main())


def test_an_unanswered_punch_fails_by_its_deadline():
    """Nobody dials back: the punch gives up at its deadline (a bound port that never
    listens resets every attempt, which it retries until then)."""
    async def main():
        silent = reusable_socket()  # bound, never listening: every SYN is reset
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises((OSError, TimeoutError)):
            await punch(0, ("127.0.0.1", silent.getsockname()[1]), loop.time() + 0.5)
        assert loop.time() - started < 5
        silent.close()

    asyncio.run(main())


def test_a_tunnel_ends_both_ways_when_one_end_closes():
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    tunnel = Tunnel(a_peer, b_peer).start()
    a.sendall(b"hello")
    assert b.recv(5) == b"hello"
    b.sendall(b"back")
    assert a.recv(4) == b"back"
    a.close()  # one end gone: the other reads its end, and the tunnel's sockets close
    b.settimeout(5)
    assert b.recv(1) == b""
    b.close()
    for thread in tunnel._threads:
        thread.join(5)
    assert not tunnel.open


# -- the coordinator's part ----------------------------------------------------------------------

def _registry() -> tuple[ShardRegistry, object]:
    """Three node-local shards of job "j": h0 reachable, h1 behind NAT with a punch port, h2
    behind NAT without one; and a generation formed over them."""
    registry = ShardRegistry(Rendezvous(heartbeat_timeout=10.0))
    for index, (host, reachable, punch_port) in enumerate(
            [("h0", True, 0), ("h1", False, 4100), ("h2", False, 0)]):
        registry.register(spb.ShardHello(address=f"10.0.0.{index}:1", job="j", host=host,
                                         punch_port=punch_port),
                          job_scoped=True, reachable=reachable, public_host=f"198.51.100.{index}")
    gen = registry.rendezvous.adopt("j", 1, 2, {0: "m0", 1: "m1"})
    registry.on_formed(gen)
    return registry, gen


def test_a_shard_behind_nat_takes_stripes_when_it_can_be_punched_through():
    async def main():
        registry, gen = _registry()
        # h2's shard cannot be reached from the other hosts at all: no stripe goes to it.
        assert gen.shards == ["10.0.0.0:1", "10.0.0.1:1"]
        # From another host, h1's shard is punched to at its NAT's outside address; from
        # its own host it is dialed; every shard dialed: an empty list.
        assert registry.traversal("j", 1, "h0") == ["", "198.51.100.1:4100"]
        assert registry.traversal("j", 1, "h1") == []
        assert registry.traversal("j", 1, "h9") == ["", "198.51.100.1:4100"]
        assert registry.traversal("j", 2, "h0") == []  # no such generation: nothing to punch
        assert registry.outbound_hosts("j") == {"h1", "h2"}

    asyncio.run(main())


def test_shards_of_every_job_behind_nat_take_stripes_when_they_can_be_punched_through():
    registry = ShardRegistry(Rendezvous(heartbeat_timeout=10.0))
    for index, (reachable, punch_port) in enumerate([(True, 0), (False, 4100), (False, 0)]):
        registry.register(spb.ShardHello(address=f"10.0.0.{index}:1", host=f"h{index}",
                                         punch_port=punch_port), reachable=reachable)
    assert [r.address for r in registry.stripes_for("any")] == ["10.0.0.0:1", "10.0.0.1:1"]


def test_a_punch_goes_to_the_callers_stripe_only_and_to_its_own_host():
    async def main():
        registry, _ = _registry()
        h1 = registry.slots[1]
        while not h1.outbox.empty():  # its "accepted" and "formed"
            h1.outbox.get_nowait()
        registry.punch("j", 1, 1, "203.0.113.7", 50123)
        command = h1.outbox.get_nowait()
        assert command.WhichOneof("kind") == "punch"
        assert (command.punch.host, command.punch.port) == ("203.0.113.7", 50123)
        with pytest.raises(RendezvousError, match="dialed directly"):
            registry.punch("j", 1, 0, "203.0.113.7", 50123)
        with pytest.raises(RendezvousError, match="no stripe 2"):
            registry.punch("j", 1, 2, "203.0.113.7", 50123)
        with pytest.raises(RendezvousError, match="generation 5"):
            registry.punch("j", 5, 1, "203.0.113.7", 50123)
        with pytest.raises(ProtocolError, match="port"):
            registry.punch("j", 1, 1, "203.0.113.7", 0)
        registry.lost(h1, "its control stream broke")
        with pytest.raises(RendezvousError, match="not up"):
            registry.punch("j", 1, 1, "203.0.113.7", 50123)
        assert h1.outbox.empty()  # nothing more reached the shard

    asyncio.run(main())

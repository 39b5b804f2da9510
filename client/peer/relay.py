"""A rank's half of the coordinator's peer relay (the hub's half is
``gradstar.coordinator.rendezvous.relay``, whose docstring has the protocol): how peer streams
reach a rank on a host that takes no inbound connections, over calls both ranks dial.

- The receiver (:class:`RelayListener`, started when its own peer-table entry says it is
  outbound-only) keeps a ``listen`` call open on the coordinator's collective port. For each
  sender the hub announces it opens an ``accept`` call and serves it with its own
  :meth:`PeerServer.Stream <gradstar.client.peer.server.PeerServer.Stream>`, through
  :class:`RelayedContext`: the same hello check, mailboxes and acknowledgements as a direct
  stream.
- The sender opens a :class:`~gradstar.client.peer.link.PeerLink` whose call is a ``send`` to
  the hub instead of a stream to the receiver's peer server (:func:`relayed_link`); the frames
  are the same.

What it costs: every frame crosses the coordinator's host (its link carries both ranks'
bytes) and one more round trip to it; direct streams keep being used wherever the receiver can
be dialed. So a sender first tries NAT traversal (:func:`punched_link`, where the receiver
gave a punch port: ``Peer.punch``): it punches a connection through to the receiver's peer
server, which the receiver's listener answers from its punch port when the hub announces it
(a punch notice); only if that fails does it relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from gradstar.errors import GradstarError
from gradstar.transport.addresses import split_host_port
from gradstar.transport.relay import read_notice, relay_metadata
from gradstar.transport.traversal import PunchedRoute, PunchPort, asker
from gradstar.wire import PUNCH_METHOD, RELAY_METHOD

from .link import PeerLink

log = logging.getLogger(__name__)

#: Pause before a broken listen call is opened again (the coordinator may be restarting).
RELISTEN_SECONDS = 1.0


class _RelayAbort(Exception):
    """The relayed stream was ended by this rank's peer server (an ``abort``)."""


class RelayedContext:
    """What :meth:`PeerServer.Stream` needs of a servicer context (read, write, abort), over
    the client side of an ``accept`` call: the sender's frames are this call's responses, and
    this rank's frames its requests."""

    def __init__(self, call) -> None:
        self._call = call

    async def read(self):
        frame = await self._call.read()
        return grpc.aio.EOF if frame is grpc.aio.EOF else frame

    async def write(self, frame: bytes) -> None:
        await self._call.write(frame)

    async def abort(self, code, details: str = "", trailing_metadata=()) -> None:
        # The ERROR frame went first (as on a direct stream); the sender reads it, then EOF.
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            await self._call.done_writing()
        raise _RelayAbort(details)


class RelayListener:
    """The receiver's ``listen`` call and the ``accept`` calls it opens (one per sender that
    asks), each served by ``server.Stream``; :meth:`stop` ends them all."""

    def __init__(self, channel: grpc.aio.Channel, server, identity, member_id: str,
                 metadata, punch: PunchPort | None = None) -> None:
        """``punch``: this rank's punch port, joined to its peer server, to answer the
        punches the hub announces (NAT traversal); None: relayed streams only."""
        self._channel = channel
        self._punch = punch
        self._server = server
        self._identity = identity
        self._member_id = member_id
        self._metadata = tuple(metadata)
        self._tasks: set[asyncio.Task] = set()
        self._main: asyncio.Task | None = None

    def start(self) -> None:
        self._main = asyncio.ensure_future(self._listen())

    def _call_metadata(self, role: str, peer: int = -1):
        me = self._identity
        return self._metadata + relay_metadata(me.job, me.generation, me.rank, self._member_id,
                                               role, peer)

    async def _listen(self) -> None:
        while True:
            call = self._channel.stream_stream(RELAY_METHOD)(
                metadata=self._call_metadata("listen"))
            try:
                while (frame := await call.read()) is not grpc.aio.EOF:
                    src, host, port = read_notice(frame)
                    if host:  # rank src punches towards this rank: dial it back
                        if self._punch is not None:
                            self._punch.answer((host, port))
                        continue
                    task = asyncio.ensure_future(self._accept(src))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            except (grpc.RpcError, GradstarError) as error:
                log.debug("rank %d's relay listen call ended: %s", self._identity.rank, error)
            finally:
                call.cancel()
            await asyncio.sleep(RELISTEN_SECONDS)

    async def _accept(self, src: int) -> None:
        call = self._channel.stream_stream(RELAY_METHOD)(
            metadata=self._call_metadata("accept", src))
        try:
            await self._server.Stream(None, RelayedContext(call))
            await call.done_writing()
        except (_RelayAbort, grpc.RpcError, asyncio.InvalidStateError) as error:
            log.debug("rank %d's relayed stream from rank %d ended: %s", self._identity.rank,
                      src, error)
        finally:
            call.cancel()

    async def stop(self) -> None:
        tasks = [t for t in (self._main, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._channel.close()


def relayed_link(identity, dst: int, hub: str, settings, metadata, member_id: str) -> PeerLink:
    """A link to rank ``dst`` through the coordinator's relay at ``hub`` (its collective port)
    instead of ``dst``'s peer server."""
    extra = relay_metadata(identity.job, identity.generation, identity.rank, member_id, "send",
                           dst)
    return PeerLink(identity, dst, hub, settings, tuple(metadata) + extra, method=RELAY_METHOD)


def punched_link(identity, dst: int, address: str, punch: str, hub: grpc.aio.Channel,
                 where: str, settings, metadata, member_id: str) -> tuple[PeerLink, PunchedRoute]:
    """A link to rank ``dst``'s peer server (``address``) through NAT: a local route that
    punches through to ``punch`` (its Peer.punch), asking the coordinator (``hub``, the
    channel to its collective port ``where``) to have ``dst`` dial back; and the route, to
    close with the link."""
    host, port = split_host_port(punch)
    ask = asker(hub, PUNCH_METHOD, (*metadata, *relay_metadata(
        identity.job, identity.generation, identity.rank, member_id, "punch-rank", dst)),
        f"punching through to rank {dst}", where)
    route = PunchedRoute((host, int(port)), ask).start()
    return PeerLink(identity, dst, route.address, settings, metadata, authority=address), route

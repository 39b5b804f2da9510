"""A rank's point-to-point side: its peer server, its links, and the session it watches (the
protocol is in :mod:`gradstar.client.peer`).

When a receive from a rank fails because that rank *finished* (closed its group cleanly):
only once everything it sent has been received. Two signals say it finished: the goodbye at
the end of its peer stream to this rank (behind its last message), and the hub's notice on the
session (which also covers a rank that never opened a stream to this one). A rank closing its
group says goodbye on its streams before it leaves the hub, so by the time the notice comes its
streams have ended; a notice that overtakes a stream still open waits for that stream's end.

A rank whose generation already failed when it closes its group has not finished: its streams
end without a goodbye and its answer to the senders of its incoming streams is the failure, not
a RankFinishedError. Its neighbours may not have heard of the failure yet (the goodbye could
overtake the hub's notice), and they must report the lost rank, not this one as finished.
"""


from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import numpy as np

from gradstar.config import ClientSettings
from gradstar.errors import (
    CollectiveTimeoutError,
    ConfigurationError,
    GradstarError,
    ProcessGroupClosedError,
    RankFinishedError,
    RankLostError,
)
from gradstar.transport.addresses import (
    WILDCARDS,
    advertised_host,
    host_port,
    is_loopback,
    split_host_port,
)
from gradstar.transport.channels import open_channel
from gradstar.transport.traversal import PunchPort

from .. import session
from ..collective.data_plane import resolve
from .link import PeerLink
from .relay import RelayListener, punched_link, relayed_link
from .server import Identity, LinkLost, PeerServer

log = logging.getLogger(__name__)

#: How long closing the group waits for sends still in flight (issued, not yet held by their
#: receivers) before it says goodbye behind them.
FLUSH_TIMEOUT = 5.0


def peer_hosts(settings: ClientSettings) -> tuple[str, str]:
    """(the host the peer server binds, the host it advertises).

    An explicit ``peer_host`` is bound, and advertised unless it is a wildcard. By default a
    rank whose coordinator is on this host (a loopback address) serves on 127.0.0.1 only, as
    every rank of such a job is here; otherwise it serves on every interface and advertises
    its address toward the coordinator (:mod:`gradstar.transport.addresses`), which the other
    hosts reach as they reach the coordinator.

    Raises:
        ConfigurationError: ``socket_ifname`` names no interface with an IPv4 address.
    """
    s = settings
    toward = split_host_port(s.coordinator)[0]
    bind = s.peer_host
    if bind is None:
        local = is_loopback(toward) and not (s.advertise_host or s.socket_ifname)
        bind = "127.0.0.1" if local else "0.0.0.0"
    if bind not in WILDCARDS and not s.advertise_host:
        return bind, bind
    return bind, advertised_host(toward, advertise=s.advertise_host, ifname=s.socket_ifname)


class PeerEndpoint:
    """A rank's point-to-point side: its peer server, its links and the session it watches."""

    def __init__(self, settings: ClientSettings, metadata) -> None:
        self.settings = settings
        self.server = PeerServer(settings)
        self._metadata = metadata
        self._links: dict[int, asyncio.Future] = {}
        #: Sends in flight (tasks), which closing lets finish first.
        self._sending: set[asyncio.Future] = set()
        self._session = None
        self.identity: Identity | None = None
        self.peers: dict[int, str] = {}
        #: Ranks on other hosts that take no inbound connections (rank -> host key): their
        #: streams go through the coordinator's relay (:mod:`.relay`) at ``relay``.
        self.closed_to_me: dict[int, str] = {}
        self.relay = ""
        self._member_id = ""
        self._listener: RelayListener | None = None
        #: NAT traversal (settings.nat_traversal): the port this rank answers punches from;
        #: where the others punch through to (rank -> Peer.punch); the routes of punched
        #: links; the channel their punches are asked on.
        self._punch: PunchPort | None = None
        self.punches: dict[int, str] = {}
        self._routes: list = []
        #: rank -> how its stream goes: "direct", "punched" or "relayed".
        self.routes_to: dict[int, str] = {}
        self._hub: grpc.aio.Channel | None = None
        self.address = ""
        #: Set by :meth:`close`: what operations still waiting raise.
        self.closed: ProcessGroupClosedError | None = None
        #: Payload bytes of the messages sent (once received) and received so far.
        self.bytes_sent = self.bytes_received = 0

    async def start(self, advertise: str = "") -> str:
        """Start the peer server; return the address to register at rendezvous.

        ``advertise`` overrides the address (for NAT or a hostname the others resolve).
        """
        s = self.settings
        if s.world_size == 1:
            return ""  # no other rank to talk to
        if (s.tls_ca or s.tls_cert) and not (s.tls_cert and s.tls_key):
            # TLS to the hub but no certificate to serve with: no plaintext fallback. The
            # empty address makes sends to this rank fail with a ConfigurationError.
            return ""
        bind, host = peer_hosts(s)
        port = await self.server.start(bind)
        self.address = advertise or host_port(host, port)
        if s.nat_traversal and bind != "127.0.0.1":
            bound = "" if bind in WILDCARDS else bind
            self._punch = PunchPort((bound or "127.0.0.1", port), host=bound,
                                    name=f"the peer server at {self.address}")
        return self.address

    @property
    def punch_port(self) -> int:
        """The port the others punch through to (JoinRequest.punch_port; 0: none)."""
        return self._punch.port if self._punch is not None else 0

    def bind(self, identity: Identity, joined, session) -> None:
        """Take the generation's peer table (``joined``: the rank's ``Joined``): each rank's
        address, and which ranks on other hosts than this one take no inbound connections
        (reached through the coordinator's relay). A rank that is such a rank itself keeps a
        relay listener open for the others' streams."""
        self.identity, self._session = identity, session
        peers = joined.peers
        self.peers = {p.rank: p.address for p in peers}
        mine = next((p for p in peers if p.rank == identity.rank), None)
        here = mine.host if mine is not None else ""
        self.closed_to_me = {p.rank: p.host for p in peers
                             if p.outbound_only and p.rank != identity.rank
                             and not (here and p.host == here)}
        self.punches = {p.rank: p.punch for p in peers
                        if p.punch and p.rank in self.closed_to_me and self.settings.nat_traversal}
        self._member_id = joined.member_id
        self.relay = (resolve(joined.collectives, self.settings.coordinator)
                      if joined.collectives else self.settings.coordinator)
        self.server.bind(identity)
        if mine is not None and mine.outbound_only and len(peers) > 1:
            self._listener = RelayListener(open_channel(self.settings, self.relay, bulk=True),
                                           self.server, identity, joined.member_id,
                                           self._metadata, punch=self._punch)
            self._listener.start()

    async def _link(self, dst: int) -> PeerLink:
        opening = self._links.get(dst)
        if opening is None:
            if self.closed is not None:  # no new stream once the goodbyes are said
                raise self.closed
            address = self.peers.get(dst, "")
            if dst in self.closed_to_me:  # behind NAT: punched through, else relayed
                opening = self._links[dst] = asyncio.ensure_future(self._through_nat(dst))
                return await asyncio.shield(opening)
            if not address:
                raise ConfigurationError(
                    f"rank {dst} registered no peer address, so rank {self.identity.rank} "
                    "cannot send to it: a rank configured for TLS needs tls_cert and tls_key "
                    "to serve peer streams")
            link = PeerLink(self.identity, dst, address, self.settings, self._metadata)
            opening = self._links[dst] = asyncio.ensure_future(self._open(link))
            self.routes_to[dst] = "direct"
        return await asyncio.shield(opening)

    async def _through_nat(self, dst: int) -> PeerLink:
        """A link to ``dst`` on an outbound-only host: punched through to its peer server
        (NAT traversal) where it gave a punch port, else (or if that fails) through the
        coordinator's relay."""
        if dst in self.punches:
            if self._hub is None:
                self._hub = open_channel(self.settings, self.relay)
            link, route = punched_link(self.identity, dst, self.peers.get(dst, ""),
                                       self.punches[dst], self._hub, self.relay, self.settings,
                                       self._metadata, self._member_id)
            self._routes.append(route)
            try:
                opened = await self._open(link)
                self.routes_to[dst] = "punched"
                return opened
            except GradstarError as error:
                log.warning("rank %d: no punched stream to rank %d (%s; %s); relaying it",
                            self.identity.rank, dst, error, route.last_error or "no answer")
        self.routes_to[dst] = "relayed"
        return await self._open(relayed_link(self.identity, dst, self.relay, self.settings,
                                             self._metadata, self._member_id))

    @staticmethod
    async def _open(link: PeerLink) -> PeerLink:
        try:
            await link.open()
        except BaseException as error:
            await link.close(error if isinstance(error, GradstarError) else
                             LinkLost(link.dst, f"opening the stream to rank {link.dst} failed"))
            raise
        return link

    async def send(self, arr: np.ndarray, array_kind: int, dst: int, tag: str,
                   timeout: float) -> None:
        """Send ``arr`` to ``dst``; completes once ``dst`` holds it. See the module docstring."""

        finished = self._session.finished(dst)
        if finished is not None:
            raise finished

        async def go():
            link = await self._link(dst)
            await link.send(arr, array_kind, tag)

        sending = asyncio.ensure_future(go())
        self._sending.add(sending)
        sending.add_done_callback(self._sending.discard)
        await self._guarded(sending, dst, timeout, lambda: CollectiveTimeoutError(
            f"Timed out: rank {self.identity.rank}'s send of tag {tag} to rank {dst} was not "
            f"received within {timeout:g} s", missing_ranks=[dst]))
        self.bytes_sent += arr.nbytes

    async def recv(self, src: int, tag: str, timeout: float,
                   into: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """The next message from ``src`` with ``tag``: (array, ArrayKind). ``into``: a
        C-contiguous array the message may be written straight into, if it has that dtype and
        size (then the array returned is ``into`` itself); keep it untouched until this returns.

        Raises:
            RankFinishedError: ``src`` closed its group cleanly and sent no such message.
            RankLostError, CollectiveTimeoutError, ProcessGroupClosedError: as for ``send``.
        """
        mailbox = self.server.mailboxes[src]
        found, value = mailbox.try_take(tag)
        if found:  # already complete: no other rank is needed, even if the generation failed
            return self._count(value)
        if self._session.failure is not None:
            raise self._session.failure
        self._settle(src)

        def timed_out():
            stalled = (f"; its stream is stalled on tag {mailbox.stalled_on} because this "
                       f"rank's buffer for it is full (tags held: {mailbox.held_tags()[:8]})"
                       if mailbox.stalled_on is not None else "")
            return CollectiveTimeoutError(
                f"Timed out: rank {self.identity.rank} received no message with tag {tag} "
                f"from rank {src} within {timeout:g} s{stalled}", missing_ranks=[src])

        try:
            return self._count(await self._guarded(
                self._take_unless_finished(mailbox.take(tag, into), [src]), src, timeout,
                timed_out))
        except RankFinishedError as error:
            raise self._finished_error([error.rank], tag) from None

    async def recv_any(self, tag: str, timeout: float) -> tuple[int, tuple[np.ndarray, int]]:
        """The next message with ``tag`` from any other rank: (src, (array, ArrayKind)).
        Messages of one rank come in the order it sent them; across ranks, see
        :mod:`gradstar.client.peer.mailbox`.

        Raises:
            RankFinishedError: every other rank finished and none left such a message.
            RankLostError, CollectiveTimeoutError, ProcessGroupClosedError: as for ``recv``.
        """
        boxes = self.server.mailboxes
        found = boxes.try_take_any(tag)
        if found is not None:
            return found[0], self._count(found[1])
        if self._session.failure is not None:
            raise self._session.failure
        senders = [box.src for box in boxes.values()]
        for src in senders:
            self._settle(src)

        def timed_out():
            return CollectiveTimeoutError(
                f"Timed out: rank {self.identity.rank} received no message with tag {tag} "
                f"from any rank within {timeout:g} s", missing_ranks=senders)

        try:
            src, message = await self._guarded(
                self._take_unless_finished(boxes.take_any(tag), senders), None, timeout,
                timed_out)
            return src, self._count(message)
        except RankFinishedError:
            raise self._finished_error(senders, tag) from None

    def _count(self, message: tuple[np.ndarray, int]) -> tuple[np.ndarray, int]:
        self.bytes_received += message[0].nbytes
        return message

    def _settle(self, src: int) -> None:
        """Close ``src``'s mailbox if the hub reports that it finished and no stream from it is
        open: nothing more can come from it (what it sent is held and stays receivable)."""
        finished = self._session.finished(src)
        if finished is not None and not self.server.streaming_from(src):
            self.server.mailboxes[src].close(finished)

    async def _take_unless_finished(self, take, senders: list[int]):
        """Await the receive ``take`` from ``senders``, settling each sender the hub reports
        finished meanwhile (:meth:`_settle`), which fails ``take`` once none can send."""
        take = asyncio.ensure_future(take)
        notices = {asyncio.ensure_future(self._session.until_finished(src)): src
                   for src in senders if not self.server.mailboxes[src].closed}
        try:
            while notices:
                done, _ = await asyncio.wait((take, *notices),
                                             return_when=asyncio.FIRST_COMPLETED)
                if take in done:
                    break
                for notice in done:
                    self._settle(notices.pop(notice))
            return await take
        finally:
            for notice in notices:
                notice.cancel()
            if not take.done():
                take.cancel()
                await asyncio.gather(take, return_exceptions=True)

    def _finished_error(self, ranks: list[int], tag: str) -> RankFinishedError:
        me = self.identity
        who = (f"rank {ranks[0]} of job {me.job!r} finished" if len(ranks) == 1 else
               f"every other rank of job {me.job!r} ({', '.join(map(str, ranks))}) finished")
        return RankFinishedError(
            f"{who} (closed its process group) without sending rank {me.rank} a message with "
            f"tag {tag}; everything it sent before closing has been received",
            rank=ranks[0], generation=me.generation)

    async def _guarded(self, coro, peer: int, timeout: float, timeout_error):
        """Run ``coro`` until it ends, the generation fails or ``timeout`` passes.

        A lost link waits up to :data:`~gradstar.client.session.VERDICT_GRACE` for the hub's
        verdict (which names the rank that died) and otherwise blames ``peer``.
        """
        work = asyncio.ensure_future(coro)
        verdict = asyncio.ensure_future(self._session.failure_within(timeout))
        try:
            await asyncio.wait((work, verdict), return_when=asyncio.FIRST_COMPLETED)
        finally:
            verdict.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if not work.cancelled() and work.exception() is None:
            return work.result()
        if work.cancelled():
            failure = self._session.failure
            raise failure if failure is not None else timeout_error()
        error = work.exception()
        if isinstance(error, LinkLost) and self.closed is not None:
            raise self.closed from None
        if isinstance(error, LinkLost):
            failure = await self._session.verdict(error.peer)
            if failure is not None:
                raise failure from None
            raise RankLostError(
                f"{error} and the coordinator reported no failure within "
                f"{session.VERDICT_GRACE:g} s: "
                f"rank {error.peer} is treated as lost by rank {self.identity.rank}",
                rank=error.peer, generation=self.identity.generation) from None
        raise error

    async def close(self) -> None:
        """Say goodbye on every link and stop the peer server. Idempotent.

        Sends still in flight may finish first (up to :data:`FLUSH_TIMEOUT`). A goodbye
        follows the link's last message, so the receiver knows this rank *finished* once it
        has everything it sent (its receives from here then raise RankFinishedError);
        the peer server answers the senders of its incoming streams with a RankFinishedError
        frame, which their pending and later sends to this rank raise.

        If the generation already failed, this rank did not finish it: no goodbye (the streams
        end as broken ones, which their receivers resolve into the hub's verdict) and the
        senders are answered with the failure itself (see the module docstring).
        """
        if self.closed is not None:
            return
        if self._sending:  # what was sent before closing is delivered before the goodbye
            await asyncio.wait(set(self._sending), timeout=FLUSH_TIMEOUT)
        me = self.identity
        rank = me.rank if me is not None else "?"
        self.closed = ProcessGroupClosedError(f"rank {rank}'s process group was closed")
        failure = None if self._session is None else self._session.failure
        links = list(self._links.values())
        self._links.clear()

        async def close_link(opening: asyncio.Future) -> None:
            opening.cancel()  # only if still opening; an open link says goodbye
            with contextlib.suppress(Exception, asyncio.CancelledError):
                link = await opening
                await link.close(self.closed, say_goodbye=failure is None)

        await asyncio.gather(*(close_link(opening) for opening in links))
        farewell = failure
        if farewell is None and me is not None:
            farewell = RankFinishedError(
                f"rank {me.rank} of job {me.job!r} finished (closed its process group) and "
                "takes no more messages", rank=me.rank, generation=me.generation)
        await self.server.stop(self.closed, farewell)
        if self._listener is not None:  # after the farewells, which relayed streams carry too
            await self._listener.stop()
        for route in self._routes:
            await route.close()
        if self._hub is not None:
            await self._hub.close()
        if self._punch is not None:
            self._punch.close()

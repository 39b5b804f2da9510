"""A rank's point-to-point side: its peer server, its links, and the session it watches (the
protocol is in :mod:`gradstar.client.peer`)."""


from __future__ import annotations

import asyncio
import contextlib
import socket

import numpy as np

from gradstar.config import ClientSettings
from gradstar.errors import (
    CollectiveTimeoutError,
    ConfigurationError,
    GradstarError,
    ProcessGroupClosedError,
    RankLostError,
)

from .. import session
from .link import PeerLink
from .server import Identity, LinkLost, PeerServer, host_port

_WILDCARDS = ("", "0.0.0.0", "::")


class PeerEndpoint:
    """A rank's point-to-point side: its peer server, its links and the session it watches."""

    def __init__(self, settings: ClientSettings, metadata) -> None:
        self.settings = settings
        self.server = PeerServer(settings)
        self._metadata = metadata
        self._links: dict[int, asyncio.Future] = {}
        self._session = None
        self.identity: Identity | None = None
        self.peers: dict[int, str] = {}
        self.address = ""
        #: Set by :meth:`close`: what operations still waiting raise.
        self.closed: ProcessGroupClosedError | None = None

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
        port = await self.server.start()
        host = s.peer_host
        if host in _WILDCARDS:
            host = socket.gethostname()
        self.address = advertise or host_port(host, port)
        return self.address

    def bind(self, identity: Identity, peers: dict[int, str], session) -> None:
        self.identity, self.peers, self._session = identity, peers, session
        self.server.bind(identity)

    async def _link(self, dst: int) -> PeerLink:
        opening = self._links.get(dst)
        if opening is None:
            address = self.peers.get(dst, "")
            if not address:
                raise ConfigurationError(
                    f"rank {dst} registered no peer address, so rank {self.identity.rank} "
                    "cannot send to it: a rank configured for TLS needs tls_cert and tls_key "
                    "to serve peer streams")
            link = PeerLink(self.identity, dst, address, self.settings, self._metadata)
            opening = self._links[dst] = asyncio.ensure_future(self._open(link))
        return await asyncio.shield(opening)

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

        await self._guarded(go(), dst, timeout, lambda: CollectiveTimeoutError(
            f"Timed out: rank {self.identity.rank}'s send of tag {tag} to rank {dst} was not "
            f"received within {timeout:g} s", missing_ranks=[dst]))

    async def recv(self, src: int, tag: str, timeout: float) -> tuple[np.ndarray, int]:
        """The next message from ``src`` with ``tag``: (array, ArrayKind)."""
        mailbox = self.server.mailboxes[src]
        found, value = mailbox.try_take(tag)
        if found:  # already complete: no other rank is needed, even if the generation failed
            return value
        if self._session.failure is not None:
            raise self._session.failure
        finished = self._session.finished(src)
        if finished is not None:  # and nothing of it waits in the mailbox
            raise finished

        def timed_out():
            stalled = (f"; its stream is stalled on tag {mailbox.stalled_on} because this "
                       f"rank's buffer for it is full (tags held: {mailbox.held_tags()[:8]})"
                       if mailbox.stalled_on is not None else "")
            return CollectiveTimeoutError(
                f"Timed out: rank {self.identity.rank} received no message with tag {tag} "
                f"from rank {src} within {timeout:g} s{stalled}", missing_ranks=[src])

        return await self._guarded(self._take_unless_finished(mailbox, tag, src), src, timeout,
                                   timed_out)

    async def _take_unless_finished(self, mailbox, tag: str, src: int):
        """``mailbox.take(tag)``, unless the hub reports that ``src`` finished first: its sends
        were acknowledged before it left, so what the mailbox lacks then never comes."""
        take = asyncio.ensure_future(mailbox.take(tag))
        finished = asyncio.ensure_future(self._session.until_finished(src))
        try:
            await asyncio.wait((take, finished), return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()
            if not take.done():
                take.cancel()
                await asyncio.gather(take, return_exceptions=True)
        if not take.cancelled():
            return take.result()
        found, value = mailbox.try_take(tag)
        if found:
            return value
        raise self._session.finished(src)

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
        """Say goodbye on every link and stop the peer server. Idempotent."""
        rank = self.identity.rank if self.identity is not None else "?"
        self.closed = ProcessGroupClosedError(f"rank {rank}'s process group was closed")
        links = list(self._links.values())
        self._links.clear()

        async def close_link(opening: asyncio.Future) -> None:
            opening.cancel()  # only if still opening; an open link says goodbye
            with contextlib.suppress(Exception, asyncio.CancelledError):
                link = await opening
                await link.close(self.closed)

        await asyncio.gather(*(close_link(opening) for opening in links))
        await self.server.stop(self.closed)

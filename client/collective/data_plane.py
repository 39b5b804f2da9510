"""Where a rank's collective streams go: the coordinator, or the generation's hub shards.

The coordinator's ``Joined`` answer lists the shards the generation stripes over (empty: the
coordinator carries every collective itself). The rank opens one channel per shard, with the
coordinator channel's TLS settings and token, so each shard's stripe travels on its own TCP
connection. A shard address with no host (``:PORT``, as local shards advertise themselves)
means the host this rank reaches the coordinator at. Parameter-averaging rounds always go to
the coordinator, which keeps the job's global model. Joining waits until every shard is
connected (:meth:`DataPlane.connect`), as it waits for the coordinator, so that a shard this
rank cannot reach fails the join with its cause named (a TLS mismatch within a second or two).

A shard on an outbound-only host of another host (``Joined.traversal`` names its punch
address) is reached through NAT: the channel dials a local :class:`PunchedRoute`, which
punches each connection through (``PeerRelay/Punch`` on the coordinator's collective port asks
the shard to dial back; :mod:`gradstar.transport.traversal`).
Once connected, it measures the round trip to each target and opens more connections to the
far ones (:mod:`.connections`; ``connections`` in the settings overrides the count).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gradstar.config import ClientSettings
from gradstar.errors import CoordinatorUnavailableError
from gradstar.transport.addresses import split_host_port
from gradstar.transport.channels import call_metadata, open_channel
from gradstar.transport.relay import relay_metadata
from gradstar.transport.tls_check import wait_connected
from gradstar.transport.traversal import PunchedRoute, asker
from gradstar.wire import COLLECTIVE_METHOD, PUNCH_METHOD

from . import connections
from .targets import SharedMemoryOffer, Target

log = logging.getLogger(__name__)

#: A collective striped over K targets is cut into at least this many chunks per target, down
#: to MIN_STRIPED_CHUNK bytes: one chunk per shard sends every byte to shard 0, and two per
#: shard leave the pipeline's fill and drain dominating.
CHUNKS_PER_STRIPE = 16
MIN_STRIPED_CHUNK = 64 << 10
#: The same holds across hosts (node-local shards), where larger chunks pay off: a shard can
#: send a chunk's result only once every rank's chunk arrived, so the first and last chunks'
#: round trips are the pipeline's fill and drain, while on fast links the CPU is the limit and
#: every message costs both ends far more than its bytes (gRPC hands each one between its
#: threads and the event loop). The chunk size is the balance of the two; the measurements
#: behind it: docs/performance.md, "Figures behind the code".


def striped_chunk_bytes(configured: int, nbytes: int, stripes: int) -> int:
    """The chunk size for a collective of ``nbytes`` over ``stripes`` targets: ``configured``,
    or smaller so that each stripe gets CHUNKS_PER_STRIPE chunks (every rank computes the same
    from the same header fields and generation, as the hub checks)."""
    if stripes <= 1:
        return configured
    wanted = -(-nbytes // (stripes * CHUNKS_PER_STRIPE))
    return min(configured, max(MIN_STRIPED_CHUNK, wanted))


def resolve(address: str, coordinator: str) -> str:
    """``address`` with an empty host replaced by the coordinator's host."""
    if not address.startswith(":"):
        return address
    host = coordinator.rsplit(":", 1)[0] if ":" in coordinator else coordinator
    return f"{host}{address}"


class DataPlane:
    """The coordinator's :class:`Target` and one per hub shard of the generation."""

    def __init__(self, settings: ClientSettings, shards: list[str],
                 collectives: str = "", traversal: list[str] = (),
                 caller: Callable[[int], tuple] = lambda stripe: ()) -> None:
        """``traversal``: Joined.traversal; ``caller(stripe)``: the call metadata of a punch to
        that stripe's shard (the token, and the relay keys naming this member)."""
        self.settings = settings
        # The coordinator's collectives go on a connection of their own, apart from the
        # session's, to the port it serves them on (``collectives``; empty: its own): a
        # session's keepalive pings must not wait behind MBs of tensors
        # (gradstar.transport.channels, BULK_KEEPALIVE_TIMEOUT_MS).
        self.collectives = resolve(collectives or settings.coordinator, settings.coordinator)
        self._coordinator_channel = open_channel(settings, self.collectives, bulk=True)
        self.coordinator = Target(self._coordinator_channel.stream_stream(COLLECTIVE_METHOD),
                                  self.collectives,
                                  shm=SharedMemoryOffer(settings.shared_memory))
        #: The shards' addresses, in stripe order, as this rank reaches them.
        self.addresses = [resolve(a, settings.coordinator) for a in shards]
        #: Stripe -> the local route that punches through to its shard (NAT traversal).
        self.routes: dict[int, PunchedRoute] = {}
        for k, where in enumerate(traversal):
            if where and k < len(self.addresses):
                host, port = split_host_port(where)
                self.routes[k] = PunchedRoute((host, int(port)), asker(
                    self._coordinator_channel, PUNCH_METHOD, caller(k),
                    f"punching through to hub shard {k}", self.collectives))
        self._channels = [
            open_channel(settings, self.routes[k].address, bulk=True, authority=address)
            if k in self.routes else open_channel(settings, address, bulk=True)
            for k, address in enumerate(self.addresses)]
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # connect() starts the routes
        else:
            self.start()
        self._extra: list = []  # the far targets' further channels (:meth:`widen`)
        self.shards = [
            Target(channel.stream_stream(COLLECTIVE_METHOD), address,
                   f"hub shard {k} at {address}" + (
                       f" (behind NAT: punched through from this host, "
                       f"{self.routes[k].remote[0]}:{self.routes[k].remote[1]})"
                       if k in self.routes else ""),
                   SharedMemoryOffer(settings.shared_memory))
            for k, (channel, address) in enumerate(zip(self._channels, self.addresses,
                                                       strict=True))]

    @classmethod
    def joined(cls, settings: ClientSettings, joined, metadata: tuple) -> DataPlane:
        """The data plane of a ``Joined`` answer; ``metadata``: the calls' token. A punch to a
        shard behind NAT names this member (the relay's keys)."""
        return cls(settings, list(joined.shards), joined.collectives, list(joined.traversal),
                   caller=lambda stripe: (*metadata, *relay_metadata(
                       joined.job, joined.generation, joined.rank, joined.member_id, "punch",
                       stripe)))

    def start(self) -> None:
        """Open the local routes of the shards reached through NAT (on the running loop)."""
        for route in self.routes.values():
            route.start()

    def targets(self, averaging: bool = False) -> list[Target]:
        """Where a collective's stripes go, in stripe order (averaging rounds: the coordinator,
        which keeps the global model)."""
        if averaging or not self.shards:
            return [self.coordinator]
        return self.shards

    async def connect(self, timeout: float, world_size: int = 1) -> None:
        """Wait until this rank is connected to every hub shard and to the coordinator's
        collective port (all at once).

        Raises:
            CoordinatorUnavailableError: a shard or the collective port was not reached within
                ``timeout`` seconds, or its TLS settings do not match this rank's (named at
                once).
        """
        s = self.settings
        self.start()
        ends = list(zip(self._channels, (t.address for t in self.shards),
                        (t.name for t in self.shards), strict=True))
        ends.append((self._coordinator_channel, self.collectives,
                     f"the coordinator's collective port at {self.collectives}"))
        waits = [asyncio.ensure_future(wait_connected(
            channel, address, timeout, s.tls_ca, s.tls_cert, s.tls_key, name=name))
            for channel, address, name in ends]
        try:
            await asyncio.gather(*waits)
        except CoordinatorUnavailableError as error:
            failed = [f"hub shard {k}: {r.last_error}" for k, r in self.routes.items()
                      if r.last_error]
            if not failed:
                raise
            raise CoordinatorUnavailableError(
                f"{error}; NAT traversal failed ({'; '.join(failed)}): a NAT that maps each "
                "destination to another port cannot be punched through; set "
                "GRADSTAR_NAT_TRAVERSAL=0 on the shards' hosts to go through the reachable "
                "hosts instead") from None
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        await self.widen(timeout, world_size)

    async def widen(self, timeout: float, world_size: int = 1) -> None:
        """Give each target the connections its round trip needs
        (:func:`.connections.connections_for` in a job of two ranks, else one; or the
        settings' ``connections``):
        channels of their own, each its own TCP connection, ready before this returns. A
        connection that cannot be made within ``timeout`` is left out: the target keeps those
        it has."""
        # Only a target that carries whole collectives alone (the coordinator; averaging
        # rounds) gets more by default: a striped collective already crosses the host's link
        # on one connection per shard, and more per shard measured no faster across 4 hosts
        # at 200 ms (docs/regions.md); ``connections`` set gives every target that many.
        alone = [True] + [False] * len(self.shards)
        pairs = [(self._coordinator_channel, self.coordinator),
                 *zip(self._channels, self.shards, strict=True)]
        metadata = call_metadata(self.settings)
        counts = await asyncio.gather(*(self._count(channel, metadata, timeout, auto,
                                                    world_size)
                                        for (channel, _), auto in zip(pairs, alone,
                                                                      strict=True)))
        punched = {self.shards[k].address for k in self.routes}
        for (_, target), count in zip(pairs, counts, strict=True):
            if count <= 1 or target.address in punched:
                continue  # a shard behind NAT keeps the connection punched through to it
            more = [open_channel(self.settings, target.address, bulk=True)
                    for _ in range(count - 1)]
            self._extra.extend(more)
            ready = await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), timeout)
                                           for c in more), return_exceptions=True)
            target.connections[:] = [target.stream, *(
                c.stream_stream(COLLECTIVE_METHOD)
                for c, r in zip(more, ready, strict=True) if not isinstance(r, BaseException))]
            log.info("%s: %d connections", target.name, len(target.connections))

    async def _count(self, channel, metadata, timeout: float, auto: bool,
                     world_size: int) -> int:
        if self.settings.connections or not auto:
            return self.settings.connections or 1
        rtt = await connections.round_trip(channel, metadata, min(timeout, 5.0))
        advice = connections.host_tuning_advice(rtt)
        if advice is not None:
            log.warning("%s", advice)
        # Only a pair of ranks gets more by default: one far rank to its hub at 200 ms took
        # 1.35 s over 6 connections against 4.1-4.5 s over one, while 4 ranks into one hub
        # took 8.3-8.4 s over 2 or 6 each against 5.3-6.0 s over one (docs/regions.md).
        count = connections.connections_for(rtt) if world_size <= 2 else 1
        log.debug("%.1f ms round trip: %d connections", rtt * 1e3, count)
        return count

    async def close(self) -> None:
        """End the streams kept open to the coordinator and the shards, then their channels
        (the session's channel is the group's to close)."""
        for target in (self.coordinator, *self.shards):
            target.close()
        for route in self.routes.values():
            await route.close()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(c.close() for c in (self._coordinator_channel,
                                                       *self._channels, *self._extra)))

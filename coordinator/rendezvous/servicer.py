"""The gRPC servicer of the rendezvous: one session stream per member (join, heartbeats, failure
notices). It translates, nothing more: the logic lives in :mod:`.rendezvous`, and gradstar errors
become gRPC statuses in :func:`gradstar.transport.status.abort`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from gradstar.errors import ProtocolError, RankFinishedError
from gradstar.proto.v1 import rendezvous_pb2 as rpb
from gradstar.proto.v1 import rendezvous_pb2_grpc
from gradstar.transport.addresses import host_port
from gradstar.transport.auth import check_job_access
from gradstar.transport.relay import caller_host
from gradstar.transport.status import abort, error_status
from gradstar.transport.traversal import probe, probes_caller

from . import elastic, resize
from .rebuild import claim_of
from .rendezvous import Member, Rendezvous

log = logging.getLogger(__name__)

# The last item of a member's notice queue: its session stream ends.
_SESSION_END = object()


class RendezvousServicer(rendezvous_pb2_grpc.RendezvousServicer):
    """One session stream per member: join, heartbeats, and failure notices."""

    def __init__(self, rendezvous: Rendezvous, heartbeat_interval: float, max_join: float,
                 collectives: str = "",
                 outbound_hosts: Callable[[str], set[str]] = lambda job: set(),
                 leads: Callable[[int], int] = lambda seen: 0,
                 traversal: Callable[[str, int, str], list[str]] = lambda j, n, h: []) -> None:
        """``outbound_hosts(job)``: the host keys of ``job`` that take no inbound connections
        (its node-local shards the coordinator could not dial). ``traversal(job, generation,
        host)``: Joined.traversal for a member on ``host`` (the shard registry's).
        ``leads(seen)``: the
        coordinator's leadership term if it may serve a rank that has seen term ``seen``
        (else it raises NotLeaderError or StaleCoordinatorError: ``Coordinator.leads``)."""
        self.rendezvous = rendezvous
        self.leads = leads
        self.outbound_hosts = outbound_hosts
        self.traversal = traversal
        self.heartbeat_interval = heartbeat_interval
        self.max_join = max_join
        #: Where members send collectives (``Joined.collectives``): ``:PORT`` or empty.
        self.collectives = collectives

    async def Session(self, request_iterator: AsyncIterator[rpb.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[rpb.SessionEvent]:
        requests = request_iterator.__aiter__()
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "join":
            await abort(context, ProtocolError("a session must start with a join request"))
        j = first.join
        async with error_status(context):
            check_job_access(j.job)  # before the join makes the job or takes a place in it
            term = self.leads(j.rejoin.term if j.HasField("rejoin") else 0)
            timeout = min(j.timeout_seconds or self.max_join, self.max_join)
            replay: list[int] = []
            # Where the others punch through to it, if its host turns out outbound-only.
            seen_at = caller_host(context.peer())
            punch = (host_port(seen_at, j.punch_port)
                     if 0 < j.punch_port < 65536 and seen_at else "")
            # Outbound-only as it says, or as a probe of its peer server finds (an address on
            # its own host only, as for shards; a node-local shard's probe says it too).
            outbound = j.outbound_only or bool(
                j.peer_address and probes_caller(j.peer_address, context.peer())
                and not await probe(j.peer_address))
            if j.HasField("rejoin"):
                member, replay = await self.rendezvous.rebuilds.rejoin(claim_of(j), timeout)
                member.outbound_only, member.punch = outbound, punch
            else:
                member = await self.rendezvous.join(
                    j.job, j.world_size, j.rank if j.rank >= 0 else None, j.peer_address,
                    timeout, host=j.host, elastic=j.elastic, outbound_only=outbound,
                    max_world_size=j.max_world_size, min_world_size=j.min_world_size,
                    moving_from=j.moving_from if j.HasField("moving_from") else None,
                    hostname=j.hostname, punch=punch,
                )
        gen = member.generation
        job = gen.job
        log.info("job %r generation %d: rank %d joined", j.job, gen.number, member.rank)
        closed = self.outbound_hosts(j.job)
        reader = asyncio.create_task(self._read(member, requests))
        try:
            yield rpb.SessionEvent(joined=rpb.Joined(
                shards=gen.shards, collectives=self.collectives,
                job=j.job, generation=gen.number, rank=member.rank, world_size=gen.world_size,
                member_id=member.member_id,
                peers=[rpb.Peer(rank=r, address=m.peer_address, host=m.host, hostname=m.hostname,
                                outbound_only=m.outbound_only or m.host in closed,
                                punch=m.punch if m.outbound_only or m.host in closed else "")
                       for r, m in sorted(gen.members.items())],
                heartbeat_interval_seconds=self.heartbeat_interval,
                # This member's keys only, on its own session stream (32 bytes per rank).
                peer_keys=gen.peer_keys(member.rank), replacement=member.replacement,
                boundary=member.boundary, resized=gen.resized,
                newcomers=[r for r, m in sorted(gen.members.items()) if m.newcomer],
                min_world_size=job.min_world_size, max_world_size=job.max_world_size,
                replay=replay, term=term,
                traversal=self.traversal(j.job, gen.number, member.host),
            ))
            while (notice := await member.notices.get()) is not _SESSION_END:
                if isinstance(notice, resize.Pending):
                    yield rpb.SessionEvent(resize=rpb.ResizePending(
                        generation=notice.generation, joining=notice.joining,
                        departing=notice.departing, refused=notice.refused))
                    continue
                if isinstance(notice, resize.Decided):
                    yield rpb.SessionEvent(resize_at=rpb.ResizeAt(
                        generation=notice.generation, boundary=notice.boundary))
                    continue
                if isinstance(notice, RankFinishedError):
                    yield rpb.SessionEvent(finished=rpb.RankFinished(
                        generation=gen.number, rank=notice.rank, reason=str(notice)))
                    continue
                yield rpb.SessionEvent(failed=rpb.GenerationFailed(
                    generation=gen.number, lost_rank=getattr(notice, "rank", -1),
                    reason=str(notice), error=type(notice).__name__,
                    fields_json=json.dumps(notice.fields()),
                ))
        finally:
            reader.cancel()
            if not member.left:
                log.warning("job %r: rank %d's session closed", j.job, member.rank)
                self.rendezvous.lost(member, "its session with the coordinator closed")

    def _resize(self, member: Member, request: rpb.SessionRequest, kind: str) -> None:
        """A member's part in resizing its job at a step boundary (:mod:`.resize`)."""
        state = self.rendezvous.jobs.get(member.job)
        if state is None or member.generation is None:
            return
        member.touch()
        if kind == "boundaries":
            member.boundaries = request.boundaries
            elastic.declared(state, self.rendezvous.fail)
        elif kind == "position":
            resize.report(state, member, request.position.generation,
                          request.position.boundary)
        elif kind == "advance":
            resize.advance(state, member)
        else:
            resize.depart(state, member)

    async def _read(self, member: Member, requests) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "heartbeat":
                    member.touch()
                elif kind in ("boundaries", "position", "advance", "depart"):
                    self._resize(member, request, kind)
                elif kind == "leave":
                    self.rendezvous.leave(member)
                    break
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            member.notices.put_nowait(_SESSION_END)

"""The rank's session with the rendezvous: join, heartbeats, and generation-failure notices."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import grpc

from gradstar.errors import (
    CoordinatorUnavailableError,
    GradstarError,
    ProtocolError,
    RankFinishedError,
    RankLostError,
    StaleCoordinatorError,
    error_from_wire,
)
from gradstar.proto.v1 import rendezvous_pb2 as rpb
from gradstar.proto.v1 import rendezvous_pb2_grpc
from gradstar.transport import shm
from gradstar.transport.status import error_from_rpc, is_coordinator_verdict

from .coordinators import Coordinators
from .reconnect import Ride
from .stragglers import StragglerLog

_END = object()

#: How long a call whose stream broke waits for the hub to say which rank (or shard) was lost
#: before it reports the break itself; the hub usually knows within milliseconds of a process
#: dying, because that process's session stream breaks too.
VERDICT_GRACE = 3.0
#: How late (seconds) a heartbeat may be before this rank counts as having been stopped: a
#: process frozen (SIGSTOP, a debugger, swapped out) this long cannot answer the hub's keepalive
#: pings (2 s), so the hub may have declared it lost and closed its connection meanwhile.
STALL_S = 2.0
#: How long after such a stall a broken session is put down to it.
STALL_MEMORY_S = 60.0


class Session:
    """Holds the session stream open; ``failure`` is set once the generation is over."""

    def __init__(self, coordinators: Coordinators, metadata,
                 reconnect_timeout: float = 0.0) -> None:
        #: Where the coordinator may be (several under --ha), the highest term seen.
        self.coordinators = coordinators
        self._metadata = metadata
        self.use(coordinators.current)
        #: The group's straggler log line (:mod:`.stragglers`), which collectives feed.
        self.stragglers: StragglerLog | None = None
        #: Where this rank is in its job's step boundaries (a resize's ResizePending and
        #: ResizeAt go there): :class:`~gradstar.client.process_group.membership.Membership`.
        self.membership = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = None
        self._watcher: asyncio.Task | None = None
        self._beater: asyncio.Task | None = None
        self._closing = False
        self.joined: rpb.Joined | None = None
        self._failure: GradstarError | None = None
        self._failed = asyncio.Event()
        #: Ranks of the generation that closed their group cleanly (RankFinished notices).
        self._finished: dict[int, RankFinishedError] = {}
        self._finishes = asyncio.Event()
        #: When the heartbeat loop last woke, and its longest recent lateness (seconds, when).
        self._beat_at = time.monotonic()
        self._beat_interval = 1.0
        self._stall: tuple[float, float] = (0.0, 0.0)
        #: Riding through a coordinator restart (:mod:`.reconnect`; None: timeout 0, off).
        # A refused rejoin after this process was stopped: the hub gave up on it (_stalled).
        self.ride = (Ride(self, reconnect_timeout, self._target, lost=self._fail,
                          refused=lambda e: self._fail(self._stalled() or e))
                     if reconnect_timeout > 0 else None)
        self._request: rpb.JoinRequest | None = None
        #: What this rank said of step boundaries (SessionRequest.boundaries), said again to a
        #: coordinator it rejoins: the new one knows only what it is told.
        self._declared: rpb.SessionRequest | None = None

    def use(self, address: str) -> None:
        """Talk to the coordinator at ``address`` (one of :attr:`coordinators`) from now on."""
        self._target = address
        self.channel = self.coordinators.channel(address)
        self._stub = rendezvous_pb2_grpc.RendezvousStub(self.channel)

    @property
    def target(self) -> str:
        """The address of the coordinator this session talks to."""
        return self._target

    @property
    def failure(self) -> GradstarError | None:
        """Why this rank's generation is over (a lost rank, a lost coordinator), or None."""
        return self._failure

    def _fail(self, error: GradstarError) -> None:
        if self._failure is None:
            self._failure = error
            self._failed.set()

    def finished(self, rank: int) -> RankFinishedError | None:
        """The notice that ``rank`` finished (closed its group cleanly), or None."""
        return self._finished.get(rank)

    async def until_finished(self, rank: int) -> RankFinishedError:
        """Wait until the hub reports that ``rank`` finished; its notice."""
        while rank not in self._finished:
            self._finishes.clear()
            await self._finishes.wait()
        return self._finished[rank]

    async def wait_failed(self) -> GradstarError:
        """Wait until the session fails (the generation is over); return why."""
        await self._failed.wait()
        return self._failure

    async def failure_within(self, timeout: float) -> GradstarError | None:
        """The session's failure, waiting up to ``timeout`` seconds for one to be reported."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._failed.wait(), timeout)
        return self._failure

    async def verdict(self, peer: int | None = None) -> GradstarError | None:
        """The hub's verdict on a broken stream: the session's failure — or, for a stream with
        rank ``peer``, the notice that it finished — waiting up to :data:`VERDICT_GRACE`
        seconds for one to be reported; while the session rides through a restart of the
        coordinator (:mod:`.reconnect`), the error that says it went away."""
        if peer is None:
            if self.ride is None:
                return await self.failure_within(VERDICT_GRACE)
            return await self.ride.verdict(VERDICT_GRACE)
        failed = asyncio.ensure_future(self._failed.wait())
        finished = asyncio.ensure_future(self.until_finished(peer))
        try:
            await asyncio.wait((failed, finished), timeout=VERDICT_GRACE,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            finished.cancel()
        return self._failure or self._finished.get(peer)

    async def join(self, job: str, world_size: int, rank: int | None, peer_address: str,
                   timeout: float, elastic: bool = False, *,
                   outbound_only: bool = False, max_world_size: int = 0,
                   min_world_size: int = 0, moving_from: rpb.MovingFrom | None = None,
                   punch_port: int = 0) -> rpb.Joined:
        """Join ``job`` and wait for its generation to form.

        Raises:
            RendezvousError and subclasses: the coordinator refused or timed out the join.
            AuthenticationError, CoordinatorUnavailableError: as named.
        """
        self._request = rpb.JoinRequest(
            job=job, world_size=world_size, rank=-1 if rank is None else rank,
            peer_address=peer_address, timeout_seconds=timeout, host=shm.host_key(),
            elastic=elastic, outbound_only=outbound_only, max_world_size=max_world_size,
            min_world_size=min_world_size, moving_from=moving_from,
            hostname=socket.gethostname(), punch_port=punch_port,
        )
        self.joined = await self._open(self._request, timeout)
        return self.joined

    async def rejoin(self, claim: rpb.Rejoin, timeout: float) -> rpb.Joined:
        """Rejoin this session's generation on a coordinator that came back
        (:mod:`.reconnect`: ``claim`` is what this rank holds of it), on a new session
        stream; the answer (whose ``replay`` lists the collectives to issue again) becomes
        :attr:`joined`, with the peer keys this rank had.

        Raises:
            What :meth:`join` raises; RejoinRefusedError: the coordinator cannot take the
                generation back.
        """
        request = rpb.JoinRequest()
        request.CopyFrom(self._request)
        j = self.joined
        request.world_size, request.rank, request.timeout_seconds = j.world_size, j.rank, timeout
        request.ClearField("moving_from")  # a rejoin claims the generation it was in
        request.rejoin.CopyFrom(claim)
        joined = await self._open(request, timeout)
        if self._declared is not None:
            self._outbox.put_nowait(self._declared)
        del joined.peer_keys[:]
        joined.peer_keys.extend(j.peer_keys)  # the peers' streams keep their keys
        self.joined = joined
        return joined

    async def _open(self, request: rpb.JoinRequest, timeout: float) -> rpb.Joined:
        """Open a session stream with ``request``, wait for its answer, and start watching it
        and sending heartbeats on it."""
        job = request.job
        self._outbox = outbox = asyncio.Queue()
        outbox.put_nowait(rpb.SessionRequest(join=request))
        # No deadline on the call itself: it lives as long as the rank. The join is bounded by
        # the coordinator's join timeout, and the wait below is a backstop against a dead hub.
        self._call = self._stub.Session(self._requests(outbox), metadata=self._metadata)
        try:
            event = await asyncio.wait_for(self._call.read(), timeout + 10)
        except grpc.RpcError as error:
            raise error_from_rpc(error, f"joining job {job!r}", self._target) from None
        except TimeoutError:
            self._call.cancel()
            raise CoordinatorUnavailableError(
                f"Timed out: the coordinator at {self._target} did not answer the join of job "
                f"{job!r} within {timeout + 10:g} s"
            ) from None
        if event is grpc.aio.EOF or event.WhichOneof("kind") != "joined":
            raise ProtocolError("the coordinator ended the session without a join answer")
        try:
            self.coordinators.accept(event.joined, self._target)
        except StaleCoordinatorError:
            self._call.cancel()
            raise
        self.joined = event.joined
        if self.membership is not None:  # before any resize notice can be read
            self.membership.joined(event.joined)
        self._watcher = asyncio.create_task(self._watch(), name="gradstar-session-watch")
        self._beater = asyncio.create_task(
            self._beat(event.joined.heartbeat_interval_seconds or 1.0), name="gradstar-heartbeat"
        )
        return event.joined

    async def wait_ready(self, timeout: float, *, fail_fast: bool = False) -> None:
        """Wait until the session's channel is connected (its coordinator listens), for at most
        ``timeout`` seconds (TimeoutError past it); with ``fail_fast``, TimeoutError also as
        soon as a connection attempt failed (nothing listens there: with several coordinators,
        the next one is tried instead of waiting out the channel's back-off)."""
        if not fail_fast:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
            return
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        async with asyncio.timeout(timeout):
            while (state := self.channel.get_state(try_to_connect=True)) is not ready:
                if state is failed:
                    raise TimeoutError
                await self.channel.wait_for_state_change(state)

    def send(self, request: rpb.SessionRequest) -> None:
        """Queue ``request`` on the session stream (call it on the session's loop)."""
        if request.WhichOneof("kind") == "boundaries":
            self._declared = request
        if not self._closing:
            self._outbox.put_nowait(request)

    @staticmethod
    async def _requests(outbox: asyncio.Queue):
        while (request := await outbox.get()) is not _END:
            yield request

    async def _beat(self, interval: float) -> None:
        self._beat_interval, self._beat_at = interval, time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            late = now - self._beat_at - interval
            if late > STALL_S:
                self._stall = (late, now)
            self._beat_at = now
            self._outbox.put_nowait(rpb.SessionRequest(
                heartbeat=rpb.Heartbeat(sent_unix_ms=int(time.time() * 1000))))

    async def _watch(self) -> None:
        call = self._call  # a later stream (a rejoin) is watched by a watcher of its own
        try:
            # read() rather than iteration: the join already used read() on this call, and
            # grpc.aio forbids mixing the two styles on one RPC.
            while (event := await call.read()) is not grpc.aio.EOF:
                if event.WhichOneof("kind") == "finished":
                    f = event.finished
                    self._finished[f.rank] = RankFinishedError(
                        f.reason, rank=f.rank, generation=f.generation)
                    self._finishes.set()
                elif event.WhichOneof("kind") in ("resize", "resize_at"):
                    if self.membership is not None:
                        self.membership.heard(event, self)
                elif event.WhichOneof("kind") == "failed":
                    f = event.failed
                    self._fail(error_from_wire(f.error, f.fields_json, f.reason) if f.error
                               else RankLostError(f.reason, rank=f.lost_rank,
                                                  generation=f.generation))
        except grpc.RpcError as error:
            if not self._closing and self._call is call:
                # The hub's own verdict ends the session; a transport failure (ping timeout, a
                # reset, grpc-python's INTERNAL) is a broken stream (_broke).
                failure = error_from_rpc(error, "the rendezvous session", self._target)
                if is_coordinator_verdict(error):
                    self._fail(failure)
                self._broke(failure)
            return
        if not self._closing and self._call is call:
            self._broke(CoordinatorUnavailableError(
                f"the coordinator at {self._target} closed this rank's session"
            ))

    def abandon(self, error: GradstarError) -> None:
        """Leave a coordinator that said it no longer leads (a collective refused with
        LeadershipError) as if its stream had broken: a session that rides through restarts
        looks for the leader; any other fails with ``error``."""
        if self._call is not None and not self._closing:
            call = self._call
            self._broke(error)
            call.cancel()

    def _broke(self, error: GradstarError) -> None:
        """The session stream broke without the hub's verdict: the coordinator went away,
        which a session that rides through restarts (:mod:`.reconnect`) waits out (a
        coordinator that did not go away refuses its rejoin), or this rank was stopped long
        enough to be lost (:meth:`_stalled`), which fails it."""
        if self.ride is None or self._failure is not None:
            # Right after this process was stopped, a break is the hub having given up on it.
            self._fail(self._stalled() or error)
            return
        if self._beater is not None:
            self._beater.cancel()  # its heartbeats would queue for the dead stream
        self._outbox.put_nowait(_END)  # ends the dead stream's request generator
        self._call = None
        self.ride.went_away(error)

    def _stalled(self) -> RankLostError | None:
        """Why the session broke, when this process was stopped long enough for the hub to give
        up on it (the break then says nothing about the hub): this rank was lost, by the hub's
        count as by everyone else's. None when no such stall was seen lately."""
        now = time.monotonic()
        # A beat still due (the loop has not run it since it woke) is late by this much.
        pending = now - self._beat_at - self._beat_interval
        late, when = self._stall
        if pending > STALL_S:
            late, when = pending, now
        if late <= STALL_S or now - when > STALL_MEMORY_S or self.joined is None:
            return None
        j = self.joined
        return RankLostError(
            f"rank {j.rank} of job {j.job!r} (this process) was stopped or starved for "
            f"{late:.1f} s, long enough for the coordinator at {self._target} to declare it "
            f"lost and end its session; generation {j.generation} is over for this rank, so "
            "every collective of it fails: join the job again", rank=j.rank,
            generation=j.generation)

    async def close(self, timeout: float = 5.0) -> None:
        """Leave the job in an orderly way and end the stream."""
        if self._closing:
            return
        self._closing = True
        if self.ride is not None:
            self.ride.close()
        if self._beater is not None:
            self._beater.cancel()
        self._outbox.put_nowait(rpb.SessionRequest(leave=True))
        self._outbox.put_nowait(_END)
        if self._watcher is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._watcher, timeout)
        if self._call is not None and not self._call.done():
            self._call.cancel()
        # An ended call still holds its channel's TCP connection (gRPC's core call keeps a
        # reference to the transport until the call object is freed, whether or not the channel
        # was closed): kept here, a closed group held a connection, and the coordinator its
        # descriptor, for as long as the group object lived.
        self._call = None
        await self.coordinators.close()

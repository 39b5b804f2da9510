"""A hub shard: one process of the data plane (``gradstar shard``).

A shard serves the same Collective stream as the coordinator, with the same engine, limits,
token check and TLS, for the stripes of collectives that ranks send it. It keeps no rendezvous
of its own: the coordinator tells it over the control stream (:mod:`.registry`) which generations
exist (``formed``: members, and this shard's stripe position) and when they end (``over``), and
the shard applies both to a :class:`~gradstar.coordinator.rendezvous.Rendezvous` that the
engine reads exactly as the coordinator's engine reads its own.

Checks a shard adds: a stream must name a generation the coordinator formed over this shard
(a header that arrives a moment before the ``formed`` notice waits up to
:data:`FORMED_WAIT` seconds), and its stripe must be this shard's position in that generation's
table, so a misrouted stream fails loudly instead of reducing the wrong chunks.

What a shard reports (every second, ``ShardStats``): bytes and collectives per job, and the
arrival summaries (:mod:`..metrics.arrivals`) of the ranks whose collectives it measured since
the last report, so the coordinator names stragglers wherever the collectives ran.

Losing the coordinator ends the shard: its generations fail on every rank with
:class:`~gradstar.errors.CoordinatorUnavailableError`, and the process exits non-zero so that
whatever started it (the coordinator's :mod:`.local`, a StatefulSet) starts it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradstar import ops
from gradstar.allocator import tune_allocator
from gradstar.config import ShardSettings
from gradstar.errors import (
    CoordinatorUnavailableError,
    GradstarError,
    InvalidCollectiveError,
    RendezvousError,
    error_from_wire,
)
from gradstar.proto.v1 import collective_pb2 as cpb
from gradstar.proto.v1 import shard_pb2 as spb
from gradstar.proto.v1 import shard_pb2_grpc
from gradstar.transport.addresses import WILDCARDS, advertised_host, host_port, split_host_port
from gradstar.transport.auth import bearer
from gradstar.transport.channels import (
    client_credentials,
    secure_or_insecure_channel,
    server_credentials,
)
from gradstar.transport.job_tokens import load_job_secret
from gradstar.transport.serve import serve
from gradstar.transport.shm import host_key
from gradstar.transport.status import error_from_rpc
from gradstar.transport.tls_check import wait_connected
from gradstar.transport.traversal import PunchPort
from gradstar.wire import COLLECTIVE_SERVICE, MAX_NDIM, payload_bytes

from ..collective import CollectiveEngine, CollectiveServicer
from ..metrics.arrivals import to_fields
from ..rendezvous.rendezvous import Rendezvous

log = logging.getLogger(__name__)

#: How long a header may wait for the coordinator's notice that its generation formed.
FORMED_WAIT = 5.0
#: Arrival summaries a report carries at most (~0.2 KB each); the others follow in the next.
ARRIVALS_PER_REPORT = 2048


class Shard:
    """``await start()`` binds, registers with the coordinator and serves; ``await stop()``.

    ``await wait_closed()`` returns when the shard stopped or lost its coordinator (then
    :attr:`lost` holds why).
    """

    def __init__(self, settings: ShardSettings) -> None:
        self.settings = settings
        self.rendezvous = Rendezvous(settings.heartbeat_timeout,
                                     on_generation_failed=self._generation_failed)
        self.engine = CollectiveEngine.from_settings(self.rendezvous, settings)
        #: (job, generation) -> (this shard's stripe position, shards in the generation).
        self.positions: dict[tuple[str, int], tuple[int, int]] = {}
        self.slot: int | None = None
        self.port: int | None = None
        self.address = ""
        self.lost: GradstarError | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._channel: grpc.aio.Channel | None = None
        self._control_task: asyncio.Task | None = None
        self._formed = asyncio.Event()
        self._closed = asyncio.Event()
        self._reports: asyncio.Queue = asyncio.Queue()
        #: NAT traversal (settings.nat_traversal): the port this shard punches from.
        self._punch: PunchPort | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> int:
        """Serve, then register; return the bound port.

        Raises:
            OSError: the address could not be bound.
            CoordinatorUnavailableError: the coordinator did not accept a connection within
                ``shard_wait`` seconds, or (at once, naming the cause) TLS settings do not
                match it: ``coordinator_ca`` is not the CA of its certificate, it requires a
                client certificate, or TLS is on one side only.
            CoordinatorUnavailableError / AuthenticationError: registration failed.
            ConfigurationError: a placeholder token, or a non-loopback address without a job
                token and without ``insecure`` (see CoordinatorSettings.check_protected), or
                a job secret file that cannot be read, is empty or too short.
        """
        s = self.settings
        s.check_protected()
        tune_allocator()
        token = s.token.get_secret_value() if s.token else None
        admin = s.admin_token.get_secret_value() if s.admin_token else None
        self.collectives = CollectiveServicer(self.engine, admit=self._admit,
                                              shared_memory=self.settings.shared_memory)
        self._health = health.aio.HealthServicer()
        # grpc's servicer answers SERVING for "" until told otherwise: not before registering.
        for name in ("", COLLECTIVE_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        creds = (server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca)
                 if s.tls_cert is not None else None)
        server, port = serve(
            f"{s.host}:{s.port}",
            (self.collectives.handler(),
             partial(health_pb2_grpc.add_HealthServicer_to_server, self._health)),
            what="the shard", token=token, admin_token=admin, credentials=creds, bulk=True,
            stream_window_bytes=s.stream_window_bytes,
            # Ranks send their stripes with the token they joined with: their job's own too.
            job_secret=load_job_secret(s.job_secret_file))
        await server.start()
        self._server, self.port = server, port
        self.address = self._advertised(port)
        if s.nat_traversal:
            bound = "" if s.host in WILDCARDS else s.host
            self._punch = PunchPort((bound or "127.0.0.1", port), host=bound,
                                    name=f"shard at {self.address}")
        try:
            await self._register()
        except BaseException:
            await self.stop()
            raise
        for name in ("", COLLECTIVE_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    def _advertised(self, port: int) -> str:
        s = self.settings
        host = s.advertise_host
        if host is None:
            host = s.host
            if host in WILDCARDS:  # an address the ranks reach, as they reach the coordinator
                host = advertised_host(split_host_port(s.coordinator)[0], ifname=s.socket_ifname)
        return host_port(host, port)

    async def _register(self) -> None:
        s = self.settings
        creds = (client_credentials(s.coordinator_ca, s.tls_cert, s.tls_key)
                 if s.coordinator_ca is not None else None)
        self._channel = secure_or_insecure_channel(s.coordinator, creds)
        # The shard presents its own certificate to the coordinator only over TLS.
        tls = creds is not None
        log.info("shard bound to %s:%d; registering with the coordinator at %s (waiting up to "
                 "%g s)", s.host, self.port, s.coordinator, s.shard_wait)
        await wait_connected(self._channel, s.coordinator, s.shard_wait, s.coordinator_ca,
                             s.tls_cert if tls else None, s.tls_key if tls else None,
                             ca_setting="coordinator_ca")
        stub = shard_pb2_grpc.ShardControlStub(self._channel)
        self._reports.put_nowait(spb.ShardReport(hello=spb.ShardHello(
            address=self.address, slot=s.slot, job=s.for_job, host=host_key(),
            outbound_only=s.outbound_only,
            punch_port=self._punch.port if self._punch is not None else 0)))
        # A shard for one job registers with the job token, as its job's ranks hold it (a
        # coordinator with an admin token of its own opens Register to that token only).
        token = (s.token or s.admin_token) if s.for_job else (s.admin_token or s.token)
        metadata = bearer(token.get_secret_value()) if token is not None else ()
        register = stub.RegisterForJob if s.for_job else stub.Register
        call = register(self._report_stream(), metadata=metadata)
        try:
            first = await asyncio.wait_for(call.read(), s.shard_wait)
        except grpc.RpcError as error:
            raise error_from_rpc(error, "registering this shard", s.coordinator) from None
        except TimeoutError:
            call.cancel()
            raise CoordinatorUnavailableError(
                f"the coordinator at {s.coordinator} did not accept this shard within "
                f"{s.shard_wait:g} s") from None
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "accepted":
            raise CoordinatorUnavailableError(
                f"the coordinator at {s.coordinator} closed the shard's control stream")
        self.slot = first.accepted.slot
        log.info("shard %d serving on %s for coordinator %s", self.slot, self.address,
                 s.coordinator)
        self._control_task = asyncio.create_task(
            self._control(call, first.accepted.stats_interval_seconds or 1.0),
            name="gradstar-shard-control")

    async def _report_stream(self):
        while (report := await self._reports.get()) is not None:
            yield report

    async def _control(self, call, interval: float) -> None:
        reporter = asyncio.create_task(self._report_every(interval))
        try:
            while (command := await call.read()) is not grpc.aio.EOF:
                kind = command.WhichOneof("kind")
                if kind == "formed":
                    self._on_formed(command.formed)
                elif kind == "over":
                    self._on_over(command.over)
                elif kind == "punch":
                    self._on_punch(command.punch)
            reason = "the coordinator closed this shard's control stream"
        except grpc.RpcError as error:
            reason = f"lost the coordinator ({error.code().name}: {error.details()})"
        finally:
            reporter.cancel()
        self.lost = CoordinatorUnavailableError(
            f"hub shard {self.slot} at {self.address} {reason}; its collectives fail")
        log.error("%s", self.lost)
        for job in list(self.rendezvous.jobs.values()):
            if job.generation is not None:
                self.rendezvous.fail(job.generation, self.lost)
        self._closed.set()

    async def _report_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self._reports.put_nowait(spb.ShardReport(stats=self.stats()))
            self.collectives.sweep_segments()
            for name in self.rendezvous.drop_idle(self.settings.job_retention):
                self.engine.metrics.forget(name)

    def stats(self) -> spb.ShardStats:
        stats = spb.ShardStats()
        for name, job in self.rendezvous.jobs.items():
            c = job.counters
            stats.bytes_in += c.bytes_in
            stats.bytes_out += c.bytes_out
            gen = job.generation
            stats.jobs.append(spb.ShardJob(
                job=name, bytes_in=c.bytes_in, bytes_out=c.bytes_out, completed=c.completed,
                failed=c.failed, active=gen is not None and gen.healthy))
        for job, rank, summary in self.engine.metrics.arrivals.changed(ARRIVALS_PER_REPORT):
            stats.arrivals.append(spb.RankArrivals(job=job, rank=rank, **to_fields(summary)))
        return stats

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def stop(self, grace: float = 0.0) -> None:
        self._reports.put_nowait(None)
        if self._punch is not None:
            self._punch.close()
        if self._control_task is not None:
            self._control_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._control_task
        if self._channel is not None:
            await self._channel.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        self._closed.set()

    # -- the coordinator's notices -------------------------------------------------------------

    def _on_formed(self, formed: spb.GenerationFormed) -> None:
        self.rendezvous.adopt(formed.job, formed.generation, formed.world_size,
                              {m.rank: m.member_id for m in formed.members})
        self.positions[(formed.job, formed.generation)] = (formed.position, formed.shards)
        self._formed.set()

    def _on_over(self, over: spb.GenerationOver) -> None:
        gen = self.rendezvous.generation(over.job, over.generation)
        if gen is not None:
            self.rendezvous.fail(gen, error_from_wire(over.error, over.fields_json,
                                                      over.message))

    def _on_punch(self, punch: spb.ShardPunch) -> None:
        """Punch towards a rank on another host (gradstar.transport.traversal); the
        connection is joined to this shard's own server."""
        if self._punch is None:
            log.warning("shard %s: punch towards %s:%d refused (no NAT traversal here)",
                        self.slot, punch.host, punch.port)
            return
        host = punch.host
        if host in ("127.0.0.1", "::1"):  # the rank is on the coordinator's host
            host = split_host_port(self.settings.coordinator)[0]
        self._punch.answer((host, punch.port))

    def _generation_failed(self, gen) -> None:
        self.engine.fail_generation(gen)
        self.positions.pop((gen.job.name, gen.number), None)

    async def _admit(self, header: cpb.CollectiveHeader) -> None:
        """Wait for ``header``'s generation to be known, and check its stripe.

        Raises:
            RendezvousError: the coordinator formed no such generation over this shard.
            InvalidCollectiveError: the stream carries another shard's stripe.
        """
        key = (header.job, header.generation)
        deadline = time.monotonic() + FORMED_WAIT
        while key not in self.positions:
            state = self.rendezvous.jobs.get(header.job)
            if state is not None and state.generation is not None and (
                    state.generation.number > header.generation or
                    state.generation.number == header.generation):
                break  # known (perhaps already over): the engine names the reason
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousError(
                    f"job {header.job!r} generation {header.generation} was not formed over "
                    f"hub shard {self.slot} at {self.address}; join the job again")
            self._formed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._formed.wait(), left)
        if header.averaging.rule:
            raise InvalidCollectiveError(
                f"averaging round seq {header.seq} reached hub shard {self.slot}: averaging "
                "rounds go to the coordinator, which keeps the job's global model")
        position, shards = self.positions.get(key, (None, 0))
        if position is None:
            return
        if (not 0 < header.chunk_bytes or header.op not in ops.OP_NAMES
                or len(header.shape) > MAX_NDIM):
            return  # the engine refuses the header with its own message
        try:
            nbytes = payload_bytes(header.shape, header.dtype)
        except GradstarError:
            return  # likewise: an unknown dtype
        world = self.rendezvous.jobs[header.job].generation.world_size
        layout = ops.input_layout(header.op, world, nbytes, header.chunk_bytes)
        active = ops.active_shards(layout, shards)
        if (header.stripes or 1) != active or header.stripe != position:
            raise InvalidCollectiveError(
                f"rank {header.rank} sent stripe {header.stripe} of {header.stripes or 1} of "
                f"collective seq {header.seq} to hub shard {self.slot}, which carries stripe "
                f"{position} of {active} for this collective")

"""The coordinator's grpc.aio server: services, security, liveness sweep, shards and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from functools import partial

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gradstar.allocator import trim_heap, tune_allocator
from gradstar.config import CoordinatorSettings
from gradstar.errors import InvalidCollectiveError
from gradstar.proto.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    collective_pb2,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    rounds_pb2,
    rounds_pb2_grpc,
    shard_pb2,
    shard_pb2_grpc,
    steps_pb2,
    steps_pb2_grpc,
)
from gradstar.transport.channels import server_credentials
from gradstar.transport.http import bound_port, serve_http
from gradstar.transport.job_tokens import load_job_secret
from gradstar.transport.serve import serve

from .collective import CollectiveEngine, CollectiveServicer
from .leadership import Etcd, Leadership, endpoints_of, tls_context
from .metrics import render_async
from .rendezvous import Rendezvous, RendezvousServicer
from .rendezvous.relay import RelayServicer
from .rounds import AveragingStore, RoundsServicer, RoundsTable
from .shards import LocalShards, ShardControlServicer, ShardRegistry
from .steps import SnapshotStore, StepsServicer, StepsTable
from .views import AdminServicer, CoordinatorStatus, status_routes
from .views.leadership import leadership_json, leadership_metrics, leadership_reply

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    rendezvous_pb2.DESCRIPTOR.services_by_name["Rendezvous"].full_name,
    collective_pb2.DESCRIPTOR.services_by_name["Collective"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
    shard_pb2.DESCRIPTOR.services_by_name["ShardControl"].full_name,
    rounds_pb2.DESCRIPTOR.services_by_name["Rounds"].full_name,
    steps_pb2.DESCRIPTOR.services_by_name["Steps"].full_name,
)


class Coordinator:
    """The hub. ``await start()`` binds and serves; ``await stop()`` drains and shuts down.

    Usable as ``async with Coordinator(settings) as coord:``; ``coord.port`` is the bound port
    (useful with ``port=0``).
    """

    def __init__(self, settings: CoordinatorSettings | None = None) -> None:
        self.settings = settings or CoordinatorSettings()
        s = self.settings
        self.engine: CollectiveEngine | None = None
        self.rendezvous: Rendezvous | None = None
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._bulk_server: grpc.aio.Server | None = None
        #: The port collectives are served on (Joined.collectives), once started.
        self.collective_port: int | None = None
        self._health: health.aio.HealthServicer | None = None
        self._sweeper: asyncio.Task | None = None
        self._tls = s.tls_cert is not None
        #: Bound port of the Prometheus endpoint (``settings.metrics_port``), once started.
        self.metrics_port: int | None = None
        self._metrics_server: asyncio.Server | None = None
        #: What the status page beside /metrics shows (see gradstar.coordinator.views).
        self.status: CoordinatorStatus | None = None
        #: The data-plane shards (see gradstar.coordinator.shards), once started.
        self.shards: ShardRegistry | None = None
        self._local_shards: LocalShards | None = None
        self._serving = False
        self._health_updates: set[asyncio.Task] = set()
        #: The election under ``--ha`` (None without it: this coordinator always leads);
        #: ``elected`` is set once it leads, ``fenced`` once it lost the lead for good.
        self.leadership: Leadership | None = None
        self.elected = asyncio.Event()
        self.fenced = asyncio.Event()

    @property
    def address(self) -> str:
        host = self.settings.host
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{self.port}"

    async def start(self) -> int:
        """Bind, serve and wait for the expected shards (:meth:`listen`, then
        :meth:`wait_for_shards`); return the bound port.

        Raises:
            OSError: the address could not be bound, or fewer than the expected shards
                registered within ``shard_wait`` seconds (the coordinator is stopped then).
            ConfigurationError: a placeholder token, or a non-loopback address without a job
                token and without ``insecure`` (see CoordinatorSettings.check_protected).
        """
        await self.listen()
        await self.wait_for_shards()
        return self.port

    async def listen(self) -> int:
        """Bind, register every service, start serving and start the local shards; return the
        bound port. Health says NOT_SERVING until :meth:`wait_for_shards` has seen the expected
        shards up, but the port takes connections at once: shards on other hosts register
        through it.

        Raises:
            OSError: the address could not be bound.
            ConfigurationError: a placeholder token, or a non-loopback address without a job
                token and without ``insecure`` (see CoordinatorSettings.check_protected), or
                a job secret file that cannot be read, is empty or too short.
        """
        s = self.settings
        s.check_protected()
        tune_allocator()
        if s.ha is None:
            self.elected.set()
        else:
            # An etcd that cannot be reached is named here, before anything binds.
            endpoints, prefix = endpoints_of(s.ha)
            tls = None if s.ha_ca is None else tls_context(s.ha_ca, s.ha_cert, s.ha_key)
            self.leadership = Leadership(Etcd(endpoints, tls=tls), prefix, "", s.ha_ttl,
                                         on_elected=self._on_elected,
                                         on_fenced=self._on_fenced)
            await self.leadership.connect()
        self.averaging = AveragingStore(s.state_dir)
        # Rounds keep fragments in a store of their own, so their names never meet the
        # collectives' global models (and their files sit in a folder of their own).
        self.rounds = RoundsTable(
            AveragingStore(s.state_dir / "rounds" if s.state_dir is not None else None),
            max_numel=s.max_tensor_bytes // 4, max_held_bytes=s.max_collective_state_bytes)
        # DDP steps in sync modes (Quorum, BoundedStaleness, Asynchronous): a rank silent for
        # the heartbeat timeout leaves the live set, as its session would.
        # With a state directory the ledgers' snapshots are saved, and a ledger made after a
        # restart starts from its saved one (its ranks resume there).
        store = SnapshotStore(s.state_dir) if s.state_dir is not None else None
        self.steps = StepsTable(max_numel=s.max_tensor_bytes // 4,
                                max_held_bytes=s.max_steps_bytes,
                                job_share=s.steps_job_share,
                                lease=s.heartbeat_timeout,
                                load=store.load if store is not None else None)
        self.rendezvous = Rendezvous(
            s.heartbeat_timeout, on_generation_failed=self._generation_failed,
            on_generation_formed=lambda g: self.shards.on_formed(g),
            on_generation_closed=lambda g: self.shards.on_over(g),
            on_rank_finished=self._rank_finished,
            on_member_gone=lambda m: self.steps.rank_gone(
                m.job, m.rank, "finished" if m.finished else "lost"),
        )
        self.rendezvous.max_jobs = s.max_jobs
        expected = s.shards if s.expected_shards is None else s.expected_shards
        self.shards = ShardRegistry(self.rendezvous, expected, on_health=self._shards_health)
        # A generation taken back after a restart stripes over the shards this one starts.
        self.rendezvous.rebuilds.before_forming = lambda: self.shards.wait_ready(s.shard_wait)
        if self.leadership is not None:  # a coordinator that does not lead writes nothing
            self.averaging.guard = self.rounds.store.guard = self.leadership.guard
            if store is not None:
                store.guard = self.leadership.guard
        self.status = CoordinatorStatus(self.rendezvous, self.shards,
                                        serving=lambda: self._serving and self.shards.healthy,
                                        rounds=self.rounds, steps=self.steps)
        self.status.leadership = lambda: leadership_json(self.leadership_view())
        self.engine = CollectiveEngine.from_settings(
            self.rendezvous, s, averaging=self.averaging, metrics=self.status.metrics)
        token = s.token.get_secret_value() if s.token else None
        admin = s.admin_token.get_secret_value() if s.admin_token else None
        # Both ports take each job's own token: the collective port carries the job's tensors.
        job_secret = load_job_secret(s.job_secret_file)
        creds = (server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca) if self._tls
                 else None)
        self.collectives = CollectiveServicer(self.engine, admit=self._admit,
                                              shared_memory=s.shared_memory)
        # Collectives get a server of their own: its connections carry MBs of tensors, behind
        # which a keepalive ping waits for seconds on a full link (8 ranks x 64 MiB through a
        # hub's 200 Mbit/s link lost their sessions to the keepalive pings that find lost ranks).
        # Outer rounds carry tensors too: served there (named in Seed replies) and here.
        rounds = RoundsServicer(self.rounds, s.max_chunk_bytes)
        # DDP's sync-mode steps carry whole gradients: on the collective port only.
        self._steps = StepsServicer(self.steps, s.max_chunk_bytes, store,
                                    members=self.rendezvous.bound_member,
                                    rebuilt=self.rendezvous.rebuilds.rebuilt.__contains__)
        bulk, self.collective_port = serve(
            f"{s.host}:{s.collective_port}",
            (self.collectives.handler(),
             partial(rounds_pb2_grpc.add_RoundsServicer_to_server, rounds),
             partial(steps_pb2_grpc.add_StepsServicer_to_server, self._steps),
             # Peer streams to ranks on outbound-only hosts ride here, relayed.
             RelayServicer(self.rendezvous.bound_member, punch=self.shards.punch).handler()),
            what="the coordinator's collective port", token=token, admin_token=admin,
            credentials=creds, bulk=True, stream_window_bytes=s.stream_window_bytes,
            job_secret=job_secret)
        rounds.bulk_address = f":{self.collective_port}"
        rounds.leads = self.leads
        self._health = health.aio.HealthServicer()
        # grpc's servicer answers SERVING for "" until told otherwise: not before the shards.
        await self._set_health(False)
        services = [
            partial(rendezvous_pb2_grpc.add_RendezvousServicer_to_server, RendezvousServicer(
                self.rendezvous, s.heartbeat_interval, s.max_collective_timeout,
                collectives=f":{self.collective_port}",
                outbound_hosts=lambda job: self.shards.outbound_hosts(job),
                traversal=lambda job, number, host: self.shards.traversal(job, number, host),
                leads=self.leads)),
            # Still served here too: a rank of an earlier version sends its collectives here.
            self.collectives.handler(),
            partial(rounds_pb2_grpc.add_RoundsServicer_to_server, rounds),
            partial(admin_pb2_grpc.add_AdminServicer_to_server, AdminServicer(
                self.rendezvous, self.averaging, self.drain, self.shards, self.rounds,
                self.engine.metrics, self.steps, leadership=self.leadership_view)),
            partial(shard_pb2_grpc.add_ShardControlServicer_to_server,
                    ShardControlServicer(self.shards)),
            partial(health_pb2_grpc.add_HealthServicer_to_server, self._health),
        ]
        if s.reflection:  # open without a token (see gradstar.transport.auth): opt-in
            services.append(partial(reflection.enable_server_reflection,
                                    (*SERVICE_NAMES, health.SERVICE_NAME,
                                     reflection.SERVICE_NAME)))
        server, port = serve(f"{s.host}:{s.port}", services, what="the coordinator",
                             token=token, admin_token=admin, credentials=creds,
                             stream_window_bytes=s.stream_window_bytes, job_secret=job_secret)
        if s.metrics_port is not None:
            routes = {"/metrics": self._metrics_page, **status_routes(self.status.snapshot)}
            self._metrics_server = await serve_http(s.metrics_host, s.metrics_port, routes)
            self.metrics_port = bound_port(self._metrics_server)
        await bulk.start()
        await server.start()
        self._server, self.port, self._bulk_server = server, port, bulk
        if self.leadership is not None:
            await self.leadership.start(s.ha_advertise or self.advertised)
        self._sweeper = asyncio.create_task(self._sweep(), name="gradstar-heartbeat-sweep")
        if s.shards:
            self._local_shards = LocalShards(s, port, s.shards)
            await self._local_shards.start()
        return port

    async def wait_for_shards(self) -> None:
        """Wait up to ``shard_wait`` seconds for the expected shards, then report SERVING.

        Cancelled, it leaves the coordinator listening and NOT_SERVING: :meth:`stop` it.

        Raises:
            OSError: fewer than the expected shards registered in time; the coordinator is
                stopped then.
        """
        s = self.settings
        if not self.shards.healthy:
            log.info("coordinator bound to %s:%d; waiting up to %g s for hub shards (%d of %d "
                     "up)", s.host, self.port, s.shard_wait, len(self.shards.up),
                     self.shards.expected)
        if not await self.shards.wait_ready(s.shard_wait):
            await self.stop(grace=0)
            raise OSError(f"only {len(self.shards.up)} of {self.shards.expected} hub shards "
                          f"registered within {s.shard_wait:g} s")
        self._serving = True
        await self._set_health(True)
        log.info("coordinator serving on %s:%d (tls=%s, auth=%s, job tokens=%s, shards=%d)",
                 s.host, self.port, self._tls, bool(s.token), s.job_secret_file is not None,
                 len(self.shards.up))

    @property
    def advertised(self) -> str:
        """Where ranks reach this coordinator, as the election publishes it: its host and
        port, with a wildcard host replaced by this host's name."""
        host = self.settings.host
        return f"{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{self.port}"

    def leads(self, seen: int = 0) -> int:
        """This coordinator's leadership term (0 without ``--ha``), if it may serve a job's
        call from a rank that has seen term ``seen``.

        Raises:
            NotLeaderError, StaleCoordinatorError: (under ``--ha``) it does not lead.
        """
        return 0 if self.leadership is None else self.leadership.check(seen)

    def leadership_view(self):
        """Who leads (Admin.GetLeadership's reply; :mod:`.views.leadership`)."""
        return leadership_reply(self.leadership, self.address, self.rendezvous.jobs)

    def _on_elected(self) -> None:
        self.elected.set()
        if self.shards is not None:  # else it was elected as it started: health follows
            self._shards_health(self.shards.healthy)

    def _on_fenced(self, reason: str) -> None:
        """The lead is lost for good: no joins, health NOT_SERVING, and both servers stopped
        at once, without a verdict on any call, so that the ranks still connected ride
        through to the new leader; ``fenced`` tells the command to exit."""
        self.rendezvous.draining = True
        self._serving = False
        self._shards_health(False)
        for server in (self._server, self._bulk_server):
            if server is not None:
                self._keep(server.stop(0))
        self.fenced.set()

    async def _admit(self, header) -> None:
        """The coordinator carries whole collectives only (stripes go to hub shards), and only
        while it leads."""
        self.leads()
        if header.stripes > 1:
            raise InvalidCollectiveError(
                f"rank {header.rank} sent stripe {header.stripe} of {header.stripes} of "
                f"collective seq {header.seq} to the coordinator; stripes go to the hub shards "
                "listed when the generation formed")

    def _generation_failed(self, gen) -> None:
        # One failure on the status page, not one more per collective it takes down.
        with self.status.generation_failed(gen):
            self.engine.fail_generation(gen)
        self.shards.on_over(gen)

    def _rank_finished(self, gen, error) -> None:
        self.engine.fail_generation(gen, error)
        self.shards.on_over(gen, error)

    def _shards_health(self, healthy: bool) -> None:
        if (self._serving and not self.rendezvous.draining) or self.fenced.is_set():
            self._keep(self._set_health(healthy))

    def _keep(self, coroutine) -> None:
        # The loop holds tasks only weakly: keep this one until it has run.
        task = asyncio.get_running_loop().create_task(coroutine)
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _set_health(self, serving: bool) -> None:
        """SERVING only while not draining and every expected shard is up."""
        ok = (serving and not self.rendezvous.draining and self.shards.healthy
              and (self.leadership is None or self.leadership.valid()))
        status = (health_pb2.HealthCheckResponse.SERVING if ok
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, status)

    async def _sweep(self) -> None:
        """Declare lost the members whose heartbeats stopped (frozen or partitioned ranks),
        unmap the segments of ranks that let go of them, and drop jobs idle for longer than
        ``job_retention``."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval / 2)
            self.status.sample()  # the status page's byte rates
            self.collectives.sweep_segments()
            if self.engine.budget.should_trim():
                trim_heap()
                self.engine.budget.trimmed()
            for m in self.rendezvous.expire():
                log.warning("job %r: rank %d missed heartbeats", m.job, m.rank)
            self._steps.sweep()
            self.steps.drop_idle(self.settings.job_retention)
            for name in self.rounds.drop_idle(self.settings.job_retention):
                log.info("job %r: outer rounds dropped after %g s without replicas", name,
                         self.settings.job_retention)
            for name in self.rendezvous.drop_idle(self.settings.job_retention):
                self.engine.metrics.forget(name)
                self.shards.forget(name)
                log.info("job %r dropped after %g s without members", name,
                         self.settings.job_retention)

    async def _metrics_page(self) -> tuple[int, str, bytes]:
        text = await render_async(self.rendezvous, self.engine.metrics, self.averaging,
                                  shards=self.shards, max_bytes=self.settings.metrics_max_bytes,
                                  rounds=self.rounds, steps=self.steps)
        text += leadership_metrics(self.leadership_view())
        return 200, "text/plain; version=0.0.4; charset=utf-8", text.encode()

    async def drain(self) -> None:
        """Report NOT_SERVING and refuse new joins; running generations keep working."""
        self.rendezvous.draining = True
        await self._set_health(False)
        log.info("draining: new joins are refused")

    async def stop(self, grace: float | None = None) -> None:
        """Drain, give running calls ``grace`` seconds, then stop the server."""
        if self._server is None:
            return
        await self.drain()
        if self.leadership is not None:  # revoked: a standby takes over at once
            await self.leadership.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        grace = self.settings.drain_grace if grace is None else grace
        await asyncio.gather(self._server.stop(grace), self._bulk_server.stop(grace))
        self._server = self._bulk_server = None
        if self._local_shards is not None:
            await self._local_shards.stop()
            self._local_shards = None
        if self._metrics_server is not None:
            self._metrics_server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._metrics_server.wait_closed(), 5)
            self._metrics_server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop(grace=0)


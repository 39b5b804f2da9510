"""The coordinator's side of a sharded hub: which data-plane shards exist, which generation
stripes over which of them, and what happens when one goes away.

Protocol (``shard.proto``). A shard (:mod:`.shard`, ``gradstar shard``) opens a
``ShardControl.Register`` stream with the admin token and says hello with the address ranks
reach it at; the :class:`ShardRegistry` gives it a *slot* (the one it asks for when that slot is
free or lost, else the lowest free one) and answers ``accepted``. From then on:

- every generation that forms takes the shards that are *up* at that moment, in slot order, as
  its stripe table (``Generation.shards``, sent to the ranks in ``Joined.shards``): the
  node-local shards started for its job when there are any, else the shards that serve every
  job (:meth:`ShardRegistry.stripes_for`). Each of those shards is told ``formed`` (job,
  generation, members, its stripe position) *before* any rank hears of the generation. A
  rank's header reaching a shard a moment before the notice is held briefly by the shard
  (:mod:`.shard`), never refused;
- every generation that ends (failed, superseded, or closed by its last member) is told
  ``over`` to its shards, so their pending collectives fail at once with the same error; so is
  one whose member finished while others are live (RankFinishedError): every collective of it
  needs that rank, and the shards carry nothing else;
- the shard reports its counters every second (``stats``), with the arrival summaries
  (:mod:`..metrics.arrivals`) of the ranks whose collectives it measured since its last report; the
  coordinator keeps the latest per shard, job and rank, and merges them with its own.

A shard whose stream breaks (process killed, host gone, or stalled: keepalive pings go
unanswered within ~5 s) is *lost*: its slot stays in the table as ``lost``, every generation
striped over it fails with :class:`~gradstar.errors.ShardLostError` naming it (ranks get it from
their session within the keepalive time, about 5 s), and the coordinator reports
NOT_SERVING until the configured number of shards is up again. Generations formed later use the
shards that are up. A restarted shard asks for its old slot back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from gradstar.errors import GradstarError, ProtocolError, RendezvousError, ShardLostError
from gradstar.node_shard import HOST_GROUP
from gradstar.proto.v1 import shard_pb2 as spb
from gradstar.proto.v1 import shard_pb2_grpc
from gradstar.transport.addresses import split_host_port
from gradstar.transport.auth import check_job_access
from gradstar.transport.relay import caller_host
from gradstar.transport.status import error_status
from gradstar.transport.traversal import probe, probes_caller

from ..metrics.arrivals import MAX_ENTRIES, RankArrivals, from_message
from ..rendezvous.rendezvous import Generation, Rendezvous

log = logging.getLogger(__name__)

#: How often shards report their counters.
STATS_INTERVAL = 1.0
#: A shard silent for this long takes no new generations: its host may be gone (a link down
#: is noticed by keepalive only ~5 s later, and the ranks that survive it re-join sooner, so a
#: generation formed meanwhile would stripe over a shard nobody reaches). A shard merely slow
#: to report loses nothing but a share of that generation's traffic.
STALE_AFTER = 1.5 * STATS_INTERVAL
#: Arrival summaries (job, rank) kept per shard at most.
MAX_SHARD_ARRIVALS = MAX_ENTRIES
_END = object()


@dataclass(eq=False)
class ShardRecord:
    """One slot of the data plane and the shard that holds it."""

    slot: int
    address: str
    #: A node-local shard's job ('' serves every job): see :meth:`ShardRegistry.stripes_for`.
    job: str = ""
    #: The shard's host key (ShardHello.host): where a per-host group's stripes go.
    host: str = ""
    state: str = "up"
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    stats: spb.ShardStats = field(default_factory=spb.ShardStats)
    last_report: float = field(default_factory=time.monotonic)
    #: Jobs' generations striped over this shard: (job, generation number).
    generations: set[tuple[str, int]] = field(default_factory=set)
    #: job -> rank -> arrival summary, the latest the shard reported (ShardStats.arrivals).
    arrivals: dict[str, dict[int, RankArrivals]] = field(default_factory=dict)
    arrival_entries: int = 0
    #: Ranks on other hosts can dial it: not said to be outbound-only, and the coordinator's
    #: probe of its address connected (:func:`probe`).
    reachable: bool = True
    #: An outbound-only shard's punch port (ShardHello.punch_port; 0: no NAT traversal), and
    #: the host the coordinator saw it call from (its NAT's outside address).
    punch_port: int = 0
    public_host: str = ""

    @property
    def punched(self) -> bool:
        """Whether ranks on other hosts reach it by NAT traversal (not dialed directly)."""
        return not self.reachable and self.punch_port > 0

    def send(self, command: spb.ShardCommand) -> None:
        if self.state == "up":
            self.outbox.put_nowait(command)


class ShardRegistry:
    """Slots, their shards, and the stripe table of every generation (no I/O: the servicer
    below and the rendezvous hooks drive it)."""

    def __init__(self, rendezvous: Rendezvous, expected: int = 0,
                 on_health: Callable[[bool], None] = lambda healthy: None) -> None:
        self.rendezvous = rendezvous
        self.expected = expected
        self.slots: dict[int, ShardRecord] = {}
        self._on_health = on_health
        self._changed = asyncio.Event()
        #: (job, generation) -> its shards in stripe order (:meth:`on_formed`).
        self._stripes: dict[tuple[str, int], list[ShardRecord]] = {}

    @property
    def up(self) -> list[ShardRecord]:
        return [r for _, r in sorted(self.slots.items()) if r.state == "up"]

    @property
    def healthy(self) -> bool:
        """Whether at least the configured number of shards is up."""
        return len(self.up) >= self.expected

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until :attr:`healthy`; False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.healthy:
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    def register(self, hello: spb.ShardHello, job_scoped: bool = False,
                 reachable: bool = True, public_host: str = "") -> ShardRecord:
        """Give a shard a slot. A ``job_scoped`` one (registered with the job token) takes a
        free slot, or one a shard of its own job left, never another lost shard's. One not
        ``reachable`` from other hosts carries only its own host's group.

        Raises:
            ProtocolError: the hello names no address.
        """
        if not hello.address or len(hello.address) > 1024:
            raise ProtocolError("a shard must say hello with the address ranks reach it at")
        taken = {s for s, r in self.slots.items() if r.state == "up"}
        if job_scoped:
            taken |= {s for s, r in self.slots.items() if r.job != hello.job[:256]}
        if hello.slot >= 0 and hello.slot not in taken:
            slot = hello.slot
        else:
            slot = next(s for s in range(len(self.slots) + 1) if s not in taken)
        record = self.slots[slot] = ShardRecord(
            slot, hello.address, hello.job[:256], hello.host[:64], reachable=reachable,
            punch_port=hello.punch_port if 0 < hello.punch_port < 65536 else 0,
            public_host=public_host or split_host_port(hello.address)[0])
        record.send(spb.ShardCommand(accepted=spb.ShardAccepted(
            slot=slot, stats_interval_seconds=STATS_INTERVAL)))
        log.info("shard %d registered at %s%s%s", slot, hello.address,
                 f" for job {hello.job!r}" if hello.job else "",
                 "" if reachable else " (outbound-only: its host takes no inbound connections"
                 + (f"; other hosts reach it by NAT traversal from {record.public_host}:"
                    f"{record.punch_port})" if record.punched else
                    ", so it carries its own host's ranks only)"))
        self._health_changed()
        return record

    def report(self, record: ShardRecord, stats: spb.ShardStats) -> None:
        """A shard's counters; its arrival summaries (only those that changed) are kept apart,
        at most :data:`MAX_SHARD_ARRIVALS` per shard, for jobs the coordinator knows."""
        for a in stats.arrivals:
            table = record.arrivals.get(a.job)
            if table is None:
                if a.job not in self.rendezvous.jobs:
                    continue  # dropped here already, or never joined: nothing shows it
                table = record.arrivals[a.job] = {}
            if a.rank not in table and record.arrival_entries >= MAX_SHARD_ARRIVALS:
                continue
            record.arrival_entries += a.rank not in table
            table[a.rank] = from_message(a)
        stats.ClearField("arrivals")
        record.stats = stats
        record.last_report = time.monotonic()

    def job_arrivals(self, job: str) -> list[dict[int, RankArrivals]]:
        """What every shard (lost ones too: what they measured stays true) reported of
        ``job``'s arrivals, rank -> summary per shard."""
        return [r.arrivals[job] for _, r in sorted(self.slots.items()) if job in r.arrivals]

    def forget(self, job: str) -> None:
        """Drop what the shards reported of ``job`` (the coordinator dropped the job)."""
        for record in self.slots.values():
            table = record.arrivals.pop(job, None)
            if table is not None:
                record.arrival_entries -= len(table)

    def lost(self, record: ShardRecord, reason: str) -> None:
        """The shard's stream ended: fail every generation striped over it."""
        if record.state != "up":
            return
        record.state = "lost"
        log.warning("shard %d at %s was lost (%s)", record.slot, record.address, reason)
        for job_name, number in sorted(record.generations):
            gen = self.rendezvous.generation(job_name, number)
            if gen is not None and gen.healthy:
                self.rendezvous.fail(gen, ShardLostError(
                    f"hub shard {record.slot} at {record.address} was lost ({reason}) during "
                    f"generation {number} of job {job_name!r}; its collectives fail on every "
                    "rank; join again to continue on the shards that remain",
                    shard=record.slot, address=record.address, generation=number))
        record.generations.clear()
        self._health_changed()

    # -- rendezvous hooks ----------------------------------------------------------------------

    def stripes_for(self, job: str) -> list[ShardRecord]:
        """The shards a generation of ``job`` stripes over, in slot order: the node-local
        shards started for it (or for the job whose subgroup it is, ``job/group...``) when
        any is up — the shards of its own hosts, whose links carry its bytes anyway — else
        the shards that serve every job. A per-host group (:data:`HOST_GROUP`) takes that
        host's shard alone; a shard silent for :data:`STALE_AFTER` seconds is left out."""
        now = time.monotonic()
        up = [r for r in self.up if now - r.last_report <= STALE_AFTER]
        own = [r for r in up if r.job and (job == r.job or job.startswith(r.job + "/"))]
        host = job.rpartition(HOST_GROUP)[2] if HOST_GROUP in job else ""
        if host:  # a per-host group (gradstar.client.hierarchy): that host's shard alone
            mine = [r for r in own if r.host == host]
            if mine:  # reached from its own host, outbound-only or not
                return mine
        # Across hosts, only shards every rank can reach: dialed, or punched through NAT
        # (gradstar.transport.traversal). An outbound-only shard that takes no part in
        # traversal would leave the other hosts' ranks unable to reach their stripe.
        own = [r for r in own if r.reachable or r.punched]
        return own or [r for r in up if not r.job and (r.reachable or r.punched)]

    def outbound_hosts(self, job: str) -> set[str]:
        """Host keys of ``job``'s node-local shards that other hosts cannot dial: the ranks on
        those hosts take no inbound connections either."""
        return {r.host for r in self.up if r.host and not r.reachable
                and (job == r.job or job.startswith(r.job + "/"))}

    def traversal(self, job: str, generation: int, host: str) -> list[str]:
        """Joined.traversal for a member of ``job``'s ``generation`` on ``host`` (its host
        key): per stripe, the punch address of a shard it reaches through NAT ('' where it
        dials directly); empty when it dials every one."""
        where = [f"{r.public_host}:{r.punch_port}" if r.punched and r.host != host else ""
                 for r in self._stripes.get((job, generation), ())]
        return where if any(where) else []

    def punch(self, job: str, generation: int, stripe: int, host: str, port: int) -> None:
        """Have the shard of ``job``'s ``generation`` at stripe ``stripe`` punch towards
        ``host``:``port``, where a member (bound by the caller) is punching towards it. The
        host is the one the member's request came from, never one it names: the coordinator
        makes a shard dial the caller's own host only.

        Raises:
            RendezvousError: no such generation or stripe, or a shard that is dialed directly
                or no longer up.
        """
        records = self._stripes.get((job, generation))
        if records is None or not 0 <= stripe < len(records):
            raise RendezvousError(f"job {job!r} generation {generation} has no stripe {stripe} "
                                  "on this coordinator's shards")
        record = records[stripe]
        if not record.punched or record.state != "up":
            raise RendezvousError(
                f"hub shard {record.slot} at {record.address} is "
                + ("not up" if record.state != "up" else "dialed directly, not through NAT"))
        if not 0 < port < 65536 or not host:
            raise ProtocolError(f"a punch names the caller's port (1-65535), not {port}")
        record.send(spb.ShardCommand(punch=spb.ShardPunch(host=host, port=port)))

    def on_formed(self, gen: Generation) -> None:
        up = self.stripes_for(gen.job.name)
        gen.shards = [r.address for r in up]
        self._stripes[(gen.job.name, gen.number)] = up
        members = [spb.GenerationMember(rank=r, member_id=m.member_id)
                   for r, m in sorted(gen.members.items())]
        for position, record in enumerate(up):
            record.generations.add((gen.job.name, gen.number))
            record.send(spb.ShardCommand(formed=spb.GenerationFormed(
                job=gen.job.name, generation=gen.number, world_size=gen.world_size,
                members=members, shards=len(up), position=position)))

    def on_over(self, gen: Generation, error: GradstarError | None = None) -> None:
        """Tell ``gen``'s shards it is over: their pending and later collectives of it fail
        with ``error`` (default: the generation's failure). Also sent when a member finishes
        while others are live — every collective needs it, and shards carry collectives only."""
        error = error or gen.failure or GradstarError(
            f"generation {gen.number} of job {gen.job.name!r} is over: every rank left")
        over = spb.GenerationOver(job=gen.job.name, generation=gen.number,
                                  error=type(error).__name__,
                                  fields_json=json.dumps(error.fields()), message=str(error))
        key = (gen.job.name, gen.number)
        self._stripes.pop(key, None)
        for record in self.slots.values():
            if key in record.generations:
                record.generations.discard(key)
                record.send(spb.ShardCommand(over=over))

    # -- views ---------------------------------------------------------------------------------

    def job_totals(self, job: str) -> tuple[int, int, dict[int, int], dict[int, int]]:
        """(bytes in, bytes out, completed by op, failed by op) the shards report for ``job``."""
        b_in = b_out = 0
        completed: dict[int, int] = {}
        failed: dict[int, int] = {}
        for record in self.slots.values():
            for j in record.stats.jobs:
                if j.job != job:
                    continue
                b_in += j.bytes_in
                b_out += j.bytes_out
                for op, n in j.completed.items():
                    completed[op] = completed.get(op, 0) + n
                for op, n in j.failed.items():
                    failed[op] = failed.get(op, 0) + n
        return b_in, b_out, completed, failed

    def _health_changed(self) -> None:
        self._changed.set()
        self._on_health(self.healthy)


class ShardControlServicer(shard_pb2_grpc.ShardControlServicer):
    """The ``ShardControl.Register`` stream: hello, then commands out and reports in."""

    def __init__(self, registry: ShardRegistry) -> None:
        self.registry = registry

    # grpc.aio tells streaming handlers apart by their kind: both must be async generators.
    async def Register(self, request_iterator: AsyncIterator[spb.ShardReport],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[spb.ShardCommand]:
        """A shard of the hub (admin token): serves every job, or the one its hello names."""
        async for command in self._register(request_iterator, context, for_job=False):
            yield command

    async def RegisterForJob(self, request_iterator: AsyncIterator[spb.ShardReport],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[spb.ShardCommand]:
        """A node-local shard for one job (job token): its hello must name the job; it never
        takes a slot another job's or every job's shard left (see shard.proto)."""
        async for command in self._register(request_iterator, context, for_job=True):
            yield command

    async def _register(self, request_iterator, context, for_job: bool):
        reports = request_iterator.__aiter__()
        try:
            first = await anext(reports)
        except StopAsyncIteration:
            return
        async with error_status(context):
            if first.WhichOneof("kind") != "hello":
                raise ProtocolError("a shard's control stream must start with a hello")
            if for_job and not first.hello.job:
                raise ProtocolError("RegisterForJob is for a shard started for one job; its "
                                    "hello names no job")
            # A job's own token registers a shard for that job only (Register needs the admin
            # token, which opens every job).
            check_job_access(first.hello.job)
            hello = first.hello
            reachable = not hello.outbound_only and (
                not probes_caller(hello.address, context.peer())
                or await probe(hello.address))
            record = self.registry.register(hello, job_scoped=for_job, reachable=reachable,
                                            public_host=caller_host(context.peer()))
        reader = asyncio.create_task(self._read(record, reports))
        reason = "its control stream closed"
        try:
            while (command := await record.outbox.get()) is not _END:
                yield command
        except asyncio.CancelledError:
            reason = "its control stream broke"
            raise
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.registry.lost(record, reason)

    async def _read(self, record: ShardRecord, reports) -> None:
        try:
            async for report in reports:
                if report.WhichOneof("kind") == "stats":
                    self.registry.report(record, report.stats)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            record.outbox.put_nowait(_END)

"""Admin service: what operators see of the coordinator's jobs, shards and stragglers, and
draining."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc

from gradstar.proto.v1 import admin_pb2 as apb
from gradstar.proto.v1 import admin_pb2_grpc
from gradstar.transport.auth import check_job_access
from gradstar.transport.status import error_status

from ..metrics import CollectiveMetrics, job_arrivals
from ..rendezvous.rendezvous import Job, Rendezvous
from ..rounds.averaging import AveragingStore
from ..rounds.table import RoundsTable
from ..shards.registry import ShardRegistry
from ..steps.records import LedgerSummary
from .stragglers import stragglers_reply

#: Jobs per ListJobs page at most (each summary is small; a page stays far below the message
#: limit even with 256-character names).
PAGE_SIZE = 1000


def job_summary(job: Job) -> apb.JobSummary:
    gen = job.generation
    members = len(gen.live_members) if gen is not None else 0
    joining, departing = job.at_boundary
    return apb.JobSummary(
        job=job.name, generation=gen.number if gen is not None else 0,
        world_size=job.world_size, members=members or len(job.forming), state=job.state,
        min_world_size=job.min_world_size, max_world_size=job.max_world_size,
        resizes=job.resizes, joining_at_boundary=joining, departing_at_boundary=departing,
    )


def job_detail(job: Job, models: dict | None = None, now: float | None = None,
               shards: ShardRegistry | None = None) -> apb.GetJobResponse:
    """A job's state and totals: the coordinator's own counters plus what its shards report."""
    now = time.monotonic() if now is None else now
    gen = job.generation
    c = job.counters
    b_in, b_out, completed, failed = (shards.job_totals(job.name) if shards is not None
                                      else (0, 0, {}, {}))
    reply = apb.GetJobResponse(
        summary=job_summary(job), bytes_in=c.bytes_in + b_in, bytes_out=c.bytes_out + b_out,
        last_failure=c.last_failure, rebuilds=c.rebuilds,
        rejoin_wait_seconds=c.rejoin_wait_seconds,
    )
    for op in sorted(set(c.completed) | set(c.failed) | set(completed) | set(failed)):
        reply.ops.append(apb.OpCounter(
            op=op, completed=c.completed.get(op, 0) + completed.get(op, 0),
            failed=c.failed.get(op, 0) + failed.get(op, 0)))
    reply.models.extend(
        apb.GlobalModel(name=name, rounds=m.rounds, parameters=m.params.shape[0])
        for name, m in sorted((models or {}).items())
    )
    if gen is None:
        return reply
    reply.members.extend(
        apb.Member(rank=r, peer_address=m.peer_address,
                   last_heartbeat_age_seconds=now - m.last_seen)
        for r, m in sorted(gen.members.items()) if not m.left
    )
    for (group, seq), coll in sorted(gen.collectives.items()):
        arrived = sorted(coll.participants)
        reply.in_flight.append(apb.InFlightCollective(
            seq=seq, group=group, op=coll.op, arrived_ranks=arrived,
            missing_ranks=[r for r in range(gen.world_size) if r not in coll.participants],
            age_seconds=now - coll.started,
        ))
    return reply


def shard_list(shards: ShardRegistry, now: float | None = None) -> apb.ListShardsResponse:
    now = time.monotonic() if now is None else now
    reply = apb.ListShardsResponse(expected=shards.expected)
    for slot, r in sorted(shards.slots.items()):
        reply.shards.append(apb.ShardSummary(
            slot=slot, address=r.address, state=r.state, bytes_in=r.stats.bytes_in,
            bytes_out=r.stats.bytes_out, jobs=sorted(j.job for j in r.stats.jobs if j.active),
            last_report_age_seconds=now - r.last_report))
    return reply


def rounds_view(table: RoundsTable, job: str,
                now: float | None = None) -> apb.ListRoundsResponse:
    """A job's fault-tolerant rounds: each fragment's last round and each replica's record."""
    now = table.clock() if now is None else now
    reply = apb.ListRoundsResponse()
    for model, fragment, frag, held in table.job_fragments(job):
        last = frag.history[-1] if frag.history else None
        reply.fragments.append(apb.RoundsFragment(
            model=model, fragment=fragment, rounds=held.rounds, parameters=frag.numel,
            last_participants=last.participants if last else (),
            last_missed=last.missed if last else (),
            open_contributions=len(frag.open.contributions) if frag.open else 0))
    for name, r in sorted(table.replicas.get(job, {}).items()):
        reply.replicas.append(apb.RoundsReplica(
            replica=name, joins=r.joins, contributed=r.contributed, missed=r.missed,
            late=r.late, last_seen_age_seconds=now - r.last_seen))
    return reply


def steps_view(view: LedgerSummary) -> apb.StepsModelView:
    """One ledger's summary (:meth:`~gradstar.coordinator.steps.StepsTable.summaries`)."""
    return apb.StepsModelView(
        model=view.model, mode=view.mode, steps=view.steps, world_size=view.world_size,
        live=view.live, dropped=view.dropped, staleness=view.staleness,
        snapshot_steps=-1 if view.snapshot_steps is None else view.snapshot_steps,
        ranks=[apb.StepsRankView(rank=r.rank, live=r.live, base=r.base,
                                 contributed=r.contributed, dropped=r.dropped)
               for r in view.ranks])


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, rendezvous: Rendezvous, averaging: AveragingStore,
                 drain: Callable[[], Awaitable[None]], shards: ShardRegistry | None = None,
                 rounds: RoundsTable | None = None,
                 metrics: CollectiveMetrics | None = None, steps=None,
                 leadership: Callable[[], apb.GetLeadershipResponse] | None = None):
        self.rounds = rounds
        #: Who leads (GetLeadership; :mod:`.leadership`).
        self.leadership = leadership
        #: DDP's sync-mode step ledgers (ListSteps).
        self.steps = steps
        #: The collective engine's metrics: its arrival summaries (GetStragglers).
        self.metrics = metrics or CollectiveMetrics()
        self.rendezvous = rendezvous
        self.averaging = averaging
        self.shards = shards
        self._drain = drain

    async def ListJobs(self, request: apb.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> apb.ListJobsResponse:
        """Jobs in name order, a page at a time (jobs after ``page_token``)."""
        size = min(request.page_size or PAGE_SIZE, PAGE_SIZE)
        names = sorted(n for n in self.rendezvous.jobs if n > request.page_token)
        page = names[:size]
        return apb.ListJobsResponse(
            jobs=[job_summary(self.rendezvous.jobs[n]) for n in page],
            next_page_token=page[-1] if len(names) > size else "")

    async def GetJob(self, request: apb.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> apb.GetJobResponse:
        job = self.rendezvous.jobs.get(request.job)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {request.job!r}")
        return job_detail(job, self.averaging.models(job.name), shards=self.shards)

    async def ListShards(self, request: apb.ListShardsRequest,
                         context: grpc.aio.ServicerContext) -> apb.ListShardsResponse:
        if self.shards is None:
            return apb.ListShardsResponse()
        return shard_list(self.shards)

    async def ListRounds(self, request: apb.ListRoundsRequest,
                         context: grpc.aio.ServicerContext) -> apb.ListRoundsResponse:
        if self.rounds is None or request.job not in self.rounds.jobs():
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no job named {request.job!r} has outer rounds")
        return rounds_view(self.rounds, request.job)

    async def ListSteps(self, request, context):
        views = self.steps.summaries(request.job) if self.steps is not None else []
        if not views:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no job named {request.job!r} has sync-mode steps")
        return apb.ListStepsResponse(models=[steps_view(v) for v in views])

    async def GetStragglers(self, request, context):
        """Per rank arrival lag and cost, slowest first (:mod:`.stragglers`). A job's own
        token reads its own job's rows only (the shared or admin token: every job's)."""
        async with error_status(context):
            # Before the lookup: another job's token learns nothing, not even if it exists.
            check_job_access(request.job)
        job = self.rendezvous.jobs.get(request.job)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {request.job!r}")
        arrivals = job_arrivals(self.metrics, self.shards, job.name, job.generation)
        return stragglers_reply(job.name, job, arrivals, request.limit)

    async def GetLeadership(self, request: apb.GetLeadershipRequest,
                            context: grpc.aio.ServicerContext) -> apb.GetLeadershipResponse:
        """Which coordinator leads, since when, how many takeovers (``gradstar admin
        leader``)."""
        if self.leadership is None:
            return apb.GetLeadershipResponse(role="leader")
        return self.leadership()

    async def Drain(self, request: apb.DrainRequest,
                    context: grpc.aio.ServicerContext) -> apb.DrainResponse:
        await self._drain()
        return apb.DrainResponse(active_jobs=self.rendezvous.active_jobs())

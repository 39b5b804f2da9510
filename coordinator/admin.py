"""Admin service: what operators see of the coordinator's jobs, and draining."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc

from gradstar.proto.v1 import admin_pb2 as apb
from gradstar.proto.v1 import admin_pb2_grpc

from .averaging import AveragingStore
from .rendezvous import Job, Rendezvous


def job_summary(job: Job) -> apb.JobSummary:
    gen = job.generation
    members = len(gen.live_members) if gen is not None else 0
    return apb.JobSummary(
        job=job.name, generation=gen.number if gen is not None else 0,
        world_size=job.world_size, members=members or len(job.forming), state=job.state,
    )


def job_detail(job: Job, models: dict | None = None,
               now: float | None = None) -> apb.GetJobResponse:
    now = time.monotonic() if now is None else now
    gen = job.generation
    reply = apb.GetJobResponse(
        summary=job_summary(job), bytes_in=job.counters.bytes_in,
        bytes_out=job.counters.bytes_out, last_failure=job.counters.last_failure,
    )
    ops = sorted(set(job.counters.completed) | set(job.counters.failed))
    reply.ops.extend(apb.OpCounter(op=op, completed=job.counters.completed.get(op, 0),
                                   failed=job.counters.failed.get(op, 0)) for op in ops)
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


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, rendezvous: Rendezvous, averaging: AveragingStore,
                 drain: Callable[[], Awaitable[None]]):
        self.rendezvous = rendezvous
        self.averaging = averaging
        self._drain = drain

    async def ListJobs(self, request, context):
        return apb.ListJobsResponse(
            jobs=[job_summary(j) for _, j in sorted(self.rendezvous.jobs.items())]
        )

    async def GetJob(self, request, context):
        job = self.rendezvous.jobs.get(request.job)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {request.job!r}")
        return job_detail(job, self.averaging.models(job.name))

    async def Drain(self, request, context):
        await self._drain()
        return apb.DrainResponse(active_jobs=self.rendezvous.active_jobs())

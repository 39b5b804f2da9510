"""Jobs do not accumulate: idle jobs are dropped after a retention, live jobs are capped, their
metric series go with them, and ListJobs is paginated. Driven without sockets."""

from __future__ import annotations

import asyncio

import pytest

from gradstar import errors
from gradstar.coordinator.metrics import CollectiveMetrics
from gradstar.coordinator.rendezvous import Rendezvous
from gradstar.coordinator.rounds import AveragingStore
from gradstar.coordinator.views import PAGE_SIZE, AdminServicer
from gradstar.proto.v1 import admin_pb2 as apb


async def run_job(rv: Rendezvous, name: str, world: int = 1):
    members = await asyncio.gather(*(rv.join(name, world, r, "", 5) for r in range(world)))
    return members


async def test_an_idle_job_is_dropped_only_after_the_retention():
    rv = Rendezvous(heartbeat_timeout=15)
    (member,) = await run_job(rv, "done")
    assert rv.drop_idle(60, now=0) == []  # still has a live member
    rv.leave(member)
    assert rv.drop_idle(60, now=100) == []  # idle from now on
    assert rv.drop_idle(60, now=159) == []
    assert rv.drop_idle(60, now=160) == ["done"]
    assert "done" not in rv.jobs


async def test_a_running_or_forming_job_is_never_dropped():
    rv = Rendezvous(heartbeat_timeout=15)
    await run_job(rv, "running")
    forming = rv.offer("forming", 2, 0, "")
    for t in (0, 1_000, 10_000):
        assert rv.drop_idle(1, now=t) == []
    rv.withdraw(forming)


async def test_a_job_that_comes_back_is_kept_and_its_idle_clock_restarts():
    rv = Rendezvous(heartbeat_timeout=15)
    (m,) = await run_job(rv, "j")
    rv.leave(m)
    rv.drop_idle(60, now=0)
    (m,) = await run_job(rv, "j")  # joins again before the retention ends
    assert rv.drop_idle(60, now=70) == []
    rv.leave(m)
    assert rv.drop_idle(60, now=80) == []
    assert rv.drop_idle(60, now=140) == ["j"]


async def test_new_jobs_beyond_the_cap_are_refused_and_fit_again_once_dropped():
    rv = Rendezvous(heartbeat_timeout=15)
    rv.max_jobs = 2
    (first,) = await run_job(rv, "a")
    await run_job(rv, "b")
    with pytest.raises(errors.TooManyJobsError, match=r"holds 2 jobs, its limit .*max_jobs"):
        rv.offer("c", 1, 0, "")
    rv.leave(first)
    (again,) = await run_job(rv, "a")  # a known job may always join again
    rv.leave(again)
    rv.drop_idle(0, now=0)
    rv.drop_idle(0, now=0)
    await run_job(rv, "c")


async def test_a_job_that_never_formed_leaves_the_table_with_its_last_joiner():
    rv = Rendezvous(heartbeat_timeout=15)
    joiners = [rv.offer("never", 3, r, "") for r in range(2)]
    rv.withdraw(joiners[0])
    assert rv.jobs["never"].state == "forming"
    rv.withdraw(joiners[1])
    assert "never" not in rv.jobs
    # A job that formed once keeps its state (counters, series) for the retention.
    (m,) = await run_job(rv, "formed")
    rv.leave(m)
    rv.withdraw(rv.offer("formed", 2, 0, ""))
    assert rv.jobs["formed"].state == "completed"


async def test_abandoned_joins_at_the_cap_never_lock_a_new_job_out():
    rv = Rendezvous(heartbeat_timeout=15)
    rv.max_jobs = 3
    await run_job(rv, "real")
    # Joins of distinct jobs that never form, the last two still waiting.
    for i in range(500):
        rv.withdraw(rv.offer(f"abandoned-{i}", 2, 0, ""))
    waiting = [rv.offer(f"waiting-{i}", 2, 0, "") for i in range(2)]
    assert set(rv.jobs) == {"real", "waiting-0", "waiting-1"}
    # The table is full: the job waiting longest is evicted, and its joiner told why.
    await run_job(rv, "new")
    assert set(rv.jobs) == {"real", "waiting-1", "new"}
    with pytest.raises(errors.TooManyJobsError, match=(
            r"job 'waiting-0' was evicted before it formed: the coordinator holds 3 jobs, its "
            r"limit \(coordinator setting max_jobs\)")):
        await waiting[0].joined
    rv.withdraw(waiting[1])
    # Jobs that formed are never evicted for a new one.
    await run_job(rv, "third")
    with pytest.raises(errors.TooManyJobsError, match=r"holds 3 jobs, its limit"):
        rv.offer("fourth", 1, 0, "")


def test_forget_drops_every_series_of_the_job():
    metrics = CollectiveMetrics(clock=lambda: 1.0)
    for job in ("gone", "kept"):
        metrics.matched(job, 0, [(0, 0.5), (1, 0.6)])
        metrics.finished(job, "all_reduce", 0.5, failed=False)
    metrics.forget("gone")
    assert all(key[0] == "kept" for key in metrics.durations) and metrics.durations
    assert set(metrics.arrivals.jobs) == {"kept"} and metrics.arrivals.entries == 2


async def test_list_jobs_pages_through_every_job_in_name_order():
    rv = Rendezvous(heartbeat_timeout=15)
    for i in range(PAGE_SIZE + 5):
        rv.offer(f"job-{i:05d}", 2, 0, "")
    admin = AdminServicer(rv, AveragingStore(), drain=None)
    seen, token, pages = [], "", 0
    while True:
        reply = await admin.ListJobs(apb.ListJobsRequest(page_token=token, page_size=400), None)
        seen += [j.job for j in reply.jobs]
        pages += 1
        token = reply.next_page_token
        if not token:
            break
    assert pages == 3 and seen == sorted(rv.jobs)
    first = await admin.ListJobs(apb.ListJobsRequest(page_size=10**6), None)
    assert len(first.jobs) == PAGE_SIZE and first.next_page_token == first.jobs[-1].job

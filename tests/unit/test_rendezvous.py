"""Rendezvous driven directly: forming generations, rank assignment, failures, liveness, draining.

No sockets: the tests call join/offer/lost/leave/expire the way the servicers do. Every await is
bounded, so a broken rendezvous fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from gradstar.coordinator.rendezvous import Generation, Member, Rendezvous
from gradstar.errors import (
    ConfigurationError,
    CoordinatorDrainingError,
    DuplicateRankError,
    JoinTimeoutError,
    RankFinishedError,
    RankLostError,
    RendezvousError,
    WorldSizeMismatchError,
)

BOUND = 2.0  # seconds; far above what any await here needs, far below the suite's timeout
HEARTBEAT_TIMEOUT = 10.0


class FailureRecorder:
    """An on_generation_failed callback that remembers every call."""

    def __init__(self) -> None:
        self.calls: list[Generation] = []

    def __call__(self, generation: Generation) -> None:
        self.calls.append(generation)


@pytest.fixture
def failures() -> FailureRecorder:
    return FailureRecorder()


@pytest.fixture
def rdv(failures) -> Rendezvous:
    return Rendezvous(heartbeat_timeout=HEARTBEAT_TIMEOUT, on_generation_failed=failures)


async def join_all(
    rdv: Rendezvous, job: str, ranks: list[int | None], world_size: int | None = None
) -> list[Member]:
    """Join one process per entry of ``ranks`` concurrently; members in the order of ``ranks``."""
    size = len(ranks) if world_size is None else world_size
    joins = [rdv.join(job, size, rank, f"10.0.0.{i}:7000", timeout=BOUND)
             for i, rank in enumerate(ranks)]
    return await asyncio.wait_for(asyncio.gather(*joins), BOUND)


def drain_notices(member: Member) -> list:
    notices = []
    while not member.notices.empty():
        notices.append(member.notices.get_nowait())
    return notices


# -- forming a generation ----------------------------------------------------------------------


async def test_generation_forms_when_world_size_ranks_join(rdv):
    members = await join_all(rdv, "job", [None, None, None])

    generation = members[0].generation
    assert generation is not None and generation.number == 1
    assert all(m.generation is generation for m in members)
    assert sorted(m.rank for m in members) == [0, 1, 2]
    assert generation.members == {m.rank: m for m in members}
    assert generation.healthy
    assert rdv.jobs["job"].state == "running"


async def test_generation_does_not_form_before_the_last_rank_offers(rdv):
    first = rdv.offer("job", 3, None, "a:1")
    second = rdv.offer("job", 3, None, "b:1")

    assert not first.joined.done() and not second.joined.done()
    assert rdv.jobs["job"].state == "forming"

    third = rdv.offer("job", 3, None, "c:1")
    generation = await asyncio.wait_for(first.joined, BOUND)

    assert generation is third.generation is second.generation
    assert [first.rank, second.rank, third.rank] == [0, 1, 2]


async def test_join_returns_the_callers_own_member_record(rdv):
    members = await join_all(rdv, "job", [None, None])

    assert len({m.member_id for m in members}) == 2
    assert [m.peer_address for m in members] == ["10.0.0.0:7000", "10.0.0.1:7000"]


async def test_explicit_ranks_are_respected_and_free_ranks_go_to_rank_none_joiners(rdv):
    members = await join_all(rdv, "job", [2, None, 0, None])

    assert [m.rank for m in members] == [2, 1, 0, 3]
    assert [m.requested_rank for m in members] == [2, None, 0, None]


async def test_world_size_one_forms_immediately(rdv):
    member = rdv.offer("solo", 1, None, "a:1")

    assert member.joined.done()
    assert member.rank == 0 and member.generation.number == 1


async def test_duplicate_rank_while_forming_raises(rdv):
    rdv.offer("job", 3, 1, "a:1")

    with pytest.raises(DuplicateRankError, match=re.escape(
            "rank 1 of job 'job' was already requested by another joining process")):
        rdv.offer("job", 3, 1, "b:1")
    assert len(rdv.jobs["job"].forming) == 1


async def test_joining_a_running_full_generation_raises_duplicate_rank(rdv):
    await join_all(rdv, "job", [0, 1])

    with pytest.raises(DuplicateRankError, match=re.escape(
            "job 'job' generation 1 is running and rank 1 is held by a live member")):
        rdv.offer("job", 2, 1, "c:1")
    with pytest.raises(DuplicateRankError, match="every rank is held by a live member"):
        rdv.offer("job", 2, None, "c:1")


async def test_world_size_mismatch_while_forming_raises(rdv):
    rdv.offer("job", 2, None, "a:1")

    with pytest.raises(WorldSizeMismatchError, match=re.escape(
            "job 'job' has world_size 2, but this rank asked for 3; every rank must pass the "
            "same world_size")):
        rdv.offer("job", 3, None, "b:1")
    assert len(rdv.jobs["job"].forming) == 1


async def test_world_size_mismatch_while_running_raises(rdv):
    await join_all(rdv, "job", [None, None])

    with pytest.raises(WorldSizeMismatchError, match="has world_size 2, but this rank asked for 4"):
        rdv.offer("job", 4, None, "c:1")


async def test_world_size_may_change_once_the_generation_has_failed(rdv):
    members = await join_all(rdv, "job", [None, None])
    rdv.lost(members[0], "session closed")

    regrown = await join_all(rdv, "job", [None, None, None])

    assert regrown[0].generation.world_size == 3
    assert rdv.jobs["job"].world_size == 3


@pytest.mark.parametrize(("world_size", "rank", "message"), [
    (0, None, "world_size must be between 1 and 65536, got 0"),
    (2**32 - 1, None, "world_size must be between 1 and 65536, got 4294967295"),
    (2, 2, "rank 2 is out of range for world_size 2"),
    (2, -1, "rank -1 is out of range for world_size 2"),
])
async def test_out_of_range_world_size_or_rank_raises(rdv, world_size, rank, message):
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        rdv.offer("job", world_size, rank, "a:1")


@pytest.mark.parametrize(("job", "message"), [
    ("", "a job name must not be empty"),
    ("j" * 257, "a job name is at most 256 characters, got one of 257"),
    ("a\nb", "must not contain control characters"),
    ("a\x00b", "must not contain control characters"),
    ("a\x1b[2Jb", "must not contain control characters"),
    ("a\u202eb", "must not contain control characters"),  # a bidi override
    ("a\u2028b", "must not contain control characters"),  # a line separator
])
async def test_empty_long_or_unprintable_job_names_are_refused(rdv, job, message):
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        rdv.offer(job, 1, None, "a:1")
    assert not rdv.jobs


@pytest.mark.parametrize("job", ["j" * 256, "..", "a/b", "résumé run 1", "作业"])
async def test_job_names_up_to_the_limit_are_accepted(rdv, job):
    member = rdv.offer(job, 1, None, "a:1")
    assert (await asyncio.wait_for(member.joined, BOUND)) is not None
    assert list(rdv.jobs) == [job]


# -- join timeout and withdrawal -----------------------------------------------------------------


async def test_join_timeout_names_how_many_joined_and_withdraws_the_joiner(rdv):
    waiting = rdv.offer("job", 3, 1, "a:1")

    with pytest.raises(JoinTimeoutError, match=re.escape(
            "Timed out: job 'job': only 2 of 3 ranks joined within 0.05 s "
            "(requested ranks present: any, 1)")):
        await asyncio.wait_for(rdv.join("job", 3, None, "b:1", timeout=0.05), BOUND)

    assert rdv.jobs["job"].forming == [waiting]


async def test_join_timeout_of_a_lone_joiner_of_a_new_job_leaves_no_job(rdv):
    with pytest.raises(JoinTimeoutError, match=re.escape(
            "only 1 of 2 ranks joined within 0.02 s (requested ranks present: 0)")):
        await asyncio.wait_for(rdv.join("job", 2, 0, "a:1", timeout=0.02), BOUND)

    # It never formed: nothing of it is worth keeping, and it must not take a table slot.
    assert "job" not in rdv.jobs


async def test_a_rank_freed_by_a_timed_out_joiner_can_be_requested_again(rdv):
    with pytest.raises(JoinTimeoutError):
        await asyncio.wait_for(rdv.join("job", 2, 1, "a:1", timeout=0.02), BOUND)

    members = await join_all(rdv, "job", [1, 0])

    assert [m.rank for m in members] == [1, 0]


async def test_a_cancelled_join_withdraws_the_joiner(rdv):
    task = asyncio.create_task(rdv.join("job", 2, 0, "a:1", timeout=BOUND))
    await asyncio.sleep(0)  # let the join register itself
    assert len(rdv.jobs["job"].forming) == 1

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND)

    assert "job" not in rdv.jobs  # it never formed: it left with its only joiner


# -- losing a rank -------------------------------------------------------------------------------


async def test_lost_fails_the_generation_with_an_error_naming_the_rank(rdv, failures):
    members = await join_all(rdv, "job", [0, 1, 2])
    generation = members[0].generation

    rdv.lost(members[1], "session closed")

    error = generation.failure
    assert isinstance(error, RankLostError)
    assert (error.rank, error.generation) == (1, 1)
    assert str(error) == (
        "rank 1 of job 'job' was lost (session closed); generation 1 is over, so every "
        "collective of it fails"
    )
    assert not generation.healthy
    assert failures.calls == [generation]
    assert rdv.jobs["job"].state == "failed"
    assert rdv.jobs["job"].counters.last_failure == str(error)


async def test_lost_notifies_every_member_the_lost_one_too(rdv):
    members = await join_all(rdv, "job", [0, 1, 2])

    rdv.lost(members[1], "session closed")

    # The lost one hears it as well: a rank frozen past its heartbeats reads it once thawed.
    error = members[0].generation.failure
    assert drain_notices(members[0]) == [error]
    assert drain_notices(members[2]) == [error]
    assert drain_notices(members[1]) == [error]


async def test_a_second_loss_keeps_the_first_error_and_calls_back_once(rdv, failures):
    members = await join_all(rdv, "job", [0, 1, 2])
    generation = members[0].generation

    rdv.lost(members[1], "session closed")
    rdv.lost(members[2], "missed heartbeats")
    rdv.lost(members[1], "session closed")

    assert generation.failure.rank == 1
    assert len(failures.calls) == 1
    assert drain_notices(members[0]) == [generation.failure]


async def test_lost_while_forming_only_withdraws_the_joiner(rdv, failures):
    joiner = rdv.offer("job", 2, 0, "a:1")

    rdv.lost(joiner, "session closed")

    assert "job" not in rdv.jobs  # it never formed: it left with its only joiner
    assert failures.calls == []


async def test_a_notice_wakes_a_member_waiting_on_its_queue(rdv):
    members = await join_all(rdv, "job", [0, 1])
    waiter = asyncio.create_task(asyncio.wait_for(members[0].notices.get(), BOUND))
    await asyncio.sleep(0)

    rdv.lost(members[1], "session closed")

    notice = await waiter
    assert isinstance(notice, RankLostError) and notice.rank == 1


# -- heartbeats ----------------------------------------------------------------------------------


async def test_expire_declares_members_with_stale_heartbeats_lost(rdv, failures):
    members = await join_all(rdv, "job", [0, 1, 2])
    for member, seen in zip(members, [100.0, 105.0, 108.0], strict=True):
        member.last_seen = seen

    stale = rdv.expire(now=112.5)

    assert stale == [members[0]]
    error = members[0].generation.failure
    assert isinstance(error, RankLostError) and error.rank == 0
    assert "rank 0 of job 'job' was lost (no heartbeat for 12.5 s)" in str(error)
    assert len(failures.calls) == 1


async def test_expire_keeps_members_seen_exactly_at_the_timeout(rdv, failures):
    members = await join_all(rdv, "job", [0, 1])
    for member in members:
        member.last_seen = 50.0

    assert rdv.expire(now=50.0 + HEARTBEAT_TIMEOUT) == []
    assert members[0].generation.healthy
    assert failures.calls == []


async def test_expire_with_every_member_stale_fails_the_generation_once(rdv, failures):
    members = await join_all(rdv, "job", [0, 1])
    for member in members:
        member.last_seen = 0.0

    stale = rdv.expire(now=HEARTBEAT_TIMEOUT + 1)

    assert stale == members
    assert all(m.left for m in members)
    assert len(failures.calls) == 1


async def test_touch_keeps_a_member_alive(rdv):
    members = await join_all(rdv, "job", [0, 1])
    members[0].last_seen = members[1].last_seen = -HEARTBEAT_TIMEOUT * 10

    members[0].touch()
    members[1].touch()

    assert rdv.expire() == []


# -- leaving -------------------------------------------------------------------------------------


async def test_a_member_that_leaves_has_finished_and_the_generation_stays_healthy(failures):
    finished = []
    rdv = Rendezvous(heartbeat_timeout=HEARTBEAT_TIMEOUT, on_generation_failed=failures,
                     on_rank_finished=lambda gen, error: finished.append((gen, error)))
    members = await join_all(rdv, "job", [0, 1, 2])
    generation = members[0].generation

    rdv.leave(members[2])

    assert generation.healthy and failures.calls == []
    error = generation.finished_error
    assert isinstance(error, RankFinishedError) and isinstance(error, RankLostError)
    assert error.rank == 2 and error.generation == generation.number
    assert str(error).startswith("rank 2 of job 'job' finished (closed its process group)")
    assert finished == [(generation, error)]
    # The others hear that rank 2 finished (so a recv from it ends), not that anything failed.
    assert drain_notices(members[0]) == [error] and drain_notices(members[2]) == []
    assert rdv.member("job", generation.number, 0, members[0].member_id) is generation
    assert rdv.jobs["job"].state == "running"


async def test_a_job_whose_members_all_finished_is_completed(failures):
    finished = []
    rdv = Rendezvous(heartbeat_timeout=HEARTBEAT_TIMEOUT, on_generation_failed=failures,
                     on_rank_finished=lambda gen, error: finished.append(error.rank))
    members = await join_all(rdv, "job", [0, 1, 2])

    for m in members:
        rdv.leave(m)

    assert finished == [0]  # the first finisher is what collectives are failed with
    assert members[0].generation.completed
    assert rdv.jobs["job"].state == "completed"
    assert failures.calls == [] and rdv.jobs["job"].counters.last_failure == ""
    assert rdv.active_jobs() == 0


async def test_a_member_lost_after_another_finished_still_fails_the_job(rdv, failures):
    members = await join_all(rdv, "job", [0, 1, 2])

    rdv.leave(members[0])
    rdv.lost(members[1], "session closed")

    generation = members[0].generation
    assert failures.calls == [generation]
    assert isinstance(generation.failure, RankLostError)
    assert not isinstance(generation.failure, RankFinishedError)
    rdv.leave(members[2])
    assert rdv.jobs["job"].state == "failed"


async def test_the_last_member_leaving_an_otherwise_empty_generation_fails_nothing(rdv, failures):
    member = (await join_all(rdv, "solo", [None]))[0]

    rdv.leave(member)

    assert member.generation.healthy
    assert failures.calls == []
    assert rdv.jobs["solo"].state == "completed"
    assert rdv.active_jobs() == 0


async def test_leave_while_forming_only_withdraws_the_joiner(rdv, failures):
    joiner = rdv.offer("job", 2, None, "a:1")

    rdv.leave(joiner)

    assert "job" not in rdv.jobs  # it never formed: it left with its only joiner
    assert failures.calls == []


# -- the next generation -------------------------------------------------------------------------


async def test_a_new_generation_forms_after_a_failure(rdv):
    first = await join_all(rdv, "job", [0, 1, 2])
    rdv.lost(first[1], "session closed")

    second = await join_all(rdv, "job", [0, None, 2])

    generation = second[0].generation
    assert generation.number == 2
    assert generation.healthy
    assert rdv.jobs["job"].generation is generation
    assert [m.rank for m in second] == [0, 1, 2]
    assert not first[0].generation.healthy


async def test_forming_over_a_completed_generation_does_not_fail_it(rdv, failures):
    old = (await join_all(rdv, "solo", [None]))[0]
    rdv.leave(old)

    new = (await join_all(rdv, "solo", [None]))[0]

    assert new.generation.number == 2
    assert failures.calls == []
    assert old.generation.completed and rdv.jobs["solo"].counters.last_failure == ""


async def test_forming_over_a_generation_with_live_members_fails_it_as_superseded(rdv, failures):
    old = await join_all(rdv, "job", [0, 1])
    rdv.leave(old[1])  # rank 0 is still live in generation 1

    new = await join_all(rdv, "job", [None, None])

    assert new[0].generation.number == 2
    assert failures.calls == [old[0].generation]
    assert str(old[0].generation.failure) == "job 'job' formed a new generation"


# -- member lookup -------------------------------------------------------------------------------


async def test_member_returns_the_generation_of_a_current_member(rdv):
    members = await join_all(rdv, "job", [0, 1])

    assert rdv.member("job", 1, 1, members[1].member_id) is members[1].generation


async def test_member_of_an_unknown_job_raises(rdv):
    with pytest.raises(RendezvousError, match=re.escape(
            "job 'nope' generation 1 is not current (current: none); join the job again")):
        rdv.member("nope", 1, 0, "id")


async def test_member_of_a_stale_generation_raises(rdv):
    first = await join_all(rdv, "job", [0, 1])
    rdv.lost(first[1], "session closed")
    await join_all(rdv, "job", [0, 1])

    with pytest.raises(RendezvousError, match=re.escape(
            "job 'job' generation 1 is not current (current: 2); join the job again")):
        rdv.member("job", 1, 0, first[0].member_id)


async def test_member_with_the_wrong_member_id_raises(rdv):
    members = await join_all(rdv, "job", [0, 1])

    with pytest.raises(RendezvousError, match=re.escape(
            "rank 0 is not a member of job 'job' generation 1")):
        rdv.member("job", 1, 0, members[1].member_id)


async def test_member_with_an_unknown_rank_raises(rdv):
    members = await join_all(rdv, "job", [0, 1])

    with pytest.raises(RendezvousError, match="rank 5 is not a member of job 'job' generation 1"):
        rdv.member("job", 1, 5, members[0].member_id)


async def test_member_of_a_failed_generation_raises_its_rank_lost_error(rdv):
    members = await join_all(rdv, "job", [0, 1])
    rdv.lost(members[1], "session closed")

    with pytest.raises(RankLostError, match="rank 1 of job 'job' was lost") as raised:
        rdv.member("job", 1, 0, members[0].member_id)
    assert raised.value is members[0].generation.failure
    assert (raised.value.rank, raised.value.generation) == (1, 1)


# -- isolation and draining ----------------------------------------------------------------------


async def test_jobs_are_isolated(rdv, failures):
    a = await join_all(rdv, "a", [0, 1])
    b = await join_all(rdv, "b", [0, 1, 2])

    rdv.lost(a[0], "session closed")

    assert failures.calls == [a[0].generation]
    assert b[0].generation.healthy and b[0].generation.number == 1
    assert all(drain_notices(m) == [] for m in b)
    assert rdv.member("b", 1, 0, b[0].member_id) is b[0].generation
    assert rdv.jobs["a"].state == "failed" and rdv.jobs["b"].state == "running"


async def test_jobs_form_independently_with_the_same_ranks(rdv):
    a_joiner = rdv.offer("a", 2, 0, "a:1")
    b_joiner = rdv.offer("b", 2, 0, "b:1")  # rank 0 of another job is no duplicate

    rdv.offer("a", 2, 1, "a:2")

    assert a_joiner.joined.done() and not b_joiner.joined.done()
    assert rdv.jobs["b"].state == "forming"
    assert rdv.active_jobs() == 2


async def test_draining_refuses_joins(rdv):
    rdv.draining = True

    with pytest.raises(CoordinatorDrainingError, match=re.escape(
            "the coordinator is draining and accepts no new joins; use another coordinator")):
        await asyncio.wait_for(rdv.join("job", 2, None, "a:1", timeout=BOUND), BOUND)
    assert "job" not in rdv.jobs


async def test_draining_leaves_running_generations_alone(rdv):
    members = await join_all(rdv, "job", [0, 1])

    rdv.draining = True

    assert rdv.member("job", 1, 0, members[0].member_id).healthy
    with pytest.raises(CoordinatorDrainingError):
        rdv.offer("job", 2, None, "c:1")


# -- growing while it runs ---------------------------------------------------------------------


async def test_an_elastic_join_past_the_world_size_grows_the_running_generation(rdv, failures):
    joins = [rdv.join("grow", 2, r, f"10.0.0.{r}:7000", timeout=BOUND, max_world_size=3)
             for r in (0, 1)]
    first = await asyncio.wait_for(asyncio.gather(*joins), BOUND)
    for m in first:
        m.boundaries = False  # sync-mode DDPs: they said they take a new rank on the ledger
    gen = first[0].generation
    grown = await asyncio.wait_for(rdv.join("grow", 2, None, "10.0.0.9:7000", timeout=BOUND,
                                            elastic=True), BOUND)
    assert (grown.rank, grown.generation, grown.replacement) == (2, gen, True)
    assert gen.world_size == 3 and rdv.jobs["grow"].world_size == 3
    # Its collectives span a fixed set of ranks: over, on every rank, with the reason.
    assert failures.calls == [gen] and "grew to 3 ranks" in str(gen.failure)
    assert rdv.bound_member("grow", gen.number, 2, grown.member_id) is gen
    # At the limit an elastic join finds no place in it: it waits for a next generation, as
    # any join does, and the running one stays as it is.
    waiting = rdv.offer("grow", 3, None, "10.0.0.8:7000", elastic=True)
    assert not waiting.joined.done() and gen.world_size == 3
    rdv.withdraw(waiting)


async def test_a_fixed_size_job_does_not_grow(rdv):
    members = await join_all(rdv, "fixed", [0, 1])
    with pytest.raises(DuplicateRankError):
        rdv.offer("fixed", 2, None, "10.0.0.9:7000", elastic=True)
    assert members[0].generation.world_size == 2 and members[0].generation.healthy


async def test_max_world_size_below_the_world_size_is_refused(rdv):
    with pytest.raises(ConfigurationError, match="max_world_size must be between"):
        rdv.offer("bad", 4, None, "10.0.0.1:7000", max_world_size=3)

"""Rendezvous: jobs, their generations and members, and member liveness.

A *job* is a named group of ``world_size`` ranks. Ranks join it; once ``world_size`` of them
are waiting the coordinator assigns the free ranks, numbers the membership as a new
*generation* and answers every joiner with the same peer table. A generation stays healthy
until one of its members is *lost* (its session stream closes or it misses heartbeats); then it
*fails*: every pending and later collective of it raises
:class:`~gradstar.errors.RankLostError` naming that rank, and survivors may join again to form
the next generation.

A member that leaves in an orderly way (``pg.close()``) has *finished*, not failed: the
generation stays healthy, so point-to-point traffic among the others goes on, and only the
collectives that need the finished rank (every collective of the generation spans all of its
ranks) fail with :class:`~gradstar.errors.RankFinishedError`. A generation whose members all
finished is *completed*. Jobs are isolated: nothing in one job's state refers to another's.

The records (jobs, generations, members) are in :mod:`.jobs`. This module does no I/O; the
servicers drive it and tests can drive it directly.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable

from gradstar.errors import (
    ConfigurationError,
    CoordinatorDrainingError,
    DuplicateRankError,
    GradstarError,
    JoinTimeoutError,
    RankFinishedError,
    RankLostError,
    RendezvousError,
    WorldSizeMismatchError,
)

from . import resize
from .admission import check_limits, dispute_world_size, make_room
from .elastic import past_size, replace, unsaid

# The records live in .jobs; named here too, where the servicers, the engine and tests import
# them from.
from .jobs import (
    MAX_JOB_NAME_CHARS,
    Generation,
    Job,
    JobCounters,
    Member,
    check_job_name,
    pair_key,
)
from .rebuild import Rebuilds

__all__ = ["MAX_JOB_NAME_CHARS", "Generation", "Job", "JobCounters", "Member", "Rendezvous",
           "check_job_name", "pair_key"]


log = logging.getLogger(__name__)

#: Most ranks a job may have: what every per-rank table of the hub is sized for at most.
MAX_WORLD_SIZE = 1 << 16


class Rendezvous:
    """Forms generations of jobs and tracks the liveness of their members.

    Hooks: ``on_generation_formed(generation)`` runs as a generation forms, before any member
    hears of it (the shard registry picks its shards there); ``on_generation_failed`` once when
    it fails, so the collective engine can fail its pending collectives; and
    ``on_generation_closed`` when its last member leaves in an orderly way; and
    ``on_rank_finished(generation, error)`` when a member finishes while others are still live,
    so the collectives that need it fail with ``error``; ``on_member_gone(member)`` whenever a
    member of a formed generation is lost or finishes (the step ledgers' live sets).
    """

    def __init__(
        self,
        heartbeat_timeout: float,
        on_generation_failed: Callable[[Generation], None] = lambda g: None,
        on_generation_formed: Callable[[Generation], None] = lambda g: None,
        on_generation_closed: Callable[[Generation], None] = lambda g: None,
        on_rank_finished: Callable[[Generation, RankFinishedError], None] = lambda g, e: None,
        on_member_gone: Callable[[Member], None] = lambda m: None,
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.jobs: dict[str, Job] = {}
        #: Jobs held at most (see :meth:`offer`); :meth:`drop_idle` frees finished ones.
        self.max_jobs = 1 << 62
        self.draining = False
        self._on_generation_failed = on_generation_failed
        self._on_generation_formed = on_generation_formed
        self._on_generation_closed = on_generation_closed
        self._on_rank_finished = on_rank_finished
        self._on_member_gone = on_member_gone
        #: Generations a restart lost, taken back from their rejoining ranks (:mod:`.rebuild`).
        self.rebuilds = Rebuilds(self.jobs, lambda job: make_room(self.jobs, job, self.max_jobs),
                                 lambda: self.draining,
                                 lambda gen: self._on_generation_formed(gen))

    async def join(
        self, job: str, world_size: int, rank: int | None, peer_address: str, timeout: float,
        *, host: str = "", hostname: str = "", elastic: bool = False,
        outbound_only: bool = False, max_world_size: int = 0, min_world_size: int = 0,
        moving_from=None, punch: str = "",
    ) -> Member:
        """Wait until the job's next generation forms; return this caller's member record.

        Raises:
            CoordinatorDrainingError: the coordinator takes no new joins.
            ConfigurationError: world_size or rank out of range, or a job name that
                :func:`check_job_name` refuses.
            WorldSizeMismatchError: the job is forming or running with another world size.
            DuplicateRankError: a live member already holds ``rank``.
            JoinTimeoutError: not every rank joined within ``timeout`` seconds.
        """
        member = self.offer(job, world_size, rank, peer_address, host=host, hostname=hostname,
                            elastic=elastic, max_world_size=max_world_size,
                            min_world_size=min_world_size, moving_from=moving_from)
        member.outbound_only, member.punch = outbound_only, punch  # before anyone hears of it
        try:
            await asyncio.wait_for(asyncio.shield(member.joined), timeout)
        except TimeoutError:
            state = self.jobs.get(job)
            present = sorted(m.requested_rank if m.requested_rank is not None else -1
                             for m in (state.forming if state is not None else ()))
            parked = state is not None and member in state.parked
            self.withdraw(member)
            named = ", ".join("any" if r < 0 else str(r) for r in present)
            raise JoinTimeoutError(unsaid(job, timeout) if parked else (
                f"Timed out: job {job!r}: only {len(present)} of {world_size} ranks joined "
                f"within {timeout:g} s (requested ranks present: {named or 'none'})")) from None
        except BaseException:
            self.withdraw(member)
            raise
        return member

    def offer(self, job: str, world_size: int, rank: int | None, peer_address: str, *,
              host: str = "", hostname: str = "",
              elastic: bool = False, max_world_size: int = 0, min_world_size: int = 0,
              moving_from=None) -> Member:
        """Register a joiner; its ``joined`` future completes when the generation forms, or at
        once when it is ``elastic`` and takes the place of a lost member of the running one,
        or, with no such place, joins it as one more rank while the job may grow
        (``max_world_size``, as torchrun's ``--nnodes MIN:MAX``): at the next step boundary
        when every member moves at them (:mod:`.resize`), else at once
        (:func:`.elastic.past_size`).
        ``moving_from``: a member of the running generation moving to the next at a resize's
        boundary (:func:`.resize.arrive`)."""
        if self.draining:
            raise CoordinatorDrainingError(
                "the coordinator is draining and accepts no new joins; use another coordinator"
            )
        check_job_name(job)
        state = self.jobs.get(job)
        if moving_from is not None:
            member = Member(job=job, requested_rank=None, peer_address=peer_address,
                            host=host[:64], hostname=hostname[:255])
            resize.arrive(state, moving_from, member, self._resized)
            return member
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ConfigurationError(f"world_size must be between 1 and {MAX_WORLD_SIZE}, got "
                                     f"{world_size}")
        if max_world_size and not world_size <= max_world_size <= MAX_WORLD_SIZE:
            raise ConfigurationError(
                f"max_world_size must be between world_size ({world_size}) and "
                f"{MAX_WORLD_SIZE}, got {max_world_size}")
        if state is not None:
            check_limits(state, max_world_size, min_world_size)
        current = state.generation if state is not None else None
        if (elastic and rank is None and current is not None and current.live_members
                and not any(m.left and not m.finished for m in current.members.values())
                and (member := past_size(state, peer_address, host, hostname, self.fail))):
            return member
        if rank is not None and not 0 <= rank < world_size:
            raise ConfigurationError(f"rank {rank} is out of range for world_size {world_size}")
        if state is None:
            make_room(self.jobs, job, self.max_jobs)
            state = self.jobs[job] = Job(job, world_size)
        state.max_world_size = max(state.max_world_size, max_world_size, state.world_size)
        state.min_world_size = max(state.min_world_size, min_world_size)
        busy = state.forming or (state.generation is not None and state.generation.healthy
                                 and state.generation.live_members)
        if state.world_size != world_size:
            if busy:
                dispute_world_size(state, world_size)
                raise WorldSizeMismatchError(
                    f"job {job!r} has world_size {state.world_size}, but this rank asked for "
                    f"{world_size}; every rank must pass the same world_size"
                )
            state.world_size = world_size
        current = state.generation
        if current is not None and current.healthy and len(current.live_members) == world_size:
            held = f"rank {rank}" if rank is not None else "every rank"
            raise DuplicateRankError(
                f"job {job!r} generation {current.number} is running and {held} is held by a "
                "live member; a restarted rank can join once the old one is declared lost"
            )
        if elastic and (replaced := replace(state, rank, peer_address, host, hostname)):
            return replaced
        if rank is not None and any(m.requested_rank == rank for m in state.forming):
            raise DuplicateRankError(
                f"rank {rank} of job {job!r} was already requested by another joining process"
            )
        member = Member(job=job, requested_rank=rank, peer_address=peer_address, host=host[:64],
                        hostname=hostname[:255])
        member.joined = asyncio.get_running_loop().create_future()
        state.forming.append(member)
        if len(state.forming) == world_size:
            self._form(state)
        return member

    def withdraw(self, member: Member) -> None:
        """Take a joiner that gave up out of its job's forming set; a job that never formed
        leaves the table with its last joiner."""
        state = self.jobs.get(member.job)
        if state is not None and member in state.forming:
            state.forming.remove(member)
            if not state.forming and not state.formed:
                del self.jobs[state.name]
        elif state is not None:
            resize.withdraw(state, member)

    def _form(self, job: Job) -> None:
        taken = {m.requested_rank for m in job.forming if m.requested_rank is not None}
        free = iter(r for r in range(job.world_size) if r not in taken)
        members: dict[int, Member] = {}
        for m in job.forming:
            m.rank = m.requested_rank if m.requested_rank is not None else next(free)
            members[m.rank] = m
        job.forming = []
        self.form(job, members)

    def _resized(self, job: Job, members: dict[int, Member]) -> Generation:
        return self.form(job, members, resized=True)

    def form(self, job: Job, members: dict[int, Member], *, resized: bool = False) -> Generation:
        """Number ``members`` (by rank) as the job's next generation and answer their joins;
        the generation before is over (failed, unless a resize moved its members on)."""
        for rank, m in members.items():
            m.rank = rank
        job.generations_formed += 1
        job.world_size = len(members)
        gen = Generation(job, job.generations_formed, job.world_size, members,
                         peer_secret=secrets.token_bytes(32))
        previous, job.generation = job.generation, gen
        if resized:
            # Its members moved on at a step boundary: the old generation ends quietly, as
            # each of them leaves it (nothing in it failed; nothing of it is pending).
            gen.resized = True
        elif previous is not None and previous.healthy and previous.live_members:
            # Everyone moved on; nothing of the old generation can still be waited for (a
            # completed one has nothing pending and did not fail).
            self.fail(previous, RendezvousError(f"job {job.name!r} formed a new generation"))
        self._on_generation_formed(gen)
        for m in members.values():
            m.generation = gen
            m.touch()
            if not m.joined.done():
                m.joined.set_result(gen)
        return gen

    def member(self, job: str, generation: int, rank: int, member_id: str) -> Generation:
        """The generation a collective caller belongs to; raises if it is not a member.

        Raises:
            RankLostError: the generation has failed (names the lost rank).
            RendezvousError: no such job, stale generation, or unknown member.
        """
        state = self.jobs.get(job)
        gen = state.generation if state is not None else None
        if gen is None or gen.number != generation:
            current = gen.number if gen is not None else "none"
            raise RendezvousError(
                f"job {job!r} generation {generation} is not current (current: {current}); "
                "join the job again"
            )
        m = gen.members.get(rank)
        if m is None or m.member_id != member_id:
            raise RendezvousError(f"rank {rank} is not a member of job {job!r} generation "
                                  f"{generation}")
        if gen.failure is not None:
            raise gen.failure
        return gen

    def bound_member(self, job: str, generation: int, rank: int, member_id: str) -> Generation:
        """The current generation of ``job`` if (``rank``, ``member_id``) is its member there:
        what binds a call outside the collectives (the Steps service) to its caller. Unlike
        :meth:`member` a failed generation still answers: a sync-mode DDP's steps go on
        without a lost rank. An elastic replacement holds its rank's place from its join on,
        so the member it replaced is refused from then on.

        Raises:
            RendezvousError: no such job, a generation that is not the job's current one, or
                a rank and member id that are not a member of it.
        """
        state = self.jobs.get(job)
        gen = state.generation if state is not None else None
        if gen is None:
            raise RendezvousError(f"job {job!r} has no generation on this coordinator: only "
                                  "its joined ranks may call for it (join the job first)")
        m = gen.members.get(rank)
        if gen.number != generation or m is None or not hmac.compare_digest(
                m.member_id.encode(), member_id.encode("utf-8", "replace")):
            raise RendezvousError(
                f"the caller is not rank {rank} of job {job!r} generation {generation} (the "
                f"job is at generation {gen.number}): only a member of the job's current "
                "generation may call for it, with the member id its join gave it")
        return gen

    def lost(self, member: Member, reason: str) -> None:
        """A member's session ended without leaving, or it missed heartbeats. A mover (it said
        ``advance``) whose session ended before its goodbye was read (its close gave up on a
        loaded machine) still moves: it has a heartbeat timeout to arrive (:meth:`expire`);
        a member departing at a named boundary departs (``resize.leaving``)."""
        self.withdraw(member)
        gen = member.generation
        if gen is None or member.left:
            return
        state = self.jobs.get(member.job)
        if state is not None and resize.leaving(state, member):
            self.leave(member)
            return
        member.left = True
        self._on_member_gone(member)
        error = RankLostError(
            f"rank {member.rank} of job {member.job!r} was lost ({reason}); generation "
            f"{gen.number} is over, so every collective of it fails",
            rank=member.rank, generation=gen.number,
        )
        # The lost rank hears it too, if its session still reads (a rank frozen past its
        # heartbeats, then thawed): it must learn why, not find its calls refused later.
        member.notices.put_nowait(error)
        self.fail(gen, error)

    def leave(self, member: Member) -> None:
        """An orderly goodbye: the member *finished*. The generation stays healthy (peer
        traffic among the others goes on); its collectives, which need every rank, fail from
        now on with :class:`RankFinishedError`. The last member to leave completes it."""
        self.withdraw(member)
        gen = member.generation
        if gen is None or member.left:
            return
        state = self.jobs.get(member.job)
        if state is not None and (resize.moving(state, member) or gen is not state.generation):
            # A move to the next generation (or a goodbye to one the job moved on from): quiet.
            member.left = member.finished = True
            if not gen.live_members:
                self._on_generation_closed(gen)
            resize.settle(state, self._resized)
            return
        member.left = member.finished = True
        self._on_member_gone(member)
        if state is not None and resize.current(state, gen) is not None:
            resize.settle(state, self._resized)  # it departs rather than moves
        if gen.failure is not None:
            return
        if gen.live_members:
            error = RankFinishedError(
                f"rank {member.rank} of job {member.job!r} finished (closed its process "
                f"group), and every collective of generation {gen.number} needs all "
                f"{gen.world_size} ranks; close the group on every rank only after its "
                "last collective", rank=member.rank, generation=gen.number)
            for m in gen.live_members:  # each hears of it: a recv from it must not wait on
                m.notices.put_nowait(error)
            if gen.finished_error is None:
                gen.finished_error = error
                self._on_rank_finished(gen, error)
        else:
            self._on_generation_closed(gen)

    def adopt(self, job: str, number: int, world_size: int, member_ids: dict[int, str],
              shards: list[str] | None = None) -> Generation:
        """Take a generation the coordinator formed (a hub shard's copy of the rendezvous):
        the members are known by rank and member id, and the job's previous generation, if
        still healthy, is over."""
        state = self.jobs.get(job)
        if state is None:
            state = self.jobs[job] = Job(job, world_size)
        state.world_size = world_size
        members = {}
        for rank, member_id in member_ids.items():
            m = Member(job=job, requested_rank=rank, peer_address="", member_id=member_id,
                       rank=rank)
            members[rank] = m
        gen = Generation(state, number, world_size, members, shards=list(shards or ()))
        for m in members.values():
            m.generation = gen
        previous, state.generation = state.generation, gen
        state.generations_formed = max(state.generations_formed, number)
        if previous is not None and previous.healthy:
            self.fail(previous, RendezvousError(f"job {job!r} formed a new generation"))
        return gen

    def generation(self, job: str, number: int) -> Generation | None:
        """The job's current generation if it is ``number``, else None."""
        state = self.jobs.get(job)
        gen = state.generation if state is not None else None
        return gen if gen is not None and gen.number == number else None

    def fail(self, gen: Generation, error: GradstarError) -> None:
        if gen.failure is not None:
            return
        gen.failure = error
        gen.job.counters.last_failure = str(error)
        if resize.current(gen.job, gen) is not None:
            resize.cancel(gen.job, error)
        for m in gen.live_members:
            m.notices.put_nowait(error)
        self._on_generation_failed(gen)

    def expire(self, now: float | None = None) -> list[Member]:
        """Declare lost every member whose last heartbeat is older than the timeout."""
        now = time.monotonic() if now is None else now
        stale = [
            m for job in self.jobs.values() if job.generation is not None
            for m in job.generation.live_members if now - m.last_seen > self.heartbeat_timeout
        ]
        for m in stale:
            self.lost(m, f"no heartbeat for {now - m.last_seen:.1f} s")
        for job in list(self.jobs.values()):
            resize.end_overdue(job, now, self.heartbeat_timeout, self.fail)
        return stale

    def drop_idle(self, retention: float, now: float | None = None) -> list[str]:
        """Forget jobs that have had no live or joining member for ``retention`` seconds (their
        state and counters; a job that joins again starts afresh). Returns their names."""
        now = time.monotonic() if now is None else now
        dropped = []
        for name, job in list(self.jobs.items()):
            gen = job.generation
            if job.forming or (gen is not None and gen.live_members and gen.healthy):
                job.idle_since = None
            elif not job.formed:
                del self.jobs[name]  # nothing to keep (withdraw drops these already)
                dropped.append(name)
            elif job.idle_since is None:
                job.idle_since = now
            elif now - job.idle_since >= retention:
                del self.jobs[name]
                dropped.append(name)
        return dropped

    def active_jobs(self) -> int:
        return sum(1 for j in self.jobs.values() if j.state in ("running", "forming"))

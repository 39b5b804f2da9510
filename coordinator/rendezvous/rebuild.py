"""Generations a restarted coordinator takes back from their rejoining ranks; no I/O.

A coordinator that was killed or restarted (same address, same ``--state-dir``) knows nothing
of the jobs that ran on it, but their ranks do: each holds its generation's number, its member
id, and which collectives it issued. A rank whose session broke without a verdict rejoins with
a :class:`Claim` (``JoinRequest.rejoin``) instead of joining afresh, and the coordinator
rebuilds the generation from the claims:

1. A claim is checked on its own first (:func:`check_claim`): a generation and sequence
   numbers that make sense, and a job this coordinator does not already hold at that
   generation or a later one — a coordinator that never went away lost the rank when its
   session broke, which failed the generation, so there is nothing to take back.
2. Claims wait in the job's :class:`Rebuild` until every rank of the generation has rejoined.
   They must agree on the generation and the world size, and hold distinct ranks and member
   ids; a claim that disagrees fails the whole rebuild, since it can never complete.
3. Then the generation forms again with the same number and member ids (so the collectives the
   ranks re-issue, headers unchanged, are its own), the peer addresses the ranks sent, and no
   peer secret (the ranks keep the peer keys they had). Its *replay set* is every seq some rank
   had not seen complete: every rank issues each again, a rank that saw one complete from the
   input it retained. A seq of it that a rank completed and no longer holds fails the rebuild.

Every refusal is :class:`~gradstar.errors.RejoinRefusedError`, never a guess: a rank that
cannot be taken back must not produce a wrong result.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gradstar.errors import CoordinatorDrainingError, JoinTimeoutError, RejoinRefusedError
from gradstar.proto.v1 import rendezvous_pb2 as rpb

from .jobs import Generation, Job, Member, check_job_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """What a rank says of its generation when it rejoins (``JoinRequest`` with ``rejoin``)."""

    job: str
    world_size: int
    rank: int
    generation: int
    member_id: str
    next_seq: int
    pending: frozenset[int] = frozenset()
    retained: frozenset[int] = frozenset()
    peer_address: str = ""
    host: str = ""
    hostname: str = ""
    #: How long the rank had been without its coordinator when it sent the claim (seconds).
    away: float = 0.0
    #: The job's size limits as the rank joined with them (0: none).
    max_world_size: int = 0
    min_world_size: int = 0

    def holds(self, seq: int) -> bool:
        """Whether this rank can issue collective ``seq`` again (or has yet to issue it)."""
        return seq in self.pending or seq in self.retained or seq >= self.next_seq


def claim_of(join: rpb.JoinRequest) -> Claim:
    """The claim a join request with ``rejoin`` set makes."""
    r = join.rejoin
    return Claim(join.job, join.world_size, join.rank, r.generation, r.member_id, r.next_seq,
                 frozenset(r.pending), frozenset(r.retained), join.peer_address, join.host,
                 join.hostname, max(r.away_seconds, 0.0), join.max_world_size,
                 join.min_world_size)


@dataclass(eq=False)
class Rebuild:
    """The claims of one job's generation, gathered until every rank has rejoined."""

    job: str
    generation: int
    world_size: int
    claims: dict[int, Claim] = field(default_factory=dict)
    #: When each claim arrived (monotonic).
    arrived: dict[int, float] = field(default_factory=dict)
    #: Resolves to the rebuilt generation and its replay set, or fails for every claim.
    done: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())

    def refuse(self, error: RejoinRefusedError) -> None:
        """Fail the rebuild for every claim waiting on it (and any that comes)."""
        if not self.done.done():
            self.done.set_exception(error)
            self.done.exception()  # its waiters get it; none waiting is no lost error

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.claims]


def check_claim(claim: Claim, known: Job | None) -> None:
    """Refuse a claim on its own, before it waits: ``known`` is the job as this coordinator
    holds it (None: unknown here).

    Raises:
        RejoinRefusedError: a generation or rank out of range, sequence numbers that cannot
            be (a pending or retained seq at or past the next one, one both pending and
            retained), or a job this coordinator holds at that generation or a later one.
    """
    who = f"rank {claim.rank} of job {claim.job!r}"
    if claim.generation < 1 or not 0 <= claim.rank < claim.world_size:
        raise RejoinRefusedError(
            f"{who} rejoins generation {claim.generation} of world size {claim.world_size}: "
            "no generation of that number or rank can exist; join the job again")
    late = sorted(s for s in claim.pending | claim.retained if not 1 <= s < claim.next_seq)
    both = sorted(claim.pending & claim.retained)
    if claim.next_seq < 1 or late or both:
        raise RejoinRefusedError(
            f"{who} rejoins generation {claim.generation} with collective sequence numbers "
            f"that cannot be: next seq {claim.next_seq}, pending or retained seqs "
            f"{late or both} (each must be below the next seq, and pending or retained, not "
            "both); its collectives cannot be issued again")
    gen = known.generation if known is not None else None
    if gen is not None and gen.number >= claim.generation:
        raise RejoinRefusedError(
            f"{who} rejoins generation {claim.generation}, but this coordinator holds the job "
            f"at generation {gen.number} ({'healthy' if gen.healthy else 'failed'}): it did "
            "not lose the generation, and the rank's broken session ended it; join the job "
            "again")


def gather(rebuild: Rebuild, claim: Claim) -> None:
    """Add ``claim`` to ``rebuild`` (its job's claims so far).

    Raises:
        RejoinRefusedError: the claim disagrees with the others (generation, world size), or
            another process holds its rank or member id; the rebuild then fails for every
            claim, since it can never complete.
    """
    holder = rebuild.claims.get(claim.rank)
    error = None
    if claim.generation != rebuild.generation or claim.world_size != rebuild.world_size:
        error = (f"rank {claim.rank} rejoins job {claim.job!r} at generation "
                 f"{claim.generation} of {claim.world_size} ranks, but its other ranks rejoin "
                 f"generation {rebuild.generation} of {rebuild.world_size}")
    elif holder is not None and holder.member_id != claim.member_id:
        error = (f"two processes rejoin job {claim.job!r} generation {rebuild.generation} as "
                 f"rank {claim.rank} with different member ids")
    elif any(c.member_id == claim.member_id and r != claim.rank
             for r, c in rebuild.claims.items()):
        error = (f"rank {claim.rank} of job {claim.job!r} rejoins with the member id of "
                 "another rank")
    if error is not None:
        refusal = RejoinRefusedError(f"{error}: the generation cannot be taken back; join the "
                                     "job again")
        rebuild.refuse(refusal)
        raise refusal
    rebuild.claims[claim.rank] = claim  # the same member again (a retried rejoin) replaces it
    rebuild.arrived[claim.rank] = time.monotonic()


def replay_set(rebuild: Rebuild) -> list[int]:
    """The seqs every rank issues again: those some rank had not seen complete.

    Raises:
        RejoinRefusedError: a rank completed one of them and no longer holds its input.
    """
    claims = rebuild.claims
    replay = sorted(set().union(*(c.pending for c in claims.values())))
    for seq in replay:
        for rank, claim in sorted(claims.items()):
            if not claim.holds(seq):
                waiting = min(r for r, c in claims.items() if seq in c.pending)
                raise RejoinRefusedError(
                    f"rank {rank} of job {rebuild.job!r} completed collective seq {seq}, which "
                    f"rank {waiting} had not seen complete when the coordinator went away, and "
                    f"no longer holds its input: generation {rebuild.generation} cannot be "
                    "taken back; join the job again")
    return replay


class Rebuilds:
    """The rendezvous' generations being taken back, by job: ``jobs`` is its table of jobs,
    ``make_room(job)`` makes room in it for one more (or raises TooManyJobsError),
    ``draining()`` whether it takes joins, ``formed(gen)`` its formed-generation hook."""

    def __init__(self, jobs: dict[str, Job], make_room: Callable[[str], None],
                 draining: Callable[[], bool], formed: Callable[[Generation], None]) -> None:
        self._jobs = jobs
        self._make_room = make_room
        self._draining = draining
        self._formed = formed
        self._gathering: dict[str, Rebuild] = {}
        #: The generations taken back (their step ledgers resume from their ranks:
        #: :mod:`gradstar.coordinator.steps.resume`).
        self.rebuilt: weakref.WeakSet[Generation] = weakref.WeakSet()
        #: Awaited once every rank of a generation rejoined, before it forms again: the
        #: coordinator's wait for its hub shards (a restarted one starts its own), so that
        #: the generation stripes over them rather than over none.
        self.before_forming: Callable[[], Awaitable[object]] | None = None

    async def rejoin(self, claim: Claim, timeout: float) -> tuple[Member, list[int]]:
        """Take ``claim``'s rank back into the generation this coordinator lost, once every
        rank of it has rejoined; its member record and the seqs every rank issues again.

        Raises:
            CoordinatorDrainingError: the coordinator takes no new joins.
            ConfigurationError: a job name :func:`~.jobs.check_job_name` refuses.
            RejoinRefusedError: the generation cannot be taken back (see the module).
            JoinTimeoutError: not every rank rejoined within ``timeout`` seconds.
        """
        if self._draining():
            raise CoordinatorDrainingError(
                "the coordinator is draining and accepts no new joins; use another coordinator")
        check_job_name(claim.job)
        check_claim(claim, self._jobs.get(claim.job))
        rebuild = self._gathering.get(claim.job)
        if rebuild is None or rebuild.done.done():
            rebuild = self._gathering[claim.job] = Rebuild(claim.job, claim.generation,
                                                           claim.world_size)
        gather(rebuild, claim)
        if not rebuild.missing:
            del self._gathering[claim.job]
            if self.before_forming is not None:
                await self.before_forming()
            try:
                replay = replay_set(rebuild)
            except RejoinRefusedError as error:
                rebuild.refuse(error)
                raise
            if claim.job not in self._jobs:
                self._make_room(claim.job)
                self._jobs[claim.job] = Job(claim.job, claim.world_size)
            self.rebuilt.add(rebuilt(rebuild, self._jobs[claim.job], self._formed, replay))
        try:
            gen, replay = await asyncio.wait_for(asyncio.shield(rebuild.done), timeout)
        except TimeoutError:
            missing = rebuild.missing
            if rebuild.claims.get(claim.rank) == claim:
                del rebuild.claims[claim.rank]
            raise JoinTimeoutError(
                f"Timed out: job {claim.job!r}: ranks {missing} of generation "
                f"{claim.generation} did not rejoin within {timeout:g} s") from None
        return gen.members[claim.rank], replay


def rebuilt(rebuild: Rebuild, job: Job, formed: Callable[[Generation], None],
            replay: list[int]) -> Generation:
    """The generation of ``rebuild`` formed again in ``job`` (every rank has rejoined; its
    :func:`replay_set` is ``replay``), its members waiting on ``rebuild.done``; ``formed(gen)``
    runs before any of them hears of it."""
    members = {}
    for rank, c in rebuild.claims.items():
        members[rank] = Member(job=job.name, requested_rank=rank, peer_address=c.peer_address,
                               member_id=c.member_id, host=c.host[:64],
                               hostname=c.hostname[:255], rank=rank)
    gen = Generation(job, rebuild.generation, rebuild.world_size, members)
    now = time.monotonic()
    job.counters.rebuilds += 1
    job.counters.rejoin_wait_seconds = waited = max(
        c.away + now - rebuild.arrived.get(r, now) for r, c in rebuild.claims.items())
    job.world_size = rebuild.world_size
    claims = rebuild.claims.values()
    job.max_world_size = max(job.world_size, *(c.max_world_size for c in claims))
    job.min_world_size = max(c.min_world_size for c in claims)
    job.generations_formed = max(job.generations_formed, rebuild.generation)
    job.generation = gen
    formed(gen)
    for m in members.values():
        m.generation = gen
        m.touch()
    log.info("job %r: generation %d rebuilt from its %d rejoining ranks, the longest away "
             "%.2f s (collectives to issue again: %s)", job.name, gen.number, gen.world_size,
             waited, ", ".join(map(str, replay)) or "none")
    rebuild.done.set_result((gen, replay))
    return gen


__all__ = ["Claim", "Rebuild", "Rebuilds", "check_claim", "claim_of", "gather", "rebuilt",
           "replay_set"]

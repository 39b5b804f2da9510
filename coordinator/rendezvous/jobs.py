"""The records the rendezvous keeps (:mod:`.rendezvous`): jobs, their numbered generations and
their members, with the checks on a job's name and the peer-stream keys a generation's members
share.

A :class:`Job` holds its current :class:`Generation` and the :class:`Member` records still
forming the next one; a generation holds its members by rank and what the collective engine
keeps of it (pending and ended collectives). Plain data: the rendezvous changes them, the
servicers, the engine and the Admin views read them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
import time
import unicodedata
import uuid
from dataclasses import dataclass, field

from gradstar.errors import ConfigurationError, GradstarError, RankFinishedError

#: Longest job name the rendezvous accepts: names go into logs, metrics labels and file names.
MAX_JOB_NAME_CHARS = 256
# Control and format characters (newlines, escapes, bidi overrides) and line separators: a
# job name must not be able to forge log lines or hide what it is in a terminal.
_UNPRINTABLE = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))
# Domain separation: a pair key can never equal another use of the generation's secret.
_PAIR_KEY_CONTEXT = b"gradstar peer pair key v1\x00"


def pair_key(secret: bytes, a: int, b: int) -> bytes:
    """The peer-stream key ranks ``a`` and ``b`` share: HMAC-SHA256 under the generation's
    ``secret`` of the unordered pair, so both ends derive the same key and no other rank can."""
    low, high = min(a, b), max(a, b)
    # Fixed-width big-endian ranks (uint32 on the wire): no two pairs encode alike.
    return hmac.digest(secret, _PAIR_KEY_CONTEXT + struct.pack(">II", low, high), hashlib.sha256)


def check_job_name(job: str, what: str = "a job name") -> None:
    """Refuse a job name (or another name, ``what``) that is empty, too long, or holds control
    characters.

    Raises:
        ConfigurationError: the name is empty, longer than :data:`MAX_JOB_NAME_CHARS`
            characters, or holds a control, format or line separator character.
    """
    if not job:
        raise ConfigurationError(f"{what} must not be empty")
    if len(job) > MAX_JOB_NAME_CHARS:
        raise ConfigurationError(
            f"{what} is at most {MAX_JOB_NAME_CHARS} characters, got one of {len(job)} "
            f"starting {job[:40]!r}"
        )
    if job.isprintable():
        # Python's printable excludes every Other and Separator category (but the space), so
        # none of _UNPRINTABLE is in it: the usual name is done without a look at each
        # character (a collective's header is checked on every arrival).
        return
    bad = next((c for c in job if unicodedata.category(c) in _UNPRINTABLE), None)
    if bad is not None:
        raise ConfigurationError(
            f"{what} must not contain control characters, got {job!r} (with {bad!r})"
        )


@dataclass(eq=False)
class Member:
    """One rank of one generation, as the coordinator sees it."""

    job: str
    requested_rank: int | None
    peer_address: str
    member_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: The host key the rank joined with ('' if none): which ranks share a host.
    host: str = ""
    #: The host name the rank joined with ('' if none): what operators see.
    hostname: str = ""
    rank: int = -1
    generation: Generation | None = None
    last_seen: float = field(default_factory=time.monotonic)
    #: GenerationFailed and RankFinished notices for this member's session stream.
    notices: asyncio.Queue = field(default_factory=asyncio.Queue)
    joined: asyncio.Future | None = None
    #: The member is gone: lost, or finished (left in an orderly way).
    left: bool = False
    finished: bool = False
    #: Took the place of a lost member of a running generation (an elastic join).
    replacement: bool = False
    #: Its host takes no inbound connections from other hosts (JoinRequest.outbound_only).
    outbound_only: bool = False
    #: Where others punch through to its peer server (Peer.punch: its session's outside host
    #: and JoinRequest.punch_port); '' where it gave no punch port.
    punch: str = ""
    #: Whether it moves to a new generation at step boundaries when the job resizes (a
    #: Synchronous DDP or LocalSGD says True, a sync-mode DDP False: SessionRequest.boundaries;
    #: every member of a generation a resize formed: True); None: not said yet.
    boundaries: bool | None = None
    #: What its Joined says of the resize that formed its generation: the boundary, and
    #: whether it joined there (a newcomer taking the others' state).
    boundary: int = 0
    newcomer: bool = False

    def touch(self) -> None:
        self.last_seen = time.monotonic()


@dataclass(eq=False)
class Generation:
    """One numbered membership of a job; collectives are matched within it."""

    job: Job
    number: int
    world_size: int
    members: dict[int, Member]
    failure: GradstarError | None = None
    #: Pending collectives by (group, seq); owned by the collective engine.
    collectives: dict = field(default_factory=dict)
    #: Outcomes of ended collectives by (group, seq), kept until every rank has seen them.
    ended: dict = field(default_factory=dict)
    #: The hub shards this generation stripes its collectives over (addresses in stripe
    #: order); empty when the coordinator carries them itself. Fixed when it forms.
    shards: list[str] = field(default_factory=list)
    #: The secret its members' peer-stream keys derive from (:meth:`peer_keys`); it never
    #: leaves the coordinator. Random when it forms, empty on a hub shard's adopted copy, never
    #: in a repr.
    peer_secret: bytes = field(default=b"", repr=False)
    #: Why collectives of this generation can no longer complete although it is healthy: the
    #: first of its members that finished while others were still live.
    finished_error: RankFinishedError | None = None
    #: Formed by a resize of the generation before (its members moved at a step boundary).
    resized: bool = False

    @property
    def healthy(self) -> bool:
        return self.failure is None

    @property
    def completed(self) -> bool:
        """Every member finished (closed its group cleanly) and nothing failed."""
        return self.healthy and all(m.finished for m in self.members.values())

    @property
    def live_members(self) -> list[Member]:
        return [m for m in self.members.values() if not m.left]

    def peer_keys(self, rank: int) -> list[bytes]:
        """``Joined.peer_keys`` of member ``rank``: by rank, the key it shares with each other
        member (:func:`pair_key`), empty at its own rank; no keys without a secret."""
        if not self.peer_secret:
            return []
        return [b"" if other == rank else pair_key(self.peer_secret, rank, other)
                for other in range(self.world_size)]


@dataclass
class JobCounters:
    """Totals an operator reads through the Admin service."""

    bytes_in: int = 0
    bytes_out: int = 0
    completed: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    last_failure: str = ""
    #: Generations taken back after a coordinator restart (:mod:`.rebuild`), and the longest a
    #: rank waited at the latest, from losing its coordinator to the rebuild (seconds).
    rebuilds: int = 0
    rejoin_wait_seconds: float = 0.0


@dataclass(eq=False)
class Job:
    name: str
    world_size: int
    generation: Generation | None = None
    forming: list[Member] = field(default_factory=list)
    generations_formed: int = 0
    counters: JobCounters = field(default_factory=JobCounters)
    #: When the job was first seen with no live or joining member (None while it has some).
    idle_since: float | None = None
    #: Most ranks the running generation may grow to by elastic joins (JoinRequest
    #: max_world_size; the largest its members asked for); ``world_size`` when it is fixed.
    max_world_size: int = 0
    #: Fewest ranks departures may leave it (JoinRequest.min_world_size; 0: no limit).
    min_world_size: int = 0
    #: The resize under way (:mod:`.resize`), or None.
    resize: object | None = None
    #: Elastic joiners past the world size waiting until every member said whether it moves
    #: at step boundaries (:func:`.elastic.past_size`).
    parked: list[Member] = field(default_factory=list)
    #: Resizes completed (generations formed by members moving at a step boundary).
    resizes: int = 0

    @property
    def at_boundary(self) -> tuple[int, int]:
        """(ranks waiting to join, members departing) at the next step boundary."""
        r = self.resize
        if r is None:
            return 0, 0
        return sum(1 for j in r.joiners if not j.joined.done()), len(r.departing)

    @property
    def formed(self) -> bool:
        """Whether a generation of the job ever formed. A job that never formed holds nothing
        worth keeping (no counters, no metric series): it is only its joiners, and it leaves
        the table with the last of them (:meth:`Rendezvous.withdraw`)."""
        return self.generations_formed > 0

    @property
    def state(self) -> str:
        if self.generation is not None and self.generation.healthy and self.generation.live_members:
            return "running"
        if self.forming:
            return "forming"
        if self.generation is not None and not self.generation.healthy:
            return "failed"
        if self.generation is not None and self.generation.completed:
            return "completed"
        return "idle"

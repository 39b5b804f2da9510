"""Errors raised by gradstar, one hierarchy for the client and the coordinator.

Every error a rank can see derives from :class:`GradstarError`::

    GradstarError
    ├── ConfigurationError            a setting or argument is invalid (also a ValueError)
    │   └── BucketCapMismatchError    ranks changed DDP's bucket_cap_mb to different values
    ├── AuthenticationError           the coordinator refused the token
    │   └── JobAccessError            a job's own token was used for another job
    ├── CoordinatorUnavailableError   the coordinator cannot be reached or went away
    │   ├── ShardLostError            a hub shard carrying the generation's collectives went away
    │   └── CoordinatorLostError      the coordinator did not come back within reconnect_timeout
    ├── ProcessGroupClosedError       the process group was closed
    ├── ProtocolError                 a malformed, truncated or corrupted frame
    ├── RendezvousError               joining a job failed
    │   ├── DuplicateRankError        another live member already holds the requested rank
    │   ├── WorldSizeMismatchError    the job exists with a different world size
    │   ├── JoinTimeoutError          not every rank joined in time
    │   ├── CoordinatorDrainingError  the coordinator is draining and takes no new work
    │   ├── TooManyJobsError          the coordinator holds as many jobs as it may
    │   └── RejoinRefusedError        a restarted coordinator cannot take a rank's generation back
    ├── LeadershipError               coordinators under --ha: which one leads, and since when
    │   ├── NotLeaderError            a standby, or a leader that lost its lease; names the leader
    │   ├── StaleCoordinatorError     a coordinator of an older leadership term than one seen
    │   └── ElectionUnavailableError  the etcd cluster electing the leader cannot be reached
    ├── RoundError                    an outer round (gradstar.StreamingDiLoCo) failed
    │   ├── RoundMismatchError        a contribution disagrees with its round (size, policy)
    │   └── RoundTimeoutError         a round did not close in time (too few replicas)
    ├── StepError                     a DDP step in a sync mode (Quorum, BoundedStaleness...) failed
    │   ├── StepMismatchError         a contribution disagrees with its ledger (mode, size, weight)
    │   ├── StepsBehindError          a rank fell behind the aggregates the hub still holds
    │   ├── StepResumeError           a restarted coordinator cannot take a rank's steps back
    │   └── StepTimeoutError          a step or barrier did not complete in time
    └── CollectiveError               a collective failed on this rank
        ├── CollectiveMismatchError   ranks disagree on op, reduce op, dtype, shape or root
        ├── CollectiveTimeoutError    some ranks never reached the collective
        ├── RankLostError             a rank died or disconnected; its generation is over
        │   └── RankFinishedError     a rank this call needs closed its group cleanly
        ├── PayloadTooLargeError      the payload is over the coordinator's limit
        ├── HubCapacityError          the hub holds as many pending collectives as it may
        └── InvalidCollectiveError    the request is invalid on its own (also a ValueError)

The coordinator sends an error to a client as a gRPC status whose trailing metadata names the
class (``gradstar-error``) and carries its fields as JSON (``gradstar-error-fields``);
:func:`error_from_wire` rebuilds the same exception on the client.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

__all__ = [
    "AuthenticationError",
    "BucketCapMismatchError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigurationError",
    "CoordinatorDrainingError",
    "CoordinatorLostError",
    "CoordinatorUnavailableError",
    "DuplicateRankError",
    "ElectionUnavailableError",
    "GradstarError",
    "HubCapacityError",
    "InvalidCollectiveError",
    "JobAccessError",
    "JoinTimeoutError",
    "LeadershipError",
    "NotLeaderError",
    "PayloadTooLargeError",
    "ProcessGroupClosedError",
    "ProtocolError",
    "RankFinishedError",
    "RankLostError",
    "RejoinRefusedError",
    "RendezvousError",
    "RoundError",
    "RoundMismatchError",
    "RoundTimeoutError",
    "ShardLostError",
    "StaleCoordinatorError",
    "StepError",
    "StepMismatchError",
    "StepResumeError",
    "StepTimeoutError",
    "StepsBehindError",
    "TooManyJobsError",
    "WorldSizeMismatchError",
]

ERROR_NAME_KEY = "gradstar-error"
ERROR_FIELDS_KEY = "gradstar-error-fields"


class GradstarError(Exception):
    """Base class of every error gradstar raises."""

    def fields(self) -> dict:
        """Structured details sent along with the message over the wire."""
        return {}


class ConfigurationError(GradstarError, ValueError):
    """A setting or argument is invalid."""


class BucketCapMismatchError(ConfigurationError):
    """Ranks disagree on DDP's ``bucket_cap_mb`` after it was changed (some ranks only, or
    different values): the buckets were kept as they were on every rank."""


class AuthenticationError(GradstarError):
    """The coordinator refused the job or admin token."""


class JobAccessError(AuthenticationError):
    """A call named a job that its token does not open: a job's own token (derived from the
    coordinator's job secret) opens that job only; nothing of the other job was read or
    changed."""

    def __init__(self, message: str, *, job: str = "") -> None:
        super().__init__(message)
        self.job = job

    def fields(self) -> dict:
        return {"job": self.job}


class CoordinatorUnavailableError(GradstarError):
    """The coordinator cannot be reached, or the connection to it was lost."""


class ShardLostError(CoordinatorUnavailableError):
    """A hub shard that carried the generation's collectives died or stalled; the generation is
    over on every rank (join again to continue on the shards that remain)."""

    def __init__(self, message: str, *, shard: int = -1, address: str = "",
                 generation: int = 0) -> None:
        super().__init__(message)
        self.shard = shard
        self.address = address
        self.generation = generation

    def fields(self) -> dict:
        return {"shard": self.shard, "address": self.address, "generation": self.generation}


class CoordinatorLostError(CoordinatorUnavailableError):
    """The coordinator went away and did not take this rank back within its
    ``reconnect_timeout``: no coordinator listened again at its address, or the restarted one
    never saw every rank of the generation rejoin."""


class ProcessGroupClosedError(GradstarError):
    """The process group was closed; create a new one to communicate again."""


class ProtocolError(GradstarError):
    """A frame is malformed, truncated or corrupted; no data from it was used."""


class RendezvousError(GradstarError):
    """Joining a job failed."""


class DuplicateRankError(RendezvousError):
    """Another live member of the job already holds the requested rank."""


class WorldSizeMismatchError(RendezvousError):
    """The job is forming with a different world size than the one requested."""


class JoinTimeoutError(RendezvousError):
    """Not every rank joined the job before the join timeout."""


class CoordinatorDrainingError(RendezvousError):
    """The coordinator is draining and accepts no new joins or collectives."""


class TooManyJobsError(RendezvousError):
    """The coordinator holds as many jobs as it may (``--max-jobs``); a new job cannot join."""


class RejoinRefusedError(RendezvousError):
    """A coordinator cannot take back the generation a rank rejoins with (another generation
    than its other ranks', one it knows to have failed, or collective sequence numbers that
    cannot be re-issued): the rank's collectives cannot go on, so it gets this, never a wrong
    result."""


class LeadershipError(GradstarError):
    """Coordinators started with ``--ha`` elect one leader; this one cannot serve the call."""


class NotLeaderError(LeadershipError):
    """This coordinator does not lead (a standby, or one that lost its etcd lease): it serves
    no job. ``leader`` is where the leader is (empty: none elected yet); ``term`` its
    leadership term (0: unknown)."""

    def __init__(self, message: str, *, leader: str = "", term: int = 0) -> None:
        super().__init__(message)
        self.leader = leader
        self.term = term

    def fields(self) -> dict:
        return {"leader": self.leader, "term": self.term}


class StaleCoordinatorError(LeadershipError):
    """A coordinator whose leadership term is older than one a rank has already seen: a
    leader that lost its lease (it was stopped or partitioned) and woke after another took
    over. Nothing of it is used; the rank looks for the current leader."""

    def __init__(self, message: str, *, term: int = 0, seen: int = 0) -> None:
        super().__init__(message)
        self.term = term
        self.seen = seen

    def fields(self) -> dict:
        return {"term": self.term, "seen": self.seen}


class ElectionUnavailableError(LeadershipError):
    """The etcd cluster that elects the leader (``--ha``) cannot be reached, or answered with
    something that is not etcd's v3 JSON gateway."""


class RoundError(GradstarError):
    """An outer round of fault-tolerant training (DiLoCo, Streaming DiLoCo) failed."""


class RoundMismatchError(RoundError, ValueError):
    """A seed or contribution disagrees with its fragment's global model or round (its size,
    its outer optimizer settings, or a round that has not begun)."""


class RoundTimeoutError(RoundError):
    """A round did not close in time: fewer than ``min_replicas`` replicas contributed."""


class StepError(GradstarError):
    """A data-parallel step in a sync mode other than Synchronous (gradstar.sync_modes) failed."""


class StepMismatchError(StepError, ValueError):
    """A contribution disagrees with its step ledger (sync mode, size, wire format, a duplicate,
    a base from the future) or carries a bad weight; it was refused and the other ranks' steps
    go on."""


class StepsBehindError(StepError):
    """A rank needs aggregates the hub no longer holds (its history and memory bound)."""


class StepResumeError(StepError):
    """A coordinator that restarted (or a standby that took over) cannot take a rank's steps
    back: a step count, barrier or mode epoch it cannot accept, or a call to a ledger still
    waiting for its ranks to resume; nothing of the ledger changed."""


class StepTimeoutError(StepError):
    """A step or a synchronize() barrier did not complete before the timeout."""


class CollectiveError(GradstarError):
    """A collective failed; no rank received a partial result."""


class CollectiveMismatchError(CollectiveError):
    """Ranks issued collectives that disagree on op, reduce op, dtype, shape or root."""

    def __init__(self, message: str, *, rank: int = -1, field: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.field = field

    def fields(self) -> dict:
        return {"rank": self.rank, "field": self.field}


class CollectiveTimeoutError(CollectiveError):
    """Some ranks did not reach the collective before its timeout."""

    def __init__(self, message: str, *, missing_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)

    def fields(self) -> dict:
        return {"missing_ranks": self.missing_ranks}


class RankLostError(CollectiveError):
    """A rank died or disconnected; every collective of its generation fails."""

    def __init__(self, message: str, *, rank: int = -1, generation: int = 0) -> None:
        super().__init__(message)
        self.rank = rank
        self.generation = generation

    def fields(self) -> dict:
        return {"rank": self.rank, "generation": self.generation}


class RankFinishedError(RankLostError):
    """A rank closed its process group cleanly (it *finished*); a collective or receive that
    needs it cannot complete. The generation stays healthy for traffic among the others."""


class PayloadTooLargeError(CollectiveError):
    """The payload is larger than the coordinator's configured limit."""


class HubCapacityError(CollectiveError):
    """The hub's budget for pending collectives, the job's share of it, or a cap on them per
    member or per job, is reached; the collective was refused (try again once others finish)."""


class InvalidCollectiveError(CollectiveError, ValueError):
    """The collective request is invalid on its own (bad root, unsupported op for the dtype)."""


_BY_NAME: dict[str, type[GradstarError]] = {
    name: cls for name, cls in globals().items()
    if isinstance(cls, type) and issubclass(cls, GradstarError)
}


def error_metadata(error: GradstarError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that lets :func:`error_from_wire` rebuild ``error`` on the client."""
    return (
        (ERROR_NAME_KEY, type(error).__name__),
        (ERROR_FIELDS_KEY, json.dumps(error.fields())),
    )


def error_from_wire(name: str | None, fields_json: str | None, message: str) -> GradstarError:
    """Rebuild the exception the coordinator described; unknown names become GradstarError."""
    cls = _BY_NAME.get(name or "", GradstarError)
    try:
        fields = json.loads(fields_json) if fields_json else {}
    except ValueError:
        fields = {}
    try:
        return cls(message, **fields) if fields else cls(message)
    except TypeError:
        return cls(message)

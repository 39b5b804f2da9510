"""What the hub lets pending collectives hold, hub-wide: a byte budget for their bookkeeping
and caps on how many are pending per member and per job.

Why: each header is checked on its own (a chunk count of at most 2^20, a payload of at most
``max_tensor_bytes``), but a header at the chunk limit costs the hub a chunk tracker for 2^20
chunks until its collective ends, and nothing else bounded how many such headers a member
could have pending. A member of one job could so grow the hub by gigabytes, for every job.

What an 82-byte header may make the hub hold is kept small: the tracker is a bit per chunk
(128 KiB at the limit), allocated only when the first chunk arrives, and a stripe's indices
behind a sharded hub are ranges, not sets (a set of a stripe of 2^20 chunks took 64 MiB over 2
shards). At the chunk limit, a rank's part is charged 132 KiB (before: 1 MiB, and over 64 MiB
behind 2 shards).

What is charged, when a rank's header is admitted and before anything is allocated for it:
its chunk tracker (:func:`gradstar.wire.tracker_bytes`, charged whether or not chunks come) and
a fixed allowance for its participant record, frames and queue. What is not:
chunk payloads in flight, which each collective's read window bounds already (``engine``
module docstring), so that the hub's memory is at most the budget plus, per pending collective,
a few windows of chunks. Everything charged is given back when the collective ends (completed,
failed, or its streams closed).

Each job may hold at most its share of the budget (``collective_state_job_share`` of
``max_collective_state_bytes``, a quarter by default), whether it is alone on the hub or not:
one job that fills its share (a member flooding headers, or a job issuing more than it waits
for) leaves the rest to the other jobs, so their collectives still open; the budget is not
split by the jobs present, since a job that took the whole hub while alone could not be made
to give any back when another arrives. An ordinary collective holds a few KiB per rank, far
below a share.

Beyond a limit, the header is refused with :class:`~gradstar.errors.HubCapacityError`
(RESOURCE_EXHAUSTED), naming the limit (for the share: that it was the job's share); the
collective it belongs to fails on its ranks, and other jobs' collectives go on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from gradstar.errors import HubCapacityError
from gradstar.wire import tracker_bytes

#: Bookkeeping of one rank's part in a collective besides its tracker: the participant record,
#: its header, its outbox queue and the servicer's frames. Measured (tracemalloc, 2 ranks):
#: about 2.5 KiB; rounded up.
PARTICIPANT_BYTES = 4 << 10
#: Freed bookkeeping after which a busy hub hands free heap memory back to the system.
TRIM_AFTER_BYTES = 64 << 20


def participant_charge(chunks: int) -> int:
    """Bytes charged for a rank's part in a collective of ``chunks`` chunks (striped or not:
    a stripe's indices are ranges, :class:`gradstar.ops.Indices`)."""
    return PARTICIPANT_BYTES + tracker_bytes(chunks)


def _named(who: str | Callable[[], str]) -> str:
    return who() if callable(who) else who


class CollectiveBudget:
    """Charges and gives back the bookkeeping of pending collectives (one per hub process)."""

    def __init__(self, max_bytes: int, max_per_member: int, max_per_job: int,
                 job_share: float = 1.0) -> None:
        self.max_bytes = max_bytes
        self.max_per_member = max_per_member
        self.max_per_job = max_per_job
        #: Bytes one job may hold: its share of the budget (at least one byte).
        self.max_job_bytes = max(1, int(max_bytes * job_share))
        self.job_share = job_share
        self.used = 0
        #: Bytes each job holds, and the job of each member with something pending.
        self.job_used: dict[str, int] = {}
        self._job_of: dict[Hashable, str] = {}
        #: Bytes given back since the heap was last trimmed (see TRIM_AFTER_BYTES).
        self.freed = 0
        self._pending: dict[Hashable, int] = {}

    def check_open(self, pending: int, job: str) -> None:
        """May a collective open in a job that has ``pending`` collectives already?

        Raises:
            HubCapacityError: the job is at ``max_pending_per_job``.
        """
        if pending >= self.max_per_job:
            raise HubCapacityError(
                f"job {job!r} has {pending} collectives pending, its limit (coordinator setting "
                "max_pending_per_job); the hub opens no more for it until some finish")

    def charge(self, member: Hashable, nbytes: int, who: str | Callable[[], str],
               job: str = "") -> None:
        """Charge ``nbytes`` for one more pending collective of ``member`` of ``job`` (``who``,
        or what it returns, names it and the collective in an error: built only for one).

        Raises:
            HubCapacityError: the member is at ``max_pending_per_member``, the charge would
                take its job over its share of the budget (``collective_state_job_share``), or
                the hub over ``max_collective_state_bytes``.
        """
        pending = self._pending.get(member, 0)
        held = self.job_used.get(job, 0)
        self._check(pending, held, nbytes, who, job)
        self._pending[member] = pending + 1
        self._job_of[member] = job
        self.job_used[job] = held + nbytes
        self.used += nbytes

    def _check(self, pending: int, held: int, nbytes: int, who: str | Callable[[], str],
               job: str) -> None:
        """Refuse a charge that may not be made (see :meth:`charge`), naming ``who`` then."""
        if pending >= self.max_per_member:
            raise HubCapacityError(
                f"{_named(who)} was refused: the rank has {pending} collectives pending, its "
                "limit (coordinator setting max_pending_per_member); finish some first")
        if held + nbytes > self.max_job_bytes < self.max_bytes:  # a share of 1: the hub's
            raise HubCapacityError(
                f"{_named(who)} was refused: it needs {nbytes} bytes of the hub's budget for "
                f"pending collectives, and job {job!r} already holds {held} of its share of "
                f"{self.max_job_bytes} bytes ({self.job_share:g} of max_collective_state_bytes; "
                "coordinator setting collective_state_job_share), which keeps the rest for other "
                "jobs; try again once this job's collectives finish")
        if self.used + nbytes > self.max_bytes:
            raise HubCapacityError(
                f"{_named(who)} was refused: it needs {nbytes} bytes of the hub's budget for "
                f"pending collectives, of which {self.max_bytes - self.used} of "
                f"{self.max_bytes} are left (coordinator setting max_collective_state_bytes); "
                "try again once collectives finish")

    def give_back(self, member: Hashable, nbytes: int) -> None:
        """A collective ``member`` took part in ended: its charge of ``nbytes`` is free again."""
        job = self._job_of.get(member, "")
        left = self._pending.get(member, 0) - 1
        if left > 0:
            self._pending[member] = left
        else:
            self._pending.pop(member, None)
            self._job_of.pop(member, None)
        held = self.job_used.get(job, 0) - nbytes
        if held > 0:
            self.job_used[job] = held
        else:
            self.job_used.pop(job, None)
        self.used -= nbytes
        self.freed += nbytes

    def should_trim(self) -> bool:
        """Whether to hand free heap memory back to the system now (the hub's sweep asks, then
        trims and calls :meth:`trimmed`): once enough bookkeeping was given back since the last
        trim, or when the hub has just gone idle (nothing pending, something ended since). The
        allocator keeps freed chunk buffers for reuse while collectives run (see
        ``gradstar.allocator``); an idle hub needs none of them."""
        return self.freed >= TRIM_AFTER_BYTES or (self.used == 0 and self.freed > 0)

    def trimmed(self) -> None:
        self.freed = 0

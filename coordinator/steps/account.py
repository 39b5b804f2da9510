"""The Steps service's one memory account (the coordinator's ``--max-steps-bytes``).

It holds everything the service keeps: open steps' contributions, the aggregate logs, the
snapshots, and every upload in flight, reserved at its header's declared size before a byte of
it is allocated (:meth:`StepsAccount.reserve`). Each job may hold at most ``job_share`` of it,
so one job that fills its share leaves the rest to the others (as the collectives' budget,
``coordinator/collective/budget.py``). To make room it drops the oldest aggregates that no live
rank (nor a joiner replaying from the snapshot) still needs, the job's own first. What is given
back is counted, so the hub hands free heap memory back to the system after a burst
(:meth:`StepsAccount.should_trim`). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gradstar.errors import HubCapacityError

from .ledger import StepLedger

#: Uploads of one kind (contributions, snapshots) one rank may have in flight per ledger: an
#: honest rank has one of each at a time (its next call waits for the answer), two allow a
#: retry while the hub still reads the abandoned one.
MAX_UPLOADS_PER_RANK = 2
#: Bytes given back after which the heap is handed back to the system at the next sweep.
TRIM_AFTER_BYTES = 64 << 20


@dataclass(eq=False)
class Reservation:
    """Memory taken from the account for one upload before anything is allocated for it;
    :meth:`release` gives it back, once."""

    account: StepsAccount
    job: str
    key: tuple[str, str, int, str]
    nbytes: int
    active: bool = True

    def release(self) -> None:
        if self.active:
            self.active = False
            self.account.hold(self.job, -self.nbytes)
            self.account.uploads[self.key] -= 1
            if not self.account.uploads[self.key]:
                del self.account.uploads[self.key]


class StepsAccount:
    """What the ledgers of ``ledgers()`` hold, hub-wide and per job (see the module)."""

    def __init__(self, max_bytes: int, job_share: float,
                 ledgers: Callable[[], Iterable[StepLedger]]) -> None:
        self.max_bytes = max_bytes
        #: Bytes one job may hold: its share of the account (at least one byte).
        self.max_job_bytes = max(1, int(max_bytes * job_share))
        self._ledgers = ledgers
        self.held_bytes = 0
        #: Bytes each job holds (of ``held_bytes``).
        self.job_bytes: dict[str, int] = {}
        #: Uploads in flight by (job, model, rank, kind).
        self.uploads: dict[tuple[str, str, int, str], int] = {}
        #: Bytes given back since the heap was last trimmed.
        self.freed = 0

    def hold(self, job: str, nbytes: int) -> None:
        """Count ``nbytes`` more (fewer, if negative) held for ``job``."""
        self.held_bytes += nbytes
        held = self.job_bytes.get(job, 0) + nbytes
        if held > 0:
            self.job_bytes[job] = held
        else:
            self.job_bytes.pop(job, None)
        if nbytes < 0:
            self.freed -= nbytes

    def evict(self, ledger: StepLedger) -> None:
        """Drop ``ledger``'s oldest aggregate."""
        self.hold(ledger.job, -ledger.log.popleft().aggregate.nbytes)

    def make_room(self, ledger: StepLedger, nbytes: int) -> None:
        """Drop old aggregates no live rank still needs until ``nbytes`` more fit, in the
        job's share and in the hub's account; the job's own logs go first.

        Raises:
            HubCapacityError: it does not fit even then.
        """
        job = ledger.job
        mine = [v for v in self._ledgers() if v.job == job]
        for other in mine:
            self._drop_unneeded(other, lambda: self.job_bytes.get(job, 0) + nbytes
                                > self.max_job_bytes)
        over = lambda: self.held_bytes + nbytes > self.max_bytes  # noqa: E731
        for other in mine + [v for v in self._ledgers() if v.job != job]:
            self._drop_unneeded(other, over)
        held = self.job_bytes.get(job, 0)
        if held + nbytes > self.max_job_bytes < self.max_bytes:
            raise HubCapacityError(
                f"job {job!r} holds {held} bytes of steps and may hold {self.max_job_bytes}, "
                f"its share of the coordinator's {self.max_bytes} (--max-steps-bytes, "
                f"--steps-job-share), which keeps the rest for other jobs; {nbytes} more bytes "
                "were refused")
        if over():
            raise HubCapacityError(
                f"the coordinator holds {self.held_bytes} bytes of steps and may hold "
                f"{self.max_bytes} (--max-steps-bytes); {nbytes} bytes from job {job!r} were "
                "refused")

    def _drop_unneeded(self, ledger: StepLedger, over: Callable[[], bool]) -> None:
        """Evict ``ledger``'s oldest aggregates that no live rank (nor a joiner replaying from
        its snapshot) still needs, while ``over()``."""
        needed = min((s.base for s in ledger.ranks.values() if s.live), default=ledger.steps)
        if ledger.snapshot is not None:  # a joiner replays from there
            needed = min(needed, ledger.snapshot.steps)
        while over() and ledger.log and ledger.log[0].number <= needed:
            self.evict(ledger)

    def reserve(self, ledger: StepLedger, rank: int, kind: str, nbytes: int) -> Reservation:
        """Take ``nbytes`` for an upload of ``rank`` (``kind``: "contribution" or "snapshot")
        before anything is allocated for it; release it once the upload is kept or dropped.

        Raises:
            HubCapacityError: the rank has ``MAX_UPLOADS_PER_RANK`` uploads of this kind in
                flight, or the bytes do not fit (the job's share, or the hub's account).
        """
        key = (ledger.job, ledger.model, rank, kind)
        flying = self.uploads.get(key, 0)
        if flying >= MAX_UPLOADS_PER_RANK:
            raise HubCapacityError(
                f"rank {rank} of job {ledger.job!r} has {flying} {kind} uploads to model "
                f"{ledger.model!r} in flight, the most the hub reads at once; wait for their "
                "answers")
        self.make_room(ledger, nbytes)
        self.hold(ledger.job, nbytes)
        self.uploads[key] = flying + 1
        return Reservation(self, ledger.job, key, nbytes)

    def forget(self, ledger: StepLedger) -> None:
        """Give back everything ``ledger`` holds (it is being dropped)."""
        held = sum(c.data.nbytes for c in ledger.open.contributions.values())
        held += sum(s.aggregate.nbytes for s in ledger.log)
        if ledger.snapshot is not None:
            held += len(ledger.snapshot.data) + len(ledger.snapshot.layout)
        self.hold(ledger.job, -held)

    def should_trim(self) -> bool:
        """Whether to hand free heap memory back to the system now (then :meth:`trimmed`):
        once ``TRIM_AFTER_BYTES`` were given back, or when no upload is in flight and
        something was (a burst ended)."""
        return self.freed >= TRIM_AFTER_BYTES or (not self.uploads and self.freed > 0)

    def trimmed(self) -> None:
        self.freed = 0

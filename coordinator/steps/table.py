"""The table of every job's step ledgers: what the Steps servicer looks ledgers up in, and what
spans them (liveness by lease, ranks the rendezvous lost, Quorum deadlines, idle ledgers, the
memory account). A ledger's own protocol (contribute, close, fetch, synchronize) is its own
(:mod:`.ledger`); nothing here does I/O, and time comes from ``clock``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gradstar.errors import HubCapacityError, StepMismatchError

from .account import StepsAccount
from .ledger import HISTORY, StepLedger
from .records import LedgerSummary, RankState, Snapshot

#: Ledgers (DDP models, or the torch hook's buckets) one job may have.
MAX_LEDGERS_PER_JOB = 4096

log = logging.getLogger(__name__)


class StepsTable:
    """Every job's ledgers; the servicer's only state, and each ledger's host
    (:class:`~.records.Host`).

    ``on_change()`` is called whenever a step closes, a barrier completes or the live set
    changes, so waiting calls look again.

    What they hold is counted in one memory account, ``account`` (:mod:`.account`:
    ``max_held_bytes``, of which one job may hold ``job_share``).
    """

    def __init__(self, *, max_numel: int, max_held_bytes: int, lease: float,
                 history: int = HISTORY, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None,
                 load: Callable[[str, str], Snapshot | None] | None = None,
                 job_share: float = 1.0) -> None:
        self.max_numel = max_numel
        self.lease = lease
        self.history = history
        self.clock = clock
        self.on_change = on_change or (lambda: None)
        self.load = load
        #: How a ledger's settling after a lost rank is put off to run once for many (the
        #: servicer's loop.call_soon; None: at once).
        self.defer: Callable[[Callable[[], None]], object] | None = None
        self.ledgers: dict[tuple[str, str], StepLedger] = {}
        self.account = StepsAccount(max_held_bytes, job_share, self.ledgers.values)
        self._unsettled: dict[int, StepLedger] = {}
        self._jobs_ledgers: dict[str, int] = {}

    def ledger(self, job: str, model: str, world_size: int, load: bool = True) -> StepLedger:
        """The ledger of (job, model), created on first sight (from its saved snapshot, with
        ``load``).

        Raises:
            StepMismatchError: the ledger was made for another world size.
            HubCapacityError: the job has the most ledgers one job may have.
        """
        ledger = self.ledgers.get((job, model))
        if ledger is None:
            count = self._jobs_ledgers.get(job, 0)
            if count >= MAX_LEDGERS_PER_JOB:
                raise HubCapacityError(
                    f"job {job!r} has {count} step ledgers (models), the most one job may have; "
                    f"model {model!r} was refused")
            ledger = self.ledgers[(job, model)] = StepLedger(job, model, world_size, self)
            self._jobs_ledgers[job] = count + 1
            saved = self.load(job, model) if load and self.load is not None else None
            if saved is not None:
                ledger.resume(saved)
        elif ledger.world_size < world_size:  # the job grew (an elastic join past its size)
            for rank in range(ledger.world_size, world_size):
                # Out of the live set until its first call: a rank that has not started yet
                # holds no step back.
                ledger.ranks[rank] = RankState(last_seen=self.clock(), live=False,
                                               base=ledger.steps, barrier=ledger.barrier_done)
            log.info("job %r: the steps of model %r count %d ranks now (%d before)", job, model,
                     world_size, ledger.world_size)
            ledger.world_size = world_size
        elif ledger.world_size != world_size:
            raise StepMismatchError(
                f"model {model!r} of job {job!r} steps with {ledger.world_size} ranks, not "
                f"{world_size}")
        return ledger

    # -- liveness ---------------------------------------------------------------------------

    def rank_gone(self, job: str, rank: int, why: str) -> None:
        """The rendezvous lost ``rank`` of ``job`` (or it finished): out of every live set.
        Each ledger settles once for every rank gone meanwhile (``defer``), not once per rank:
        a large world's ranks leaving together cost one pass."""
        for ledger in [v for (j, _), v in self.ledgers.items() if j == job]:
            if rank in ledger.ranks and ledger.ranks[rank].live:
                ledger.lose(rank, why)
                self._settle_soon(ledger)

    def expire(self) -> None:
        """Take out of the live sets every rank silent for longer than the lease, then settle
        each ledger once."""
        now = self.clock()
        for ledger in list(self.ledgers.values()):
            stale = [r for r, s in ledger.ranks.items()
                     if s.live and now - s.last_seen > self.lease]
            for rank in stale:
                ledger.lose(rank, f"silent for {now - ledger.ranks[rank].last_seen:.1f} s")
            if stale:
                ledger.settle()
                self.on_change()

    def _settle_soon(self, ledger: StepLedger) -> None:
        if self.defer is None:
            ledger.settle()
            self.on_change()
            return
        if not self._unsettled:
            self.defer(self._settle_put_off)
        self._unsettled[id(ledger)] = ledger

    def _settle_put_off(self) -> None:
        ledgers, self._unsettled = list(self._unsettled.values()), {}
        for ledger in ledgers:
            if self.ledgers.get((ledger.job, ledger.model)) is ledger:
                ledger.settle()
        self.on_change()

    # -- deadlines --------------------------------------------------------------------------

    def close_due(self) -> None:
        """Close the steps whose deadline passed (Quorum's timeout)."""
        for ledger in list(self.ledgers.values()):
            ledger.settle()

    def next_deadline(self) -> float | None:
        """The earliest open step's deadline (None: none has one)."""
        return min((d for d in (ledger.deadline() for ledger in self.ledgers.values())
                    if d is not None), default=None)

    @property
    def held_bytes(self) -> int:
        """Bytes the ledgers and the uploads in flight hold (the account's)."""
        return self.account.held_bytes

    # -- views and forgetting ---------------------------------------------------------------

    def summaries(self, job: str | None = None) -> list[LedgerSummary]:
        """What operators see of each ledger (of ``job``, or all), in (job, model) order:
        :meth:`StepLedger.summary`."""
        return [ledger.summary() for (name, _), ledger in sorted(self.ledgers.items())
                if job is None or name == job]

    def drop_idle(self, retention: float) -> list[str]:
        """Forget the ledgers none of whose ranks called for ``retention`` seconds."""
        now = self.clock()
        dropped = []
        for key, ledger in list(self.ledgers.items()):
            if all(now - s.last_seen >= retention for s in ledger.ranks.values()):
                self.drop(ledger)
                dropped.append(key[0])
        return dropped

    def drop(self, ledger: StepLedger) -> None:
        """Forget ``ledger`` and give back all it holds."""
        self.account.forget(ledger)
        del self.ledgers[(ledger.job, ledger.model)]
        left = self._jobs_ledgers.get(ledger.job, 0) - 1
        if left > 0:
            self._jobs_ledgers[ledger.job] = left
        else:
            self._jobs_ledgers.pop(ledger.job, None)

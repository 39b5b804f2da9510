"""The table of every job's step ledgers: what the Steps servicer calls. The protocol and the
records are in :mod:`.ledger`; nothing here does I/O, and time comes from ``clock``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from gradstar.errors import HubCapacityError, StepMismatchError, StepsBehindError
from gradstar.sync_modes import Quorum, SyncMode
from gradstar.wire.formats import WIRE_NONE, encode, format_from_wire

from .account import StepsAccount
from .checks import check_header, pushes
from .ledger import (
    HISTORY,
    BarrierOutcome,
    ClosedStep,
    Contribution,
    OpenStep,
    RankState,
    Snapshot,
    StepLedger,
    aggregate,
    drop_reason,
)

#: Ledgers (DDP models, or the torch hook's buckets) one job may have.
MAX_LEDGERS_PER_JOB = 4096

log = logging.getLogger(__name__)


class StepsTable:
    """Every job's ledgers; the servicer's only state.

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

    # -- ranks ------------------------------------------------------------------------------

    def ledger(self, job: str, model: str, world_size: int) -> StepLedger:
        """The ledger of (job, model), created on first sight.

        Raises:
            StepMismatchError: the ledger was made for another world size.
        """
        ledger = self.ledgers.get((job, model))
        if ledger is None:
            count = self._jobs_ledgers.get(job, 0)
            if count >= MAX_LEDGERS_PER_JOB:
                raise HubCapacityError(
                    f"job {job!r} has {count} step ledgers (models), the most one job may have; "
                    f"model {model!r} was refused")
            ledger = self.ledgers[(job, model)] = StepLedger(job, model, world_size,
                                                             self.clock())
            self._jobs_ledgers[job] = count + 1
            saved = self.load(job, model) if self.load is not None else None
            if saved is not None:
                self._resume(ledger, saved)
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

    def _resume(self, ledger: StepLedger, saved: Snapshot) -> None:
        """Start a new ledger from a saved snapshot (a restarted coordinator's): its steps
        continue from there and every rank is expected at it (they load it as they start)."""
        size = len(saved.data) + len(saved.layout)
        if self.account.held_bytes + size > self.account.max_bytes:
            log.error("job %r: the saved snapshot of %r (%d bytes) does not fit the hub's "
                      "memory bound; its ranks start without it", ledger.job, ledger.model, size)
            return
        ledger.snapshot = saved
        self.account.hold(ledger.job, size)
        ledger.steps = saved.steps
        ledger.open = OpenStep(saved.steps + 1)
        for state in ledger.ranks.values():
            state.base = saved.steps

    def seen(self, ledger: StepLedger, rank: int) -> RankState:
        """``rank`` called now: live again if it had left the live set.

        Raises:
            StepMismatchError: ``rank`` is outside the world.
        """
        if not 0 <= rank < ledger.world_size:
            raise StepMismatchError(f"rank {rank} is not in job {ledger.job!r}'s world of "
                                    f"{ledger.world_size}")
        state = ledger.ranks[rank]
        state.last_seen = self.clock()
        if not state.live:
            state.live = True
            log.info("job %r: rank %d is live again in %r's steps (at %d of %d aggregates)",
                     ledger.job, rank, ledger.model, state.base, ledger.steps)
            self.on_change()
        return state

    def heartbeat(self, ledger: StepLedger, rank: int, have: int, leave: bool = False) -> None:
        """``rank`` is alive with ``have`` aggregates applied (or ``leave``s: finished)."""
        state = self.seen(ledger, rank)
        if leave:
            self._gone(ledger, rank, "left")
        elif not state.pending and have <= ledger.steps:
            state.base = have

    def rank_gone(self, job: str, rank: int, why: str) -> None:
        """The rendezvous lost ``rank`` of ``job`` (or it finished): out of every live set.
        Each ledger settles once for every rank gone meanwhile (``defer``), not once per rank:
        a large world's ranks leaving together cost one pass."""
        for ledger in [v for (j, _), v in self.ledgers.items() if j == job]:
            if rank in ledger.ranks and ledger.ranks[rank].live:
                self._gone(ledger, rank, why)
                self._settle_soon(ledger)

    def expire(self) -> None:
        """Take out of the live sets every rank silent for longer than the lease, then settle
        each ledger once."""
        now = self.clock()
        for ledger in list(self.ledgers.values()):
            stale = [r for r, s in ledger.ranks.items()
                     if s.live and now - s.last_seen > self.lease]
            for rank in stale:
                self._gone(ledger, rank, f"silent for {now - ledger.ranks[rank].last_seen:.1f} s")
            if stale:
                self._settle(ledger)
                self.on_change()

    def _gone(self, ledger: StepLedger, rank: int, why: str) -> None:
        """Take ``rank`` out of the live set; the caller settles the ledger."""
        ledger.ranks[rank].live = False
        if ledger.snapshot_asked is not None and ledger.snapshot_asked[0] == rank:
            ledger.snapshot_asked = None  # it will not send it: ask the next one at once
        # A rank that finished is not news; one lost or silent is.
        level = logging.INFO if why in ("finished", "left") else logging.WARNING
        log.log(level, "job %r: rank %d left the live set of the steps of model %r (%s); the "
                "others go on", ledger.job, rank, ledger.model, why)

    def _settle_soon(self, ledger: StepLedger) -> None:
        if self.defer is None:
            self._settle(ledger)
            self.on_change()
            return
        if not self._unsettled:
            self.defer(self._settle_put_off)
        self._unsettled[id(ledger)] = ledger

    def _settle_put_off(self) -> None:
        ledgers, self._unsettled = list(self._unsettled.values()), {}
        for ledger in ledgers:
            if self.ledgers.get((ledger.job, ledger.model)) is ledger:
                self._settle(ledger)
        self.on_change()

    # -- contribute and close ---------------------------------------------------------------

    def check_header(self, ledger: StepLedger, rank: int, mode: SyncMode, mode_epoch: int,
                     numel: int, base: int, weight: float, wire: int = WIRE_NONE,
                     hyper: tuple[float, ...] = ()) -> None:
        """Refuse a contribution before its data is read (:func:`.checks.check_header`, with
        this hub's size limit); it never changes the ledger."""
        check_header(ledger, rank, mode, mode_epoch, numel, base, weight, wire, hyper,
                     self.max_numel)

    def put_snapshot(self, ledger: StepLedger, rank: int, steps: int, layout: str,
                     data: bytes) -> None:
        """Keep ``rank``'s state after ``steps`` aggregates as the ledger's snapshot.

        Raises:
            StepMismatchError: a step count from the future.
            HubCapacityError: it does not fit the hub's memory bound.
        """
        self.seen(ledger, rank)
        if steps > ledger.steps:
            raise StepMismatchError(f"rank {rank} of job {ledger.job!r} sent its state after "
                                    f"{steps} aggregates, but only {ledger.steps} steps closed")
        old = ledger.snapshot
        if old is not None and old.steps >= steps:
            return  # as fresh already
        grows = len(data) + len(layout) - (len(old.data) + len(old.layout) if old else 0)
        self.account.make_room(ledger, grows)
        ledger.snapshot = Snapshot(steps, layout, data)
        self.account.hold(ledger.job, grows)
        ledger.snapshot_asked = None
        self.on_change()

    def must_wait(self, ledger: StepLedger, rank: int) -> bool:
        """Whether ``rank``'s next gradient must wait before it can join (BoundedStaleness):
        it is already in the open step, which cannot close yet without leaving a live rank
        more than the bound behind. The servicer waits for a change and asks again."""
        return (rank in ledger.open.contributions and pushes(ledger.mode)
                and not ledger.within_bound())

    def contribute(self, ledger: StepLedger, rank: int, mode: SyncMode, mode_epoch: int,
                   base: int, weight: float, data: np.ndarray, wire: int = WIRE_NONE,
                   hyper: tuple[float, ...] = ()) -> tuple[bool, int, int, str]:
        """Take ``rank``'s gradient (float32: decoded from ``wire`` by the servicer):
        (accepted, step joined, staleness, reason if dropped).
        In BoundedStaleness and Asynchronous a rank's gradient arriving while its previous one
        is still in the open step closes that step first (see :meth:`must_wait`).

        Raises: as :meth:`check_header` (checked again: the ledger may have moved while the
        data arrived); HubCapacityError: holding it would pass the hub's memory bound.
        """
        state = self.seen(ledger, rank)
        self.check_header(ledger, rank, mode, mode_epoch, data.shape[0], base, weight, wire,
                          hyper)
        if rank in ledger.open.contributions:  # a push (checked: this mode pushes, in bound)
            self._close(ledger)
        if ledger.mode is None:  # the ledger's first contribution names its mode
            ledger.mode = mode
        ledger.numel, ledger.wire = data.shape[0], format_from_wire(wire)
        ledger.hyper_len = len(hyper)
        staleness = ledger.steps - base
        reason = drop_reason(ledger.mode, staleness)
        if reason:
            state.dropped += 1
            ledger.dropped += 1
            state.pending = False
            state.base = base
            return False, 0, staleness, reason
        self.account.make_room(ledger, data.nbytes)
        open_ = ledger.open
        open_.contributions[rank] = Contribution(rank, float(weight), staleness, data,
                                                 tuple(hyper))
        if open_.first_at is None:
            open_.first_at = self.clock()
        self.account.hold(ledger.job, data.nbytes)
        state.base, state.pending = base, True
        state.contributed += 1
        state.staleness[staleness] += 1
        ledger.staleness[staleness] += 1
        number = open_.number
        self._settle(ledger)
        self.on_change()  # a rank waiting on the bound may go on now
        return True, number, staleness, ""

    def close_due(self) -> None:
        """Close the Quorum steps whose timeout passed."""
        for ledger in list(self.ledgers.values()):
            self._settle(ledger)

    def next_deadline(self) -> float | None:
        deadlines = [ledger.open.first_at + ledger.mode.timeout
                     for ledger in self.ledgers.values()
                     if isinstance(ledger.mode, Quorum) and ledger.open.first_at is not None]
        return min(deadlines) if deadlines else None

    def _settle(self, ledger: StepLedger) -> None:
        """Close the open step if it may close, then complete a barrier everyone reached."""
        if self._closable(ledger):
            self._close(ledger)
        self._finish_barrier(ledger)

    def _closable(self, ledger: StepLedger) -> bool:
        open_ = ledger.open
        got = set(open_.contributions)
        if not got:
            return False
        live = ledger.live()
        at_barrier = {r for r in live if ledger.ranks[r].barrier > ledger.barrier_done}
        if live <= got | at_barrier:
            return True
        mode = ledger.mode
        if isinstance(mode, Quorum):
            need = min(mode.min_ranks, len(live | got))
            return len(got) >= need and self.clock() >= open_.first_at + mode.timeout
        return False  # BoundedStaleness, Asynchronous: a rank's next gradient closes it

    def _close(self, ledger: StepLedger) -> None:
        open_ = ledger.open
        ranks = sorted(open_.contributions)
        parts = [open_.contributions[r] for r in ranks]
        # Summed in rank order: the same aggregate whichever rank arrived first.
        values, hyper = aggregate(parts, ledger.numel)
        if ledger.wire is not None:  # encoded once: every rank decodes the same bytes
            values = np.frombuffer(encode(ledger.wire, values), dtype=np.uint8)
        self.account.hold(ledger.job, -sum(c.data.nbytes for c in parts))
        ledger.steps = open_.number
        ledger.log.append(ClosedStep(open_.number, tuple(ranks), tuple(c.weight for c in parts),
                                     tuple(c.staleness for c in parts), values, self.clock(),
                                     hyper))
        self.account.hold(ledger.job, values.nbytes)
        ledger.open = OpenStep(open_.number + 1)
        # Past the history, only what every live rank applied: one waiting in synchronize()
        # while another steps on still fetches all it missed (the memory bound still holds).
        needed = min((s.base for s in ledger.ranks.values() if s.live), default=ledger.steps)
        while len(ledger.log) > self.history and ledger.log[0].number <= needed:
            self.account.evict(ledger)
        self.on_change()

    @property
    def held_bytes(self) -> int:
        """Bytes the ledgers and the uploads in flight hold (the account's)."""
        return self.account.held_bytes

    # -- fetch and synchronize --------------------------------------------------------------

    def fetch(self, ledger: StepLedger, rank: int, have: int, limit: int = 0,
              ) -> list[ClosedStep]:
        """The closed steps after ``have`` (the first ``limit`` of them, if not 0); the rank's
        parameters are at ``have`` plus their number once it applied them.

        Raises:
            StepMismatchError: ``have`` is from the future.
            StepsBehindError: aggregates it needs were dropped from the log.
        """
        state = self.seen(ledger, rank)
        if have > ledger.steps:
            raise StepMismatchError(f"rank {rank} of job {ledger.job!r} has applied {have} "
                                    f"aggregates, but only {ledger.steps} steps closed")
        if have + 1 < ledger.first_logged():
            raise StepsBehindError(
                f"rank {rank} of job {ledger.job!r} has applied {have} aggregates; the hub "
                f"keeps them from step {ledger.first_logged()} on (its history and memory "
                "bound), so it cannot catch up from the log: restart it from a checkpoint "
                "taken after ddp.synchronize()")
        closed = [s for s in ledger.log if s.number > have]
        closed = closed[:limit] if limit else closed
        state.base, state.pending = have + len(closed), False
        self.on_change()  # its newer parameters may let a bounded step close
        return closed

    def synchronize(self, ledger: StepLedger, rank: int, barrier: int,
                    next_mode: SyncMode | None = None) -> BarrierOutcome | None:
        """``rank`` reached barrier ``barrier``, asking to switch to ``next_mode`` there (None:
        no switch): once every live rank reached it, the step count every rank applies up to
        and the mode after it; else None (ask again).

        The mode switches at the barrier only if every live rank asked for the same mode
        there; the hub then hands out the next epoch. Otherwise it stays, and the outcome says
        who asked for what.
        """
        state = self.seen(ledger, rank)
        if barrier > state.barrier:
            state.barrier = barrier
            state.next_mode = next_mode
        self._settle(ledger)
        return ledger.barriers.get(barrier)

    def _finish_barrier(self, ledger: StepLedger) -> None:
        target = ledger.barrier_done + 1
        live = ledger.live()
        if not live or any(ledger.ranks[r].barrier < target for r in live):
            return
        if ledger.open.contributions:
            self._close(ledger)  # whatever the mode: nobody else will contribute to it
        # A rank already past this barrier asked at its own later one, not at this.
        asked = {r: ledger.ranks[r].next_mode for r in sorted(live)
                 if ledger.ranks[r].barrier == target}
        refused = ""
        if any(m is not None for m in asked.values()):
            wanted = set(asked.values())
            if len(wanted) == 1 and len(asked) == len(live):
                ledger.mode, ledger.mode_epoch = wanted.pop(), ledger.mode_epoch + 1
            else:
                refused = "; ".join(f"rank {r}: {m or 'no switch'}" for r, m in asked.items())
                log.warning("job %r: the ranks of model %r asked for different modes at "
                            "barrier %d (%s); the mode stays %s", ledger.job, ledger.model,
                            target, refused, ledger.mode)
        for r in asked:
            ledger.ranks[r].next_mode = None
        ledger.barrier_done = target
        ledger.barriers[target] = BarrierOutcome(ledger.steps, ledger.mode, ledger.mode_epoch,
                                                 refused)
        for old in [b for b in ledger.barriers if b < target - 8]:
            del ledger.barriers[old]
        self.on_change()

    # -- views ------------------------------------------------------------------------------

    def summaries(self, job: str | None = None) -> list[dict]:
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


"""The table of every job's step ledgers: what the Steps servicer calls. The protocol and the
records are in :mod:`.ledger`; nothing here does I/O, and time comes from ``clock``."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gradstar.errors import HubCapacityError, StepMismatchError, StepsBehindError
from gradstar.sync_modes import Asynchronous, BoundedStaleness, Quorum, SyncMode
from gradstar.wire.formats import WIRE_NONE, encode, format_from_wire

from .ledger import (
    HISTORY,
    SNAPSHOT_EVERY,
    BarrierOutcome,
    ClosedStep,
    Contribution,
    OpenStep,
    RankState,
    Snapshot,
    StepLedger,
    aggregate,
    drop_reason,
    hyper_mismatch,
    wire_mismatch,
)

#: Seconds a rank asked for a snapshot has to send it before another may be asked.
SNAPSHOT_PATIENCE = 30.0
#: Uploads of one kind (contributions, snapshots) one rank may have in flight per ledger: an
#: honest rank has one of each at a time (its next call waits for the answer), two allow a
#: retry while the hub still reads the abandoned one.
MAX_UPLOADS_PER_RANK = 2
#: Ledgers (DDP models, or the torch hook's buckets) one job may have.
MAX_LEDGERS_PER_JOB = 4096
#: Bytes given back after which the heap is handed back to the system at the next sweep.
TRIM_AFTER_BYTES = 64 << 20

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Reservation:
    """Memory taken from the table's account for one upload before anything is allocated for
    it (:meth:`StepsTable.reserve`); :meth:`release` gives it back, once."""

    table: StepsTable
    job: str
    key: tuple[str, str, int, str]
    nbytes: int
    active: bool = True

    def release(self) -> None:
        if self.active:
            self.active = False
            self.table._unreserve(self)


class StepsTable:
    """Every job's ledgers; the servicer's only state.

    ``on_change()`` is called whenever a step closes, a barrier completes or the live set
    changes, so waiting calls look again.

    **One memory account** (``max_held_bytes``, the coordinator's ``--max-steps-bytes``)
    holds everything the Steps service keeps: open steps' contributions, the aggregate logs,
    the snapshots, and every upload in flight, reserved from its header's declared size before
    a byte of it is allocated (:meth:`reserve`). Each job may hold at most ``job_share`` of it,
    so one job that fills its share leaves the rest to the others. What is given back is
    counted, so the hub hands free heap memory back to the system after a burst
    (:meth:`should_trim`).
    """

    def __init__(self, *, max_numel: int, max_held_bytes: int, lease: float,
                 history: int = HISTORY, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None,
                 load: Callable[[str, str], Snapshot | None] | None = None,
                 job_share: float = 1.0) -> None:
        self.max_numel = max_numel
        self.max_held_bytes = max_held_bytes
        #: Bytes one job may hold: its share of the account (at least one byte).
        self.max_job_bytes = max(1, int(max_held_bytes * job_share))
        self.lease = lease
        self.history = history
        self.clock = clock
        self.on_change = on_change or (lambda: None)
        self.load = load
        #: How a ledger's settling after a lost rank is put off to run once for many (the
        #: servicer's loop.call_soon; None: at once).
        self.defer: Callable[[Callable[[], None]], object] | None = None
        self.ledgers: dict[tuple[str, str], StepLedger] = {}
        self.held_bytes = 0
        #: Bytes each job holds (of ``held_bytes``).
        self.job_bytes: dict[str, int] = {}
        #: Uploads in flight by (job, model, rank, kind).
        self.uploads: dict[tuple[str, str, int, str], int] = {}
        #: Bytes given back since the heap was last trimmed.
        self.freed = 0
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
        if self.held_bytes + size > self.max_held_bytes:
            log.error("job %r: the saved snapshot of %r (%d bytes) does not fit the hub's "
                      "memory bound; its ranks start without it", ledger.job, ledger.model, size)
            return
        ledger.snapshot = saved
        self._hold(ledger.job, size)
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
        """Refuse a contribution before its data is read.

        Raises:
            StepMismatchError: a bad weight, a base from the future, another size, mode or
                wire format than the ledger's, a duplicate in the open step.
            HubCapacityError: the gradient is over the hub's size limit.
            ProtocolError: an unknown wire format.
        """
        who = f"rank {rank} of job {ledger.job!r}"
        if reason := wire_mismatch(ledger, wire) or hyper_mismatch(ledger, hyper):
            raise StepMismatchError(f"{who} {reason}")
        if not math.isfinite(weight) or weight < 0:
            raise StepMismatchError(f"{who} sent a contribution of weight {weight}; a weight "
                                    "is a finite number >= 0 (e.g. its number of samples)")
        if numel > self.max_numel:
            raise HubCapacityError(
                f"{who} sent a gradient of {numel} float32 values, over this coordinator's "
                f"limit of {self.max_numel} (--max-tensor-bytes)")
        if ledger.numel is not None and numel != ledger.numel:
            raise StepMismatchError(f"{who} sent {numel} gradient values to model "
                                    f"{ledger.model!r}, whose gradients have {ledger.numel}")
        if base > ledger.steps:
            raise StepMismatchError(f"{who} contributed a gradient computed after {base} "
                                    f"aggregates, but only {ledger.steps} steps closed")
        self._check_mode(ledger, who, mode, mode_epoch)
        if rank in ledger.open.contributions and not _pushes(ledger.mode):
            raise StepMismatchError(f"{who} contributed twice to step {ledger.open.number}; "
                                    "apply the aggregates (optimizer.step()) between backward "
                                    "passes")

    @staticmethod
    def _check_mode(ledger: StepLedger, who: str, mode: SyncMode, epoch: int) -> None:
        """A contribution's mode must be the ledger's, at the ledger's epoch; the first one of
        a ledger names its mode (at epoch 0, or the epoch the ledger resumed at). Only a barrier
        switches (:meth:`synchronize`); this never changes the ledger."""
        if epoch != ledger.mode_epoch or (ledger.mode is not None and mode != ledger.mode):
            steps_in = "no mode yet" if ledger.mode is None else str(ledger.mode)
            raise StepMismatchError(
                f"{who} contributes in {mode} (switch {epoch}), but model {ledger.model!r} "
                f"steps in {steps_in} (switch {ledger.mode_epoch}); every rank must use the "
                "same mode, and switch (set_sync_mode) at the same step")

    def wants_snapshot(self, ledger: StepLedger, rank: int) -> bool:
        """Whether to ask ``rank`` for its state now (and mark it asked): it is the lowest live
        rank, and the latest snapshot is ``SNAPSHOT_EVERY`` steps old or missing."""
        now = self.clock()
        asked = ledger.snapshot_asked
        if asked is not None and (now - asked[1] < SNAPSHOT_PATIENCE
                                  and ledger.steps - asked[2] < SNAPSHOT_EVERY):
            return False  # asked recently: in time and in steps
        fresh = ledger.snapshot is not None and (
            ledger.steps - ledger.snapshot.steps < SNAPSHOT_EVERY)
        if fresh or rank != min(ledger.live(), default=None):
            return False
        ledger.snapshot_asked = (rank, now, ledger.steps)
        return True

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
        self._make_room(ledger, grows)
        ledger.snapshot = Snapshot(steps, layout, data)
        self._hold(ledger.job, grows)
        ledger.snapshot_asked = None
        self.on_change()

    def must_wait(self, ledger: StepLedger, rank: int) -> bool:
        """Whether ``rank``'s next gradient must wait before it can join (BoundedStaleness):
        it is already in the open step, which cannot close yet without leaving a live rank
        more than the bound behind. The servicer waits for a change and asks again."""
        return (rank in ledger.open.contributions and _pushes(ledger.mode)
                and not self._within_bound(ledger))

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
        self._make_room(ledger, data.nbytes)
        open_ = ledger.open
        open_.contributions[rank] = Contribution(rank, float(weight), staleness, data,
                                                 tuple(hyper))
        if open_.first_at is None:
            open_.first_at = self.clock()
        self._hold(ledger.job, data.nbytes)
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

    def _within_bound(self, ledger: StepLedger) -> bool:
        """Whether the open step may close now without leaving any live rank that has not
        contributed to it (and is not at a barrier, nor about to fetch) more than the bound
        behind: its next gradient, on its current parameters, joins the next step at best."""
        mode = ledger.mode
        if not isinstance(mode, BoundedStaleness):
            return True
        after = ledger.steps + 1
        return all(after - s.base <= mode.max_staleness for r, s in ledger.ranks.items()
                   if s.live and r not in ledger.open.contributions and not s.pending
                   and s.barrier <= ledger.barrier_done)

    def _close(self, ledger: StepLedger) -> None:
        open_ = ledger.open
        ranks = sorted(open_.contributions)
        parts = [open_.contributions[r] for r in ranks]
        # Summed in rank order: the same aggregate whichever rank arrived first.
        values, hyper = aggregate(parts, ledger.numel)
        if ledger.wire is not None:  # encoded once: every rank decodes the same bytes
            values = np.frombuffer(encode(ledger.wire, values), dtype=np.uint8)
        self._hold(ledger.job, -sum(c.data.nbytes for c in parts))
        ledger.steps = open_.number
        ledger.log.append(ClosedStep(open_.number, tuple(ranks), tuple(c.weight for c in parts),
                                     tuple(c.staleness for c in parts), values, self.clock(),
                                     hyper))
        self._hold(ledger.job, values.nbytes)
        ledger.open = OpenStep(open_.number + 1)
        # Past the history, only what every live rank applied: one waiting in synchronize()
        # while another steps on still fetches all it missed (the memory bound still holds).
        needed = min((s.base for s in ledger.ranks.values() if s.live), default=ledger.steps)
        while len(ledger.log) > self.history and ledger.log[0].number <= needed:
            self._evict(ledger)
        self.on_change()

    def _evict(self, ledger: StepLedger) -> None:
        self._hold(ledger.job, -ledger.log.popleft().aggregate.nbytes)

    def _hold(self, job: str, nbytes: int) -> None:
        """Count ``nbytes`` more (fewer, if negative) held for ``job``."""
        self.held_bytes += nbytes
        held = self.job_bytes.get(job, 0) + nbytes
        if held > 0:
            self.job_bytes[job] = held
        else:
            self.job_bytes.pop(job, None)
        if nbytes < 0:
            self.freed -= nbytes

    def _make_room(self, ledger: StepLedger, nbytes: int) -> None:
        """Drop old aggregates no live rank still needs until ``nbytes`` more fit, in the
        job's share and in the hub's account; the job's own logs go first.

        Raises:
            HubCapacityError: it does not fit even then.
        """
        job = ledger.job
        mine = [v for v in self.ledgers.values() if v.job == job]
        for other in mine:
            self._drop_unneeded(other, lambda: self.job_bytes.get(job, 0) + nbytes
                                > self.max_job_bytes)
        over = lambda: self.held_bytes + nbytes > self.max_held_bytes  # noqa: E731
        for other in mine + [v for v in self.ledgers.values() if v.job != job]:
            self._drop_unneeded(other, over)
        held = self.job_bytes.get(job, 0)
        if held + nbytes > self.max_job_bytes < self.max_held_bytes:
            raise HubCapacityError(
                f"job {job!r} holds {held} bytes of steps and may hold {self.max_job_bytes}, "
                f"its share of the coordinator's {self.max_held_bytes} (--max-steps-bytes, "
                f"--steps-job-share), which keeps the rest for other jobs; {nbytes} more bytes "
                "were refused")
        if over():
            raise HubCapacityError(
                f"the coordinator holds {self.held_bytes} bytes of steps and may hold "
                f"{self.max_held_bytes} (--max-steps-bytes); {nbytes} bytes from job "
                f"{job!r} were refused")

    def _drop_unneeded(self, ledger: StepLedger, over: Callable[[], bool]) -> None:
        """Evict ``ledger``'s oldest aggregates that no live rank (nor a joiner replaying from
        its snapshot) still needs, while ``over()``."""
        needed = min((s.base for s in ledger.ranks.values() if s.live), default=ledger.steps)
        if ledger.snapshot is not None:  # a joiner replays from there
            needed = min(needed, ledger.snapshot.steps)
        while over() and ledger.log and ledger.log[0].number <= needed:
            self._evict(ledger)

    def reserve(self, ledger: StepLedger, rank: int, kind: str, nbytes: int) -> Reservation:
        """Take ``nbytes`` of the account for an upload of ``rank`` (``kind``: "contribution"
        or "snapshot") before anything is allocated for it; release it once the upload is
        kept or dropped.

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
        self._make_room(ledger, nbytes)
        self._hold(ledger.job, nbytes)
        self.uploads[key] = flying + 1
        return Reservation(self, ledger.job, key, nbytes)

    def _unreserve(self, reservation: Reservation) -> None:
        self._hold(reservation.job, -reservation.nbytes)
        left = self.uploads.get(reservation.key, 0) - 1
        if left > 0:
            self.uploads[reservation.key] = left
        else:
            self.uploads.pop(reservation.key, None)

    def should_trim(self) -> bool:
        """Whether to hand free heap memory back to the system now (then :meth:`trimmed`):
        once ``TRIM_AFTER_BYTES`` were given back, or when no upload is in flight and
        something was (a burst ended)."""
        return self.freed >= TRIM_AFTER_BYTES or (not self.uploads and self.freed > 0)

    def trimmed(self) -> None:
        self.freed = 0

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
        held = sum(c.data.nbytes for c in ledger.open.contributions.values())
        held += sum(s.aggregate.nbytes for s in ledger.log)
        if ledger.snapshot is not None:
            held += len(ledger.snapshot.data) + len(ledger.snapshot.layout)
        self._hold(ledger.job, -held)
        del self.ledgers[(ledger.job, ledger.model)]
        left = self._jobs_ledgers.get(ledger.job, 0) - 1
        if left > 0:
            self._jobs_ledgers[ledger.job] = left
        else:
            self._jobs_ledgers.pop(ledger.job, None)


def _pushes(mode: SyncMode | None) -> bool:
    """Whether a rank's gradient may arrive while its previous one is in the open step (and
    closes it): the modes whose ranks do not wait for their own step."""
    return isinstance(mode, BoundedStaleness | Asynchronous)

"""The table of every job's step ledgers: what the Steps servicer calls. The protocol and the
records are in :mod:`.ledger`; nothing here does I/O, and time comes from ``clock``."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from gradstar.errors import HubCapacityError, StepMismatchError, StepsBehindError
from gradstar.sync_modes import Asynchronous, BoundedStaleness, Quorum, SyncMode
from gradstar.wire.formats import WIRE_NONE, encode, format_from_wire

from .ledger import (
    HISTORY,
    SNAPSHOT_EVERY,
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

log = logging.getLogger(__name__)


class StepsTable:
    """Every job's ledgers; the servicer's only state.

    ``on_change()`` is called whenever a step closes, a barrier completes or the live set
    changes, so waiting calls look again.
    """

    def __init__(self, *, max_numel: int, max_held_bytes: int, lease: float,
                 history: int = HISTORY, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None,
                 load: Callable[[str, str], Snapshot | None] | None = None) -> None:
        self.max_numel = max_numel
        self.max_held_bytes = max_held_bytes
        self.lease = lease
        self.history = history
        self.clock = clock
        self.on_change = on_change or (lambda: None)
        self.load = load
        self.ledgers: dict[tuple[str, str], StepLedger] = {}
        self.held_bytes = 0

    # -- ranks ------------------------------------------------------------------------------

    def ledger(self, job: str, model: str, world_size: int) -> StepLedger:
        """The ledger of (job, model), created on first sight.

        Raises:
            StepMismatchError: the ledger was made for another world size.
        """
        ledger = self.ledgers.get((job, model))
        if ledger is None:
            ledger = self.ledgers[(job, model)] = StepLedger(job, model, world_size,
                                                             self.clock())
            saved = self.load(job, model) if self.load is not None else None
            if saved is not None:
                self._resume(ledger, saved)
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
        self.held_bytes += size
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
        """The rendezvous lost ``rank`` of ``job`` (or it finished): out of every live set."""
        for ledger in [v for (j, _), v in self.ledgers.items() if j == job]:
            if rank in ledger.ranks and ledger.ranks[rank].live:
                self._gone(ledger, rank, why)

    def expire(self) -> None:
        """Take out of the live sets every rank silent for longer than the lease."""
        now = self.clock()
        for ledger in list(self.ledgers.values()):
            for rank, state in ledger.ranks.items():
                if state.live and now - state.last_seen > self.lease:
                    self._gone(ledger, rank, f"silent for {now - state.last_seen:.1f} s")

    def _gone(self, ledger: StepLedger, rank: int, why: str) -> None:
        ledger.ranks[rank].live = False
        if ledger.snapshot_asked is not None and ledger.snapshot_asked[0] == rank:
            ledger.snapshot_asked = None  # it will not send it: ask the next one at once
        log.warning("job %r: rank %d left the live set of %r's steps (%s); the others go on",
                    ledger.job, rank, ledger.model, why)
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

    def _check_mode(self, ledger: StepLedger, who: str, mode: SyncMode, epoch: int) -> None:
        if ledger.mode is None or (epoch > ledger.mode_epoch and not ledger.open.contributions):
            ledger.mode, ledger.mode_epoch = mode, epoch
            return
        if epoch != ledger.mode_epoch or mode != ledger.mode:
            raise StepMismatchError(
                f"{who} contributes in {mode} (switch {epoch}), but model {ledger.model!r} "
                f"steps in {ledger.mode} (switch {ledger.mode_epoch}); every rank must use the "
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
        self.held_bytes += grows
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
        self.held_bytes += data.nbytes
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
        self.held_bytes -= sum(c.data.nbytes for c in parts)
        ledger.steps = open_.number
        ledger.log.append(ClosedStep(open_.number, tuple(ranks), tuple(c.weight for c in parts),
                                     tuple(c.staleness for c in parts), values, self.clock(),
                                     hyper))
        self.held_bytes += values.nbytes
        ledger.open = OpenStep(open_.number + 1)
        # Past the history, only what every live rank applied: one waiting in synchronize()
        # while another steps on still fetches all it missed (the memory bound still holds).
        needed = min((s.base for s in ledger.ranks.values() if s.live), default=ledger.steps)
        while len(ledger.log) > self.history and ledger.log[0].number <= needed:
            self._evict(ledger)
        self.on_change()

    def _evict(self, ledger: StepLedger) -> None:
        self.held_bytes -= ledger.log.popleft().aggregate.nbytes

    def _make_room(self, ledger: StepLedger, nbytes: int) -> None:
        """Drop old aggregates no live rank still needs until ``nbytes`` more fit.

        Raises:
            HubCapacityError: it does not fit even then.
        """
        for other in self.ledgers.values():
            needed = min((s.base for s in other.ranks.values() if s.live), default=other.steps)
            if other.snapshot is not None:  # a joiner replays from there
                needed = min(needed, other.snapshot.steps)
            while (self.held_bytes + nbytes > self.max_held_bytes and other.log
                   and other.log[0].number <= needed):
                self._evict(other)
        if self.held_bytes + nbytes > self.max_held_bytes:
            raise HubCapacityError(
                f"the coordinator holds {self.held_bytes} bytes of steps and may hold "
                f"{self.max_held_bytes} (--max-steps-bytes); {nbytes} bytes from job "
                f"{ledger.job!r} were refused")

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

    def synchronize(self, ledger: StepLedger, rank: int, barrier: int) -> int | None:
        """``rank`` reached barrier ``barrier``: the step count every rank applies up to once
        every live rank reached it, else None (ask again)."""
        state = self.seen(ledger, rank)
        state.barrier = max(state.barrier, barrier)
        self._settle(ledger)
        return ledger.barrier_steps.get(barrier)

    def _finish_barrier(self, ledger: StepLedger) -> None:
        target = ledger.barrier_done + 1
        live = ledger.live()
        if not live or any(ledger.ranks[r].barrier < target for r in live):
            return
        if ledger.open.contributions:
            self._close(ledger)  # whatever the mode: nobody else will contribute to it
        ledger.barrier_done = target
        ledger.barrier_steps[target] = ledger.steps
        for old in [b for b in ledger.barrier_steps if b < target - 8]:
            del ledger.barrier_steps[old]
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
                self.held_bytes -= sum(c.data.nbytes for c in ledger.open.contributions.values())
                self.held_bytes -= sum(s.aggregate.nbytes for s in ledger.log)
                if ledger.snapshot is not None:
                    self.held_bytes -= len(ledger.snapshot.data) + len(ledger.snapshot.layout)
                del self.ledgers[key]
                dropped.append(key[0])
        return dropped


def _pushes(mode: SyncMode | None) -> bool:
    """Whether a rank's gradient may arrive while its previous one is in the open step (and
    closes it): the modes whose ranks do not wait for their own step."""
    return isinstance(mode, BoundedStaleness | Asynchronous)

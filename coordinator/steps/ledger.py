"""The hub's step ledger: when a data-parallel step is complete, in every sync mode but
Synchronous (``gradstar.sync_modes``). The rank's side is ``gradstar.client.steps``.

One ledger per (job, model). Protocol, per rank:

1. **Contribute** ``(rank, base, weight, gradient)``: ``base`` is how many aggregates the
   gradient's parameters had applied. It joins the step open now, number ``steps + 1``; its
   *staleness* is ``steps - base`` (aggregates the group applied since). Quorum drops a stale
   contribution (staleness > 0), BoundedStaleness one over its bound (a rank that was out of
   the live set); both answer ``accepted=False`` and the rank catches up. A second contribution
   of a rank to one step, a base from the future, another size, mode or a bad weight raise
   :class:`StepMismatchError` for that rank only; the others' step is untouched.
2. **Close**: a step closes when every live rank contributed (or waits at a barrier), or as
   the mode allows earlier, at its deadline (its timeout after the first fresh contribution;
   measured on the last steps' fresh ``arrivals`` when it adapts): Quorum once ``min_ranks``
   contributed (fewer if fewer are live); Asynchronous and BoundedStaleness with whatever
   arrived, BoundedStaleness only once no live rank's next gradient would be more than
   ``max_staleness`` aggregates stale. In those two (they *push*) a rank's next gradient may
   also arrive while its previous one is in the open step (``timeout=0``: its call did not
   wait), and then closes that step (one "clock" of the fastest rank, as in SSP) — in
   BoundedStaleness only within the bound; until then that fast rank's call waits. Its
   *aggregate* is the sum of its contributions, each times its factor (its weight's share,
   scaled as the mode says: :meth:`~gradstar.sync_modes.SyncMode.factors`, recorded per
   step), in rank order in float32, so it does not depend on arrival order; the hub computes
   it once and every rank gets the same bytes. Each contribution carries its rank's optimizer
   hyperparameters (lr, ...); a step records their weighted mean, and every rank applies the
   step with those values (a per-rank LR schedule cannot split the replicas).
   **Wire formats**: one per ledger (DDP's ``wire=``, set by the first contribution); the
   servicer decodes each contribution to float32, the aggregate is encoded once and logged
   encoded: every rank decodes the same bytes. A dropped contribution is answered before
   anything of it is kept, so the rank restores its residual (error feedback).
3. **Fetch** ``(have)``: the aggregates after ``have``, in step order, with who made each
   (ranks, weights, staleness). The rank applies them with its own optimizer; from then on its
   parameters are at ``steps`` aggregates (its next base).
4. **Liveness**: a rank is live while it calls (heartbeats every second) within the lease,
   and until the rendezvous reports it lost or finished. A rank out of the live set holds
   nobody; it is live again at its next call and catches up from the log (the last
   ``history`` aggregates, fewer under the memory bound: :class:`StepsBehindError` past it; a
   live rank's missing ones are kept past the history, e.g. while it waits in a barrier).
5. **Snapshots**: the hub asks the lowest live rank (in a Contribute answer) for its whole
   state once no snapshot is ``SNAPSHOT_EVERY`` steps fresh; the rank sends it after applying
   the aggregates up to its step. A rank that joins mid-training (a restarted process) takes
   the latest snapshot and replays the aggregates after it from the log: no peer waits.
6. **Synchronize** (a barrier, ``barrier`` = the rank's count of calls): once every live rank
   reached it the open step closes whatever the mode, and every rank applies up to the same
   step count: replicas bitwise identical. Mode switches happen there and only there: a rank
   asks for its next mode with its Synchronize, and the hub switches once every live rank
   asked for the same one, handing out the next ``mode_epoch``; a contribution must carry the
   ledger's mode and epoch, and no refused call changes either.

A contribution is held whole from its arrival until its step closes; a rank that dies
mid-upload never reaches the ledger (the servicer takes complete vectors only). What a mode
decides is asked of the mode object (:class:`~gradstar.sync_modes.SyncMode`), never of its
type. The ledger's calls return named records (:mod:`.records`). Nothing here does I/O; time,
memory, the size limit and the change signal come from the ledger's host
(:class:`~.table.StepsTable`).
"""

from __future__ import annotations

import logging
from collections import Counter, deque

import numpy as np

from gradstar.errors import StepMismatchError, StepsBehindError
from gradstar.sync_modes import ADAPT_STEPS, SyncMode
from gradstar.wire.formats import WIRE_NONE, encode, format_from_wire

from .checks import check_header
from .records import (
    BarrierOutcome,
    ClosedStep,
    Contributed,
    Contribution,
    Host,
    LedgerSummary,
    OpenStep,
    RankState,
    RankSummary,
    Snapshot,
    aggregate,
    shares,
)

log = logging.getLogger(__name__)

#: Closed steps' aggregates kept per ledger for ranks that fall behind.
HISTORY = 64
#: Steps between the snapshots the hub asks a live rank for (a joiner replays at most these).
SNAPSHOT_EVERY = 16
#: Seconds a rank asked for a snapshot has to send it before another may be asked.
SNAPSHOT_PATIENCE = 30.0


class StepLedger:
    """One model's steps: the open one, the recent closed ones, and the ranks (see the module
    docstring for the protocol)."""

    def __init__(self, job: str, model: str, world_size: int, host: Host) -> None:
        self.job, self.model, self.world_size = job, model, world_size
        self.host = host
        self.numel: int | None = None
        #: How many optimizer hyperparameters a contribution carries (set with ``numel``).
        self.hyper_len: int | None = None
        #: Of ``numel``, the trailing module buffers' values (averaged, never scaled).
        self.buffer_numel = 0
        #: The contributions' and aggregates' wire format (None: float32), set with ``numel``.
        self.wire = None
        self.mode: SyncMode | None = None
        self.mode_epoch = 0
        self.steps = 0
        self.open = OpenStep(1)
        self.log: deque[ClosedStep] = deque()
        #: The last closed steps' arrivals (``OpenStep.arrivals``): what a mode measures the
        #: ranks' spread on (Quorum's adaptive timeout).
        self.arrivals: deque[tuple[float, ...]] = deque(maxlen=ADAPT_STEPS)
        # Every rank of the world is expected from the start (they built DDP together); one
        # that never calls leaves the live set after the lease like any silent rank.
        now = host.clock()
        self.ranks = {r: RankState(last_seen=now) for r in range(world_size)}
        self.barrier_done = 0
        #: The recent completed barriers' outcomes, by barrier number.
        self.barriers: dict[int, BarrierOutcome] = {}
        self.dropped = 0
        self.staleness: Counter = Counter()
        self.snapshot: Snapshot | None = None
        #: The rank asked for a snapshot, when, and at which step count (None: nobody is).
        self.snapshot_asked: tuple[int, float, int] | None = None

    # -- ranks ------------------------------------------------------------------------------

    def live(self) -> set[int]:
        return {r for r, s in self.ranks.items() if s.live}

    def seen(self, rank: int) -> RankState:
        """``rank`` called now: live again if it had left the live set.

        Raises:
            StepMismatchError: ``rank`` is outside the world.
        """
        if not 0 <= rank < self.world_size:
            raise StepMismatchError(f"rank {rank} is not in job {self.job!r}'s world of "
                                    f"{self.world_size}")
        state = self.ranks[rank]
        state.last_seen = self.host.clock()
        if not state.live:
            state.live = True
            log.info("job %r: rank %d is live again in %r's steps (at %d of %d aggregates)",
                     self.job, rank, self.model, state.base, self.steps)
            self.host.on_change()
        return state

    def heartbeat(self, rank: int, have: int, leave: bool = False) -> None:
        """``rank`` is alive with ``have`` aggregates applied (or ``leave``s: finished)."""
        state = self.seen(rank)
        if leave:
            self.lose(rank, "left")
        elif not state.pending and have <= self.steps:
            state.base = have

    def lose(self, rank: int, why: str) -> None:
        """Take ``rank`` out of the live set; the caller settles the ledger."""
        self.ranks[rank].live = False
        if self.snapshot_asked is not None and self.snapshot_asked[0] == rank:
            self.snapshot_asked = None  # it will not send it: ask the next one at once
        # A rank that finished is not news; one lost or silent is.
        level = logging.INFO if why in ("finished", "left") else logging.WARNING
        log.log(level, "job %r: rank %d left the live set of the steps of model %r (%s); the "
                "others go on", self.job, rank, self.model, why)

    # -- snapshots --------------------------------------------------------------------------

    def first_logged(self) -> int:
        """Number of the oldest aggregate still held (steps + 1 when none)."""
        return self.log[0].number if self.log else self.steps + 1

    def joinable(self) -> bool:
        """Whether a joiner can start from the snapshot: the log still holds every aggregate
        after it (the hub asks for a fresh one when it does not)."""
        return self.snapshot is not None and self.snapshot.steps + 1 >= self.first_logged()

    def wants_snapshot(self, rank: int, now: float) -> bool:
        """Whether to ask ``rank`` for its state now (and mark it asked): it is the lowest live
        rank, and the latest snapshot is ``SNAPSHOT_EVERY`` steps old or missing."""
        asked = self.snapshot_asked
        if asked is not None and (now - asked[1] < SNAPSHOT_PATIENCE
                                  and self.steps - asked[2] < SNAPSHOT_EVERY):
            return False  # asked recently: in time and in steps
        fresh = self.snapshot is not None and self.steps - self.snapshot.steps < SNAPSHOT_EVERY
        if fresh or rank != min(self.live(), default=None):
            return False
        self.snapshot_asked = (rank, now, self.steps)
        return True

    def resume(self, saved: Snapshot) -> None:
        """Start from a saved snapshot (a restarted coordinator's): the steps continue from
        there and every rank is expected at it (they load it as they start)."""
        account = self.host.account
        size = len(saved.data) + len(saved.layout)
        if account.held_bytes + size > account.max_bytes:
            log.error("job %r: the saved snapshot of %r (%d bytes) does not fit the hub's "
                      "memory bound; its ranks start without it", self.job, self.model, size)
            return
        self.snapshot = saved
        account.hold(self.job, size)
        self.steps = saved.steps
        self.open = OpenStep(saved.steps + 1)
        for state in self.ranks.values():
            state.base = saved.steps

    def put_snapshot(self, rank: int, steps: int, layout: str, data: bytes) -> None:
        """Keep ``rank``'s state after ``steps`` aggregates as the snapshot.

        Raises:
            StepMismatchError: a step count from the future.
            HubCapacityError: it does not fit the hub's memory bound.
        """
        self.seen(rank)
        if steps > self.steps:
            raise StepMismatchError(f"rank {rank} of job {self.job!r} sent its state after "
                                    f"{steps} aggregates, but only {self.steps} steps closed")
        old = self.snapshot
        if old is not None and old.steps >= steps:
            return  # as fresh already
        grows = len(data) + len(layout) - (len(old.data) + len(old.layout) if old else 0)
        self.host.account.make_room(self, grows)
        self.snapshot = Snapshot(steps, layout, data)
        self.host.account.hold(self.job, grows)
        self.snapshot_asked = None
        self.host.on_change()

    # -- contribute and close ---------------------------------------------------------------

    def check_header(self, rank: int, mode: SyncMode, mode_epoch: int, numel: int,
                     base: int, weight: float, wire: int = WIRE_NONE,
                     hyper: tuple[float, ...] = (), buffers: int = 0) -> None:
        """Refuse a contribution before its data is read (:func:`.checks.check_header`, with
        the host's size limit); it never changes the ledger."""
        check_header(self, rank, mode, mode_epoch, numel, base, weight, wire, hyper, buffers,
                     self.host.max_numel)

    def within_bound(self) -> bool:
        """Whether the open step may close now without leaving any live rank that has not
        contributed to it (and is not at a barrier, nor about to fetch) more than the mode's
        staleness bound behind: its next gradient, on its current parameters, joins the next
        step at best."""
        bound = None if self.mode is None else self.mode.stale_bound
        if bound is None:
            return True
        after = self.steps + 1
        return all(after - s.base <= bound for r, s in self.ranks.items()
                   if s.live and r not in self.open.contributions and not s.pending
                   and s.barrier <= self.barrier_done)

    def must_wait(self, rank: int) -> bool:
        """Whether ``rank``'s next gradient must wait before it can join (BoundedStaleness):
        it is already in the open step, which cannot close yet without leaving a live rank
        more than the bound behind. The servicer waits for a change and asks again."""
        return (rank in self.open.contributions and self.mode is not None
                and self.mode.pushes and not self.within_bound())

    def contribute(self, rank: int, mode: SyncMode, mode_epoch: int, base: int,
                   weight: float, data: np.ndarray, wire: int = WIRE_NONE,
                   hyper: tuple[float, ...] = (), buffers: int = 0) -> Contributed:
        """Take ``rank``'s gradient (float32: decoded from ``wire`` by the servicer; its last
        ``buffers`` values module buffers, never scaled). In the modes that push, a rank's
        gradient arriving while its previous one is in the open step closes it first.

        Raises: as :meth:`check_header` (checked again: the ledger may have moved while the
        data arrived); HubCapacityError: holding it would pass the hub's memory bound.
        """
        state = self.seen(rank)
        self.check_header(rank, mode, mode_epoch, data.shape[0], base, weight, wire, hyper,
                          buffers)
        if rank in self.open.contributions:  # a push (checked: this mode pushes, in bound)
            self.close()
        if self.mode is None:  # the ledger's first contribution names its mode
            self.mode = mode
        self.numel, self.wire = data.shape[0], format_from_wire(wire)
        self.hyper_len, self.buffer_numel = len(hyper), buffers
        staleness = self.steps - base
        reason = self.mode.drop_reason(staleness)
        if reason:
            state.dropped += 1
            self.dropped += 1
            state.pending = False
            state.base = base
            return Contributed(False, 0, staleness, reason)
        self.host.account.make_room(self, data.nbytes)
        open_ = self.open
        open_.contributions[rank] = Contribution(rank, float(weight), staleness, data,
                                                 tuple(hyper))
        # The clock starts at the first fresh gradient, and the spread is the fresh ones': a
        # step a stale one opened would close before the others could come (out of phase).
        if staleness == 0:
            now = self.host.clock()
            open_.first_at = now if open_.first_at is None else open_.first_at
            open_.arrivals.append(now - open_.first_at)
        self.host.account.hold(self.job, data.nbytes)
        state.base, state.pending, state.contributed = base, True, state.contributed + 1
        state.staleness[staleness] += 1
        self.staleness[staleness] += 1
        number = open_.number
        self.settle()
        self.host.on_change()  # a rank waiting on the bound may go on now
        return Contributed(True, number, staleness)

    def deadline(self) -> float | None:
        """When the open step may close without every live rank (the mode's; None: not)."""
        if self.mode is None or self.open.first_at is None:
            return None
        return self.mode.deadline(self.open.first_at, self.arrivals,
                                  len(self.live() | set(self.open.contributions)))

    def settle(self) -> None:
        """Close the open step if it may close, then complete a barrier everyone reached."""
        if self._closable():
            self.close()
        self._finish_barrier()

    def _closable(self) -> bool:
        open_ = self.open
        got = set(open_.contributions)
        if not got:
            return False
        live = self.live()
        at_barrier = {r for r in live if self.ranks[r].barrier > self.barrier_done}
        if live <= got | at_barrier:
            return True
        # Else as the mode says (its deadline, from the first fresh gradient), never past the
        # staleness bound; in the modes that push, a rank's next gradient may close it too.
        return open_.first_at is not None and self.within_bound() and self.mode.closes_early(
            len(got), len(live | got), self.host.clock() - open_.first_at, self.arrivals)

    def close(self) -> None:
        """Close the open step: its aggregate, scaled as the mode says, joins the log."""
        open_, account = self.open, self.host.account
        ranks = sorted(open_.contributions)
        parts = [open_.contributions[r] for r in ranks]
        # Summed in rank order: the same aggregate whichever rank arrived first; scaled for
        # the ranks live now (or contributing).
        factors = self.mode.factors(shares([c.weight for c in parts]),
                                    [c.staleness for c in parts], len(self.live() | set(ranks)))
        values, hyper = aggregate(parts, self.numel, factors, self.buffer_numel)
        if self.wire is not None:  # encoded once: every rank decodes the same bytes
            values = np.frombuffer(encode(self.wire, values), dtype=np.uint8)
        account.hold(self.job, -sum(c.data.nbytes for c in parts))
        self.steps = open_.number
        self.log.append(ClosedStep(open_.number, tuple(ranks), tuple(c.weight for c in parts),
                                   tuple(c.staleness for c in parts), values,
                                   self.host.clock(), hyper,
                                   tuple(float(np.float32(f)) for f in factors)))
        account.hold(self.job, values.nbytes)
        self.arrivals.append(tuple(open_.arrivals))
        self.open = OpenStep(open_.number + 1)
        # Past the history, only what every live rank applied: one waiting in synchronize()
        # while another steps on still fetches all it missed (the memory bound still holds).
        needed = min((s.base for s in self.ranks.values() if s.live), default=self.steps)
        while len(self.log) > self.host.history and self.log[0].number <= needed:
            account.evict(self)
        self.host.on_change()

    # -- fetch and synchronize --------------------------------------------------------------

    def fetch(self, rank: int, have: int, limit: int = 0) -> list[ClosedStep]:
        """The closed steps after ``have`` (the first ``limit`` of them, if not 0); the rank's
        parameters are at ``have`` plus their number once it applied them.

        Raises:
            StepMismatchError: ``have`` is from the future.
            StepsBehindError: aggregates it needs were dropped from the log.
        """
        state = self.seen(rank)
        if have > self.steps:
            raise StepMismatchError(f"rank {rank} of job {self.job!r} has applied {have} "
                                    f"aggregates, but only {self.steps} steps closed")
        if have + 1 < self.first_logged():
            raise StepsBehindError(
                f"rank {rank} of job {self.job!r} has applied {have} aggregates; the hub "
                f"keeps them from step {self.first_logged()} on (its history and memory "
                "bound), so it cannot catch up from the log: restart it from a checkpoint "
                "taken after ddp.synchronize()")
        closed = [s for s in self.log if s.number > have]
        closed = closed[:limit] if limit else closed
        state.base, state.pending = have + len(closed), False
        self.settle()  # its newer parameters may let a bounded step past its deadline close
        self.host.on_change()
        return closed

    def synchronize(self, rank: int, barrier: int,
                    next_mode: SyncMode | None = None) -> BarrierOutcome | None:
        """``rank`` reached barrier ``barrier``, asking to switch to ``next_mode`` there (None:
        no switch): once every live rank reached it, the step count every rank applies up to
        and the mode after it; else None (ask again).

        The mode switches at the barrier only if every live rank asked for the same mode
        there; the hub then hands out the next epoch. Otherwise it stays, and the outcome says
        who asked for what.
        """
        state = self.seen(rank)
        if barrier > state.barrier:
            state.barrier = barrier
            state.next_mode = next_mode
        self.settle()
        return self.barriers.get(barrier)

    def _finish_barrier(self) -> None:
        target = self.barrier_done + 1
        live = self.live()
        if not live or any(self.ranks[r].barrier < target for r in live):
            return
        if self.open.contributions:
            self.close()  # whatever the mode: nobody else will contribute to it
        # A rank already past this barrier asked at its own later one, not at this.
        asked = {r: self.ranks[r].next_mode for r in sorted(live)
                 if self.ranks[r].barrier == target}
        refused = ""
        if any(m is not None for m in asked.values()):
            wanted = set(asked.values())
            if len(wanted) == 1 and len(asked) == len(live):
                self.mode, self.mode_epoch = wanted.pop(), self.mode_epoch + 1
            else:
                refused = "; ".join(f"rank {r}: {m or 'no switch'}" for r, m in asked.items())
                log.warning("job %r: the ranks of model %r asked for different modes at "
                            "barrier %d (%s); the mode stays %s", self.job, self.model,
                            target, refused, self.mode)
        for r in asked:
            self.ranks[r].next_mode = None
        self.barrier_done = target
        self.barriers[target] = BarrierOutcome(self.steps, self.mode, self.mode_epoch, refused)
        for old in [b for b in self.barriers if b < target - 8]:
            del self.barriers[old]
        self.host.on_change()

    # -- views ------------------------------------------------------------------------------

    def summary(self) -> LedgerSummary:
        """What operators see of it: mode, steps closed, live ranks, contributions dropped,
        staleness counts, and per rank."""
        return LedgerSummary(
            job=self.job, model=self.model, mode=str(self.mode or "-"), steps=self.steps,
            live=tuple(sorted(self.live())), world_size=self.world_size, dropped=self.dropped,
            open_contributions=len(self.open.contributions),
            staleness=dict(sorted(self.staleness.items())),
            snapshot_steps=self.snapshot.steps if self.snapshot else None,
            ranks=tuple(RankSummary(r, s.live, s.base, s.contributed, s.dropped,
                                    dict(sorted(s.staleness.items())))
                        for r, s in sorted(self.ranks.items())))

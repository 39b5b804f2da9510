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
   the mode allows earlier: Quorum once ``min_ranks`` contributed (fewer if fewer are live)
   and ``timeout`` passed since the step's first contribution. In Asynchronous and
   BoundedStaleness a rank does not wait for its own step: its next gradient may arrive while
   its previous one is still in the open step, and then closes that step (a step is one
   "clock" of the fastest rank, as in SSP) — in BoundedStaleness only once closing leaves no
   live rank's next gradient more than ``max_staleness`` aggregates stale; until then that
   fast rank's call waits (the only time a rank waits for another). Its *aggregate* is the
   weighted mean of its contributions, summed in rank order in float32, so it does not depend
   on arrival order; the hub computes it once and every rank gets the same bytes. Each
   contribution carries its rank's optimizer hyperparameters (lr, ...); a step records their
   weighted mean, and every rank applies the step with those values (a per-rank LR schedule
   cannot split the replicas).
   **Wire formats**: a ledger's contributions travel in one wire format (DDP's ``wire=``, set
   by the first contribution; another is :class:`StepMismatchError` for its sender). The hub
   decodes each to float32 on receipt (its encoded size checked against ``numel``), adds in
   float32, and keeps the aggregate encoded once in that format: every rank decodes the same
   bytes, and the log holds encoded bytes. The ranks keep their own residuals (error
   feedback); a dropped contribution is answered before anything of it is kept, so the rank
   restores the residual it had before it.
3. **Fetch** ``(have)``: the aggregates after ``have``, in step order, with who made each
   (ranks, weights, staleness). The rank applies them with its own optimizer; from then on its
   parameters are at ``steps`` aggregates (its next base).
4. **Liveness**: a rank is live while it calls (heartbeats, every second from the client)
   within ``lease`` seconds, and until the rendezvous reports it lost or finished. A rank that
   leaves the live set holds nobody; it is live again at its next call, and catches up from the
   log (the last ``history`` aggregates, fewer under the hub's memory bound:
   :class:`StepsBehindError` past it). A live rank's missing aggregates are kept past the
   history (within the memory bound), e.g. while it waits in a barrier and others step on.
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
mid-upload never reaches this table (the servicer takes complete vectors only). Nothing here
does I/O; time comes from ``clock``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from gradstar.errors import ProtocolError
from gradstar.sync_modes import BoundedStaleness, Quorum, SyncMode
from gradstar.wire.formats import WireFormat, format_from_wire

log = logging.getLogger(__name__)

#: Closed steps' aggregates kept per ledger for ranks that fall behind.
HISTORY = 64
#: Steps between the snapshots the hub asks a live rank for (a joiner replays at most these).
SNAPSHOT_EVERY = 16
#: Seconds a rank asked for a snapshot has to send it before another may be asked.
SNAPSHOT_PATIENCE = 30.0


@dataclass
class RankState:
    """What a ledger knows of one rank."""

    last_seen: float
    live: bool = True
    #: Aggregates applied to the parameters its next gradient is computed on.
    base: int = 0
    #: It contributed since its last fetch: its next gradient will be on newer parameters.
    pending: bool = False
    #: synchronize() calls it reached.
    barrier: int = 0
    #: The mode it asked to switch to at that barrier (None: no switch).
    next_mode: SyncMode | None = None
    contributed: int = 0
    dropped: int = 0
    staleness: Counter = field(default_factory=Counter)


@dataclass
class Contribution:
    rank: int
    weight: float
    staleness: int
    data: np.ndarray
    #: The rank's optimizer hyperparameters when it computed the gradient (lr, ...).
    hyper: tuple[float, ...] = ()


@dataclass
class OpenStep:
    number: int
    first_at: float | None = None
    contributions: dict[int, Contribution] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """A rank's whole state after ``steps`` aggregates: opaque bytes and their JSON layout."""

    steps: int
    layout: str
    data: bytes


@dataclass(frozen=True)
class BarrierOutcome:
    """What a completed barrier answers every rank: the step count to apply up to, and the
    mode (and its epoch) from there on; ``refused`` says who asked for what when a switch
    asked there was not made."""

    steps: int
    mode: SyncMode | None
    mode_epoch: int
    refused: str = ""


@dataclass(frozen=True)
class ClosedStep:
    number: int
    ranks: tuple[int, ...]
    weights: tuple[float, ...]
    staleness: tuple[int, ...]
    #: What the ranks get: float32 values, or their bytes (uint8) in the ledger's wire format.
    aggregate: np.ndarray
    closed_at: float
    #: The hyperparameters every rank applies it with: its contributions' weighted mean.
    hyper: tuple[float, ...] = ()


class StepLedger:
    """One model's steps: the open one, the recent closed ones, and the ranks."""

    def __init__(self, job: str, model: str, world_size: int, now: float) -> None:
        self.job, self.model, self.world_size = job, model, world_size
        self.numel: int | None = None
        #: How many optimizer hyperparameters a contribution carries (set with ``numel``).
        self.hyper_len: int | None = None
        #: The contributions' and aggregates' wire format (None: float32), set with ``numel``.
        self.wire: WireFormat | None = None
        self.mode: SyncMode | None = None
        self.mode_epoch = 0
        self.steps = 0
        self.open = OpenStep(1)
        self.log: deque[ClosedStep] = deque()
        # Every rank of the world is expected from the start (they built DDP together); one
        # that never calls leaves the live set after the lease like any silent rank.
        self.ranks = {r: RankState(last_seen=now) for r in range(world_size)}
        self.barrier_done = 0
        #: The recent completed barriers' outcomes, by barrier number.
        self.barriers: dict[int, BarrierOutcome] = {}
        self.dropped = 0
        self.staleness: Counter = Counter()
        self.snapshot: Snapshot | None = None
        #: The rank asked for a snapshot, when, and at which step count (None: nobody is).
        self.snapshot_asked: tuple[int, float, int] | None = None

    def live(self) -> set[int]:
        return {r for r, s in self.ranks.items() if s.live}

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

    def within_bound(self) -> bool:
        """Whether the open step may close now without leaving any live rank that has not
        contributed to it (and is not at a barrier, nor about to fetch) more than the bound
        behind (BoundedStaleness): its next gradient, on its current parameters, joins the next
        step at best."""
        mode = self.mode
        if not isinstance(mode, BoundedStaleness):
            return True
        after = self.steps + 1
        return all(after - s.base <= mode.max_staleness for r, s in self.ranks.items()
                   if s.live and r not in self.open.contributions and not s.pending
                   and s.barrier <= self.barrier_done)

    def summary(self) -> dict:
        """What operators see of it: mode, steps closed, live ranks, contributions dropped,
        staleness counts, and per rank."""
        return {
            "job": self.job, "model": self.model, "mode": str(self.mode or "-"),
            "steps": self.steps, "live": sorted(self.live()),
            "world_size": self.world_size, "dropped": self.dropped,
            "open_contributions": len(self.open.contributions),
            "staleness": dict(sorted(self.staleness.items())),
            "snapshot_steps": self.snapshot.steps if self.snapshot else None,
            "ranks": [{"rank": r, "live": s.live, "base": s.base,
                       "contributed": s.contributed, "dropped": s.dropped,
                       "staleness": dict(sorted(s.staleness.items()))}
                      for r, s in sorted(self.ranks.items())],
        }


def wire_mismatch(ledger: StepLedger, wire: int) -> str:
    """Why a contribution in the header's ``wire`` value does not fit ``ledger`` ("" if it does).

    Raises:
        ProtocolError: an unknown wire format value.
    """
    try:
        fmt = format_from_wire(wire)
    except ProtocolError:
        raise ProtocolError(f"unknown wire format {wire} in a contribution header") from None
    if ledger.numel is None or fmt == ledger.wire:
        return ""
    name = "float32" if fmt is None else fmt.name
    theirs = "float32" if ledger.wire is None else ledger.wire.name
    return (f"sent its gradient in {name}, but model {ledger.model!r} steps in {theirs}; every "
            "rank of a model must use the same wire format")


def drop_reason(mode: SyncMode, staleness: int) -> str:
    if isinstance(mode, Quorum) and staleness > 0:
        return (f"computed {staleness} aggregate(s) ago: a Quorum step takes current "
                "gradients only")
    if isinstance(mode, BoundedStaleness) and staleness > mode.max_staleness:
        return (f"computed {staleness} aggregates ago, over the bound of "
                f"{mode.max_staleness}")
    return ""


def hyper_mismatch(ledger: StepLedger, hyper) -> str:
    """Why a contribution's optimizer hyperparameters do not fit ``ledger`` ("" if they do)."""
    if not all(math.isfinite(v) for v in hyper):
        return f"sent optimizer hyperparameters that are not finite: {list(hyper)}"
    if ledger.hyper_len is not None and len(hyper) != ledger.hyper_len:
        return (f"sent {len(hyper)} optimizer hyperparameters, but model {ledger.model!r}'s "
                f"contributions carry {ledger.hyper_len}; every rank must build the same "
                "optimizer (the same parameter groups and options)")
    return ""


def shares(weights: list[float]) -> list[float]:
    """Each weight's share of their sum, in float64 and scaled by the largest first, so that
    any finite weights >= 0 give finite shares summing to 1 (weights of 1 and 1e39, or two of
    1e-46, which float32 turns into inf or 0); every weight 0: equal shares."""
    top = max(weights, default=0.0)
    if top <= 0:
        return [1.0 / len(weights)] * len(weights)
    scaled = [w / top for w in weights]
    total = math.fsum(scaled)
    return [w / total for w in scaled]


def aggregate(parts: list[Contribution], numel: int) -> tuple[np.ndarray, tuple[float, ...]]:
    """The weighted mean of ``parts``: each contribution times its share of the weights
    (:func:`shares`, rounded to float32), summed in the given order in float32 (the same bytes
    whichever rank arrived first); zeros when every weight is 0. And their hyperparameters'
    weighted mean (float64; the plain mean when every weight is 0)."""
    out = np.zeros(numel, dtype=np.float32)
    if not parts:
        return out, ()
    weighted = shares([c.weight for c in parts])
    if any(c.weight > 0 for c in parts):
        scratch = np.empty_like(out)
        for c, share in zip(parts, weighted, strict=True):
            np.multiply(c.data, np.float32(share), out=scratch)
            np.add(out, scratch, out=out)
    hyper = tuple(math.fsum(w * c.hyper[i] for w, c in zip(weighted, parts, strict=True))
                  for i in range(len(parts[0].hyper)))
    return out, hyper

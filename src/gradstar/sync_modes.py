"""When a data-parallel step is complete: the sync modes the hub applies to DDP's contributions.

Every contribution (one rank's gradient, computed on the parameters after ``base`` aggregates)
passes through the hub, so the hub decides when a step closes and gives every rank the same
aggregate. Ranks apply the aggregates in the hub's order, so replicas stay identical in every
mode; what differs is what a step waits for:

- :class:`Synchronous` — every rank, every step (today's DDP all_reduce; the default).
- :class:`Quorum` — *backup workers* (Chen et al., 2016): a step closes with every live rank,
  or with at least ``min_ranks`` of them once ``timeout`` seconds have passed since its first
  contribution. By default the timeout adapts: twice the time the recent steps took from their
  first contribution to their ``min_ranks``-th (a missing rank later than the others' own
  spread is a straggler), so without a straggler a step waits for every rank and with one the
  fast ranks wait about their own spread. A contribution computed on parameters the group has
  since moved past is *dropped* (counted): every aggregate is computed on current parameters
  (staleness 0).
- :class:`Asynchronous` — a step closes with every live rank, or with whatever has arrived
  once ``timeout`` passed since its first contribution (adaptive by default, as Quorum's for
  ``min_ranks`` = the live ranks but one); a late gradient is not dropped but joins the next
  step, stale (staleness unbounded but counted). Without a straggler a step so holds every
  rank's fresh gradient, as a Synchronous one; ``timeout=0`` never waits (a rank's next
  gradient closes the step its previous one is in, so nearly every gradient is one step
  stale even when no rank is slow: measured 15-50 points behind Synchronous on spirals).
- :class:`BoundedStaleness` — as Asynchronous, unless closing a step would leave a live rank
  more than ``max_staleness`` aggregates behind the parameters its next gradient is computed
  on; then it waits for that rank (Ho et al., 2013, SSP).

**Step scaling** (BoundedStaleness and Asynchronous, ``scaling=``; Quorum's default is
``"share"``, see :class:`Quorum`). With a straggler a step of
those modes holds what arrived before its deadline, often fewer than n gradients, and the fast
ranks close about one step per gradient: at the learning rate Synchronous trains well the
parameters move up to n times as far per gradient, and stale gradients with momentum add to it
(measured with the plain rule: both diverged at twice Synchronous's best rate). By default
(``"share+staleness"``) the hub scales each contribution by the step's share of the live
ranks, k/n for k contributions of n live ranks (every fresh gradient then moves the
parameters as far as in a Synchronous step: its 1/n of a mean of n),
and by 1 / (1 + its staleness) (staleness-aware ASGD, Zhang et al., 2016). ``"share"`` and
``"staleness"`` apply one of them, ``"plain"`` neither (the weighted mean as it is, the rule
before the scaling; retune the learning rate). The factor is on the gradient (module buffers
sent after it are averaged as they are), so an optimizer that normalises its gradient (Adam)
sees little of it. Each step records the factors it was made with
(``ddp.sync_stats().recent_steps``).

Each mode object answers the questions the hub and the rank ask of it (:class:`SyncMode`):
whether a step may close early, whether a late gradient is dropped, whether a rank's next
gradient may arrive while its previous one is in the open step (it *pushes*), whether a rank
waits for its own step, when the open step's deadline falls, and how a closed step is scaled;
nobody else branches on the mode. The objects are plain values: the client sends them in every
contribution's header (:meth:`SyncMode.message`), the hub reads them back (:func:`from_message`,
one row per proto value in :data:`MODES`) and refuses a rank whose mode differs from its
peers'. No torch, no I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gradstar.errors import ConfigurationError
from gradstar.proto.v1 import steps_pb2 as pb

__all__ = [
    "MODES",
    "SCALINGS",
    "Asynchronous",
    "BoundedStaleness",
    "Quorum",
    "SyncMode",
    "Synchronous",
    "from_message",
]

#: The step scalings by name, and their wire values (``scaling=`` of the ledger modes).
SCALINGS = {"plain": pb.STEP_SCALING_PLAIN, "share": pb.STEP_SCALING_SHARE,
            "staleness": pb.STEP_SCALING_STALENESS,
            "share+staleness": pb.STEP_SCALING_SHARE_STALENESS}
_SCALING_NAMES = {v: k for k, v in SCALINGS.items()}
#: What each scaling multiplies by: (the step's share of the live ranks, 1 / (1 + staleness)).
_RULES = {"plain": (False, False), "share": (True, False), "staleness": (False, True),
          "share+staleness": (True, True)}
#: Closed steps whose arrivals an adaptive timeout is measured on.
ADAPT_STEPS = 16
#: The quantile of those steps' spreads that Asynchronous and BoundedStaleness wait twice (a
#: gradient they miss is stale, not dropped, but one missed step puts that rank out of
#: phase: measured on 4 ranks without a straggler, the median left 14% of the steps partial).
CARRY_QUANTILE = 0.9


class SyncMode:
    """Base of the sync modes; the values are frozen dataclasses, equal when their fields are.

    The class attributes and methods are the questions hub and rank ask; a mode overrides what
    it decides differently from this base (a step that waits for every live rank, drops
    nothing, scales nothing and has no deadline)."""

    #: The proto value that names the mode on the wire.
    kind: ClassVar[int] = pb.SYNC_MODE_UNSPECIFIED
    #: Whether contributions go through the hub's step ledger (every mode but Synchronous).
    on_ledger: ClassVar[bool] = True
    #: Whether a rank's next gradient may arrive while its previous one is still in the open
    #: step, and then closes it (a rank does not wait for its own step).
    pushes: ClassVar[bool] = False
    #: Most aggregates a live rank's next gradient may lag behind (None: unbounded).
    stale_bound: int | None = None
    #: How a closed step's aggregate is scaled (:data:`SCALINGS`).
    scaling: str = "plain"

    @property
    def waits_for_own_step(self) -> bool:
        """Whether a rank's contribution call waits until the step it joined closed (its
        answer then brings that step's aggregate)."""
        return self.on_ledger and not self.pushes

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=self.kind)

    def drop_reason(self, staleness: int) -> str:
        """Why a contribution ``staleness`` aggregates old is dropped ("" if it is taken)."""
        return ""

    def deadline(self, first_at: float, recent: Sequence[Sequence[float]],
                 live: int) -> float | None:
        """When the open step, first contributed to at ``first_at``, may close without every
        one of the ``live`` ranks (live or contributed; None: never before they all
        contributed or reached a barrier). ``recent``: the last closed steps' arrivals, each
        the seconds from its first contribution to each of its contributions in arrival order
        (the hub's measure of the ranks' spread)."""
        return None

    def closes_early(self, got: int, live: int, waited: float,
                     recent: Sequence[Sequence[float]]) -> bool:
        """Whether a step with ``got`` contributions, of ``live`` ranks (live or contributed),
        ``waited`` seconds after its first one, closes before every live rank contributed
        (``recent`` as for :meth:`deadline`)."""
        return False

    def factors(self, shares: Sequence[float], staleness: Sequence[int],
                live: int) -> list[float]:
        """Each contribution's factor in a closed step's aggregate (float64, rank order):
        its weight's share (``shares``, summing to 1) times the mode's scaling, for a step of
        ``len(shares)`` contributions when ``live`` ranks are live (or contributed)."""
        by_share, by_staleness = _RULES[self.scaling]
        share = len(shares) / max(live, len(shares)) if by_share else 1.0
        return [w * share / (1 + s if by_staleness else 1) for w, s in
                zip(shares, staleness, strict=True)]

    @classmethod
    def from_fields(cls, message: pb.SyncMode) -> SyncMode:
        """The mode of this class that ``message`` describes (fields checked)."""
        return cls()


@dataclass(frozen=True)
class Synchronous(SyncMode):
    """Every rank contributes to every step; a lost rank fails the step on every rank (named
    error), as with torch's DDP."""

    kind: ClassVar[int] = pb.SYNC_MODE_SYNCHRONOUS
    on_ledger: ClassVar[bool] = False


@dataclass(frozen=True)
class Quorum(SyncMode):
    """A step closes with every live rank, or with the first ``min_ranks`` once ``timeout``
    seconds have passed since its first contribution. Late contributions are dropped.
    ``timeout=None`` (the default) adapts: twice the median, over the last
    :data:`ADAPT_STEPS` steps, of the seconds from a step's first contribution to its
    ``min_ranks``-th; until a step has shown it, a step waits for every live rank.

    A full step holds ``min_ranks`` gradients (every live rank if fewer are live); a step of
    k fewer is scaled by k / ``min_ranks`` (``scaling="share"``, the default), so each of its
    gradients moves the parameters as far as in a full step. That happens at the end of a job
    with a persistent straggler: the fast ranks wait in ``synchronize()`` and each of the
    straggler's remaining gradients closes a step alone, taken whole before (``"plain"``, the
    rule before; measured 5-23 points lower on two classifiers).

    Raises:
        ConfigurationError: ``min_ranks`` below 1, ``timeout`` negative or not finite, or an
            unknown scaling.
    """

    kind: ClassVar[int] = pb.SYNC_MODE_QUORUM
    min_ranks: int
    timeout: float | None = None
    scaling: str = "share"

    def __post_init__(self) -> None:
        if isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int) or (
                self.min_ranks < 1):
            raise ConfigurationError(
                f"Quorum(min_ranks={self.min_ranks!r}): min_ranks must be a whole number of "
                "ranks, at least 1")
        if self.timeout is not None:
            _check_seconds("Quorum", "timeout", self.timeout)
        _check_scaling("Quorum", self.scaling)

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=self.kind, min_ranks=self.min_ranks,
                           timeout_seconds=float(self.timeout or 0.0),
                           adaptive_timeout=self.timeout is None,
                           scaling=SCALINGS[self.scaling])

    def wait(self, recent: Sequence[Sequence[float]]) -> float | None:
        """Seconds a step waits after its first contribution before it may close with
        ``min_ranks`` (None: until every live rank contributed)."""
        if self.timeout is not None:
            return self.timeout
        return adaptive_wait(recent, self.min_ranks)

    def drop_reason(self, staleness: int) -> str:
        if staleness > 0:
            return (f"computed {staleness} aggregate(s) ago: a Quorum step takes current "
                    "gradients only")
        return ""

    def deadline(self, first_at: float, recent: Sequence[Sequence[float]],
                 live: int) -> float | None:
        wait = self.wait(recent)
        return None if wait is None else first_at + wait

    def closes_early(self, got: int, live: int, waited: float,
                     recent: Sequence[Sequence[float]]) -> bool:
        wait = self.wait(recent)
        return wait is not None and got >= min(self.min_ranks, live) and waited >= wait

    def factors(self, shares: Sequence[float], staleness: Sequence[int],
                live: int) -> list[float]:
        # A full Quorum step is min_ranks gradients (or every live rank, if fewer are live):
        # "share" scales only a step with fewer, e.g. a straggler's alone at a barrier.
        return super().factors(shares, staleness, min(live, self.min_ranks))

    @classmethod
    def from_fields(cls, message: pb.SyncMode) -> SyncMode:
        return cls(int(message.min_ranks), None if message.adaptive_timeout
                   else float(message.timeout_seconds), _scaling_of(cls, message))


class _Carrying(SyncMode):
    """What BoundedStaleness and Asynchronous share: late gradients are carried into the next
    step (never dropped), each step is scaled (``scaling``), and a rank waits for its own step
    at most ``timeout`` seconds after the step's first gradient (adaptive by default; ``0``:
    never, its next gradient closes it)."""

    pushes: ClassVar[bool] = True
    scaling: str = "share+staleness"
    timeout: float | None = None

    def _check(self, owner: str) -> None:
        _check_scaling(owner, self.scaling)
        if self.timeout is not None:
            _check_seconds(owner, "timeout", self.timeout)

    @property
    def waits_for_own_step(self) -> bool:
        return self.timeout != 0

    def wait(self, recent: Sequence[Sequence[float]], live: int) -> float | None:
        """Seconds a step of ``live`` ranks waits after its first fresh contribution before it
        closes with what has arrived (None: until every live rank contributed). The adaptive
        wait is twice the 90th percentile (:data:`CARRY_QUANTILE`) of the recent steps' times
        from their first fresh gradient to their ``live - 1``-th: a rank later than the
        others' spread is a straggler. Of two ranks, the one other rank has no spread (the
        time to the first gradient is 0, and so was the wait): it is twice the recent times
        to the second, so a rank later than its usual is not waited for, and a partner that is
        always slower than the other is its pace, waited for as in Synchronous."""
        if self.timeout is not None:
            return self.timeout if self.timeout > 0 else None
        return adaptive_wait(recent, live - 1 if live > 2 else live, CARRY_QUANTILE)

    def deadline(self, first_at: float, recent: Sequence[Sequence[float]],
                 live: int) -> float | None:
        wait = self.wait(recent, live)
        return None if wait is None else first_at + wait

    def closes_early(self, got: int, live: int, waited: float,
                     recent: Sequence[Sequence[float]]) -> bool:
        wait = self.wait(recent, live)
        return wait is not None and waited >= wait

    def _fields(self) -> dict:
        return {"scaling": SCALINGS[self.scaling], "timeout_seconds": float(self.timeout or 0),
                "adaptive_timeout": self.timeout is None}


@dataclass(frozen=True)
class BoundedStaleness(_Carrying):
    """A step closes with whatever has arrived, as long as no live rank's next contribution
    would be more than ``max_staleness`` aggregates stale; fast ranks wait only then. A rank
    waits for its own step up to ``timeout`` after the step's first gradient (see
    :class:`Asynchronous`). Each step's aggregate is scaled by ``scaling`` (see the module
    docstring; ``"plain"``: not).

    Raises:
        ConfigurationError: ``max_staleness`` is not a whole number >= 0; an unknown scaling;
            ``timeout`` negative or not finite.
    """

    kind: ClassVar[int] = pb.SYNC_MODE_BOUNDED_STALENESS
    max_staleness: int
    scaling: str = "share+staleness"
    timeout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or (
                self.max_staleness < 0):
            raise ConfigurationError(
                f"BoundedStaleness(max_staleness={self.max_staleness!r}): the bound must be "
                "a whole number of aggregates, at least 0 (1-4 is the useful range)")
        self._check("BoundedStaleness")

    @property
    def stale_bound(self) -> int:
        return self.max_staleness

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=self.kind, max_staleness=self.max_staleness, **self._fields())

    def drop_reason(self, staleness: int) -> str:
        if staleness > self.max_staleness:
            return (f"computed {staleness} aggregates ago, over the bound of "
                    f"{self.max_staleness}")
        return ""

    @classmethod
    def from_fields(cls, message: pb.SyncMode) -> SyncMode:
        return cls(int(message.max_staleness), _scaling_of(cls, message),
                   _timeout_of(message))


@dataclass(frozen=True)
class Asynchronous(_Carrying):
    """A step closes with whatever has arrived once ``timeout`` seconds passed since its first
    gradient (or with every live rank); no rank waits longer for another, and a late gradient
    joins the next step (counted stale). ``timeout=None`` (the default) adapts as Quorum's
    does for ``min_ranks`` = the live ranks but one: without a straggler every step holds
    every rank's fresh gradient, as in Synchronous; ``timeout=0`` never waits (a rank's next
    gradient closes its previous step: every gradient then comes one step stale). Each step's
    aggregate is scaled by ``scaling`` (see the module docstring; ``"plain"``: not).

    Raises:
        ConfigurationError: an unknown scaling; ``timeout`` negative or not finite.
    """

    kind: ClassVar[int] = pb.SYNC_MODE_ASYNCHRONOUS
    scaling: str = "share+staleness"
    timeout: float | None = None

    def __post_init__(self) -> None:
        self._check("Asynchronous")

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=self.kind, **self._fields())

    @classmethod
    def from_fields(cls, message: pb.SyncMode) -> SyncMode:
        return cls(_scaling_of(cls, message), _timeout_of(message))


#: Every sync mode by its proto value: the one table :func:`from_message` reads.
MODES: dict[int, type[SyncMode]] = {
    mode.kind: mode for mode in (Synchronous, Quorum, BoundedStaleness, Asynchronous)}


def from_message(message: pb.SyncMode) -> SyncMode:
    """The mode a header names.

    Raises:
        ConfigurationError: an unknown kind, or fields out of range.
    """
    mode = MODES.get(message.kind)
    if mode is None:
        raise ConfigurationError(
            f"unknown sync mode kind {message.kind} (this coordinator knows "
            f"{', '.join(m.__name__ for m in MODES.values())})")
    return mode.from_fields(message)


def check_mode(mode: object) -> SyncMode:
    """``mode`` itself if it is a sync mode.

    Raises:
        ConfigurationError: it is not one of the mode objects.
    """
    if type(mode) not in MODES.values():
        raise ConfigurationError(
            f"sync_mode={mode!r}: pass gradstar.Synchronous(), gradstar.Quorum(min_ranks=k, "
            "timeout=s), gradstar.BoundedStaleness(max_staleness=s) or "
            "gradstar.Asynchronous()")
    return mode


def adaptive_wait(recent: Sequence[Sequence[float]], k: int,
                  quantile: float = 0.5) -> float | None:
    """Twice the ``quantile`` (the median by default), over the last :data:`ADAPT_STEPS` of
    the ``recent`` steps' fresh arrivals that held ``k`` of them, of the seconds from their
    first fresh contribution to their ``k``-th (None: no step has shown it yet)."""
    spreads = sorted(arrivals[k - 1] for arrivals in list(recent)[-ADAPT_STEPS:]
                     if len(arrivals) >= k)
    return 2 * spreads[min(len(spreads) - 1, int(quantile * len(spreads)))] if spreads else None


def _timeout_of(message: pb.SyncMode) -> float | None:
    """A carrying mode's timeout (a message without the adaptive flag, from before the
    flag applied to these modes, never waited: 0)."""
    return None if message.adaptive_timeout else float(message.timeout_seconds)


def _scaling_of(mode: type[SyncMode], message: pb.SyncMode) -> str:
    if message.scaling == pb.STEP_SCALING_UNSPECIFIED:
        return mode.scaling
    name = _SCALING_NAMES.get(message.scaling)
    if name is None:
        raise ConfigurationError(f"unknown step scaling {message.scaling} in a sync mode "
                                 f"(this coordinator knows {', '.join(SCALINGS)})")
    return name


def _check_scaling(owner: str, scaling: object) -> None:
    if scaling not in SCALINGS:
        raise ConfigurationError(f"{owner}(scaling={scaling!r}): the step scaling is one of "
                                 f"{', '.join(map(repr, SCALINGS))}")


def _check_seconds(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value < 0:
        raise ConfigurationError(f"{owner}({name}={value!r}): seconds must be a finite "
                                 "number >= 0")

"""When a data-parallel step is complete: the sync modes the hub applies to DDP's contributions.

Every contribution (one rank's gradient, computed on the parameters after ``base`` aggregates)
passes through the hub, so the hub decides when a step closes and gives every rank the same
aggregate. Ranks apply the aggregates in the hub's order, so replicas stay identical in every
mode; what differs is what a step waits for:

- :class:`Synchronous` — every rank, every step (today's DDP all_reduce; the default).
- :class:`Quorum` — *backup workers* (Chen et al., 2016): a step closes with every live rank,
  or with at least ``min_ranks`` of them once ``timeout`` seconds have passed since its first
  contribution. A contribution computed on parameters the group has since moved past is
  *dropped* (counted): every aggregate is computed on current parameters (staleness 0).
- :class:`BoundedStaleness` — a step closes with whatever has arrived, unless closing it would
  leave a live rank more than ``max_staleness`` aggregates behind the parameters its next
  gradient is computed on; then it waits for that rank (Ho et al., 2013, SSP).
- :class:`Asynchronous` — a step closes with whatever has arrived; staleness is unbounded but
  counted.

The mode objects are plain values: the client sends them in every contribution's header
(:meth:`SyncMode.message`), the hub reads them back (:func:`from_message`) and refuses a rank
whose mode differs from its peers'. No torch, no I/O here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradstar.errors import ConfigurationError
from gradstar.proto.v1 import steps_pb2 as pb

__all__ = [
    "Asynchronous",
    "BoundedStaleness",
    "Quorum",
    "SyncMode",
    "Synchronous",
    "from_message",
]


class SyncMode:
    """Base of the sync modes; the values are frozen dataclasses, equal when their fields are."""

    #: Whether contributions go through the hub's step ledger (every mode but Synchronous).
    on_ledger: bool = True

    def message(self) -> pb.SyncMode:  # pragma: no cover - every subclass defines it
        raise NotImplementedError


@dataclass(frozen=True)
class Synchronous(SyncMode):
    """Every rank contributes to every step; a lost rank fails the step on every rank (named
    error), as with torch's DDP."""

    on_ledger = False

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=pb.SYNC_MODE_SYNCHRONOUS)


@dataclass(frozen=True)
class Quorum(SyncMode):
    """A step closes with every live rank, or with the first ``min_ranks`` once ``timeout``
    seconds have passed since its first contribution. Late contributions are dropped.

    Raises:
        ConfigurationError: ``min_ranks`` below 1, or ``timeout`` negative or not finite.
    """

    min_ranks: int
    timeout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int) or (
                self.min_ranks < 1):
            raise ConfigurationError(
                f"Quorum(min_ranks={self.min_ranks!r}): min_ranks must be a whole number of "
                "ranks, at least 1")
        _check_seconds("Quorum", "timeout", self.timeout)

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=pb.SYNC_MODE_QUORUM, min_ranks=self.min_ranks,
                           timeout_seconds=float(self.timeout))


@dataclass(frozen=True)
class BoundedStaleness(SyncMode):
    """A step closes with whatever has arrived, as long as no live rank's next contribution
    would be more than ``max_staleness`` aggregates stale; fast ranks wait only then.

    Raises:
        ConfigurationError: ``max_staleness`` is not a whole number >= 0.
    """

    max_staleness: int

    def __post_init__(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or (
                self.max_staleness < 0):
            raise ConfigurationError(
                f"BoundedStaleness(max_staleness={self.max_staleness!r}): the bound must be "
                "a whole number of aggregates, at least 0 (1-4 is the useful range)")

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=pb.SYNC_MODE_BOUNDED_STALENESS,
                           max_staleness=self.max_staleness)


@dataclass(frozen=True)
class Asynchronous(SyncMode):
    """A step closes with whatever has arrived; no rank ever waits for another."""

    def message(self) -> pb.SyncMode:
        return pb.SyncMode(kind=pb.SYNC_MODE_ASYNCHRONOUS)


def from_message(message: pb.SyncMode) -> SyncMode:
    """The mode a header names.

    Raises:
        ConfigurationError: an unknown kind, or fields out of range.
    """
    kind = message.kind
    if kind == pb.SYNC_MODE_SYNCHRONOUS:
        return Synchronous()
    if kind == pb.SYNC_MODE_QUORUM:
        return Quorum(int(message.min_ranks), float(message.timeout_seconds))
    if kind == pb.SYNC_MODE_BOUNDED_STALENESS:
        return BoundedStaleness(int(message.max_staleness))
    if kind == pb.SYNC_MODE_ASYNCHRONOUS:
        return Asynchronous()
    raise ConfigurationError(f"unknown sync mode kind {kind} (this coordinator knows "
                             "Synchronous, Quorum, BoundedStaleness and Asynchronous)")


def check_mode(mode: object) -> SyncMode:
    """``mode`` itself if it is a sync mode.

    Raises:
        ConfigurationError: it is not one of the four mode objects.
    """
    if not isinstance(mode, SyncMode) or type(mode) is SyncMode:
        raise ConfigurationError(
            f"sync_mode={mode!r}: pass gradstar.Synchronous(), gradstar.Quorum(min_ranks=k, "
            "timeout=s), gradstar.BoundedStaleness(max_staleness=s) or "
            "gradstar.Asynchronous()")
    return mode


def _check_seconds(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value < 0:
        raise ConfigurationError(f"{owner}({name}={value!r}): seconds must be a finite "
                                 "number >= 0")

"""The records of a step ledger (:mod:`.ledger`): what it knows of each rank, a contribution,
the open step, a closed one, a snapshot, the named results its calls return and what operators
see of it (:class:`LedgerSummary`); what it takes from its host (:class:`Host`); and the one
arithmetic of an aggregate. No I/O."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gradstar.sync_modes import SyncMode


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
    #: When its first fresh (staleness 0) contribution arrived: its deadline counts from here.
    first_at: float | None = None
    contributions: dict[int, Contribution] = field(default_factory=dict)
    #: Seconds from ``first_at`` to each fresh contribution, in arrival order.
    arrivals: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Snapshot:
    """A rank's whole state after ``steps`` aggregates: opaque bytes and their JSON layout."""

    steps: int
    layout: str
    data: bytes


@dataclass(frozen=True)
class Contributed:
    """The ledger's verdict on a contribution: taken into ``step`` (``accepted``) or dropped
    (``reason`` says why; ``step`` is then 0), ``staleness`` aggregates old either way."""

    accepted: bool
    step: int
    staleness: int
    reason: str = ""


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
    #: Each contribution's factor in the aggregate (rank order; ``SyncMode.factors``, as the
    #: float32 values the hub multiplied by).
    factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class RankSummary:
    """What operators see of one rank of a ledger (:class:`LedgerSummary`)."""

    rank: int
    live: bool
    #: Aggregates applied to the parameters its next gradient is computed on.
    base: int
    contributed: int
    dropped: int
    #: Its contributions taken into steps, by staleness.
    staleness: dict[int, int]


@dataclass(frozen=True)
class LedgerSummary:
    """What operators see of one ledger (``StepLedger.summary``): read by the Admin service,
    the status page and /metrics."""

    job: str
    model: str
    #: The sync mode's name ("-" before the first contribution).
    mode: str
    #: Steps closed so far.
    steps: int
    #: The ranks of the live set, in order.
    live: tuple[int, ...]
    world_size: int
    #: Contributions dropped (too stale).
    dropped: int
    #: Contributions in the open step.
    open_contributions: int
    #: Contributions taken into steps, by staleness.
    staleness: dict[int, int]
    #: Steps of the snapshot the ledger holds; None without one.
    snapshot_steps: int | None
    ranks: tuple[RankSummary, ...]


class Account(Protocol):
    """The memory account a ledger holds its bytes in (:class:`~.account.StepsAccount`)."""

    held_bytes: int
    max_bytes: int

    def hold(self, job: str, nbytes: int) -> None: ...
    def make_room(self, ledger, nbytes: int) -> None: ...
    def evict(self, ledger) -> None: ...


class Host(Protocol):
    """What a ledger takes from the table it lives in (:class:`~.table.StepsTable`)."""

    history: int
    max_numel: int
    account: Account
    clock: Callable[[], float]
    #: Called whenever a step closes, a barrier completes or the live set changes.
    on_change: Callable[[], None]


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


def aggregate(parts: list[Contribution], numel: int, factors: list[float], buffers: int = 0,
              ) -> tuple[np.ndarray, tuple[float, ...]]:
    """The sum of ``parts``, each times its factor rounded to float32 (the mode's
    :meth:`~gradstar.sync_modes.SyncMode.factors` of the weights' :func:`shares`), in the given
    order in float32 (the same bytes whichever rank arrived first); the last ``buffers``
    values (module buffers) times each weight's share instead, never scaled; zeros when every
    weight is 0. And their hyperparameters' weighted mean (float64; the plain mean when every
    weight is 0)."""
    out = np.zeros(numel, dtype=np.float32)
    if not parts:
        return out, ()
    weighted = shares([c.weight for c in parts])
    if any(c.weight > 0 for c in parts):
        scratch = np.empty_like(out)
        cut = numel - buffers
        for c, factor, share in zip(parts, factors, weighted, strict=True):
            np.multiply(c.data[:cut], np.float32(factor), out=scratch[:cut])
            np.multiply(c.data[cut:], np.float32(share), out=scratch[cut:])
            np.add(out, scratch, out=out)
    hyper = tuple(math.fsum(w * c.hyper[i] for w, c in zip(weighted, parts, strict=True))
                  for i in range(len(parts[0].hyper)))
    return out, hyper

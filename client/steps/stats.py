"""What a rank sees of its sync mode: ``ddp.sync_stats()`` and its entries (filled by
:class:`~.sync.StepSync`)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

#: Entries of SyncStats.recent_steps and recent_contributions.
RECENT = 1024


@dataclass(frozen=True)
class StepEntry:
    """One applied step: who made its aggregate (rank order), their weights and staleness."""

    step: int
    ranks: tuple[int, ...]
    weights: tuple[float, ...]
    staleness: tuple[int, ...]
    #: The optimizer hyperparameters it was applied with (see :mod:`.hyper`).
    hyper: tuple[float, ...] = ()
    #: Each contribution's factor in the aggregate: its weight's share times the mode's step
    #: scaling (``SyncMode.factors``; their sum is the step's scale).
    factors: tuple[float, ...] = ()

    @property
    def scale(self) -> float:
        """How far the step moved the parameters against a full step of the same gradients:
        the sum of its factors (1 with the plain rule)."""
        return sum(self.factors) if self.factors else 1.0


@dataclass(frozen=True)
class ContributionEntry:
    """One of this rank's contributions: its base, and the step it joined (None: dropped)."""

    base: int
    step: int | None
    staleness: int


@dataclass
class SyncStats:
    """What this rank saw of its sync mode (``ddp.sync_stats()``).

    ``staleness`` counts this rank's accepted contributions by staleness; ``step_staleness``
    every contribution of every applied step (all ranks'), by staleness.
    """

    mode: str
    #: The step scaling the mode applies (``"share"``, ``"plain"``, ...: see
    #: :mod:`gradstar.sync_modes`); each step's factors are in ``recent_steps``.
    scaling: str = "plain"
    #: Aggregates applied to this rank's parameters (its position in the hub's step log; a
    #: rank that started from a snapshot counts the snapshot's steps too).
    step: int = 0
    #: Aggregates this process applied.
    steps_applied: int = 0
    contributions: int = 0
    accepted: int = 0
    dropped: int = 0
    staleness: Counter = field(default_factory=Counter)
    step_staleness: Counter = field(default_factory=Counter)
    step_sizes: Counter = field(default_factory=Counter)
    waited_seconds: float = 0.0
    #: The last applied steps and this rank's last contributions (up to RECENT each).
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    recent_contributions: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    #: The ranks the hub's step ledger counts as live, as of this rank's last heartbeat (at
    #: most a second old): the job's size as it grows and shrinks (``pg.world_size`` is the
    #: size this rank joined with). Empty before the first answer.
    live_ranks: tuple[int, ...] = ()

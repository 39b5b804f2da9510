"""A step ledger taken back after a coordinator restart (or a standby's takeover); no I/O.

The coordinator that went away held the ledger: its closed steps, the open one, its snapshot.
The ranks hold what matters of it: each its parameters and optimizer state after some number
of aggregates (bitwise the same on every rank at the same number), its barrier count and its
mode epoch. When the rendezvous rebuilt a generation from its rejoining ranks
(:mod:`gradstar.coordinator.rendezvous.rebuild`), each of its ledgers is made afresh and
*resumes* from what its ranks say (``Resume``), before any other call of theirs:

1. Every rank of the generation says where it stands (:class:`ResumeClaim`); the calls wait
   (bounded, the rank asks again) until the last one has.
2. The ledger goes on from ``H``, the highest step count any rank applied: no aggregate that a
   rank applied is lost or applied twice. The open step is ``H + 1`` and empty; a gradient in
   flight when the coordinator went away is issued again by its rank if it was computed
   after ``H`` aggregates (then it cannot be in any step a rank applied), else it counts as
   dropped (it may be in one).
3. The ranks behind ``H`` (whose missing aggregates went with the old coordinator) load a
   snapshot at ``H``, which the lowest rank at ``H`` sends at once; the --state-dir snapshot
   (older, maybe of another run) is not used.
4. The barriers completed are the fewest any rank completed (a rank in its barrier when the
   coordinator went away calls it again); the ranks must agree on the mode epoch.

Refusals are :class:`~gradstar.errors.StepResumeError` and change nothing: claims that cannot
agree (mode epochs), a later claim from the future (a step count past the ledger's), or any
other call to a ledger still resuming.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

from gradstar.errors import StepResumeError

from .ledger import StepLedger
from .records import OpenStep
from .table import StepsTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeClaim:
    """Where a rank stands when it resumes: aggregates applied, barriers completed, mode
    epoch."""

    rank: int
    have: int
    barriers: int
    mode_epoch: int


@dataclass(frozen=True)
class Resumed:
    """The answer to one rank: the step count the ledger goes on from, and whether this rank
    loads the snapshot at it or sends it."""

    steps: int
    load_snapshot: bool = False
    send_snapshot: bool = False


@dataclass(eq=False)
class Resumption:
    """One ledger's claims, gathered until every rank of its world said."""

    ledger: StepLedger
    claims: dict[int, ResumeClaim] = field(default_factory=dict)
    #: Each rank's answer, once the ledger resumed.
    answers: dict[int, Resumed] | None = None
    #: Why the claims cannot agree (then every claim is refused with it).
    refused: StepResumeError | None = None

    @property
    def done(self) -> bool:
        return self.answers is not None or self.refused is not None


class Resumptions:
    """The ledgers of rebuilt generations and their resumptions (the Steps servicer's)."""

    def __init__(self) -> None:
        self._by_ledger: weakref.WeakKeyDictionary[StepLedger, Resumption] = (
            weakref.WeakKeyDictionary())
        #: The (job, model) ledgers begun for each rebuilt generation.
        self._begun: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()

    def ledger(self, table: StepsTable, generation, rebuilt: bool, job: str, model: str,
               rank: int, what: str) -> StepLedger:
        """The ledger of (job, model) for a caller of ``generation`` (``rebuilt``: taken back
        from its rejoining ranks), calling ``what`` (empty: a call a resuming ledger takes).
        The first call of a rebuilt generation makes its ledger afresh (any older one of the
        job's dropped, no saved snapshot loaded), waiting for its ranks to resume.

        Raises:
            StepResumeError: ``what`` while the ledger waits for its ranks.
            What :meth:`StepsTable.ledger` raises.
        """
        if rebuilt and model not in self._begun.get(generation, ()):
            old = table.ledgers.get((job, model))
            if old is not None:
                table.drop(old)
            ledger = table.ledger(job, model, generation.world_size, load=False)
            self._begun.setdefault(generation, set()).add(model)
            self._begin(ledger, generation.number)
        else:
            ledger = table.ledger(job, model, generation.world_size)
        if what:
            self.refuse_pending(ledger, rank, what)
        return ledger

    def _begin(self, ledger: StepLedger, generation: int) -> None:
        self._by_ledger[ledger] = Resumption(ledger)
        log.info("job %r: the steps of model %r wait for the ranks of rebuilt generation %d to "
                 "resume", ledger.job, ledger.model, generation)

    def pending(self, ledger: StepLedger) -> bool:
        """Whether ``ledger`` still waits for some rank's claim (no other call is taken)."""
        resumption = self._by_ledger.get(ledger)
        return resumption is not None and not resumption.done

    def refuse_pending(self, ledger: StepLedger, rank: int, what: str) -> None:
        """Refuse ``what`` of ``rank`` while ``ledger`` waits for its ranks.

        Raises:
            StepResumeError: it does.
        """
        if self.pending(ledger):
            raise StepResumeError(
                f"rank {rank} of job {ledger.job!r} called {what} on the steps of model "
                f"{ledger.model!r}, which wait for every rank of the generation to resume after "
                "a coordinator restart; a rank resumes first (Resume)")

    def claim(self, ledger: StepLedger, claim: ResumeClaim) -> Resumed | None:
        """Take ``claim``; the rank's answer once every rank said (None: ask again).

        Raises:
            StepMismatchError: the rank is outside the world.
            StepResumeError: the claims cannot agree, or (after the ledger resumed) the claim
                is from the future or of another mode epoch.
        """
        ledger.seen(claim.rank)
        resumption = self._by_ledger.get(ledger)
        if resumption is None or resumption.done:
            return self._answer(ledger, resumption, claim)
        resumption.claims[claim.rank] = claim  # a retried claim replaces the same rank's
        if len(resumption.claims) == ledger.world_size:
            try:
                resumption.answers = settle(ledger, resumption.claims)
            except StepResumeError as error:
                resumption.refused = error
            ledger.host.on_change()
        return self._answer(ledger, resumption, claim) if resumption.done else None

    def _answer(self, ledger: StepLedger, resumption: Resumption | None,
                claim: ResumeClaim) -> Resumed:
        if resumption is not None:
            if resumption.refused is not None:
                raise resumption.refused
            if resumption.claims.get(claim.rank) == claim:
                return resumption.answers[claim.rank]
        return late(ledger, claim)


def settle(ledger: StepLedger, claims: dict[int, ResumeClaim]) -> dict[int, Resumed]:
    """Resume ``ledger`` from every rank's claim (see the module docstring); each rank's
    answer.

    Raises:
        StepResumeError: the ranks' mode epochs differ (a mode switch cut by the restart).
    """
    epochs = {c.mode_epoch for c in claims.values()}
    if len(epochs) > 1:
        said = ", ".join(f"rank {r}: {c.mode_epoch}" for r, c in sorted(claims.items()))
        raise StepResumeError(
            f"the ranks of job {ledger.job!r} resume the steps of model {ledger.model!r} at "
            f"different mode epochs ({said}): a set_sync_mode() switch was cut by the "
            "coordinator restart, and which mode each step had cannot be told; restart the "
            "job's ranks")
    steps = max(c.have for c in claims.values())
    sender = min(r for r, c in claims.items() if c.have == steps)
    behind = [r for r, c in claims.items() if c.have < steps]
    ledger.steps, ledger.open, ledger.mode_epoch = steps, OpenStep(steps + 1), epochs.pop()
    ledger.barrier_done = min(c.barriers for c in claims.values())
    for rank, c in claims.items():
        state = ledger.ranks[rank]
        state.base, state.barrier, state.pending = c.have, c.barriers, False
    if behind:  # asked now; no Contribute answer asks another rank meanwhile
        ledger.snapshot_asked = (sender, ledger.host.clock(), steps)
    log.warning("job %r: the steps of model %r resumed at %d aggregates after a coordinator "
                "restart (ranks behind, loading rank %d's snapshot: %s)", ledger.job,
                ledger.model, steps, sender, ", ".join(map(str, behind)) or "none")
    return {r: Resumed(steps, load_snapshot=r in behind, send_snapshot=bool(behind)
                       and r == sender) for r in claims}


def late(ledger: StepLedger, claim: ResumeClaim) -> Resumed:
    """The answer to a claim made after ``ledger`` resumed (or of a ledger that never lost
    anything): the rank goes on from the log, or from the snapshot when the log no longer
    holds what it lacks.

    Raises:
        StepResumeError: a step count from the future, or another mode epoch.
    """
    who = f"rank {claim.rank} of job {ledger.job!r}"
    if claim.have > ledger.steps:
        raise StepResumeError(
            f"{who} resumes the steps of model {ledger.model!r} after {claim.have} aggregates, "
            f"but this coordinator's ledger goes on from {ledger.steps}: its state is from "
            "another run or coordinator, and taking it back would split the replicas")
    if claim.mode_epoch != ledger.mode_epoch:
        raise StepResumeError(
            f"{who} resumes the steps of model {ledger.model!r} at mode epoch "
            f"{claim.mode_epoch}, but the ledger is at {ledger.mode_epoch}")
    return Resumed(ledger.steps, load_snapshot=claim.have + 1 < ledger.first_logged())


__all__ = ["ResumeClaim", "Resumed", "Resumption", "Resumptions", "late", "settle"]

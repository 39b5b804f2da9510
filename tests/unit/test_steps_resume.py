"""A step ledger taken back after a coordinator restart, without sockets
(coordinator/steps/resume.py): it resumes at the highest step count a rank applied once every
rank of the rebuilt generation said where it stands, the ranks behind load the snapshot the
lowest rank at that count sends, and what cannot be taken back is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gradstar.coordinator.steps import StepsTable
from gradstar.coordinator.steps.resume import ResumeClaim, Resumed, Resumptions
from gradstar.errors import StepResumeError
from gradstar.sync_modes import Quorum


@dataclass(eq=False)
class Gen:
    """What the resumptions read of a generation (weakly referenced, by identity)."""

    number: int = 3
    world_size: int = 3


def table() -> StepsTable:
    return StepsTable(max_numel=1 << 20, max_held_bytes=1 << 24, lease=15.0)


def claim(rank: int, have: int, barriers: int = 1, epoch: int = 0) -> ResumeClaim:
    return ResumeClaim(rank, have, barriers, epoch)


def test_a_rebuilt_ledger_resumes_at_the_highest_step_count_once_every_rank_said():
    steps, resumptions, gen = table(), Resumptions(), Gen()
    ledger = resumptions.ledger(steps, gen, True, "j", "ddp", 0, "")
    # Nothing but Resume (and heartbeats) until every rank said.
    with pytest.raises(StepResumeError, match=r"rank 1 .* called Contribute .* resumes first"):
        resumptions.ledger(steps, gen, True, "j", "ddp", 1, "Contribute")
    assert resumptions.claim(ledger, claim(0, 7)) is None
    assert resumptions.claim(ledger, claim(2, 9, barriers=2)) is None
    assert resumptions.pending(ledger)
    assert resumptions.claim(ledger, claim(1, 9)) == Resumed(9, send_snapshot=True)
    assert not resumptions.pending(ledger)
    # The others' answers, asked again: rank 0 behind loads rank 1's snapshot.
    assert resumptions.claim(ledger, claim(0, 7)) == Resumed(9, load_snapshot=True)
    assert resumptions.claim(ledger, claim(2, 9, barriers=2)) == Resumed(9)
    assert (ledger.steps, ledger.open.number, ledger.barrier_done) == (9, 10, 1)
    assert [ledger.ranks[r].base for r in range(3)] == [7, 9, 9]
    assert ledger.snapshot_asked[0] == 1  # no Contribute answer asks another rank meanwhile
    # Its next step is the 10th; a gradient computed after 9 aggregates joins it fresh.
    mode = Quorum(min_ranks=3)
    for rank in range(3):
        ledger.contribute(rank, mode, 0, 9, 1.0, np.ones(4, np.float32))
    assert ledger.steps == 10 and [s.number for s in ledger.log] == [10]
    # The same generation's later calls find the same ledger; no new resumption.
    assert resumptions.ledger(steps, gen, True, "j", "ddp", 0, "Fetch") is ledger


def test_claims_from_the_future_or_of_other_mode_epochs_are_refused_by_name():
    steps, resumptions, gen = table(), Resumptions(), Gen(world_size=2)
    ledger = resumptions.ledger(steps, gen, True, "j", "ddp", 0, "")
    resumptions.claim(ledger, claim(0, 4, epoch=1))
    with pytest.raises(StepResumeError, match=r"different mode epochs \(rank 0: 1, rank 1: 2\)"):
        resumptions.claim(ledger, claim(1, 4, epoch=2))
    with pytest.raises(StepResumeError, match="different mode epochs"):  # every claim
        resumptions.claim(ledger, claim(0, 4, epoch=1))
    assert ledger.steps == 0 and ledger.open.number == 1  # nothing changed

    # Once resumed, a rank that says it applied more than the ledger goes on from is refused.
    other, gen2 = Resumptions(), Gen(world_size=2)
    ledger = other.ledger(steps, gen2, True, "k", "ddp", 0, "")
    other.claim(ledger, claim(0, 4))
    other.claim(ledger, claim(1, 4))
    with pytest.raises(StepResumeError, match="after 6 aggregates, but this coordinator's "
                                              "ledger goes on from 4"):
        other.claim(ledger, claim(1, 6))
    with pytest.raises(StepResumeError, match="mode epoch 3, but the ledger is at 0"):
        other.claim(ledger, claim(1, 4, epoch=3))
    assert ledger.steps == 4


def test_a_generation_formed_here_resumes_from_the_log_and_a_rebuilt_one_ignores_the_state_dir():
    steps, resumptions, gen = table(), Resumptions(), Gen(world_size=2)
    ledger = resumptions.ledger(steps, gen, False, "j", "ddp", 0, "Contribute")
    assert not resumptions.pending(ledger)
    mode = Quorum(min_ranks=2)
    for _ in range(2):
        for rank in range(2):
            ledger.contribute(rank, mode, 0, ledger.steps, 1.0, np.ones(4, np.float32))
    # A rank that lost its answers (not the coordinator) catches up from the log.
    assert resumptions.claim(ledger, claim(0, 1)) == Resumed(2)
    # A rebuilt generation of the same job makes the ledger afresh: the old one is dropped.
    rebuilt = resumptions.ledger(steps, Gen(number=4, world_size=2), True, "j", "ddp", 0, "")
    assert rebuilt is not ledger and rebuilt.steps == 0 and resumptions.pending(rebuilt)
    assert steps.ledgers[("j", "ddp")] is rebuilt

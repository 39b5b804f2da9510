"""The step ledger keeps, past its history, the aggregates a live rank has not applied: a rank
that waits in ``synchronize()`` while a slower one keeps stepping alone catches up after the
barrier (it got StepsBehindError once the other had closed more than ``history`` steps)."""

from __future__ import annotations

import numpy as np

from gradstar.coordinator.steps.ledger import StepsTable
from gradstar.sync_modes import Asynchronous

MODE = Asynchronous()
GRAD = np.ones(4, dtype=np.float32)


def test_a_rank_waiting_at_a_barrier_catches_up_past_the_history():
    table = StepsTable(max_numel=1 << 20, max_held_bytes=1 << 30, lease=15.0, history=8)
    ledger = table.ledger("job", "ddp", 2)
    assert table.synchronize(ledger, 0, 1) is None  # rank 0 is done at once and waits
    for have in range(20):  # rank 1 steps on alone, far past the history
        assert table.contribute(ledger, 1, MODE, 0, have, 1.0, GRAD)[0]
        assert [s.number for s in table.fetch(ledger, 1, have)] == [have + 1]
    assert table.synchronize(ledger, 1, 1) == 20
    assert [s.number for s in table.fetch(ledger, 0, 0)] == list(range(1, 21))
    # Once every live rank applied them, the log is back to its history.
    table.contribute(ledger, 1, MODE, 0, 20, 1.0, GRAD)
    assert len(ledger.log) == 8

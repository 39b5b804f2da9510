"""The carrying modes' adaptive wait and full step, without sockets (gradstar.sync_waits, the
ledger's record of arrivals): a fixed schedule of arrivals whose closes and factors are
computed here by hand."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar.sync_modes import Asynchronous, BoundedStaleness
from gradstar.sync_waits import CARRY_QUANTILE, Arrivals, adaptive_wait, worth_waiting

from .test_steps_ledger import assert_factors, catch_up, clocked, give, table


def test_worth_waiting_is_the_median_time_to_the_kth_plus_a_cycle_over_k():
    recent = [Arrivals((0.0, 0.02, 0.05, 0.09), 0.03), Arrivals((0.0, 0.01, 0.04), 0.05),
              Arrivals((0.0, 0.03, 0.06), 0.07), Arrivals((0.0, 0.02, 0.05))]  # last: no ready
    # Times to the 3rd: 0.05, 0.04, 0.06 (median 0.05); cycles 0.08, 0.09, 0.13 (median 0.09).
    assert worth_waiting(recent, 3) == pytest.approx(0.05 + 0.09 / 3)
    assert worth_waiting([Arrivals((0.0, 0.1))], 2) is None  # no cycle measured yet
    assert worth_waiting(recent, 5) is None  # no step held 5 fresh gradients
    assert Arrivals((0.0, 0.1), 0.2) == (0.0, 0.1)  # a tuple of the offsets


@pytest.mark.parametrize("make", [Asynchronous, lambda: BoundedStaleness(2)])
def test_a_straggler_within_twice_the_spread_is_not_waited_for_past_what_waiting_pays(make):
    # 4 ranks; ranks 0-2 arrive 0, 0.02 and 0.05 s after a step's first fresh gradient, each
    # 0.03 s after the step before closed; rank 3 comes 0.09 s after the first. Twice the 90th
    # percentile of the times to the 3rd gradient is 0.10 s: the rule before waited for rank 3
    # in every step. Waiting pays only while rank 3 is later than the 3rd gradient by less
    # than a cycle (0.03 + 0.05) over 3: the wait is 0.05 + 0.08 / 3 = 0.0767 s.
    clock, t, ledger = clocked(4)
    mode = make()

    def fast(start: float) -> None:
        for rank, after in ((0, 0.0), (1, 0.02), (2, 0.05)):
            clock.now = start + after
            if ledger.steps:
                catch_up(t, ledger, rank)
            give(t, ledger, rank, mode, 1.0 + rank)

    fast(0.0)  # step 1: nothing measured, so it waits for every rank
    clock.now = 0.09
    give(t, ledger, 3, mode, 4.0)
    assert ledger.steps == 1 and ledger.arrivals[-1].ready is None
    fast(0.12)  # step 2: no cycle measured yet, so twice the spread (0.10 s) covers rank 3
    assert ledger.deadline() == pytest.approx(0.22)
    clock.now = 0.21
    catch_up(t, ledger, 3)
    give(t, ledger, 3, mode, 4.0)
    assert ledger.steps == 2 and ledger.log[-1].ranks == (0, 1, 2, 3)
    assert ledger.arrivals[-1] == pytest.approx((0.0, 0.02, 0.05, 0.09))
    assert ledger.arrivals[-1].ready == pytest.approx(0.03)  # 0.24 - the close at 0.21
    fast(0.24)  # step 3
    assert adaptive_wait(ledger.arrivals, 3, CARRY_QUANTILE) == pytest.approx(0.10)
    assert mode.wait(ledger.arrivals, 4) == pytest.approx(0.05 + 0.08 / 3)
    assert ledger.deadline() == pytest.approx(0.24 + 0.05 + 0.08 / 3)
    clock.now = 0.316
    t.close_due()
    assert ledger.steps == 2
    clock.now = 0.317
    t.close_due()
    assert ledger.steps == 3 and ledger.log[-1].ranks == (0, 1, 2)
    clock.now = 0.33  # rank 3's gradient, on the parameters after step 2: one step stale
    assert give(t, ledger, 3, mode, 8.0, base=2).staleness == 1
    fast(0.35)  # step 4: every live rank contributed, so it closes at once
    assert ledger.steps == 4 and ledger.log[-1].ranks == (0, 1, 2, 3)
    # Factors by hand: a full step is the live ranks but one (3), so steps 1-3 are full (their
    # weighted mean: 1/4 each of four, 1/3 each of three), and rank 3's stale gradient in step
    # 4 is 1/4 / (1 + 1).
    expected = [(1 / 4,) * 4, (1 / 4,) * 4, (1 / 3,) * 3, (1 / 4, 1 / 4, 1 / 4, 1 / 8)]
    values = [(1.0, 2.0, 3.0, 4.0), (1.0, 2.0, 3.0, 4.0), (1.0, 2.0, 3.0), (1.0, 2.0, 3.0, 8.0)]
    assert_factors(ledger.log, expected, values)


def test_a_step_of_fewer_than_the_live_ranks_but_one_is_scaled_by_its_share_of_them():
    # 4 live ranks: a full step is 3. Steps of 1 and 2 (timeout=0: the pushes close them) are
    # 1/3 and 2/3 of one; the plain rule takes each whole.
    for scaling, one, two in (("share+staleness", 1 / 3, 1 / 3), ("plain", 1.0, 1 / 2)):
        t = table()
        ledger = t.ledger("j", "m", 4)
        mode = Asynchronous(scaling=scaling, timeout=0)
        give(t, ledger, 0, mode, 3.0)
        give(t, ledger, 0, mode, 6.0, base=0)  # closes step 1 (rank 0 alone); 1 stale
        give(t, ledger, 1, mode, 9.0, base=1)  # fresh
        give(t, ledger, 1, mode, 0.0, base=1)  # closes step 2 (ranks 0 and 1)
        assert [s.ranks for s in ledger.log] == [(0,), (0, 1)]
        stale = 2 if scaling != "plain" else 1
        assert ledger.log[0].factors == (float(np.float32(one)),)
        assert ledger.log[1].factors == (float(np.float32(two / stale)),
                                          float(np.float32(two)))

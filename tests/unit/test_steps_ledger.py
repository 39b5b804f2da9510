"""The hub's step ledger (gradstar.coordinator.steps.ledger), without sockets: when steps close
in each sync mode, what their aggregates are, staleness, liveness, barriers and memory."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from gradstar.coordinator.steps.records import Contributed, LedgerSummary
from gradstar.coordinator.steps.table import StepsTable
from gradstar.errors import (
    ConfigurationError,
    HubCapacityError,
    StepMismatchError,
    StepsBehindError,
)
from gradstar.sync_modes import (
    Asynchronous,
    BoundedStaleness,
    Quorum,
    Synchronous,
    check_mode,
    from_message,
)

N = 4  # elements per gradient


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(clock=None, **kw) -> StepsTable:
    kw.setdefault("max_numel", 1 << 20)
    kw.setdefault("max_held_bytes", 1 << 24)
    kw.setdefault("lease", 5.0)
    return StepsTable(clock=clock or Clock(), **kw)


def grad(value: float) -> np.ndarray:
    return np.full(N, value, dtype=np.float32)


def give(t: StepsTable, ledger, rank: int, mode, value: float, base: int | None = None,
         weight: float = 1.0):
    base = ledger.ranks[rank].base if base is None else base
    return ledger.contribute(rank, mode, 0, base, weight, grad(value))


def catch_up(t: StepsTable, ledger, rank: int) -> None:
    ledger.fetch(rank, ledger.ranks[rank].base)


def test_quorum_closes_with_all_live_ranks_at_once():
    t = table()
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=2, timeout=10.0)
    for rank in range(3):
        assert give(t, ledger, rank, mode, rank) == Contributed(True, 1, 0)
    assert ledger.steps == 1
    np.testing.assert_array_equal(ledger.log[-1].aggregate, grad(1.0))


def test_quorum_closes_with_min_ranks_after_the_timeout_and_drops_the_late_one():
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=2, timeout=0.5)
    give(t, ledger, 0, mode, 1.0)
    give(t, ledger, 1, mode, 3.0)
    assert ledger.steps == 0  # two of three, before the timeout
    clock.now = 0.6
    t.close_due()
    assert ledger.steps == 1 and ledger.log[-1].ranks == (0, 1)
    # min_ranks gradients make a full step: the default "share" leaves its mean as it is.
    assert ledger.log[-1].factors == (0.5, 0.5)
    np.testing.assert_array_equal(ledger.log[-1].aggregate, grad(2.0))
    dropped = give(t, ledger, 2, mode, 100.0)  # computed on base 0
    assert not dropped.accepted and dropped.staleness == 1 and "Quorum" in dropped.reason
    assert ledger.ranks[2].dropped == 1 and ledger.open.contributions == {}


def test_a_plain_quorum_takes_the_mean_as_it_is_and_the_barrier_tail_is_scaled_by_default():
    # The straggler's tail: the fast ranks wait in synchronize() and each of the slow rank's
    # gradients closes a step alone. By default (share) it is a third of a full step (of
    # min_ranks = 3), as its gradient in one; "plain" (the rule before) takes it whole.
    third = float(np.float32(1 / 3))
    for scaling, factor in (("share", third), ("plain", 1.0)):
        t = table()
        ledger = t.ledger("j", "m", 4)
        mode = Quorum(min_ranks=3, timeout=0.0, scaling=scaling)
        for rank in (0, 1, 2):
            assert ledger.synchronize(rank, 1, None) is None  # waiting at the barrier
        give(t, ledger, 3, mode, 8.0)
        assert ledger.steps == 1 and ledger.log[-1].ranks == (3,)
        assert ledger.log[-1].factors == (factor,)
        np.testing.assert_array_equal(ledger.log[-1].aggregate,
                                      grad(np.float32(8.0) * np.float32(factor)))


def test_quorum_needs_only_the_live_ranks_when_fewer_than_min_ranks_are_left():
    t = table()
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=3, timeout=0.0)
    t.rank_gone("j", 2, "lost")
    give(t, ledger, 0, mode, 1.0)
    assert ledger.steps == 0
    give(t, ledger, 1, mode, 1.0)
    assert ledger.steps == 1  # every live rank contributed


def test_quorums_adaptive_timeout_is_twice_the_recent_spread_to_min_ranks():
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=2)  # timeout=None: it adapts
    assert mode.timeout is None and from_message(mode.message()) == mode
    give(t, ledger, 0, mode, 1.0)
    clock.now = 0.1
    give(t, ledger, 1, mode, 1.0)
    assert ledger.deadline() is None  # nothing measured yet: the first step waits for all
    clock.now = 5.0
    t.close_due()
    assert ledger.steps == 0
    clock.now = 5.15
    give(t, ledger, 2, mode, 1.0)
    assert ledger.steps == 1 and ledger.arrivals[-1] == pytest.approx((0.0, 0.1, 5.15))
    # Rank 2 was 5 s behind the others, who took 0.1 s to the second gradient: wait 0.2 s.
    for rank, at in ((0, 6.0), (1, 6.05)):
        clock.now = at
        catch_up(t, ledger, rank)
        give(t, ledger, rank, mode, 2.0)
    assert ledger.deadline() == pytest.approx(6.2)
    clock.now = 6.19
    t.close_due()
    assert ledger.steps == 1  # not yet: the missing rank is not later than the spread
    clock.now = 6.2
    t.close_due()
    assert ledger.steps == 2 and ledger.log[-1].ranks == (0, 1)
    late = give(t, ledger, 2, mode, 3.0, base=0)  # rank 2 computed before step 1 closed
    assert not late.accepted and ledger.ranks[2].dropped == 1
    # A fixed timeout ignores the spread.
    assert Quorum(2, 0.5).deadline(1.0, ledger.arrivals, 3) == 1.5
    assert Quorum(2).wait([(0.0, 0.1), (0.0, 0.3), (0.0, 0.2), (0.0,)]) == pytest.approx(0.4)


def test_weighted_mean_in_rank_order_whatever_the_arrival_order():
    aggregates = []
    for order in ([0, 1, 2], [2, 0, 1]):
        t = table()
        ledger = t.ledger("j", "m", 3)
        mode = Quorum(min_ranks=3, timeout=0.0)
        values = {0: np.float32(0.1), 1: np.float32(1e7), 2: np.float32(-1e7)}
        weights = {0: 1.0, 1: 2.0, 2: 2.0}
        for rank in order:
            ledger.contribute(rank, mode, 0, 0, weights[rank], grad(values[rank]))
        aggregates.append(ledger.log[-1].aggregate)
    np.testing.assert_array_equal(aggregates[0], aggregates[1])
    want = (grad(0.1) * np.float32(1.0) + grad(1e7) * np.float32(2.0)
            + grad(-1e7) * np.float32(2.0)) / np.float32(5.0)
    np.testing.assert_array_equal(aggregates[0], want)


def test_zero_weights_make_a_zero_aggregate():
    t = table()
    ledger = t.ledger("j", "m", 2)
    mode = Quorum(min_ranks=2, timeout=0.0)
    give(t, ledger, 0, mode, 5.0, weight=0.0)
    give(t, ledger, 1, mode, 7.0, weight=0.0)
    np.testing.assert_array_equal(ledger.log[-1].aggregate, grad(0.0))


def test_asynchronous_a_ranks_next_gradient_closes_the_step_its_previous_one_is_in():
    t = table()
    ledger = t.ledger("j", "m", 3)
    # timeout=0: a rank does not wait for its own step (the rule before the adaptive wait).
    mode = Asynchronous(scaling="plain", timeout=0)  # the weighted mean as it is
    give(t, ledger, 0, mode, 1.0)
    give(t, ledger, 1, mode, 3.0)
    assert ledger.steps == 0  # rank 2 has not contributed: nobody pushed yet
    assert give(t, ledger, 0, mode, 5.0, base=0) == Contributed(True, 2, 1)  # rank 0 again
    assert ledger.steps == 1 and ledger.log[-1].ranks == (0, 1)
    np.testing.assert_array_equal(ledger.log[-1].aggregate, grad(2.0))
    give(t, ledger, 2, mode, 7.0, base=0)  # slow rank 2 joins step 2, one step stale
    assert ledger.steps == 1
    give(t, ledger, 0, mode, 9.0, base=1)  # rank 0 again: closes step 2 without rank 1
    assert ledger.steps == 2 and ledger.log[-1].ranks == (0, 2)
    assert ledger.log[-1].staleness == (1, 1)
    for rank in (1, 2):  # every live rank in the open step: it closes at once
        give(t, ledger, rank, mode, 1.0, base=2)
    assert ledger.steps == 3 and ledger.log[-1].ranks == (0, 1, 2)


def schedule(t: StepsTable, ledger, mode) -> None:
    """A fixed schedule of arrivals of 3 ranks: step 1 = ranks 0 and 1 (values 1, 3; fresh),
    step 2 = ranks 0 and 2 (5, 7; each one step stale), step 3 = all three (9 one step stale,
    1 and 1 fresh)."""
    give(t, ledger, 0, mode, 1.0)
    give(t, ledger, 1, mode, 3.0)
    give(t, ledger, 0, mode, 5.0, base=0)  # closes step 1
    give(t, ledger, 2, mode, 7.0, base=0)
    give(t, ledger, 0, mode, 9.0, base=1)  # closes step 2
    for rank in (1, 2):
        give(t, ledger, rank, mode, 1.0, base=2)  # step 3 has every live rank: it closes


# Each step's factors by hand: share = contributions / live ranks (3), staleness = 1 / (1 + s),
# times each weight's share (1/2, 1/2, then 1/3 each).
BY_HAND = {
    "plain": [(1 / 2, 1 / 2), (1 / 2, 1 / 2), (1 / 3, 1 / 3, 1 / 3)],
    "share": [(1 / 3, 1 / 3), (1 / 3, 1 / 3), (1 / 3, 1 / 3, 1 / 3)],
    "staleness": [(1 / 2, 1 / 2), (1 / 4, 1 / 4), (1 / 6, 1 / 3, 1 / 3)],
    "share+staleness": [(1 / 3, 1 / 3), (1 / 6, 1 / 6), (1 / 6, 1 / 3, 1 / 3)],
}


@pytest.mark.parametrize("scaling", sorted(BY_HAND))
@pytest.mark.parametrize("make", [Asynchronous, lambda **kw: BoundedStaleness(4, **kw)])
def test_each_steps_scaling_is_the_hand_computed_one_for_a_fixed_schedule(make, scaling):
    t = table()
    ledger = t.ledger("j", "m", 3)
    schedule(t, ledger, make(scaling=scaling, timeout=0))  # the pushes close the steps
    values = [(1.0, 3.0), (5.0, 7.0), (9.0, 1.0, 1.0)]
    assert [s.ranks for s in ledger.log] == [(0, 1), (0, 2), (0, 1, 2)]
    assert [s.staleness for s in ledger.log] == [(0, 0), (1, 1), (1, 0, 0)]
    for step, factors, vs in zip(ledger.log, BY_HAND[scaling], values, strict=True):
        assert step.factors == tuple(float(np.float32(f)) for f in factors)
        expected = np.float32(0)
        for f, v in zip(factors, vs, strict=True):  # as the hub: float32, rank order
            expected = np.float32(expected + np.float32(v) * np.float32(f))
        np.testing.assert_array_equal(step.aggregate, np.full(N, expected, np.float32))


@pytest.mark.parametrize("make", [Asynchronous, lambda: BoundedStaleness(2)])
def test_the_default_rule_waits_the_spread_then_carries_the_late_gradient_scaled_by_hand(make):
    # The defaults (adaptive timeout, share+staleness) for a fixed schedule of arrivals of 3
    # ranks: step 1 waits for every rank (nothing measured yet); rank 2 is then 1 s late,
    # past twice the others' spread to their 2nd gradient (0.1 s): step 2 closes at 0.2 s
    # without it, and its gradient joins step 3, two steps stale (steps 1 and 2 closed).
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 3)
    mode = make()
    for rank, at, value in ((0, 0.0, 1.0), (1, 0.1, 3.0), (2, 0.2, 5.0)):
        clock.now = at
        give(t, ledger, rank, mode, value)
        assert ledger.steps == (1 if rank == 2 else 0)  # no deadline before step 1 closed
    assert ledger.arrivals[-1] == pytest.approx((0.0, 0.1, 0.2))
    for rank, at in ((0, 1.0), (1, 1.1)):
        clock.now = at
        catch_up(t, ledger, rank)
        give(t, ledger, rank, mode, 2.0 + rank)
    assert ledger.deadline() == pytest.approx(1.2)  # 1.0 + 2 x 0.1
    clock.now = 1.19
    t.close_due()
    assert ledger.steps == 1
    clock.now = 1.21
    t.close_due()
    assert ledger.steps == 2 and ledger.log[-1].ranks == (0, 1)
    clock.now = 2.0
    late = give(t, ledger, 2, mode, 7.0, base=0)  # computed before step 1 closed
    assert late == Contributed(True, 3, 2)  # carried, 2 steps stale (steps 1 and 2 closed)
    for rank, at in ((0, 2.05), (1, 2.1)):
        clock.now = at
        catch_up(t, ledger, rank)
        give(t, ledger, rank, mode, 1.0)
    assert ledger.steps == 3 and ledger.log[-1].ranks == (0, 1, 2)
    # Factors by hand: weight share (1/k) x share of the live ranks (k/3) / (1 + staleness).
    expected = [(1 / 3, 1 / 3, 1 / 3), (1 / 3, 1 / 3), (1 / 3, 1 / 3, 1 / 3 / 3)]
    assert [s.staleness for s in ledger.log] == [(0, 0, 0), (0, 0), (0, 0, 2)]
    values = [(1.0, 3.0, 5.0), (2.0, 3.0), (1.0, 1.0, 7.0)]
    for step, factors, vs in zip(ledger.log, expected, values, strict=True):
        assert step.factors == tuple(float(np.float32(f)) for f in factors)
        total = np.float32(0)
        for f, v in zip(factors, vs, strict=True):  # as the hub: float32, rank order
            total = np.float32(total + np.float32(v) * np.float32(f))
        np.testing.assert_array_equal(step.aggregate, grad(total))


@pytest.mark.parametrize("make", [Asynchronous, lambda: BoundedStaleness(2)])
def test_of_two_ranks_the_adaptive_wait_is_twice_the_recent_time_to_the_second(make):
    # Two ranks have no "others' spread" (the time to the first gradient is 0): the step waits
    # twice the recent times to the second gradient, and closes without a rank later than it.
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 2)
    mode = make()
    for start in (0.0, 1.0, 2.0):  # three steps of both ranks, 0.05-0.08 s apart
        for rank, at in ((0, start), (1, start + (0.08 if start == 1.0 else 0.05))):
            clock.now = at
            if ledger.ranks.get(rank) is not None:
                catch_up(t, ledger, rank)
            give(t, ledger, rank, mode, 1.0)
    assert ledger.steps == 3
    assert mode.wait(ledger.arrivals, 2) == pytest.approx(0.16)  # 2 x the 90th pct, 0.08 s
    clock.now = 3.0
    catch_up(t, ledger, 0)
    give(t, ledger, 0, mode, 1.0)
    assert ledger.deadline() == pytest.approx(3.16)
    clock.now = 3.15
    t.close_due()
    assert ledger.steps == 3  # rank 1 is not later than its usual yet
    clock.now = 3.17
    t.close_due()
    assert ledger.steps == 4 and ledger.log[-1].ranks == (0,)
    assert mode.wait([(0.0,)] * 3, 1) == 0.0  # one live rank: its own step closes at once


def test_a_stale_gradient_starts_no_steps_clock_and_is_not_in_the_spread():
    # Rank 2 missed step 2 and its gradient opens step 3 stale: the step's deadline waits for
    # the first fresh gradient (rank 0's, answered just before), so the ranks that were just
    # answered make it; the spread measured is the fresh gradients' only.
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 3)
    mode = Asynchronous(timeout=0.1)
    for rank in range(3):
        give(t, ledger, rank, mode, 1.0)  # step 1: everyone, at once
    for rank in (0, 1):
        catch_up(t, ledger, rank)
        give(t, ledger, rank, mode, 1.0)
    clock.now = 0.2
    t.close_due()
    assert ledger.steps == 2 and ledger.log[-1].ranks == (0, 1)  # rank 2 missed it
    catch_up(t, ledger, 0)
    catch_up(t, ledger, 1)
    assert give(t, ledger, 2, mode, 1.0, base=1).staleness == 1  # opens step 3, stale
    assert ledger.open.first_at is None and ledger.deadline() is None
    clock.now = 5.0
    t.close_due()
    assert ledger.steps == 2  # no clock: it waits for the others' fresh gradients
    give(t, ledger, 0, mode, 1.0)
    assert ledger.deadline() == pytest.approx(5.1)  # from rank 0's arrival
    clock.now = 5.05
    give(t, ledger, 1, mode, 1.0)
    assert ledger.steps == 3 and ledger.log[-1].ranks == (0, 1, 2)
    assert ledger.arrivals[-1] == pytest.approx((0.0, 0.05))  # the fresh ones' spread


def test_bounded_staleness_past_its_deadline_still_waits_for_a_rank_at_the_bound():
    # The deadline passed, but closing would leave rank 1's next gradient 2 stale, over the
    # bound of 1: the step stays open until rank 1 fetched (its base moved up).
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 2)
    mode = BoundedStaleness(1, timeout=0.1)
    give(t, ledger, 0, mode, 1.0)
    clock.now = 0.05
    give(t, ledger, 1, mode, 1.0)  # step 1: both
    catch_up(t, ledger, 0)
    give(t, ledger, 0, mode, 1.0)  # step 2 open; rank 1 still at base 0 (not fetched)
    ledger.ranks[1].pending = False  # it is computing on base 0 (it fetched nothing)
    clock.now = 1.0
    t.close_due()
    assert ledger.steps == 1  # past the deadline, held by the bound
    catch_up(t, ledger, 1)  # rank 1 is at step 1 now: closing leaves it 1 behind
    assert ledger.steps == 2 and ledger.log[-1].ranks == (0,)


def test_the_default_scaling_is_the_share_of_the_live_ranks_over_one_plus_staleness():
    assert Asynchronous() == Asynchronous(scaling="share+staleness")
    assert BoundedStaleness(2) == BoundedStaleness(2, scaling="share+staleness")
    t = table()
    ledger = t.ledger("j", "m", 4)
    t.rank_gone("j", 3, "lost")  # 3 live ranks: a step of 2 of them is 2/3 of a full one
    mode = Asynchronous(timeout=0)  # the default scaling; the pushes close the steps
    give(t, ledger, 0, mode, 3.0)
    give(t, ledger, 1, mode, 6.0)
    give(t, ledger, 0, mode, 2.0, base=0)  # closes step 1; joins step 2, 1 stale
    give(t, ledger, 2, mode, 9.0, base=1)  # fresh
    give(t, ledger, 0, mode, 0.0, base=1)  # closes step 2
    third = np.float32(1 / 3)
    np.testing.assert_array_equal(ledger.log[0].aggregate, grad(
        np.float32(3.0) * third + np.float32(6.0) * third))
    # Step 2: rank 0's gradient 1 step stale (1/3 / 2), rank 2's fresh (1/3).
    assert ledger.log[1].factors == (float(np.float32(1 / 6)), float(third))
    np.testing.assert_array_equal(ledger.log[1].aggregate, grad(
        np.float32(2.0) * np.float32(1 / 6) + np.float32(9.0) * third))
    with pytest.raises(ConfigurationError, match="scaling"):
        Asynchronous(scaling="lr")


def test_module_buffers_after_the_gradient_are_averaged_never_scaled():
    # 2 gradient values, then 2 buffer values (BatchNorm's statistics): a step of 1 of 2 live
    # ranks scales the gradient by 1/2 and keeps the buffers' mean as it is.
    t = table()
    ledger = t.ledger("j", "m", 2)
    mode = Asynchronous(timeout=0)
    data = np.array([4.0, 8.0, 10.0, 3.0], np.float32)
    ledger.contribute(0, mode, 0, 0, 1.0, data, buffers=2)
    ledger.contribute(0, mode, 0, 0, 1.0, data, buffers=2)  # its push closes step 1 alone
    np.testing.assert_array_equal(ledger.log[0].aggregate, [2.0, 4.0, 10.0, 3.0])
    with pytest.raises(StepMismatchError, match="buffer values"):
        ledger.contribute(1, mode, 0, 0, 1.0, data, buffers=1)


def test_bounded_staleness_waits_for_a_rank_that_would_fall_too_far_behind():
    t = table()
    ledger = t.ledger("j", "m", 2)
    mode = BoundedStaleness(max_staleness=2, timeout=0)  # pushes: no wait for its own step
    give(t, ledger, 0, mode, 1.0)
    for expected in (1, 2):  # rank 0 runs ahead twice; rank 1 computes on base 0
        assert not ledger.must_wait(0)
        give(t, ledger, 0, mode, 1.0)
        assert ledger.steps == expected
    # A third step would leave rank 1's gradient 3 stale: rank 0's next one waits.
    assert ledger.must_wait(0)
    assert give(t, ledger, 1, mode, 5.0, base=0) == Contributed(True, 3, 2)
    assert not ledger.must_wait(0)
    give(t, ledger, 0, mode, 1.0)
    assert ledger.steps == 3 and ledger.log[-1].ranks == (0, 1)


def test_bounded_staleness_never_exceeds_its_bound_under_a_random_schedule():
    rng = random.Random(7)
    for bound in (0, 1, 3):
        t = table()
        ledger = t.ledger("j", "m", 4)
        mode = BoundedStaleness(max_staleness=bound, timeout=0)
        joined: dict[int, int] = {}  # rank -> step its gradient joined, until it catches up
        for _ in range(400):
            rank = rng.randrange(4)  # the next rank to act, at random
            if rank in joined:
                if ledger.steps >= joined[rank]:  # its step closed: apply, compute again
                    catch_up(t, ledger, rank)
                    del joined[rank]
                continue
            if ledger.must_wait(rank):
                continue  # the hub holds its call: another rank acts meanwhile
            taken = give(t, ledger, rank, mode, 1.0)
            assert taken.accepted and taken.staleness <= bound
            if rng.random() < 0.5:  # a rank fetches what closed, or pushes its next gradient
                catch_up(t, ledger, rank)
            joined[rank] = taken.step
        assert max(ledger.staleness) <= bound
        assert ledger.steps > 20


def test_a_rank_that_left_the_live_set_holds_nobody_and_comes_back_by_calling():
    clock = Clock()
    t = table(clock, lease=2.0)
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=3, timeout=0.0)
    give(t, ledger, 0, mode, 1.0)
    give(t, ledger, 1, mode, 1.0)
    clock.now = 1.0
    ledger.heartbeat(0, 0)
    ledger.heartbeat(1, 0)
    clock.now = 2.5
    t.expire()  # rank 2 silent for 2.5 s
    assert not ledger.ranks[2].live and ledger.steps == 1
    ledger.heartbeat(2, 0)
    assert ledger.ranks[2].live


def test_synchronize_closes_the_open_step_once_every_live_rank_arrived():
    t = table()
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=3, timeout=100.0)
    give(t, ledger, 0, mode, 1.0)
    assert ledger.synchronize(0, 1) is None
    assert ledger.synchronize(1, 1) is None
    assert ledger.steps == 0
    t.rank_gone("j", 2, "lost")  # the last one dies: the barrier completes without it
    assert ledger.steps == 1 and ledger.barriers[1].steps == 1
    assert ledger.synchronize(0, 1).steps == 1


def test_bad_contributions_are_named_and_leave_the_open_step_alone():
    t = table()
    ledger = t.ledger("j", "m", 2)
    mode = Quorum(min_ranks=2, timeout=0.0)
    give(t, ledger, 0, mode, 1.0)
    bad = [
        (lambda: give(t, ledger, 0, mode, 2.0), "twice"),
        (lambda: give(t, ledger, 1, mode, 2.0, weight=-1.0), "weight"),
        (lambda: give(t, ledger, 1, mode, 2.0, weight=float("nan")), "weight"),
        (lambda: give(t, ledger, 1, mode, 2.0, base=5), "only 0 steps"),
        (lambda: ledger.contribute(1, mode, 0, 0, 1.0, np.zeros(N + 1, np.float32)),
         "values"),
        (lambda: give(t, ledger, 1, Quorum(min_ranks=1, timeout=0.0), 2.0), "same mode"),
        (lambda: give(t, ledger, 1, Asynchronous(), 2.0), "same mode"),
        (lambda: t.ledger("j", "m", 1), "2 ranks"),  # a job shrinks by ranks leaving
        (lambda: ledger.fetch(1, 3), "only 0 steps"),
        (lambda: ledger.seen(7), "not in"),
    ]
    for call, words in bad:
        with pytest.raises(StepMismatchError, match=words):
            call()
    assert list(ledger.open.contributions) == [0] and ledger.steps == 0
    give(t, ledger, 1, mode, 3.0)
    np.testing.assert_array_equal(ledger.log[-1].aggregate, grad(2.0))


def test_a_mode_switches_only_at_a_barrier_every_live_rank_asked_it_at():
    t = table()
    ledger = t.ledger("j", "m", 2)
    q = Quorum(min_ranks=2, timeout=0.0)
    give(t, ledger, 0, q, 1.0)
    # A contribution never switches: another mode, or a later epoch, is refused as it is.
    for mode, epoch in ((Asynchronous(), 0), (Asynchronous(), 1), (q, 2**64 - 1)):
        with pytest.raises(StepMismatchError, match="switch"):
            ledger.contribute(1, mode, epoch, 0, 1.0, grad(1.0))
        assert (ledger.mode, ledger.mode_epoch) == (q, 0)
    give(t, ledger, 1, q, 1.0)
    catch_up(t, ledger, 0)
    catch_up(t, ledger, 1)
    # Rank 0 asks for Asynchronous at barrier 1, rank 1 for nothing: no switch, said so.
    assert ledger.synchronize(0, 1, Asynchronous()) is None
    outcome = ledger.synchronize(1, 1)
    assert (outcome.mode, outcome.mode_epoch) == (q, 0)
    assert "rank 0: Asynchronous" in outcome.refused and "rank 1: no switch" in outcome.refused
    # Both ask at barrier 2: the hub switches and hands out epoch 1.
    assert ledger.synchronize(0, 2, Asynchronous()) is None
    outcome = ledger.synchronize(1, 2, Asynchronous())
    assert (outcome.mode, outcome.mode_epoch, outcome.refused) == (Asynchronous(), 1, "")
    assert ledger.synchronize(0, 2, Asynchronous()) == outcome  # asked again: the same
    with pytest.raises(StepMismatchError, match="switch"):
        ledger.contribute(0, Asynchronous(), 0, ledger.steps, 1.0, grad(1.0))
    before = ledger.steps
    # Taken at the new epoch (the frozen clock's spread is 0: its step closes at once).
    assert ledger.contribute(0, Asynchronous(), 1, ledger.steps, 1.0, grad(1.0)).accepted
    assert ledger.steps == before + 1 and ledger.log[-1].ranks == (0,)


def test_extreme_finite_weights_give_the_exact_weighted_mean():
    t = table()
    ledger = t.ledger("j", "m", 2)
    mode = Quorum(min_ranks=2, timeout=0.0)
    cases = [((1.0, 1e39), 2.0), ((1e-46, 1e-46), 1.5), ((1e308, 1e308), 1.5),
             ((0.0, 5e-324), 2.0), ((3.0, 1.0), 1.25)]
    for (w0, w1), expected in cases:
        ledger.contribute(0, mode, 0, ledger.steps, w0, grad(1.0))
        ledger.contribute(1, mode, 0, ledger.steps, w1, grad(2.0))
        got = ledger.log[-1].aggregate
        assert np.isfinite(got).all(), (w0, w1)
        np.testing.assert_allclose(got, grad(expected), rtol=1e-6)


def test_a_refused_header_leaves_the_ledger_as_it_was():
    t = table()
    ledger = t.ledger("j", "m", 2)
    before = (ledger.mode, ledger.mode_epoch, ledger.numel, ledger.wire, ledger.hyper_len)
    # A header the check passes, then data that never comes (the servicer reads it after):
    ledger.check_header(1, Asynchronous(), 0, N, 0, 1.0)
    with pytest.raises(StepMismatchError):
        ledger.check_header(1, Asynchronous(), 2**64 - 1, N, 0, 1.0)
    assert (ledger.mode, ledger.mode_epoch, ledger.numel, ledger.wire,
            ledger.hyper_len) == before
    give(t, ledger, 0, Quorum(min_ranks=2, timeout=0.0), 1.0)  # an honest rank still names the mode
    assert ledger.mode == Quorum(min_ranks=2, timeout=0.0)


def test_ranks_expiring_together_settle_each_ledger_once(monkeypatch):
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 8000)
    settles = []

    def counted(led):
        real = led.settle
        monkeypatch.setattr(led, "settle", lambda: (settles.append(led), real()))

    counted(ledger)
    clock.now = 100.0
    t.expire()
    assert not ledger.live() and len(settles) == 1
    # Lost through the rendezvous one by one, with settling put off as the servicer does.
    other = t.ledger("j2", "m", 4000)
    counted(other)
    put_off = []
    t.defer = put_off.append
    for rank in range(4000):
        t.rank_gone("j2", rank, "lost")
    assert len(put_off) == 1 and not other.live()
    put_off[0]()
    assert len(settles) == 2


def test_history_and_memory_are_bounded():
    t = table(history=3, max_held_bytes=10 * N * 4)
    ledger = t.ledger("j", "m", 2)
    mode = Asynchronous()
    t.rank_gone("j", 1, "lost")
    for _ in range(20):
        give(t, ledger, 0, mode, 1.0)
        catch_up(t, ledger, 0)
    assert len(ledger.log) == 3 and t.held_bytes == 3 * N * 4
    with pytest.raises(StepsBehindError, match="from step 18"):
        ledger.fetch(1, 0)
    big = table(max_held_bytes=N * 4)
    ledger = big.ledger("j", "m", 2)
    give(big, ledger, 0, Quorum(min_ranks=2, timeout=0.0), 1.0)
    with pytest.raises(HubCapacityError, match="refused"):
        give(big, ledger, 1, Quorum(min_ranks=2, timeout=0.0), 1.0)
    assert big.drop_idle(0.0) == ["j"] and big.held_bytes == 0


def test_modes_are_values_that_travel_and_are_checked():
    for mode in (Synchronous(), Quorum(3, 0.5), BoundedStaleness(2), Asynchronous()):
        assert from_message(mode.message()) == mode
        assert check_mode(mode) is mode
    for bad in (lambda: Quorum(0), lambda: Quorum(2, -1.0), lambda: Quorum(2, float("inf")),
                lambda: BoundedStaleness(-1), lambda: BoundedStaleness(1.5),
                lambda: check_mode("quorum")):
        with pytest.raises(ConfigurationError):
            bad()


def test_a_rank_waiting_at_a_barrier_catches_up_past_the_history():
    table = StepsTable(max_numel=1 << 20, max_held_bytes=1 << 30, lease=15.0, history=8)
    ledger = table.ledger("job", "ddp", 2)
    assert ledger.synchronize(0, 1) is None  # rank 0 is done at once and waits
    for have in range(20):  # rank 1 steps on alone, far past the history
        assert ledger.contribute(1, Asynchronous(), 0, have, 1.0, grad(1.0)).accepted
        assert [s.number for s in ledger.fetch(1, have)] == [have + 1]
    assert ledger.synchronize(1, 1).steps == 20
    assert [s.number for s in ledger.fetch(0, 0)] == list(range(1, 21))
    # Once every live rank applied them, the log is back to its history.
    for rank in (0, 1):
        ledger.contribute(rank, Asynchronous(), 0, 20, 1.0, grad(1.0))
    assert len(ledger.log) == 8


def step_all(t: StepsTable, ledger, ranks, mode) -> None:
    """Each of ``ranks`` contributes once and catches up: one step closes."""
    for rank in ranks:
        give(t, ledger, rank, mode, float(rank))
    for rank in ranks:
        catch_up(t, ledger, rank)


def test_a_rank_asked_for_a_snapshot_that_dies_hands_the_request_on():
    t = table()
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=2, timeout=0.0)
    step_all(t, ledger, [0, 1, 2], mode)
    assert ledger.wants_snapshot(0, t.clock())  # the lowest live rank
    assert not ledger.wants_snapshot(0, t.clock())  # asked already
    t.rank_gone("j", 0, "lost")  # before it sent anything
    assert not ledger.wants_snapshot(2, t.clock())
    assert ledger.wants_snapshot(1, t.clock())  # the next lowest, at once, not after the patience


def test_a_rank_that_does_not_send_is_asked_again_after_a_snapshot_interval_of_steps():
    from gradstar.coordinator.steps.ledger import SNAPSHOT_EVERY

    t = table()
    ledger = t.ledger("j", "m", 2)
    mode = Quorum(min_ranks=2, timeout=0.0)
    step_all(t, ledger, [0, 1], mode)
    assert ledger.wants_snapshot(0, t.clock())
    for _ in range(SNAPSHOT_EVERY - 1):
        step_all(t, ledger, [0, 1], mode)
        assert not ledger.wants_snapshot(0, t.clock())
    step_all(t, ledger, [0, 1], mode)
    assert ledger.wants_snapshot(0, t.clock())  # well within the patience in seconds


def test_a_snapshot_older_than_the_log_is_not_joinable_until_a_fresh_one_comes():
    t = table(history=4)
    ledger = t.ledger("j", "m", 2)
    mode = Quorum(min_ranks=2, timeout=0.0)
    step_all(t, ledger, [0, 1], mode)
    ledger.put_snapshot(0, 1, "{}", b"state at 1")
    assert ledger.joinable()
    for _ in range(8):  # the log keeps 4: step 2, the first after the snapshot, goes
        step_all(t, ledger, [0, 1], mode)
    assert ledger.first_logged() > 2 and not ledger.joinable()
    ledger.put_snapshot(0, ledger.steps, "{}", b"state now")
    assert ledger.joinable()


def test_a_step_carries_its_contributions_weighted_mean_hyperparameters():
    t = table()
    ledger = t.ledger("j", "m", 2)
    q = Quorum(min_ranks=2, timeout=0.0)
    ledger.contribute(0, q, 0, 0, 1.0, grad(1), hyper=(0.1, 0.9))
    ledger.contribute(1, q, 0, 0, 3.0, grad(1), hyper=(0.5, 0.9))
    assert ledger.log[-1].hyper == pytest.approx((0.4, 0.9))  # (0.1 + 3 * 0.5) / 4
    for bad, match in (((0.1,), "carry 2"), ((float("nan"), 0.9), "not finite"),
                       ((0.1, float("inf")), "not finite")):
        with pytest.raises(StepMismatchError, match=match):
            ledger.contribute(0, q, 0, 1, 1.0, grad(1), hyper=bad)
    assert not ledger.open.contributions  # the refused ones left nothing


def test_a_ledger_grows_with_its_job_and_counts_the_new_rank_from_its_first_call():
    t = table()
    ledger = t.ledger("j", "m", 2)
    q = Quorum(min_ranks=3, timeout=0.0)  # as many as are live, while fewer are
    give(t, ledger, 0, q, 1.0)
    give(t, ledger, 1, q, 3.0)
    assert ledger.steps == 1
    assert t.ledger("j", "m", 3) is ledger and ledger.world_size == 3
    assert not ledger.ranks[2].live and ledger.ranks[2].base == 1  # holds no step back yet
    for r in (0, 1):
        catch_up(t, ledger, r)
    give(t, ledger, 0, q, 1.0)
    give(t, ledger, 1, q, 1.0)
    assert ledger.steps == 2  # closed by the two live ranks
    catch_up(t, ledger, 2)  # its first call: live from here
    for r, value in ((0, 1.0), (1, 2.0), (2, 6.0)):
        catch_up(t, ledger, r)
        give(t, ledger, r, q, value)
    assert ledger.steps == 3 and ledger.log[-1].ranks == (0, 1, 2)
    np.testing.assert_array_equal(ledger.log[-1].aggregate, grad(3.0))


def test_the_summary_is_a_named_record_of_the_ledger():
    t = table()
    ledger = t.ledger("j", "m", 3)
    schedule(t, ledger, Asynchronous(scaling="plain", timeout=0))  # the push rule
    view = ledger.summary()
    assert isinstance(view, LedgerSummary)
    assert (view.job, view.model, view.steps, view.live, view.world_size) == (
        "j", "m", 3, (0, 1, 2), 3)
    # Steps 1 and 3 took two fresh contributions each; step 2 and rank 0's in step 3, stale.
    assert view.staleness == {0: 4, 1: 3} and view.dropped == 0
    assert view.open_contributions == 0 and view.snapshot_steps is None
    assert [(r.rank, r.live, r.contributed, r.dropped) for r in view.ranks] == [
        (0, True, 3, 0), (1, True, 2, 0), (2, True, 2, 0)]
    assert view.ranks[0].staleness == {0: 1, 1: 2}
    assert t.summaries("j") == [view] and t.summaries("other") == []
    with pytest.raises(AttributeError):
        view.steps = 4  # frozen: what operators read cannot change under them


def test_a_rank_that_finished_is_no_warning_and_a_silent_one_is(caplog):
    clock = Clock()
    t = table(clock)
    ledger = t.ledger("j", "m", 3)
    mode = Quorum(min_ranks=1, timeout=10.0)
    for rank in range(3):
        give(t, ledger, rank, mode, 1.0)
    with caplog.at_level(logging.INFO, logger="gradstar.coordinator.steps.ledger"):
        ledger.heartbeat(1, ledger.steps, leave=True)  # an orderly close
        clock.now = 6.0  # past the 5 s lease: rank 2 said nothing
        ledger.heartbeat(0, ledger.steps)
        t.expire()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.INFO, "job 'j': rank 1 left the live set of the steps of model 'm' (left); "
                       "the others go on"),
        (logging.WARNING, "job 'j': rank 2 left the live set of the steps of model 'm' "
                          "(silent for 6.0 s); the others go on")]

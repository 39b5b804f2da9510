"""Pipeline schedules without sockets: action order, warm-up, memory bound, deadlock freedom."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradstar.client.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    Action,
    gpipe,
    one_f_one_b,
    peak_live,
    schedule_actions,
    simulate,
    split_sizes,
    warmup_forwards,
)
from gradstar.errors import ConfigurationError

shapes = st.integers(1, 8).flatmap(
    lambda stages: st.tuples(st.just(stages), st.integers(0, stages - 1), st.integers(1, 24)))


def names(actions) -> str:
    return " ".join(str(a) for a in actions)


def test_gpipe_runs_every_forward_then_every_backward():
    assert names(gpipe(4, 1, 3)) == "F0 F1 F2 B0 B1 B2"


def test_1f1b_on_4_stages_with_8_micro_batches():
    assert names(one_f_one_b(4, 0, 8)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert names(one_f_one_b(4, 1, 8)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert names(one_f_one_b(4, 2, 8)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert names(one_f_one_b(4, 3, 8)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


def test_1f1b_with_fewer_micro_batches_than_warm_up_is_gpipe():
    assert one_f_one_b(6, 0, 3) == gpipe(6, 0, 3)


@given(shapes)
def test_every_micro_batch_runs_forward_then_backward_once_in_order(shape):
    stages, stage, m = shape
    for actions in (gpipe(stages, stage, m), one_f_one_b(stages, stage, m)):
        assert sorted(actions) == sorted(
            [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)])
        forwards = [a.micro for a in actions if a.kind == FORWARD]
        backwards = [a.micro for a in actions if a.kind == BACKWARD]
        assert forwards == backwards == list(range(m))
        assert all(actions.index(Action(FORWARD, i)) < actions.index(Action(BACKWARD, i))
                   for i in range(m))


@given(shapes)
def test_1f1b_warms_up_with_stages_minus_r_minus_1_forwards_then_alternates(shape):
    stages, stage, m = shape
    actions = one_f_one_b(stages, stage, m)
    warmup = warmup_forwards(stages, stage, m)
    assert warmup == min(stages - stage - 1, m)
    first_backward = next(i for i, a in enumerate(actions) if a.kind == BACKWARD)
    assert first_backward == (warmup + 1 if warmup < m else m)
    steady = actions[warmup:warmup + 2 * (m - warmup)]
    assert [a.kind for a in steady] == [FORWARD, BACKWARD] * (m - warmup)
    assert all(a.kind == BACKWARD for a in actions[warmup + 2 * (m - warmup):])


@given(shapes)
def test_1f1b_keeps_at_most_stages_minus_r_alive_and_gpipe_keeps_all(shape):
    stages, stage, m = shape
    assert peak_live(one_f_one_b(stages, stage, m)) == min(stages - stage, m)
    assert peak_live(one_f_one_b(stages, stage, m)) <= stages - stage
    assert peak_live(gpipe(stages, stage, m)) == m


@given(st.integers(1, 8), st.integers(1, 24))
def test_both_schedules_finish_without_deadlock_in_the_same_time(stages, m):
    for build in (gpipe, one_f_one_b):
        assert simulate([build(stages, s, m) for s in range(stages)]) == 2 * (m + stages - 1)


def test_the_simulator_finds_a_deadlock():
    # Stage 1 of 2 wants the backward of micro-batch 1 before its forward of micro-batch 0.
    bad = [gpipe(2, 0, 2), [Action(BACKWARD, 1), *gpipe(2, 1, 2)]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad)


def test_schedule_actions_names_the_schedules():
    assert schedule_actions("gpipe", 3, 0, 2) == gpipe(3, 0, 2)
    assert schedule_actions("1f1b", 3, 0, 2) == one_f_one_b(3, 0, 2)
    with pytest.raises(ConfigurationError, match="unknown pipeline schedule 'pipedream'"):
        schedule_actions("pipedream", 3, 0, 2)
    with pytest.raises(ConfigurationError, match="out of range"):
        schedule_actions("gpipe", 3, 3, 2)
    with pytest.raises(ConfigurationError, match="at least 1"):
        schedule_actions("1f1b", 3, 0, 0)


@given(st.integers(1, 40).flatmap(lambda m: st.tuples(st.just(m), st.integers(m, 500))))
def test_split_sizes_are_equal_but_the_last_which_takes_the_remainder(shape):
    m, batch = shape
    sizes = split_sizes(batch, m)
    assert len(sizes) == m and sum(sizes) == batch
    assert sizes[:-1] == [batch // m] * (m - 1)
    assert batch // m <= sizes[-1] < batch // m + m


def test_a_batch_smaller_than_the_micro_batch_count_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="a batch of 3 rows cannot be split into 4"):
        split_sizes(3, 4)

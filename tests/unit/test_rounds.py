"""The rounds state machine (coordinator/rounds/) and Streaming DiLoCo's plan, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from gradstar.client.outer import Schedule, split_fragments
from gradstar.coordinator.rounds import AveragingStore, Policy, RoundsTable
from gradstar.errors import ConfigurationError, HubCapacityError, RoundMismatchError

POLICY = Policy(outer_lr=0.5, outer_momentum=0.0, nesterov=True, min_replicas=2,
                round_timeout=10.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(tmp_path=None, **kw) -> tuple[RoundsTable, Clock]:
    clock = Clock()
    store = AveragingStore(tmp_path)
    t = RoundsTable(store, max_numel=kw.get("max_numel", 1000),
                    max_held_bytes=kw.get("max_held_bytes", 1 << 20), clock=clock)
    return t, clock


def seeded(names=("a", "b", "c"), tmp_path=None, **kw):
    t, clock = table(tmp_path, **kw)
    for n in names:
        t.seed("j", "m", 0, n, np.ones(4, np.float32))
    return t, clock


def vec(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_first_seed_is_the_global_model_and_later_seeds_only_join():
    t, _ = table()
    assert t.seed("j", "m", 0, "a", vec(1, 2)) == 0
    assert t.seed("j", "m", 0, "b", vec(9, 9)) == 0
    np.testing.assert_array_equal(t.global_model("j", "m", 0).params, vec(1, 2))
    assert t.replicas["j"]["a"].joins == t.replicas["j"]["b"].joins == 1


def test_seed_of_another_size_is_refused_with_a_named_error():
    t, _ = table()
    t.seed("j", "m", 0, "a", vec(1, 2))
    with pytest.raises(RoundMismatchError, match="has 2 parameters on the coordinator"):
        t.seed("j", "m", 0, "b", vec(1, 2, 3))


def test_round_closes_when_every_active_replica_contributed():
    t, _ = seeded()
    assert t.contribute("j", "m", 0, "a", 0, POLICY, vec(1, 1, 1, 1)) == (True, 0)
    assert t.contribute("j", "m", 0, "b", 0, POLICY, vec(3, 3, 3, 3)) == (True, 0)
    assert t.contribute("j", "m", 0, "c", 0, POLICY, vec(2, 2, 2, 2)) == (True, 1)
    # mean 2, lr 0.5, no momentum: 1 - 0.5 * 2 = 0
    np.testing.assert_array_equal(t.global_model("j", "m", 0).params, np.zeros(4))
    assert t.fragments[("j", "m", 0)].history[-1].participants == ("a", "b", "c")


def test_deadline_closes_with_the_replicas_present_and_drops_the_missing_one():
    t, clock = seeded()
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(2, 2, 2, 2))
    t.contribute("j", "m", 0, "b", 0, POLICY, vec(2, 2, 2, 2))
    assert t.close_due() == []
    clock.now += 10.0
    assert t.close_due() == [("j", "m", 0)]
    last = t.fragments[("j", "m", 0)].history[-1]
    assert last.participants == ("a", "b") and last.missed == ("c",)
    assert t.replicas["j"]["c"].missed == 1 and not t.replicas["j"]["c"].active
    # The next round does not wait for the dropped replica.
    t.contribute("j", "m", 0, "a", 1, POLICY, vec(0, 0, 0, 0))
    assert t.contribute("j", "m", 0, "b", 1, POLICY, vec(0, 0, 0, 0)) == (True, 2)


def test_below_min_replicas_a_round_stays_open_past_its_deadline():
    t, clock = seeded()
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(2, 2, 2, 2))
    clock.now += 60.0
    assert t.close_due() == []
    assert t.contribute("j", "m", 0, "b", 0, POLICY, vec(2, 2, 2, 2)) == (True, 1)


def test_late_contribution_is_not_taken_and_the_replica_rejoins():
    t, clock = seeded()
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(1, 1, 1, 1))
    t.contribute("j", "m", 0, "b", 0, POLICY, vec(1, 1, 1, 1))
    clock.now += 10.0
    t.close_due()
    assert t.contribute("j", "m", 0, "c", 0, POLICY, vec(5, 5, 5, 5)) == (False, 1)
    record = t.replicas["j"]["c"]
    assert record.late == 1 and record.active
    # Seeding again is a restart: a join.
    assert t.seed("j", "m", 0, "c", np.ones(4, np.float32)) == 1
    assert record.joins == 2


def test_one_join_per_start_whatever_the_number_of_fragments():
    t, _ = table()
    for fragment in range(3):
        t.seed("j", "m", fragment, "a", vec(1, 2))
    assert t.replicas["j"]["a"].joins == 1
    for fragment in range(3):  # restarted
        t.seed("j", "m", fragment, "a", vec(1, 2))
    assert t.replicas["j"]["a"].joins == 2


def test_a_dropped_replica_that_seeds_again_is_counted_as_a_join():
    t, clock = seeded()
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(1, 1, 1, 1))
    t.contribute("j", "m", 0, "b", 0, POLICY, vec(1, 1, 1, 1))
    clock.now += 10.0
    t.close_due()
    t.seed("j", "m", 0, "c", np.ones(4, np.float32))
    assert t.replicas["j"]["c"].joins == 2


def test_the_mean_does_not_depend_on_arrival_order():
    rng = np.random.default_rng(0)
    deltas = {n: rng.standard_normal(64).astype(np.float32) for n in "abc"}
    results = []
    for order in ("abc", "cba", "bca"):
        t, _ = table()
        for n in "abc":
            t.seed("j", "m", 0, n, np.zeros(64, np.float32))
        for n in order:
            t.contribute("j", "m", 0, n, 0, POLICY, deltas[n])
        results.append(t.global_model("j", "m", 0).params.tobytes())
    assert len(set(results)) == 1


def test_outer_nesterov_momentum_stays_on_the_hub():
    t, _ = seeded(names=("a",))
    policy = Policy(0.5, 0.9, True, 1, 10.0)
    t.contribute("j", "m", 0, "a", 0, policy, vec(1, 1, 1, 1))
    t.contribute("j", "m", 0, "a", 1, policy, vec(1, 1, 1, 1))
    # round 0: buf = 1, step = 1 + 0.9 = 1.9; round 1: buf = 1.9, step = 1 + 0.9*1.9 = 2.71
    expected = np.float32(1) - np.float32(0.5) * np.float32(1.9)
    expected = expected - np.float32(0.5) * (np.float32(1) + np.float32(0.9) * np.float32(1.9))
    np.testing.assert_allclose(t.global_model("j", "m", 0).params, expected, rtol=1e-6)


@pytest.mark.parametrize(("change", "match"), [
    ({"number": 5}, "only 0 rounds completed"),
    ({"delta": np.ones(3, np.float32)}, "sent 3 values"),
    ({"policy": Policy(0.1, 0.0, True, 2, 10.0)}, "the round runs with"),
])
def test_mismatched_contributions_are_refused(change, match):
    t, _ = seeded()
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(1, 1, 1, 1))
    args = {"number": 0, "policy": POLICY, "delta": vec(1, 1, 1, 1), **change}
    with pytest.raises(RoundMismatchError, match=match):
        t.contribute("j", "m", 0, "b", args["number"], args["policy"], args["delta"])


def test_contribution_without_a_global_model_says_to_seed_first():
    t, _ = table()
    with pytest.raises(RoundMismatchError, match="seed it first"):
        t.contribute("j", "m", 0, "a", 0, POLICY, vec(1))


def test_memory_bounds_refuse_before_holding():
    t, _ = seeded(max_held_bytes=20, max_numel=4)
    with pytest.raises(HubCapacityError, match="over this coordinator's limit"):
        t.check_numel(5)
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(1, 1, 1, 1))
    with pytest.raises(HubCapacityError, match="holds 16 bytes"):
        t.contribute("j", "m", 0, "b", 0, POLICY, vec(1, 1, 1, 1))


def test_fragments_and_round_counts_survive_a_restart_with_a_state_dir(tmp_path):
    t, _ = seeded(names=("a",), tmp_path=tmp_path)
    policy = Policy(0.5, 0.9, True, 1, 10.0)
    t.contribute("j", "m", 0, "a", 0, policy, vec(1, 2, 3, 4))
    again, _ = table(tmp_path)
    held = again.global_model("j", "m", 0)
    assert held.rounds == 1
    np.testing.assert_array_equal(held.params, t.global_model("j", "m", 0).params)
    np.testing.assert_array_equal(held.momentum, t.global_model("j", "m", 0).momentum)
    # The restarted hub takes round 1 at once.
    assert again.contribute("j", "m", 0, "a", 1, policy, vec(0, 0, 0, 0)) == (True, 2)


def test_a_restarted_hub_expects_the_replicas_of_the_last_round_in_its_next(tmp_path):
    t, _ = seeded(tmp_path=tmp_path)
    for name in ("a", "b", "c"):
        t.contribute("j", "m", 0, name, 0, POLICY, vec(1, 2, 3, 4))
    assert t.global_model("j", "m", 0).rounds == 1
    again, clock = table(tmp_path)  # the coordinator restarted: no replica seeded it
    assert again.global_model("j", "m", 0).replicas == ("a", "b", "c")
    # Two of three (min_replicas) do not close round 1: the third is expected, as before.
    assert again.contribute("j", "m", 0, "b", 1, POLICY, vec(0, 0, 0, 0)) == (True, 1)
    assert again.contribute("j", "m", 0, "c", 1, POLICY, vec(0, 0, 0, 0)) == (True, 1)
    assert again.contribute("j", "m", 0, "a", 1, POLICY, vec(4, 4, 4, 4)) == (True, 2)
    # One that never comes back holds the round only until its deadline.
    again.contribute("j", "m", 0, "a", 2, POLICY, vec(0, 0, 0, 0))
    again.contribute("j", "m", 0, "b", 2, POLICY, vec(0, 0, 0, 0))
    restarted, clock = table(tmp_path)
    restarted.contribute("j", "m", 0, "a", 2, POLICY, vec(0, 0, 0, 0))
    assert restarted.contribute("j", "m", 0, "b", 2, POLICY, vec(0, 0, 0, 0)) == (True, 2)
    clock.now += POLICY.round_timeout + 0.1
    assert restarted.close_due() == [("j", "m", 0)]
    assert restarted.global_model("j", "m", 0).rounds == 3


def test_split_fragments_keeps_layers_together_and_balances_sizes():
    assert split_fragments([10, 1, 10, 1, 10, 1, 10, 1], 4) == [
        range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_fragments([1, 100, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ConfigurationError, match="between 1 and"):
        split_fragments([1, 2], 3)


def test_schedule_staggers_fragments_and_resumes_where_the_latest_round_began():
    s = Schedule(12, 4, 2)
    starts = {t: s.starts(t) for t in range(1, 30) if s.starts(t)}
    assert starts == {3: [1], 6: [2], 9: [3], 12: [0], 15: [1], 18: [2], 21: [3], 24: [0],
                      27: [1]}
    assert s.resume_step([0, 0, 0, 0]) == 0
    assert s.resume_step([2, 2, 1, 1]) == 24
    with pytest.raises(ConfigurationError, match="delay"):
        Schedule(4, 2, 4)


def test_idle_jobs_are_forgotten_and_come_back_from_the_state_dir(tmp_path):
    t, clock = seeded(names=("a",), tmp_path=tmp_path)
    t.contribute("j", "m", 0, "a", 0, Policy(0.5, 0.0, True, 1, 10.0), vec(1, 1, 1, 1))
    clock.now += 599.0
    assert t.drop_idle(600.0) == []
    clock.now += 2.0
    assert t.drop_idle(600.0) == ["j"]
    assert t.jobs() == [] and t.fragments == {}
    assert t.global_model("j", "m", 0).rounds == 1  # loaded again on demand


def test_an_idle_job_releases_what_its_open_round_held():
    t, clock = seeded(names=("a", "b"))
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(1, 1, 1, 1))
    assert t.held_bytes == 16
    clock.now += 10_000.0
    assert t.drop_idle(600.0) == ["j"]
    assert t.held_bytes == 0


def test_a_replica_that_leaves_is_waited_for_by_no_round():
    t, _ = seeded()
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(2, 2, 2, 2))
    t.contribute("j", "m", 0, "b", 0, POLICY, vec(2, 2, 2, 2))
    assert t.leave("j", "c") == [("j", "m", 0)]  # closed now, not at the deadline
    last = t.fragments[("j", "m", 0)].history[-1]
    assert last.participants == ("a", "b") and last.missed == ()  # it left: not missed
    assert t.replicas["j"]["c"].missed == 0 and not t.replicas["j"]["c"].active
    t.contribute("j", "m", 0, "a", 1, POLICY, vec(0, 0, 0, 0))  # the next one expects a, b
    assert t.contribute("j", "m", 0, "b", 1, POLICY, vec(0, 0, 0, 0)) == (True, 2)
    assert t.seed("j", "m", 0, "c", np.ones(4, np.float32)) == 2  # a seed joins it again
    assert t.replicas["j"]["c"].active and t.replicas["j"]["c"].joins == 2


def test_a_leave_keeps_a_round_open_below_min_replicas():
    t, _ = seeded()
    t.contribute("j", "m", 0, "a", 0, POLICY, vec(2, 2, 2, 2))
    assert t.leave("j", "b") == []  # one contribution, min_replicas 2: it stays open
    assert t.fragments[("j", "m", 0)].open.expected == frozenset({"a", "c"})

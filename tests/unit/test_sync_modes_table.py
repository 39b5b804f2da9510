"""Every value of the wire's SyncModeKind has its mode object in gradstar.sync_modes.MODES (as
tests/unit/test_ops_table.py checks the ops): a proto value without one fails here, before any
rank sends it. Each object round-trips through its message and answers every question the hub
and the rank ask of a mode (docs/development.md, "Adding a sync mode")."""

from __future__ import annotations

import dataclasses

import pytest

from gradstar import sync_modes
from gradstar.errors import ConfigurationError
from gradstar.proto.v1 import steps_pb2 as pb

#: One configured value of each mode (a new mode adds its own here, or the test below fails).
EXAMPLES = {
    pb.SYNC_MODE_SYNCHRONOUS: sync_modes.Synchronous(),
    pb.SYNC_MODE_QUORUM: sync_modes.Quorum(min_ranks=2, timeout=0.25),
    pb.SYNC_MODE_BOUNDED_STALENESS: sync_modes.BoundedStaleness(3, scaling="staleness"),
    pb.SYNC_MODE_ASYNCHRONOUS: sync_modes.Asynchronous(scaling="plain", timeout=0.05),
}


def kinds() -> list[tuple[str, int]]:
    return [(name, value) for name, value in pb.SyncModeKind.items() if value != 0]


@pytest.mark.parametrize(("name", "value"), kinds())
def test_every_sync_mode_kind_has_a_mode_object(name, value):
    mode = sync_modes.MODES.get(value)
    assert mode is not None, f"steps.proto's {name} has no object in gradstar.sync_modes.MODES"
    assert mode.kind == value and dataclasses.is_dataclass(mode)
    example = EXAMPLES.get(value)
    assert type(example) is mode, f"{name}: add an example value to EXAMPLES"
    assert sync_modes.from_message(example.message()) == example  # every field travels
    assert sync_modes.check_mode(example) is example
    assert mode.__name__ in sync_modes.__all__


@pytest.mark.parametrize(("name", "value"), kinds())
def test_every_mode_answers_the_hub_and_the_rank(name, value):
    mode = EXAMPLES[value]
    assert isinstance(mode.on_ledger, bool) and isinstance(mode.pushes, bool)
    assert isinstance(mode.waits_for_own_step, bool)
    assert mode.on_ledger or not mode.waits_for_own_step  # Synchronous's all_reduce waits
    # A mode that neither pushes nor waits for its own step would leave a step open forever.
    assert not mode.on_ledger or mode.pushes or mode.waits_for_own_step
    assert mode.stale_bound is None or mode.stale_bound >= 0
    assert isinstance(mode.drop_reason(0), str) and mode.drop_reason(0) == ""  # fresh: taken
    deadline = mode.deadline(10.0, [(0.0, 0.1, 0.2)], 3)
    assert deadline is None or deadline >= 10.0
    assert isinstance(mode.closes_early(1, 4, 0.0, []), bool)
    factors = mode.factors([0.25, 0.75], [0, 1], 4)
    assert len(factors) == 2 and all(0 < f <= s for f, s in zip(factors, [0.25, 0.75],
                                                                   strict=True))
    assert mode.scaling in sync_modes.SCALINGS


def test_an_unknown_kind_or_scaling_is_a_named_error():
    with pytest.raises(ConfigurationError, match="unknown sync mode kind 99"):
        sync_modes.from_message(pb.SyncMode(kind=99))
    with pytest.raises(ConfigurationError, match="unknown step scaling 77"):
        sync_modes.from_message(pb.SyncMode(kind=pb.SYNC_MODE_ASYNCHRONOUS, scaling=77))
    with pytest.raises(ConfigurationError, match="sync_mode="):
        sync_modes.check_mode(sync_modes.SyncMode())


def test_every_scaling_value_has_a_name():
    assert sorted(sync_modes.SCALINGS.values()) == sorted(
        v for v in pb.StepScaling.values() if v != 0)
    for name in sync_modes.SCALINGS:  # every named rule computes its factors
        mode = sync_modes.Asynchronous(scaling=name)
        assert sync_modes.from_message(mode.message()) == mode
        assert len(mode.factors([0.5, 0.5], [0, 2], 4)) == 2
    # An unspecified scaling on the wire is the mode's default; a message without the adaptive
    # flag names its timeout_seconds (0: the rule of a rank from before the flag, which
    # never waited for its own step), as Quorum's does.
    assert sync_modes.from_message(pb.SyncMode(kind=pb.SYNC_MODE_ASYNCHRONOUS)) == (
        sync_modes.Asynchronous(timeout=0))
    assert sync_modes.from_message(pb.SyncMode(
        kind=pb.SYNC_MODE_ASYNCHRONOUS, adaptive_timeout=True)) == sync_modes.Asynchronous()


@pytest.mark.parametrize("mode", [sync_modes.Asynchronous, lambda **kw: sync_modes.
                                  BoundedStaleness(2, **kw)])
def test_the_carrying_modes_wait_for_their_own_step_as_their_timeout_says(mode):
    recent = [(0.0, 0.01, 0.02, 0.5), (0.0, 0.03, 0.04, 0.6), (0.0, 0.02, 0.03)]
    adaptive = mode()
    assert adaptive.waits_for_own_step and adaptive.pushes
    # Adaptive: twice the 90th percentile of the recent steps' times to their (live - 1)-th,
    # here the 3rd of 4 (0.02, 0.03, 0.04; of three, the largest): the late 4th rank is not
    # waited for. Quorum's is the median (its missed gradients are dropped).
    assert adaptive.wait(recent, 4) == pytest.approx(0.08)
    assert adaptive.deadline(1.0, recent, 4) == pytest.approx(1.08)
    assert sync_modes.Quorum(3).wait(recent) == pytest.approx(0.06)
    assert adaptive.wait([], 4) is None  # nothing measured yet: wait for every live rank
    assert not adaptive.closes_early(2, 4, 0.07, recent)
    assert adaptive.closes_early(1, 4, 0.08, recent)  # with whatever arrived
    fixed = mode(timeout=0.2)
    assert fixed.deadline(1.0, recent, 4) == pytest.approx(1.2) and fixed.waits_for_own_step
    never = mode(timeout=0)  # the rule before: the next gradient closes the step
    assert not never.waits_for_own_step and never.deadline(1.0, recent, 4) is None
    assert not never.closes_early(3, 4, 10.0, recent)
    for value in (adaptive, fixed, never):
        assert sync_modes.from_message(value.message()) == value
    with pytest.raises(ConfigurationError, match="timeout"):
        mode(timeout=-1)

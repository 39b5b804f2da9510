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
    pb.SYNC_MODE_ASYNCHRONOUS: sync_modes.Asynchronous(scaling="plain"),
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
    assert mode.waits_for_own_step == (mode.on_ledger and not mode.pushes)
    assert mode.stale_bound is None or mode.stale_bound >= 0
    assert isinstance(mode.drop_reason(0), str) and mode.drop_reason(0) == ""  # fresh: taken
    deadline = mode.deadline(10.0, [(0.0, 0.1, 0.2)])
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
    # Unspecified on the wire is the mode's default.
    assert sync_modes.from_message(pb.SyncMode(kind=pb.SYNC_MODE_ASYNCHRONOUS)) == (
        sync_modes.Asynchronous())

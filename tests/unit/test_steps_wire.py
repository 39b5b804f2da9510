"""Wire formats in the hub's step ledger and in a rank's error feedback, without sockets: one
format per ledger (a mismatch named for its sender only), the aggregate encoded once and held
encoded, and the residual a dropped contribution leaves as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradstar.client.error_feedback import ErrorFeedback
from gradstar.client.steps.modes import SyncModeState
from gradstar.coordinator.steps.table import StepsTable
from gradstar.errors import ConfigurationError, ProtocolError, StepMismatchError
from gradstar.sync_modes import Asynchronous, Quorum, Synchronous
from gradstar.wire.formats import FORMATS, WIRE_NONE, decode, roundtrip

N = 200  # elements per gradient: three int8 blocks and a short one
QUORUM = Quorum(min_ranks=2, timeout=0.0)


def grad(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def table() -> StepsTable:
    return StepsTable(max_numel=1 << 20, max_held_bytes=1 << 24, lease=5.0)


@pytest.mark.parametrize("name", ["int8", "int4", "bf16", "fp16"])
def test_the_aggregate_is_the_weighted_mean_encoded_once_and_held_encoded(name):
    fmt = FORMATS[name]
    t = table()
    ledger = t.ledger("j", "m", 2)
    # What the servicer hands the table: each contribution decoded from the rank's bytes.
    sent = [roundtrip(fmt, grad(rank)) for rank in (0, 1)]
    ledger.contribute(1, QUORUM, 0, 0, 3.0, sent[1], fmt.wire)
    ledger.contribute(0, QUORUM, 0, 0, 1.0, sent[0], fmt.wire)
    step = ledger.log[-1]
    mean = (sent[0] * np.float32(1.0) + sent[1] * np.float32(3.0)) / np.float32(4.0)
    assert step.aggregate.dtype == np.uint8 and step.aggregate.nbytes == fmt.encoded_nbytes(N)
    np.testing.assert_array_equal(decode(fmt, step.aggregate, N), roundtrip(fmt, mean))
    # The hub holds the encoded aggregate, not a float32 copy.
    assert t.held_bytes == fmt.encoded_nbytes(N) < 4 * N


def test_a_rank_in_another_wire_format_is_refused_and_the_step_goes_on():
    t = table()
    ledger = t.ledger("j", "m", 3)
    int8 = FORMATS["int8"]
    ledger.contribute(0, QUORUM, 0, 0, 1.0, roundtrip(int8, grad(0)), int8.wire)
    for wire, words in ((FORMATS["bf16"].wire, "in bf16, but .* in int8"),
                        (WIRE_NONE, "in float32, but .* in int8")):
        with pytest.raises(StepMismatchError, match=f"rank 1 .*{words}"):
            ledger.check_header(1, QUORUM, 0, N, 0, 1.0, wire)
        with pytest.raises(StepMismatchError, match="same wire format"):
            ledger.contribute(1, QUORUM, 0, 0, 1.0, grad(1), wire)
    with pytest.raises(ProtocolError, match="unknown wire format 99"):
        ledger.check_header(2, QUORUM, 0, N, 0, 1.0, 99)
    assert list(ledger.open.contributions) == [0] and ledger.steps == 0
    ledger.contribute(2, QUORUM, 0, 0, 1.0, roundtrip(int8, grad(2)), int8.wire)
    assert ledger.steps == 1 and ledger.log[-1].ranks == (0, 2)


def test_a_float32_ledger_refuses_a_format_and_keeps_float32_aggregates():
    t = table()
    ledger = t.ledger("j", "m", 2)
    ledger.contribute(0, Asynchronous(), 0, 0, 1.0, grad(0))
    with pytest.raises(StepMismatchError, match=r"in int8, but .* in float32"):
        ledger.contribute(1, Asynchronous(), 0, 0, 1.0, grad(1), FORMATS["int8"].wire)
    ledger.contribute(1, Asynchronous(), 0, 0, 1.0, grad(1))
    ledger.contribute(0, Asynchronous(), 0, 0, 1.0, grad(0))  # its push closes step 1
    assert ledger.log[-1].aggregate.dtype == np.float32


def test_a_dropped_contribution_leaves_the_residual_as_it_was():
    # The rank's side of the drop rule: save, compensate, and restore when the hub drops.
    feedback = ErrorFeedback("int8")
    first = torch.from_numpy(grad(0))
    feedback.compensate("steps", first)
    before = feedback.residuals["steps"].clone()
    assert before.abs().max() > 0
    saved = feedback.save("steps")
    dropped = torch.from_numpy(grad(1) * 50)
    feedback.compensate("steps", dropped)
    assert not torch.equal(feedback.residuals["steps"], before)
    feedback.restore("steps", saved)
    torch.testing.assert_close(feedback.residuals["steps"], before, rtol=0, atol=0)
    # The next contribution carries the older residual, and nothing of the dropped gradient.
    nxt = torch.from_numpy(grad(2))
    expected = nxt + before
    feedback.compensate("steps", nxt)
    torch.testing.assert_close(nxt, expected, rtol=0, atol=0)
    # A rank whose first contribution is dropped has no residual again.
    fresh = ErrorFeedback("bf16")
    saved = fresh.save("steps")
    fresh.compensate("steps", torch.from_numpy(grad(3)))
    fresh.restore("steps", saved)
    assert "steps" not in fresh.residuals


def modes(mode) -> SyncModeState:
    """A DDP's sync-mode state in ``mode`` with the int8 format, for its rules alone (none of
    them reaches a ledger, so none is made)."""
    state = SyncModeState(torch.nn.Linear(1, 1), [], None, None, wire="int8", compression=None,
                          feedback=None, broadcast_buffers=False)
    state.mode = mode
    return state


def test_weights_with_a_wire_format_are_taken_in_ledger_modes_and_refused_in_synchronous():
    ledger = modes(Quorum(min_ranks=2, timeout=0.0))
    ledger.set_weight(3)
    assert ledger.weight == 3.0
    with pytest.raises(ConfigurationError, match="not carried with a wire format in "
                                                 "Synchronous"):
        ledger.set(Synchronous())
    assert ledger.mode == Quorum(min_ranks=2, timeout=0.0)  # refused before anything changed
    synchronous = modes(Synchronous())
    with pytest.raises(ConfigurationError, match="Synchronous"):
        synchronous.set_weight(2.0)
    assert synchronous.weight is None
    with pytest.raises(ConfigurationError, match="a weight is a finite number >= 0"):
        ledger.set_weight(float("nan"))

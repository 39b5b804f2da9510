"""ErrorFeedback: the residual bookkeeping of gradients sent in a lossy wire format (no sockets)."""

from __future__ import annotations

import math

import pytest
import torch

from gradstar.client.error_feedback import ErrorFeedback, check_error_feedback
from gradstar.errors import ConfigurationError
from gradstar.wire.formats import roundtrip


def gradients(steps: int, n: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    """Slowly changing gradient-like vectors: a fixed direction plus noise, heavy-ish tails."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3
    return [base + 0.1 * torch.randn(n, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "int4"])
def test_the_residual_is_what_the_format_loses_of_gradient_plus_previous_residual(fmt):
    feedback = ErrorFeedback(fmt)
    previous = torch.zeros(1000)
    for grad in gradients(3):
        flat = grad.clone()
        feedback.compensate("b", flat)
        want_sent = grad + previous
        assert torch.equal(flat, want_sent)  # the residual was added before encoding
        lost = want_sent - torch.from_numpy(roundtrip(fmt, want_sent.numpy()))
        assert torch.equal(feedback.residuals["b"], lost)
        previous = lost


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_what_was_sent_over_many_steps_differs_from_the_gradients_by_one_residual(fmt):
    # The point of error feedback: sent = g + e_prev - e, so the sum telescopes.
    feedback = ErrorFeedback(fmt)
    grads = gradients(40)
    sent_with, sent_without = torch.zeros(1000), torch.zeros(1000)
    for grad in grads:
        flat = grad.clone()
        feedback.compensate(0, flat)
        sent_with += torch.from_numpy(roundtrip(fmt, flat.numpy()))
        sent_without += torch.from_numpy(roundtrip(fmt, grad.numpy()))
    total = torch.stack(grads).sum(0)
    residual = feedback.residuals[0]
    torch.testing.assert_close(sent_with, total - residual, rtol=0, atol=1e-4)
    error_with = (sent_with - total).norm() / total.norm()
    error_without = (sent_without - total).norm() / total.norm()
    # Deterministic rounding of a slowly changing gradient is biased: without feedback its
    # error grows with the steps, with feedback it stays one rounding.
    assert error_with < error_without / 3, (error_with, error_without)


def test_slices_sent_as_zeros_keep_their_residual_for_the_next_step():
    feedback = ErrorFeedback("int4")
    first = torch.linspace(-1, 1, 256)
    feedback.compensate("b", first.clone())
    before = feedback.residuals["b"].clone()
    flat = torch.ones(256)
    flat[64:128] = 0.0  # the caller zeroed a parameter without a gradient
    feedback.compensate("b", flat, keep=[(64, 64)])
    assert torch.equal(flat[64:128], torch.zeros(64))  # sent as zeros, residual not added
    assert torch.equal(feedback.residuals["b"][64:128], before[64:128])
    assert torch.equal(flat[:64], 1.0 + before[:64])


def test_non_finite_values_get_a_zero_residual_and_do_not_poison_later_steps():
    feedback = ErrorFeedback("int8")
    flat = torch.randn(200)
    flat[5], flat[70], flat[150] = math.inf, -math.inf, math.nan
    feedback.compensate("b", flat)
    residual = feedback.residuals["b"]
    assert torch.isfinite(residual).all()
    assert residual[5] == residual[70] == residual[150] == 0
    nxt = torch.randn(200)
    feedback.compensate("b", nxt)
    assert torch.isfinite(nxt).all() and torch.isfinite(feedback.residuals["b"]).all()


def test_a_bucket_of_another_size_restarts_from_zero_and_reset_forgets_everything():
    feedback = ErrorFeedback("int8")
    feedback.compensate("b", torch.randn(100))
    grown = torch.randn(300)
    copy = grown.clone()
    feedback.compensate("b", grown)
    assert torch.equal(grown, copy)  # a zero residual was added: the bucket was re-planned
    assert feedback.residuals["b"].shape == (300,)
    feedback.reset()
    assert feedback.residuals == {}


def test_only_contiguous_float32_buckets_are_compensated():
    feedback = ErrorFeedback("int8")
    with pytest.raises(ConfigurationError, match=r"contiguous float32 buckets, got torch\.float64"):
        feedback.compensate("b", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ConfigurationError, match="contiguous float32"):
        feedback.compensate("b", torch.zeros(4, 4).t())


def test_the_options_on_by_default_with_a_format_off_when_asked_refused_without_one():
    assert check_error_feedback(None, None) is None
    assert check_error_feedback(None, False) is None
    assert check_error_feedback("int8", None).format.name == "int8"
    assert check_error_feedback("bf16", True).format.name == "bf16"
    assert check_error_feedback("int4", False) is None
    with pytest.raises(ConfigurationError, match="error_feedback=True needs a lossy wire format"):
        check_error_feedback(None, True)
    with pytest.raises(ConfigurationError, match="wire format 'int3' is not supported"):
        check_error_feedback("int3", None)


def test_residual_memory_is_one_float32_buffer_per_bucket():
    feedback = ErrorFeedback("int8")
    for key, n in [(0, 640), (1, 64), (2, 1)]:
        feedback.compensate(key, torch.zeros(n))
    assert {k: (r.dtype, r.numel()) for k, r in feedback.residuals.items()} == {
        0: (torch.float32, 640), 1: (torch.float32, 64), 2: (torch.float32, 1)}

"""DistributedDataParallel as an nn.Module, its arguments and its sync rules, on one rank.

A one-rank job on a real coordinator in this process: the DDP code runs on a worker thread
(its process group blocks) while the coordinator serves on the test's loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradstar
from gradstar.client import device
from gradstar.errors import ConfigurationError
from tests.integration.conftest import close_all, join_all

from .conftest import on_thread


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


async def test_an_async_process_group_is_refused_with_a_hint(coordinator):
    (apg,) = await join_all(coordinator.address, 1, job="async")
    try:
        with pytest.raises(ConfigurationError, match=r"needs the blocking gradstar\.ProcessGroup "
                           r"from gradstar\.init_process_group\(\), got AsyncProcessGroup"):
            gradstar.DDP(mlp(), apg)
    finally:
        await close_all([apg])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gradient_compression": "int8"}, "gradient_compression must be None, 'bf16' or 'fp16'"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a positive number"),
    ({"wire": "int8", "gradient_compression": "bf16"},
     r"pass either wire='int8' or gradient_compression='bf16', not both"),
    ({"wire": "int3"}, "wire format 'int3' is not supported"),
    ({"error_feedback": True}, "error_feedback=True needs a lossy wire format"),
    ({"gradient_as_bucket_view": True, "gradient_compression": "bf16"},
     r"gradient_as_bucket_view=True needs buckets of each gradient's dtype; parameter 0\.weight "
     r"is torch\.float32 and the buckets torch\.bfloat16"),
])
async def test_invalid_arguments_are_configuration_errors(solo, kwargs, message):
    def body(pg):
        with pytest.raises(ConfigurationError, match=message):
            gradstar.DDP(mlp(), pg, **kwargs)

    await on_thread(body, solo)


async def test_a_module_without_trainable_parameters_is_refused(solo):
    def body(pg):
        frozen = mlp().requires_grad_(False)
        with pytest.raises(ConfigurationError, match="at least one parameter that requires grad"):
            gradstar.DDP(frozen, pg)
        with pytest.raises(ConfigurationError, match=r"wraps a torch\.nn\.Module"):
            gradstar.DDP(lambda x: x, pg)

    await on_thread(body, solo)


async def test_a_module_on_another_device_is_refused_naming_the_device(solo):
    def body(pg):
        with pytest.raises(ConfigurationError) as raised:
            gradstar.DDP(mlp().to("meta"), pg)
        assert str(raised.value) == (
            "DistributedDataParallel runs on the CPU or a CUDA device; parameter 0.weight is on "
            "meta: move the module to one of them first")

    await on_thread(body, solo)


async def test_a_module_spread_over_two_devices_is_refused_naming_both(solo, monkeypatch):
    # No GPU is needed to spread a module: with meta accepted like CUDA, CPU and meta are two
    # devices of one module.
    monkeypatch.setattr(device, "STAGED_DEVICES", ("cuda", "meta"))

    def body(pg):
        model = mlp()
        model[2].to("meta")
        with pytest.raises(ConfigurationError) as raised:
            gradstar.DDP(model, pg)
        assert str(raised.value) == (
            "DistributedDataParallel needs all of a module's parameters and buffers on one "
            "device; parameter 0.weight is on cpu, parameter 2.weight on meta: move the whole "
            "module with .to(device) first")

    await on_thread(body, solo)


async def test_it_behaves_like_the_module_it_wraps(solo):
    def body(pg):
        inner = mlp()
        ddp = gradstar.DistributedDataParallel(inner, pg)
        assert ddp.module is inner and isinstance(ddp, nn.Module)
        assert list(ddp.parameters()) == list(inner.parameters())
        assert [n for n, _ in ddp.named_parameters()] == [
            "module." + n for n, _ in inner.named_parameters()]
        assert list(ddp.state_dict()) == ["module." + k for k in inner.state_dict()]
        ddp.eval()
        assert not inner.training and not inner[0].training
        ddp.train()
        assert inner.training

        other = gradstar.DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), pg)
        other.load_state_dict(ddp.state_dict())
        x = torch.randn(5, 4)
        torch.testing.assert_close(other(x), inner(x))
        assert "buckets=1" in repr(ddp) and "world_size=1" in repr(ddp)

    await on_thread(body, solo)


async def test_backward_through_the_wrapper_synchronises_and_matches_plain_autograd(solo):
    def body(pg):
        ddp, plain = gradstar.DDP(mlp(), pg, bucket_cap_mb=100 / (1 << 20)), mlp()
        x = torch.randn(6, 4)
        ddp(x).square().sum().backward()
        plain(x).square().sum().backward()
        for a, b in zip(ddp.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)
        timeline = ddp.last_step_timeline
        assert len(timeline.hooks) == 4
        assert [x.bucket for x in timeline.launches] == list(range(len(ddp.bucket_plan)))
        assert timeline.launched_during_backward >= 1

    await on_thread(body, solo)


async def test_only_a_synchronising_forward_arms_the_hooks(solo):
    def body(pg):
        ddp = gradstar.DDP(mlp(), pg)
        x = torch.randn(3, 4)
        ddp.module(x).sum().backward()  # around the wrapper: no synchronisation
        assert ddp.last_step_timeline is None
        with ddp.no_sync():
            ddp(x).sum().backward()
        assert ddp.last_step_timeline is None
        ddp.sync_gradients()  # by hand
        assert {x.during for x in ddp.last_step_timeline.launches} == {"sync_gradients"}
        loss = ddp(x).sum()
        loss.backward(retain_graph=True)
        first = ddp.last_step_timeline
        loss.backward()  # a second backward of the same forward is reduced too
        assert ddp.last_step_timeline is not first

    await on_thread(body, solo)


async def test_the_one_call_constructor_refuses_a_non_module_before_joining(coordinator):
    def body():
        with pytest.raises(ConfigurationError, match=r"create_distributed_data_parallel wraps a "
                           r"torch\.nn\.Module, got dict; nothing was joined"):
            gradstar.create_distributed_data_parallel({}, coordinator.address, "never", 1, 0)

    await on_thread(body)
    assert "never" not in coordinator.rendezvous.jobs


async def test_the_one_call_constructor_closes_its_group_when_ddp_refuses(coordinator):
    def body():
        with pytest.raises(ConfigurationError, match="bucket_cap_mb must be a positive number"):
            gradstar.create_distributed_data_parallel(
                mlp(), coordinator.address, "refused", 1, 0, bucket_cap_mb=0,
                pg_options={"timeout": 20, "join_timeout": 20})

    await on_thread(body)
    # The rank left as a finished member: the job is completed, not left with a live rank.
    assert coordinator.rendezvous.jobs["refused"].state == "completed"


async def test_sync_gradients_after_a_synchronising_backward_sends_nothing(coordinator, solo):
    # The loop the documents showed: backward through the wrapper, then sync_gradients(). The
    # means are already in .grad; a second reduction would double the traffic for nothing.
    # The hub counts a payload's bytes as they arrive, before it answers: read after a wait,
    # the count is complete.
    counters = coordinator.rendezvous.jobs["solo"].counters

    def body(pg):
        ddp = gradstar.DDP(mlp(), pg, bucket_cap_mb=100 / (1 << 20))
        x = torch.randn(6, 4)
        before = counters.bytes_in
        ddp(x).square().sum().backward()
        after_backward = counters.bytes_in
        one_step = after_backward - before
        assert one_step >= sum(p.numel() * 4 for p in ddp.parameters())  # the counter counts
        means = [p.grad.clone() for p in ddp.parameters()]
        ddp.sync_gradients()
        ddp.sync_gradients()
        assert counters.bytes_in == after_backward
        for mean, p in zip(means, ddp.parameters(), strict=True):
            assert torch.equal(p.grad, mean)
        # A gradient accumulated since (a no_sync backward) makes it send again.
        with ddp.no_sync():
            ddp(x).square().sum().backward()
        ddp.sync_gradients()
        assert counters.bytes_in - after_backward == one_step

    await on_thread(body, solo)


async def test_sync_gradients_follows_the_unused_parameter_rules(solo):
    def body(pg):
        model = mlp()
        strict = gradstar.DDP(model, pg)
        model(torch.randn(2, 4)).sum().backward()
        model[2].bias.grad = None
        with pytest.raises(ConfigurationError, match=r"got no gradient for 1 parameter\(s\) when "
                           r"sync_gradients\(\) was called: 2\.bias\..*"
                           r"find_unused_parameters=True"):
            strict.sync_gradients()
        # The mean (here: zeros) was still written before the error.
        assert torch.equal(model[2].bias.grad, torch.zeros(2))

        model = mlp()
        lenient = gradstar.DDP(model, pg, find_unused_parameters=True)
        model(torch.randn(2, 4)).sum().backward()
        model[2].bias.grad = None
        lenient.sync_gradients()
        assert model[2].bias.grad is None  # no rank had one: it stays None, as in torch
        assert model[2].weight.grad is not None

    await on_thread(body, solo)


async def test_fp16_compression_sends_half_precision_and_returns_float32(solo):
    def body(pg):
        ddp = gradstar.DDP(mlp(), pg, gradient_compression="fp16")
        assert ddp.bucket_dtypes == [torch.float16]
        ddp(torch.randn(3, 4)).sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in ddp.parameters())

    await on_thread(body, solo)


async def test_a_wire_format_makes_float32_buckets_and_residuals_reset_by_hand(solo):
    def body(pg):
        model = mlp().double()
        ddp = gradstar.DDP(model, pg, wire="int8")
        assert ddp.error_feedback and ddp.bucket_dtypes == [torch.float32]
        assert ddp.error_feedback_residuals == [None]
        ddp(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        assert all(p.grad.dtype == torch.float64 for p in ddp.parameters())
        (residual,) = ddp.error_feedback_residuals
        assert residual.dtype == torch.float32 and residual.abs().sum() > 0
        ddp.reset_error_feedback()
        assert ddp.error_feedback_residuals == [None]
        plain = gradstar.DDP(mlp(), pg, wire="bf16", error_feedback=False)
        assert not plain.error_feedback and "wire='bf16', error_feedback=False" in repr(plain)

    await on_thread(body, solo)


async def test_bucket_cap_and_broadcast_source_are_checked_before_anything_is_sent(solo):
    def body(pg):
        ddp = gradstar.DDP(mlp(), pg, bucket_cap_mb=1)
        for bad in (0, -1, "2", True):
            with pytest.raises(ConfigurationError, match="bucket_cap_mb must be a positive"):
                ddp.bucket_cap_mb = bad
        assert ddp.bucket_cap_mb == 1 and ddp.reducer.requested_cap is None
        for bad in (1, -1, True, 0.0):
            with pytest.raises(ConfigurationError, match=rf"broadcast_parameters\(src={bad!r}\): "
                               "src must be a rank, 0 to 0"):
                ddp.broadcast_parameters(src=bad)
        ddp.broadcast_parameters(src=0)

    await on_thread(body, solo)


async def test_a_new_bucket_cap_is_used_from_the_step_after_the_next_one(solo):
    def body(pg):
        ddp = gradstar.DDP(mlp(), pg, gradient_as_bucket_view=True)
        x = torch.randn(3, 4)
        assert len(ddp.bucket_plan) == 1
        ddp.bucket_cap_mb = 100 / (1 << 20)
        ddp(x).sum().backward()  # every rank (one) assigned it: the values go with the next
        assert len(ddp.bucket_plan) == 1 and ddp.reducer.confirming
        ddp(x).sum().backward()  # agreed here, rebuilt when it completes
        assert len(ddp.last_step_timeline.launches) == 1 and len(ddp.bucket_plan) == 3
        grads = [p.grad.clone() for p in ddp.parameters()]
        # The gradients moved into the new buckets with their values.
        for p, view, grad in zip(ddp.parameters(), ddp.reducer.views, grads, strict=True):
            assert p.grad.data_ptr() == view.data_ptr() and torch.equal(p.grad, grad)
        ddp(x).sum().backward()
        assert len(ddp.last_step_timeline.launches) == 3

    await on_thread(body, solo)


async def test_with_a_wire_format_a_new_bucket_cap_is_used_from_the_next_step(solo):
    def body(pg):
        # A format sends the caps apart at every step: agreed by the next step, used after it.
        ddp = gradstar.DDP(mlp(), pg, wire="int8")
        ddp.bucket_cap_mb = 100 / (1 << 20)
        ddp(torch.randn(3, 4)).sum().backward()
        assert len(ddp.last_step_timeline.launches) == 1 and len(ddp.bucket_plan) == 3

    await on_thread(body, solo)


async def test_a_rebuild_moves_each_error_feedback_residual_with_its_parameter(solo):
    def body(pg):
        ddp = gradstar.DDP(mlp(), pg, wire="int4")
        ddp(torch.randn(3, 4)).sum().backward()

        def by_parameter():
            reducer, out = ddp.reducer, {}
            for bucket, residual in zip(reducer.plan, ddp.error_feedback_residuals,
                                        strict=True):
                for member, offset, numel in zip(bucket.members, bucket.offsets, bucket.numels,
                                                 strict=True):
                    out[member] = residual[offset:offset + numel].clone()
            return out

        before = by_parameter()
        assert sum(float(r.abs().sum()) for r in before.values()) > 0
        ddp.reducer.rebuild(100)
        assert len(ddp.bucket_plan) == 3
        after = by_parameter()
        assert sorted(after) == sorted(before)
        assert all(torch.equal(after[i], before[i]) for i in before)

    await on_thread(body, solo)


async def test_with_bucket_views_autograd_accumulates_straight_into_the_bucket(solo):
    def body(pg):
        model, plain = mlp(), mlp()
        seen = []  # where weight 0's gradient is when autograd has accumulated it
        model[0].weight.register_post_accumulate_grad_hook(
            lambda p: seen.append(p.grad.data_ptr()))  # registered first: runs before DDP's
        ddp = gradstar.DDP(model, pg, gradient_as_bucket_view=True)
        view = ddp.reducer.views[0]
        x = torch.randn(5, 4)
        for _ in range(2):
            ddp.zero_grad(set_to_none=False)
            plain.zero_grad(set_to_none=False)
            ddp(x).square().sum().backward()
            plain(x).square().sum().backward()
            for got, want in zip(model.parameters(), plain.parameters(), strict=True):
                torch.testing.assert_close(got.grad, want.grad)
        # Step one: no gradient yet, autograd allocated one (copied in, then replaced by the
        # view); step two: it accumulated into the bucket itself.
        assert seen[0] != view.data_ptr() and seen[1] == view.data_ptr()
        assert model[0].weight.grad.data_ptr() == view.data_ptr()

    await on_thread(body, solo)


async def test_a_rebuild_keeps_the_sync_modes_residual_beside_the_buckets(solo):
    def body(pg):
        # A sync mode's contributions keep their residual under the key "steps" in the same
        # error feedback; a bucket re-plan in Synchronous steps must carry it over untouched.
        ddp = gradstar.DDP(mlp(), pg, wire="int4")
        ddp(torch.randn(3, 4)).sum().backward()
        flat = torch.randn(sum(p.numel() for p in ddp.parameters()))
        ddp.reducer.feedback.compensate("steps", flat)
        kept = ddp.reducer.feedback.residuals["steps"].clone()
        assert float(kept.abs().sum()) > 0
        ddp.reducer.rebuild(100)
        assert len(ddp.bucket_plan) == 3
        assert torch.equal(ddp.reducer.feedback.residuals["steps"], kept)

    await on_thread(body, solo)

"""FullyShardedDataParallel as an nn.Module, its arguments and its autograd rules, on one rank.

A one-rank job on a real coordinator in this process: the FSDP code runs on a worker thread
(its process group blocks) while the coordinator serves on the test's loop. One rank keeps
the whole flat buffer as its shard, so every gradient can be compared with plain autograd's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradstar
from gradstar.client import device
from gradstar.errors import ConfigurationError
from tests.integration.conftest import close_all, join_all

from . import fsdp_script as script
from .conftest import on_thread


def flat_grads(fsdp, plain: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(shard gradient, plain autograd's gradients of the same unit, flattened) per unit."""
    grads = {name: p.grad for name, p in plain.named_parameters()}
    return [(unit.shard.grad, unit.flatten([grads[n] for n in unit.param_names]))
            for unit in fsdp.units]


def x_of(rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, script.WIDTHS[0], generator=torch.Generator().manual_seed(rows))


async def test_an_async_process_group_is_refused_with_a_hint(coordinator):
    (apg,) = await join_all(coordinator.address, 1, job="async")
    try:
        with pytest.raises(ConfigurationError, match=r"needs the blocking gradstar\.ProcessGroup "
                           r"from gradstar\.init_process_group\(\), got AsyncProcessGroup"):
            gradstar.FSDP(script.MLP(0), apg)
    finally:
        await close_all([apg])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mixed_precision": "int8"}, "mixed_precision must be None, 'bf16' or 'fp16'"),
    ({"auto_wrap_policy": 42}, "auto_wrap_policy must be None, a list of torch.nn.Module"),
])
async def test_invalid_arguments_are_configuration_errors(solo, kwargs, message):
    def body(pg):
        with pytest.raises(ConfigurationError, match=message):
            gradstar.FSDP(script.MLP(0), pg, **kwargs)

    await on_thread(body, solo)


async def test_modules_it_cannot_shard_are_refused(solo):
    def body(pg):
        with pytest.raises(ConfigurationError, match="at least one parameter"):
            gradstar.FSDP(nn.Tanh(), pg)
        with pytest.raises(ConfigurationError, match=r"wraps a torch\.nn\.Module"):
            gradstar.FSDP(lambda x: x, pg)
        counter = nn.Linear(2, 2)
        counter.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
        with pytest.raises(ConfigurationError, match=r"parameter steps has dtype torch\.int64"):
            gradstar.FSDP(counter, pg)

    await on_thread(body, solo)


async def test_a_module_on_another_device_is_refused_naming_the_device(solo):
    def body(pg):
        with pytest.raises(ConfigurationError) as raised:
            gradstar.FSDP(script.MLP(0).to("meta"), pg)
        assert str(raised.value) == (
            "FullyShardedDataParallel runs on the CPU or a CUDA device; parameter scale is on "
            "meta: move the module to one of them first")

    await on_thread(body, solo)


async def test_a_module_spread_over_two_devices_is_refused_naming_both(solo, monkeypatch):
    # With meta accepted like CUDA, a buffer on meta beside CPU parameters spreads the module
    # over two devices without a GPU.
    monkeypatch.setattr(device, "STAGED_DEVICES", ("cuda", "meta"))

    def body(pg):
        model = script.NestedNet(0)
        model.offset = model.offset.to("meta")
        with pytest.raises(ConfigurationError) as raised:
            gradstar.FSDP(model, pg)
        assert str(raised.value) == (
            "FullyShardedDataParallel needs all of a module's parameters and buffers on one "
            "device; parameter embed.weight is on cpu, buffer offset on meta: move the whole "
            "module with .to(device) first")

    await on_thread(body, solo)


async def test_it_behaves_like_a_module_whose_parameters_are_the_flat_shards(solo):
    def body(pg):
        inner = script.MLP(0)
        want = inner(x_of())
        keys = list(inner.state_dict())
        fsdp = gradstar.FullyShardedDataParallel(inner, pg)
        assert gradstar.FSDP is gradstar.FullyShardedDataParallel
        assert fsdp.module is inner and isinstance(fsdp, nn.Module)
        assert [n for n, _ in fsdp.named_parameters()] == [f"flat_shards.{i}" for i in range(5)]
        assert [p.numel() for p in fsdp.parameters()] == [3, 54, 130, 238, 54]
        assert list(inner.parameters()) == []  # the shards are the only parameter storage
        # Outside its forward a unit's parameters are empty placeholders, as in torch's FSDP.
        assert inner.fc1.weight.numel() == 0 and inner.fc1.bias is not None
        torch.testing.assert_close(fsdp(x_of()), want)
        assert list(fsdp.full_state_dict()) == keys
        fsdp.eval()
        assert not inner.training and not inner.fc1.training
        assert "units=[<root>:3, fc1:54, fc2:130, fc3:238, fc4:54]" in repr(fsdp)
        assert "world_size=1" in repr(fsdp)

    await on_thread(body, solo)


async def test_gradients_match_plain_autograd_and_accumulate(solo):
    def body(pg):
        fsdp, plain = gradstar.FSDP(script.MLP(0), pg), script.MLP(0)
        for rows in (6, 4):  # two backward passes without zero_grad: .grad accumulates
            fsdp(x_of(rows)).square().sum().backward()
            plain(x_of(rows)).square().sum().backward()
        for got, want in flat_grads(fsdp, plain):
            torch.testing.assert_close(got, want)

    await on_thread(body, solo)


async def test_a_unit_called_twice_and_a_second_backward_of_one_forward(solo):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

        def forward(self, x):
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))

    def body(pg):
        fsdp, plain = gradstar.FSDP(Twice(), pg), Twice()
        x = x_of()
        loss = fsdp(x).square().sum()
        ops = [(c.op, c.unit) for c in fsdp.last_collectives]
        assert ops.count(("all_gather", 0)) == 2  # gathered for each call
        loss.backward(retain_graph=True)
        loss.backward()  # the second backward gathers again and reduces again
        reference = plain(x).square().sum()
        reference.backward(retain_graph=True)
        reference.backward()
        for got, want in flat_grads(fsdp, plain):
            torch.testing.assert_close(got, want)

    await on_thread(body, solo)


async def test_calling_the_inner_module_directly_still_gives_correct_gradients(solo):
    def body(pg):
        fsdp, plain = gradstar.FSDP(script.MLP(0), pg), script.MLP(0)
        # Around the wrapper the hooks still gather and reduce; only the freeing of saved
        # parameters between forward and backward is lost.
        fsdp.module(x_of()).sum().backward()
        plain(x_of()).sum().backward()
        for got, want in flat_grads(fsdp, plain):
            torch.testing.assert_close(got, want)

    await on_thread(body, solo)


async def test_a_forward_without_grad_gathers_but_never_reduces(solo):
    def body(pg):
        fsdp = gradstar.FSDP(script.MLP(0), pg)
        with torch.no_grad():
            out = fsdp(x_of())
        assert not out.requires_grad
        assert {c.op for c in fsdp.last_collectives} == {"all_gather"}
        assert all(not u.holding for u in fsdp.units)

    await on_thread(body, solo)


async def test_modifying_the_shards_between_forward_and_backward_is_an_error(solo):
    def body(pg):
        fsdp = gradstar.FSDP(script.MLP(0), pg)
        loss = fsdp(x_of()).sum()
        with torch.no_grad():
            fsdp.flat_shards[3].add_(1.0)  # as optimizer.step() would
        with pytest.raises(RuntimeError, match=r"the shard of sharding unit fc3 was modified in "
                                               r"place .* between the forward and this backward"):
            loss.backward()
        # The next step starts clean.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fsdp(x_of()).sum().backward()
        assert any("previous backward pass did not finish" in str(w.message) for w in caught)
        assert all(not u.holding for u in fsdp.units)

    await on_thread(body, solo)


async def test_an_exception_inside_a_unit_leaves_every_unit_sharded(solo):
    class Failing(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)
            self.fail = True

        def forward(self, x):
            x = self.a(x)
            if self.fail:
                raise ValueError("boom")
            return self.b(x)

    def body(pg):
        model = Failing()
        fsdp = gradstar.FSDP(model, pg, auto_wrap_policy=[nn.Linear])
        with pytest.raises(ValueError, match="boom"):
            fsdp(x_of())
        assert all(not u.holding and u.active == 0 for u in fsdp.units)
        assert model.a.weight.numel() == 0  # the placeholder again
        model.fail = False
        fsdp(x_of()).sum().backward()
        assert all(p.grad is not None for p in fsdp.parameters())

    await on_thread(body, solo)


async def test_fp16_mixed_precision_communicates_half_and_keeps_float32(solo):
    def body(pg):
        fsdp = gradstar.FSDP(script.MLP(0), pg, mixed_precision="fp16")
        fsdp(x_of()).sum().backward()
        assert {c.dtype for c in fsdp.last_collectives} == {"float16"}
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in fsdp.parameters())

    await on_thread(body, solo)


async def test_no_sync_keeps_gradients_until_sync_gradients_and_zero_grad_drops_them(solo):
    def body(pg):
        fsdp, plain = gradstar.FSDP(script.MLP(0), pg), script.MLP(0)
        with fsdp.no_sync():
            fsdp(x_of()).sum().backward()
        assert all(u.shard.grad is None and u.kept_grad is not None for u in fsdp.units)
        plain(x_of()).sum().backward()
        plain(x_of(4)).sum().backward()
        fsdp.zero_grad()
        assert all(u.kept_grad is None for u in fsdp.units)
        fsdp.sync_gradients()  # nothing kept: no collective, nothing written
        assert all(u.shard.grad is None for u in fsdp.units)
        with fsdp.no_sync():
            fsdp(x_of()).sum().backward()
            fsdp(x_of(4)).sum().backward()
        fsdp.sync_gradients()
        for got, want in flat_grads(fsdp, plain):
            torch.testing.assert_close(got, want)
        assert all(u.kept_grad is None for u in fsdp.units)

    await on_thread(body, solo)


async def test_into_inner_returns_the_plain_module_and_retires_the_wrapper(solo):
    def body(pg):
        fsdp, plain = gradstar.FSDP(script.NestedNet(0), pg,
                                    auto_wrap_policy=script.NESTED_POLICY), script.NestedNet(0)
        module = fsdp.into_inner()
        assert module is fsdp.module
        assert list(module.state_dict()) == list(plain.state_dict())
        for (name, p), (_, q) in zip(module.named_parameters(), plain.named_parameters(),
                                     strict=True):
            assert type(p) is nn.Parameter and torch.equal(p, q), name
        assert not module._forward_hooks and not module.blocks[0]._forward_pre_hooks
        x = x_of()
        torch.testing.assert_close(module(x), plain(x))
        for call in (lambda: fsdp(x), fsdp.sync_gradients, fsdp.into_inner):
            with pytest.raises(ConfigurationError, match="after into_inner\\(\\)"):
                call()

    await on_thread(body, solo)


async def test_update_shards_round_trips_a_flat_buffer_and_refuses_a_wrong_size(solo):
    def body(pg):
        fsdp = gradstar.FSDP(script.MLP(0), pg)
        opt = torch.optim.Adam(fsdp.parameters(), lr=0.01)
        fsdp(x_of()).sum().backward()
        opt.step()
        shards = list(fsdp.parameters())
        flat = torch.nn.utils.parameters_to_vector(shards)
        new = torch.randn(flat.shape, dtype=torch.float64)  # cast to the shards' float32
        fsdp.update_shards(new)
        assert list(fsdp.parameters()) == shards and opt.state[shards[0]]  # same Parameters
        torch.testing.assert_close(torch.nn.utils.parameters_to_vector(fsdp.parameters()),
                                   new.float())
        # The model is the new values: a plain MLP loaded from the full state dict agrees.
        plain = script.MLP(1)
        plain.load_state_dict(fsdp.full_state_dict())
        named = dict(plain.named_parameters())
        for unit in fsdp.units:  # one rank: its shard is the whole flat buffer, then padding
            want = unit.flatten([named[n] for n in unit.param_names])[:unit.layout.numel]
            torch.testing.assert_close(unit.shard.detach()[:unit.layout.numel], want)
        with torch.no_grad():
            torch.testing.assert_close(fsdp(x_of()), plain(x_of()))
        sizes = ", ".join(str(u.layout.shard_numel) for u in fsdp.units)
        for wrong, got in [(flat[:-1], f"a 1-D torch.float32 tensor of {flat.numel() - 1}"),
                           (flat.view(1, -1), "a 2-D torch.float32 tensor"),
                           (flat.long(), "a 1-D torch.int64 tensor"),
                           (flat.tolist(), "got list")]:
            with pytest.raises(ConfigurationError, match=(
                    rf"FSDP\.update_shards\(flat\) takes a 1-D floating-point tensor of rank 0's "
                    rf"{flat.numel()} shard elements \({len(fsdp.units)} units: {sizes}\).*"
                    rf"{got}")):
                fsdp.update_shards(wrong)
        torch.testing.assert_close(torch.nn.utils.parameters_to_vector(fsdp.parameters()),
                                   new.float())  # a refused call changed nothing

    await on_thread(body, solo)

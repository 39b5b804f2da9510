"""Sharding units without a process group: the plan's rules, and a unit's flatten, shard, bind
and gather bookkeeping (driven by a stand-in for the process group's all_gather)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from torch import nn

from gradstar.client.fsdp.plan import plan_units
from gradstar.client.fsdp.unit import ShardingUnit, joined_rows
from gradstar.client.work import Work
from gradstar.errors import ConfigurationError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.ones(3))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(2, 3)
        self.act = nn.Tanh()  # no parameters: never a unit by default
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(2))


def summary(plans) -> list[tuple[str, list[str]]]:
    return [(p.name, [q.name for q in p.params]) for p in plans]


def test_default_units_are_the_children_with_parameters_and_the_root_for_the_rest():
    assert summary(plan_units(Net())) == [
        ("", ["scale"]),
        ("embed", ["embed.weight", "embed.bias"]),
        ("blocks", ["blocks.0.gain", "blocks.0.inner.weight", "blocks.0.inner.bias",
                    "blocks.1.gain", "blocks.1.inner.weight", "blocks.1.inner.bias"]),
        ("head", ["head.weight", "head.bias"]),
    ]
    # Units and their parameters follow named_parameters() (the root's own come first there).
    assert [n for _, names in summary(plan_units(Net())) for n in names] == [
        n for n, _ in Net().named_parameters()]


def test_a_class_list_picks_units_at_any_depth_and_units_nest():
    plans = plan_units(Net(), [Block, nn.Linear])

    assert summary(plans) == [
        ("", ["scale"]),
        ("embed", ["embed.weight", "embed.bias"]),
        ("blocks.0", ["blocks.0.gain"]),  # its Linear is a unit of its own, nested inside
        ("blocks.0.inner", ["blocks.0.inner.weight", "blocks.0.inner.bias"]),
        ("blocks.1", ["blocks.1.gain"]),
        ("blocks.1.inner", ["blocks.1.inner.weight", "blocks.1.inner.bias"]),
        ("head", ["head.weight", "head.bias"]),
    ]
    assert plans[0].label == "<root>" and plans[1].label == "embed"
    assert plans[1].numel == 3 * 2 + 3


def test_a_single_class_and_a_callable_policy_work_too():
    assert [p.name for p in plan_units(Net(), Block)] == ["", "blocks.0", "blocks.1"]
    policy = [p.name for p in plan_units(Net(), lambda m: isinstance(m, nn.Sequential))]
    assert policy == ["", "blocks"]


def test_a_tied_parameter_belongs_to_the_innermost_unit_enclosing_every_use():
    net = Net()
    net.blocks[1].inner.weight = net.blocks[0].inner.weight
    by_name = dict(summary(plan_units(net, [nn.Linear])))

    assert "blocks.0.inner.weight" in by_name[""]  # the root encloses both Linears
    assert by_name["blocks.0.inner"] == ["blocks.0.inner.bias"]
    # Within one enclosing unit (blocks, by default) it stays there, once.
    plans = plan_units(net)
    blocks = next(p for p in plans if p.name == "blocks")
    tied = next(q for q in blocks.params if q.name == "blocks.0.inner.weight")
    assert tied.names == ("blocks.0.inner.weight", "blocks.1.inner.weight")
    assert [attr for _, attr in tied.slots] == ["weight", "weight"]
    assert len(blocks.params) == 5


def test_a_shared_module_is_one_slot_with_several_names():
    net = Net()
    net.head2 = net.head
    head = next(p for p in plan_units(net) if p.name == "head")

    assert head.params[0].names == ("head.weight", "head2.weight")
    assert len(head.params[0].slots) == 1


def test_units_without_parameters_are_dropped():
    net = Net()
    del net.scale

    # Tanh holds nothing; the root keeps the Blocks' gains.
    assert [p.name for p in plan_units(net, [nn.Tanh, nn.Linear])] == [
        "", "embed", "blocks.0.inner", "blocks.1.inner", "head"]
    # With the Blocks as units too, nothing is left for the root.
    assert [p.name for p in plan_units(net, [nn.Tanh, nn.Linear, Block])] == [
        "embed", "blocks.0", "blocks.0.inner", "blocks.1", "blocks.1.inner", "head"]


def test_a_unit_mixing_dtypes_is_refused():
    net = Net()
    net.head.bias.data = net.head.bias.data.double()
    with pytest.raises(ConfigurationError, match=r"sharding unit head mixes dtypes: head.weight "
                                                 r"is torch.float32, head.bias is torch.float64"):
        plan_units(net)


def test_a_unit_mixing_frozen_and_trainable_parameters_is_refused():
    net = Net()
    net.head.bias.requires_grad_(False)
    with pytest.raises(ConfigurationError, match=r"sharding unit head mixes frozen and "
                                                 r"trainable parameters \(head.bias is frozen"):
        plan_units(net)
    # Frozen as a whole is fine.
    net.head.requires_grad_(False)
    assert any(p.name == "head" for p in plan_units(net))


@pytest.mark.parametrize("policy", [42, [nn.Linear, 3], [], "Linear"])
def test_an_invalid_policy_is_a_configuration_error(policy):
    with pytest.raises(ConfigurationError, match="auto_wrap_policy"):
        plan_units(Net(), policy)


# -- ShardingUnit ---------------------------------------------------------------------------


def head_unit(world_size: int, rank: int, **kwargs) -> tuple[ShardingUnit, nn.Module]:
    net = Net()
    plan = next(p for p in plan_units(net) if p.name == "head")
    return ShardingUnit(3, plan, world_size, rank, **kwargs), net


def test_each_rank_keeps_its_contiguous_part_of_the_padded_flat_buffer():
    net = Net()
    whole = torch.cat([net.head.weight.detach().reshape(-1), net.head.bias.detach()])
    shards = [head_unit(4, r)[0].shard for r in range(4)]  # 8 elements: 2 per rank, no padding

    assert all(s.numel() == 2 and isinstance(s, nn.Parameter) for s in shards)
    assert torch.equal(torch.cat([s.detach() for s in shards]), whole)
    unit = head_unit(3, 2)[0]  # 8 elements over 3 ranks: 3 each, one of padding
    assert unit.layout.padding == 1
    assert torch.equal(unit.shard.detach(), torch.cat([whole[6:], torch.zeros(1)]))


class OneRank:
    """A stand-in for the process group's all_gather, as a 1-rank job returns it."""

    def __init__(self) -> None:
        self.sent = []

    def all_gather(self, x, async_op=False):
        self.sent.append(x.dtype)
        future = concurrent.futures.Future()
        future.set_result([x.clone()])
        return Work(future)


def test_bind_sets_views_of_the_gathered_buffer_and_unbind_removes_them():
    unit, net = head_unit(1, 0)
    original = net.head.weight.detach().clone()
    unit.detach_parameters()
    assert "weight" not in net.head._parameters
    assert net.head.weight.shape == (0,)  # a placeholder until bound

    pg = OneRank()
    unit.start_gather(pg)
    assert unit.gathering and unit.holding and unit.full is None
    full = unit.finish_gather()
    unit.bind(full)
    assert torch.equal(net.head.weight, original)
    assert net.head.weight.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert net.head(torch.ones(1, 3)).shape == (1, 2)
    unit.unbind()
    unit.release()
    assert not unit.holding
    assert net.head.weight is unit.placeholder and net.head.bias is unit.placeholder


def test_a_gather_travels_in_the_wire_dtype_and_comes_back_in_the_shards_dtype():
    unit, _ = head_unit(1, 0, param_dtype=torch.bfloat16)
    pg = OneRank()
    unit.start_gather(pg)
    full = unit.finish_gather()

    assert pg.sent == [torch.bfloat16]
    assert full.dtype == torch.float32
    torch.testing.assert_close(full, unit.shard.detach(), rtol=1e-2, atol=1e-2)


def test_load_flat_keeps_this_ranks_part():
    unit, _ = head_unit(4, 1)
    unit.load_flat(torch.arange(8.0))
    assert unit.shard.tolist() == [2.0, 3.0]


def test_joined_rows_views_all_gather_rows_without_copying():
    whole = torch.arange(12.0).view(3, 4)
    joined = joined_rows([whole[i] for i in range(3)])

    assert joined.tolist() == list(range(12))
    assert joined.data_ptr() == whole.data_ptr()
    # Rows of different buffers are concatenated instead.
    separate = [torch.arange(4.0), torch.arange(4.0, 8.0)]
    assert joined_rows(separate).tolist() == list(range(8))
    assert joined_rows(separate).data_ptr() not in {t.data_ptr() for t in separate}

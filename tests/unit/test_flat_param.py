"""FlatParamLayout: padding, shard ranges and the parts of parameters each rank holds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradstar.client.fsdp.flat_param import FlatParamLayout, ParamSlice
from gradstar.errors import ConfigurationError


def test_sizes_that_divide_need_no_padding():
    layout = FlatParamLayout([6, 2], world_size=4)

    assert (layout.numel, layout.shard_numel, layout.padded_numel, layout.padding) == (8, 2, 8, 0)
    assert layout.offsets == (0, 6)
    assert layout.split_sizes == (6, 2)


def test_sizes_that_do_not_divide_are_padded_to_a_multiple_of_the_world_size():
    # Linear(5, 9): a 9x5 weight and a bias of 9, 54 elements over 4 ranks.
    layout = FlatParamLayout([45, 9], world_size=4)

    assert (layout.shard_numel, layout.padded_numel, layout.padding) == (14, 56, 2)
    assert layout.split_sizes == (45, 9, 2)
    assert [layout.shard_range(r) for r in range(4)] == [
        range(0, 14), range(14, 28), range(28, 42), range(42, 56)]


def test_a_parameter_straddling_shards_is_split_between_their_ranks():
    layout = FlatParamLayout([45, 9], world_size=4)

    assert layout.slices(0) == [ParamSlice(param=0, param_start=0, shard_start=0, numel=14)]
    assert layout.slices(3) == [ParamSlice(0, 42, 0, 3), ParamSlice(1, 0, 3, 9)]


def test_a_shard_of_padding_only_holds_no_parameter():
    layout = FlatParamLayout([3], world_size=4)  # one element each, the last one padding

    assert layout.slices(2) == [ParamSlice(0, 2, 0, 1)]
    assert layout.slices(3) == []


def test_every_shard_holds_at_least_one_element():
    # Zero-size parameters still give every rank one element, so a unit's collectives always
    # carry data.
    layout = FlatParamLayout([0, 0], world_size=3)

    assert (layout.numel, layout.shard_numel, layout.padded_numel, layout.padding) == (0, 1, 3, 3)
    assert layout.split_sizes == (0, 0, 3)
    assert all(layout.slices(r) == [] for r in range(3))


@pytest.mark.parametrize(("numels", "world_size", "message"), [
    ([3], 0, "world_size must be a positive integer, got 0"),
    ([3], True, "world_size must be a positive integer, got True"),
    ([3, -1], 2, r"parameter sizes must not be negative, got \(3, -1\)"),
])
def test_invalid_layouts_are_configuration_errors(numels, world_size, message):
    with pytest.raises(ConfigurationError, match=message):
        FlatParamLayout(numels, world_size)


@pytest.mark.parametrize("rank", [-1, 2, 1.0])
def test_a_rank_out_of_range_is_a_configuration_error(rank):
    with pytest.raises(ConfigurationError, match="out of range for world_size 2"):
        FlatParamLayout([5], 2).slices(rank)


def test_layouts_compare_by_sizes_and_world_size():
    assert FlatParamLayout([4, 5], 2) == FlatParamLayout((4, 5), 2)
    assert FlatParamLayout([4, 5], 2) != FlatParamLayout([4, 5], 3)
    assert len({FlatParamLayout([4, 5], 2), FlatParamLayout([4, 5], 2)}) == 1


@given(numels=st.lists(st.integers(0, 50), min_size=1, max_size=8),
       world_size=st.integers(1, 9))
def test_the_ranks_slices_tile_every_parameter_exactly_once(numels, world_size):
    layout = FlatParamLayout(numels, world_size)

    assert layout.padded_numel == layout.shard_numel * world_size
    assert layout.padded_numel >= layout.numel
    assert layout.padding < world_size or layout.numel == 0
    assert sum(layout.split_sizes) == layout.padded_numel
    covered = [[0] * n for n in numels]
    for rank in range(world_size):
        shard = layout.shard_range(rank)
        previous_end = 0
        for piece in layout.slices(rank):
            assert piece.numel > 0
            assert previous_end <= piece.shard_start  # in flat-buffer order, no overlap
            previous_end = piece.shard_start + piece.numel
            assert previous_end <= layout.shard_numel
            # The piece sits where the flat buffer puts it.
            flat = layout.offsets[piece.param] + piece.param_start
            assert flat == shard.start + piece.shard_start
            for i in range(piece.param_start, piece.param_start + piece.numel):
                covered[piece.param][i] += 1
    assert all(count == 1 for counts in covered for count in counts)

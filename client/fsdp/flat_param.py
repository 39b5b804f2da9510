"""FlatParamLayout: where each parameter of a sharding unit sits in the unit's flat buffer, and
which contiguous slice of that buffer each rank keeps.

Pure arithmetic, no torch and no sockets:
:class:`~gradstar.client.fsdp.unit.ShardingUnit` uses it to flatten, shard and unflatten a
unit's parameters, and ``tests/unit/test_flat_param.py`` drives it directly.

A unit's parameters are laid end to end in registration order, then padded so that the flat
buffer splits into ``world_size`` equal shards; rank ``r`` keeps shard ``r``::

    flat buffer, padded_numel = world_size * shard_numel
    | p0 .............. | p1 ...... | p2 ........... |pad|
    |   rank 0's shard   |   rank 1's shard   |  rank 2's shard  |

A parameter may straddle a shard boundary (most do; sizes that do not divide by the world size
are the normal case, not an error). Padding is zeros, stays zeros (its gradient is zero) and is
never part of a parameter. Every shard holds at least one element, so every collective of a unit
carries data even for a unit of zero-size parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gradstar.errors import ConfigurationError


class ParamSlice(NamedTuple):
    """The part of parameter ``param`` inside one rank's shard: elements ``param_start :
    param_start + numel`` of the flattened parameter are elements ``shard_start : shard_start +
    numel`` of the shard."""

    param: int
    param_start: int
    shard_start: int
    numel: int


class FlatParamLayout:
    """The flat, padded, sharded layout of parameters of ``numels`` elements over ``world_size``.

    Raises:
        ConfigurationError: ``world_size`` is not a positive integer or a numel is negative.
    """

    def __init__(self, numels: Sequence[int], world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigurationError(f"world_size must be a positive integer, got {world_size!r}")
        self.numels = tuple(int(n) for n in numels)
        if any(n < 0 for n in self.numels):
            raise ConfigurationError(f"parameter sizes must not be negative, got {self.numels}")
        self.world_size = world_size
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        self.offsets = tuple(offsets)
        self.numel = total  # the parameters' elements, without padding
        self.shard_numel = max(1, -(-total // world_size))  # ceil, at least one element
        self.padded_numel = self.shard_numel * world_size
        self.padding = self.padded_numel - total

    def shard_range(self, rank: int) -> range:
        """The elements of the flat buffer that ``rank`` keeps."""
        self._check_rank(rank)
        return range(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    @property
    def split_sizes(self) -> tuple[int, ...]:
        """Sizes that split the flat buffer into the parameters, then the padding (if any)."""
        return (*self.numels, self.padding) if self.padding else self.numels

    def slices(self, rank: int) -> list[ParamSlice]:
        """The non-empty parts of parameters inside ``rank``'s shard, in flat-buffer order."""
        shard = self.shard_range(rank)
        found = []
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            start, stop = max(offset, shard.start), min(offset + numel, shard.stop)
            if start < stop:
                found.append(ParamSlice(index, start - offset, start - shard.start, stop - start))
        return found

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigurationError(
                f"rank {rank!r} is out of range for world_size {self.world_size}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FlatParamLayout):
            return NotImplemented
        return (self.numels, self.world_size) == (other.numels, other.world_size)

    def __hash__(self) -> int:
        return hash((self.numels, self.world_size))

    def __repr__(self) -> str:
        return (f"FlatParamLayout(numels={list(self.numels)}, world_size={self.world_size}, "
                f"shard_numel={self.shard_numel}, padding={self.padding})")


__all__ = ["FlatParamLayout", "ParamSlice"]

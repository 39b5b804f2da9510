"""The records FSDP's :mod:`~gradstar.client.fsdp.runtime` keeps: each collective issued for a
unit (what ``FSDP.last_collectives`` lists), what autograd saves instead of a tensor inside a
gathered buffer, and one backward pass's bookkeeping."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .unit import ShardingUnit


@dataclass(frozen=True)
class UnitCollective:
    """One collective FSDP issued for a unit: ``op`` is "all_gather" or "reduce_scatter",
    ``during`` is "forward", "forward prefetch", "backward" or "backward prefetch", ``dtype``
    the dtype it carried."""

    op: str
    unit: int
    during: str
    dtype: str


@dataclass(frozen=True)
class SavedParam:
    """What autograd keeps, instead of the tensor, of a tensor inside a gathered buffer."""

    unit: ShardingUnit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements from the start of the unit's gathered buffer
    version: int  # the shard's version counter when it was saved


@dataclass
class BackwardPass:
    """What the runtime tracks of one backward pass, from its first unit to its callback."""

    in_flight: deque = field(default_factory=deque)  # (unit, Work) of reductions, oldest first
    means: list = field(default_factory=list)  # (unit, this rank's mean gradient) when done
    gathered: set[int] = field(default_factory=set)
    reduced: set[int] = field(default_factory=set)
    held: dict = field(default_factory=dict)  # find_unused: unit index -> gradient to reduce
    order: list[int] = field(default_factory=list)  # units in the order backward needed them


__all__ = ["BackwardPass", "SavedParam", "UnitCollective"]

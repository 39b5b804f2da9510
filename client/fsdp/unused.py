"""FSDP's ``find_unused_parameters``: backward passes that reach different units on different
ranks (a branch, a conditional head, an expert no token of this rank was routed to).

Without it every rank must reach the same units in each backward, because each unit's
reduce-scatter starts from autograd when that unit's backward ends, and each unit needed again
in backward is gathered then: a rank that skips a unit skips its collectives and the ranks go
out of step. With it, :class:`~gradstar.client.fsdp.runtime.UnitRuntime` issues no collective
whose presence depends on the graph:

1. A unit forwarded with grad (a frozen one too) stays gathered until its backward (or the end
   of backward) frees it, so backward gathers nothing (the memory of torch's
   ``reshard_after_forward=False``: every such unit is whole from its forward to its backward).
2. A unit's gradient is held when its backward ends (:meth:`UnusedUnits.hold`), not reduced.
3. When backward ends (and in ``sync_gradients()``), one small all_reduce (op max) of a "this
   rank has a gradient" flag per unit tells every rank which units some rank has a gradient
   for; those are reduce-scattered in unit order, each rank sending zeros for a unit it did not
   reach (:meth:`UnusedUnits.reduce`). A unit no rank reached is not reduced and its
   ``shard.grad`` is left as it was (None after ``zero_grad()``), as torch's DDP leaves an
   unused parameter. A parameter inside a reached unit that took no part in the loss gets the
   zeros autograd gives it in the unit's flat gradient, so its mean is the others' gradient
   over the world size, as if this rank had computed a zero gradient for it.

Every rank must still run the same forwards (a unit's forward gathers it; call an expert with
an empty batch rather than not at all), and every rank's synchronising backward (and every
``no_sync()`` backward before a ``sync_gradients()``) must reach at least one trainable unit:
a rank that holds no gradient at all sends no flags. The reductions do not overlap backward.
"""

from __future__ import annotations

from collections import deque

import torch

from ..process_group.protocol import CollectiveGroup
from .unit import ShardingUnit

#: A reduce-scatter in flight holds a unit-sized gradient; as the runtime's own bound.
IN_FLIGHT = 2


class UnusedUnits:
    """Held gradients and the flag-agreed reduction of :mod:`this module's <.unused>` protocol,
    over ``units`` and ``pg``; ``start_reduction(unit, grad, during)`` issues one unit's
    reduce-scatter and returns its Work."""

    def __init__(self, units: list[ShardingUnit], pg: CollectiveGroup, start_reduction) -> None:
        self.units, self.process_group = units, pg
        self._start_reduction = start_reduction

    def hold(self, held: dict[int, torch.Tensor], unit: ShardingUnit,
             grad: torch.Tensor) -> None:
        """Keep ``grad`` (the unit's whole flat gradient) in ``held`` for the end of backward,
        added to what an earlier backward of the same pass, or ``no_sync()``, kept of it."""
        kept, unit.kept_grad = unit.kept_grad, None
        previous = held.pop(unit.index, kept)
        held[unit.index] = (grad.detach().clone(memory_format=torch.contiguous_format)
                            if previous is None else previous.add_(grad))

    def reduce(self, held: dict[int, torch.Tensor], during: str) -> list:
        """Reduce-scatter, in unit order, every unit some rank holds a gradient for (zeros
        where this rank holds none); the (unit, this rank's mean) pairs.

        Raises:
            CollectiveError and subclasses: the flags' all_reduce or a reduce-scatter failed.
        """
        mine = torch.tensor([float(unit.index in held) for unit in self.units],
                            dtype=torch.float64)
        used = self.process_group.all_reduce(mine, op="max").tolist()
        means, in_flight = [], deque()
        for unit, flag in zip(self.units, used, strict=True):
            if not flag:
                continue  # no rank reached it: its shard.grad stays as it is
            grad = held.get(unit.index)
            if grad is None:
                grad = torch.zeros(unit.layout.padded_numel, dtype=unit.dtype,
                                   device=unit.device)
            in_flight.append((unit, self._start_reduction(unit, grad, during)))
            if len(in_flight) > IN_FLIGHT:
                oldest, work = in_flight.popleft()
                means.append((oldest, work.wait()))
        return means + [(unit, work.wait()) for unit, work in in_flight]


__all__ = ["UnusedUnits"]

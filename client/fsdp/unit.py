"""ShardingUnit: one unit of FSDP at run time, its shard at rest and its full parameters while
gathered.

A unit is in one of three states:

* **sharded** (at rest): ``shard``, this rank's contiguous slice of the unit's flat padded
  buffer (see :class:`~gradstar.client.fsdp.flat_param.FlatParamLayout`), is the only storage of
  the unit's parameters. The modules' attributes for them are one empty placeholder tensor
  (size 0, the parameters' dtype), as with torch's FSDP, so code that only checks them (a
  module's ``repr``, ``self.bias is not None``) keeps working.
* **gathering**: an ``all_gather`` of the shards is in flight (``async_op=True``).
* **gathered**: ``full`` is the whole flat buffer in the shards' dtype, and :meth:`bind` has
  set views of it (shaped like the original parameters) as plain attributes of the modules, so
  their forward finds ``self.weight`` as usual.

Every tensor of a unit (shard, placeholder, gathered buffer) lives on the device the unit's
parameters were on, the CPU or a CUDA device; what :meth:`flatten` is given (a checkpoint's
tensors, say) is copied there.

:meth:`release` returns to sharded; the views are dropped with :meth:`unbind`. What autograd
sees of all this is :class:`~gradstar.client.fsdp.wrapper.FullyShardedDataParallel`'s business.
"""

from __future__ import annotations

import torch
from torch import nn

from gradstar.client.work import Work

from .flat_param import FlatParamLayout, ParamSlice
from .plan import Slot, UnitPlan


class ShardingUnit:
    """A unit's shard, layout and gather state; see the module docstring.

    ``param_dtype`` is the dtype shards travel in when gathered (None: their own dtype); the
    gathered buffer is cast back to the shards' dtype, the dtype the forward computes in.
    """

    def __init__(self, index: int, plan: UnitPlan, world_size: int, rank: int,
                 param_dtype: torch.dtype | None = None) -> None:
        self.index = index
        self.name = plan.name
        self.label = plan.label
        self.module = plan.module
        self.param_names: list[str] = [p.name for p in plan.params]
        self.shapes: list[torch.Size] = [p.param.shape for p in plan.params]
        self.slots: list[tuple[Slot, ...]] = [p.slots for p in plan.params]
        self.layout = FlatParamLayout([p.param.numel() for p in plan.params], world_size)
        self.rank = rank
        self.dtype: torch.dtype = plan.params[0].param.dtype
        self.device: torch.device = plan.params[0].param.device
        self.wire_dtype = param_dtype or self.dtype
        flat = self.flatten([p.param.detach() for p in plan.params])
        own = self.layout.shard_range(rank)
        self.shard = nn.Parameter(flat[own.start:own.stop].clone(),
                                  requires_grad=plan.params[0].param.requires_grad)
        self.placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
        self.full: torch.Tensor | None = None
        self.active = 0  # forwards of this unit's module now running (re-entrant calls)
        #: The unit's whole gradient summed over backward passes run inside no_sync(), not
        #: yet reduced (None: nothing kept).
        self.kept_grad: torch.Tensor | None = None
        self._work: Work | None = None

    # -- flat buffers --------------------------------------------------------------------------

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The flat padded buffer of ``tensors`` (one per parameter), in the shards' dtype, on
        the unit's device."""
        parts = [t.detach().reshape(-1).to(device=self.device, dtype=self.dtype)
                 for t in tensors]
        if self.layout.padding:
            parts.append(torch.zeros(self.layout.padding, dtype=self.dtype, device=self.device))
        return torch.cat(parts)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat padded buffer, one per parameter, in the parameters' shapes."""
        views = torch.split(flat, self.layout.split_sizes)
        return [v.view(shape) for v, shape in zip(views, self.shapes, strict=False)]

    def load_flat(self, flat: torch.Tensor) -> None:
        """Overwrite the shard with this rank's part of a whole flat padded buffer (on any
        device)."""
        own = self.layout.shard_range(self.rank)
        with torch.no_grad():
            self.shard.copy_(flat[own.start:own.stop])

    def slices(self) -> list[ParamSlice]:
        """The parts of parameters this rank's shard holds."""
        return self.layout.slices(self.rank)

    # -- gathering -----------------------------------------------------------------------------

    @property
    def gathering(self) -> bool:
        return self._work is not None

    @property
    def holding(self) -> bool:
        """Gathered, or being gathered: memory for the full parameters is in use."""
        return self._work is not None or self.full is not None

    def start_gather(self, pg) -> None:
        """Issue the all_gather of every rank's shard (``async_op=True``) in ``wire_dtype``.

        The shard is copied into the gather's buffer before this returns, so it may change
        afterwards without affecting the result.
        """
        send = self.shard.detach()
        if send.dtype != self.wire_dtype:
            send = send.to(self.wire_dtype)
        self._work = pg.all_gather(send, async_op=True)

    def finish_gather(self) -> torch.Tensor:
        """Wait for the gather; ``full`` becomes the whole flat buffer in the shards' dtype.

        Raises:
            CollectiveError and subclasses: the all_gather failed (the unit stays sharded).
        """
        work, self._work = self._work, None
        joined = joined_rows(work.wait())
        self.full = joined if joined.dtype == self.dtype else joined.to(self.dtype)
        return self.full

    def release(self, *, wait: bool = True) -> None:
        """Back to sharded. ``wait``: let a gather still in flight finish first, so that its
        error (if any) is raised here rather than lost.

        Raises:
            CollectiveError and subclasses: with ``wait``, the in-flight gather failed.
        """
        work, self._work, self.full = self._work, None, None
        if work is not None and wait:
            work.wait()

    # -- the modules' view of the parameters ---------------------------------------------------

    def bind(self, flat: torch.Tensor) -> None:
        """Set views of ``flat`` (the gathered buffer, or autograd's output for it) as the
        modules' parameter attributes."""
        for view, slots in zip(self.unflatten(flat), self.slots, strict=True):
            for module, attr in slots:
                # A plain instance attribute: the parameter's entry in module._parameters was
                # removed at construction, and nn.Module.__getattr__ is only asked when normal
                # lookup fails.
                module.__dict__[attr] = view

    def unbind(self) -> None:
        """Put the empty placeholder back in place of the views."""
        for slots in self.slots:
            for module, attr in slots:
                module.__dict__[attr] = self.placeholder

    def detach_parameters(self) -> None:
        """Remove the original parameters from their modules: the shard replaces them."""
        for slots in self.slots:
            for module, attr in slots:
                module._parameters.pop(attr, None)
        self.unbind()

    def restore_parameters(self, flat: torch.Tensor) -> None:
        """Make the unit's parameters plain ``nn.Parameter`` attributes of their modules again,
        with the values of ``flat`` (the whole flat buffer; copied), trainable as the shard
        is. A tied parameter is one Parameter in each of its slots, as before."""
        for view, slots in zip(self.unflatten(flat), self.slots, strict=True):
            param = nn.Parameter(view.detach().clone(), requires_grad=self.shard.requires_grad)
            for module, attr in slots:
                module.__dict__.pop(attr, None)
                module._parameters[attr] = param

    def __repr__(self) -> str:
        return (f"ShardingUnit({self.index}, {self.label}, params={len(self.param_names)}, "
                f"numel={self.layout.numel}, shard_numel={self.layout.shard_numel})")


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of ``all_gather``'s per-rank results.

    ``ProcessGroup.all_gather`` returns the rows of one contiguous ``(world_size, n)`` buffer;
    viewing them as one flat tensor avoids copying a whole unit on every gather. Any other list
    is concatenated.
    """
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    step = first.numel() * first.element_size()
    if all(p.is_contiguous() and p.dtype == first.dtype and p.numel() == first.numel()
           and p.untyped_storage().data_ptr() == storage
           and p.data_ptr() == first.data_ptr() + i * step for i, p in enumerate(parts)):
        return first.as_strided((first.numel() * len(parts),), (1,), first.storage_offset())
    return torch.cat([p.reshape(-1) for p in parts])


__all__ = ["ShardingUnit", "joined_rows"]

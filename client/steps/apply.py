"""How a sync-mode rank applies one closed step (:class:`~.sync.StepSync`): the aggregate's
values written into the parameters' ``.grad`` and into the module buffers, and the
``optimizer.step`` a StepSync puts in the user's optimizer, which applies the hub's
aggregates instead of the local gradient."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from gradstar.errors import ConfigurationError


def write_grads(params: list[torch.nn.Parameter], values: np.ndarray) -> None:
    """Write the flat aggregate ``values`` (DDP's parameter order) into each ``.grad``."""
    flat = torch.from_numpy(values)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            part = flat[offset:offset + n].view(p.shape)
            if p.grad is None:
                p.grad = part.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(part)
            offset += n


def write_buffers(buffers: list[torch.Tensor], values: np.ndarray) -> None:
    """Write the buffers' part of an aggregate into them (integers rounded)."""
    flat = torch.from_numpy(values)
    offset = 0
    with torch.no_grad():
        for b in buffers:
            part = flat[offset:offset + b.numel()].view(b.shape)
            b.copy_(part if b.is_floating_point() else part.round())
            offset += b.numel()


def catch_up_step(sync_ref: weakref.ref, scheduled: bool):
    """``optimizer.step`` while a :class:`~.sync.StepSync` owns the optimizer: a bound method
    (torch's LR schedulers wrap ``step.__func__``).

    ``scheduled``: a scheduler made earlier had wrapped the step this one replaces. Its
    ``step()`` warns that ``optimizer.step()`` was overridden unless the step carries its mark,
    and that it ran before ``optimizer.step()`` unless the optimizer says a step was called;
    this one keeps both true (a call may apply no aggregate yet, but it is the user's step)."""

    def step(optimizer, closure=None):
        if closure is not None:
            raise ConfigurationError(
                "optimizer.step(closure) re-evaluates the loss, which a sync mode cannot "
                "replay on other ranks; call optimizer.step() without a closure")
        if scheduled:
            optimizer._opt_called = True
        sync = sync_ref()
        if sync is not None:
            sync.catch_up()

    if scheduled:
        step._wrapped_by_lr_sched = True  # read through the bound method's __func__
    return step


__all__ = ["catch_up_step", "write_buffers", "write_grads"]

"""The replicas of :class:`~gradstar.client.data_parallel.DataParallel` and the threads that
run them.

Replicas. Replica 0 is the primary module itself: its parameters take their gradients directly
and its buffers' in-place updates (batch-norm statistics from shard 0) are kept, as with
torch's DataParallel. Every other replica is made again at each forward (:func:`replicate`), so
it always computes with the primary's current parameters (after ``optimizer.step()``):

* a shallow copy of every submodule (attributes shared, as in torch), whose parameters are
  *autograd copies* of the primary's, ``p.to(device, copy=True)``, also on the primary's own
  device (so CPU replicas take the very path of CUDA ones; a copy costs memory, not much time).
  Backward therefore sums every replica's gradient of ``p`` into the primary's ``p.grad``, once
  per backward pass: autograd adds the gradients arriving at a leaf before it accumulates them
  (one ``post_accumulate_grad`` hook call per pass, as DDP needs).
* its own copy of every buffer (broadcast from the primary at each forward; updates made in a
  replica other than 0 are dropped with the replica).

Threads. :func:`parallel_apply` runs replica 0 on the calling thread and each other replica on
a thread of its own, with the caller's grad mode, inference mode and autocast settings (all
thread-local in torch) and, on a CUDA device, the caller's current stream for that device. An
error in any replica is raised in the caller once every replica has finished, with a note that
names the replica and its device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch
from torch import nn

from .scatter import Shard


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One fresh replica of ``module`` per entry of ``devices`` (see the module docstring):
    autograd copies of its parameters, copies of its buffers, its submodules shallow-copied.
    ``module`` itself (replica 0 of DataParallel) is not among them."""
    params = {id(p): p for p in module.parameters()}
    buffers = {id(b): b for b in module.buffers()}
    replicas = []
    for device in devices:
        copies = {key: p.to(device, copy=True) for key, p in params.items()}
        with torch.no_grad():
            copies.update((key, b.to(device, copy=True)) for key, b in buffers.items())
        replicas.append(_shallow_copy(module, copies))
    return replicas


def _shallow_copy(root: nn.Module, tensors: dict[int, torch.Tensor]) -> nn.Module:
    """``root`` and its submodules copied without their tensors, which come from ``tensors``
    (by the id of the original); a submodule or tensor shared in ``root`` stays shared."""
    copies: dict[int, nn.Module] = {}
    for module in root.modules():
        replica = module.__new__(type(module))
        replica.__dict__ = module.__dict__.copy()
        # Plain dict entries, as torch's replicas do: a copy of a parameter is not a leaf, so
        # it cannot be an nn.Parameter, and nn.Module reads its tensors from these dicts.
        replica._parameters = {name: None if p is None else tensors[id(p)]
                               for name, p in module._parameters.items()}
        replica._buffers = {name: None if b is None else tensors[id(b)]
                            for name, b in module._buffers.items()}
        copies[id(module)] = replica
    for replica in copies.values():
        replica._modules = {name: None if m is None else copies[id(m)]
                            for name, m in replica._modules.items()}
    return copies[id(root)]


def parallel_apply(replicas: Sequence[nn.Module], shards: Sequence[Shard],
                   devices: Sequence[torch.device]) -> list:
    """``replicas[i](*args_i, **kwargs_i)`` for every ``shards[i] = (args_i, kwargs_i)`` at once,
    on ``devices[i]``, replica 0 on this thread and each other on a thread of its own with the
    caller's grad mode, autocast and CUDA streams; the outputs in replica order. (torch's
    ``parallel_apply`` takes the inputs and the kwargs as two lists instead.)

    Raises:
        BaseException: the first replica's error (by replica index), with a note naming it.
    """
    settings = _ThreadSettings.of_caller(devices[:len(shards)])
    results: list = [None] * len(shards)
    errors: list[BaseException | None] = [None] * len(shards)

    def run(i: int) -> None:
        args, kwargs = shards[i]
        try:
            with settings.applied(devices[i]):
                results[i] = replicas[i](*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller below
            exc.add_note(f"raised in DataParallel's replica {i} on {devices[i]}")
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"gradstar-dp-replica-{i}",
                                daemon=True) for i in range(1, len(shards))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


class _ThreadSettings:
    """What torch keeps per thread and a replica's thread must share with the caller."""

    def __init__(self, grad: bool, inference: bool, autocast: dict, streams: dict) -> None:
        self.grad, self.inference = grad, inference
        self.autocast = autocast  # device type -> (enabled, dtype)
        self.streams = streams  # CUDA device -> the caller's current stream there

    @classmethod
    def of_caller(cls, devices: Sequence[torch.device]) -> _ThreadSettings:
        autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                    for kind in {"cpu", *(d.type for d in devices)}}
        streams = {d: torch.cuda.current_stream(d) for d in set(devices) if d.type == "cuda"}
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
                   streams)

    @contextlib.contextmanager
    def applied(self, device: torch.device):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(self.streams[device]))
            yield


__all__ = ["parallel_apply", "replicate"]

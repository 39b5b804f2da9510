"""DataParallel: one process drives several local devices, and with a process group several such
processes (one per host) train together.

A training step (the protocol, per process):

1. ``forward`` splits the arguments along dim 0 into one shard per replica
   (:mod:`~gradstar.client.data_parallel.scatter`), makes a replica of the module on every
   device but the first from the primary's current parameters and buffers, runs the replicas on
   threads at once (:mod:`~gradstar.client.data_parallel.replicas`) and concatenates their
   outputs on ``output_device``.
2. ``loss.backward()`` sums every replica's gradient into the primary module's ``.grad``:
   the replicas' parameters are autograd copies of the primary's. The optimizer built on
   ``module.parameters()`` (or the wrapper's, the same tensors) steps the primary; the next
   forward replicates the new values.
3. With a ``process_group``, the primary is further wrapped in
   :class:`~gradstar.client.ddp.DistributedDataParallel` (built once, here): its parameters and
   buffers come from rank 0 at construction, buffers again before each forward, and each
   backward leaves the *mean over processes* of every process's summed gradient in ``.grad``,
   bucket by bucket while backward runs, as DDP does. Each process passes its own part of the
   global batch; a mean loss over that part then gives the gradient of the mean loss over the
   global batch. Parameters that get no gradient on a step are allowed
   (``find_unused_parameters``): those no process used keep ``grad=None``, as they would
   without a process group.

:meth:`DataParallel.forward_parallel` is steps 1 and 4 left to the caller: one input per
device in, one output per device out, not split or gathered.

Where this differs from torch's DataParallel: CPU replicas are allowed and a device may be
named more than once (:mod:`~gradstar.client.data_parallel.devices`); the split
differs by at most one row between shards (torch's ``chunk`` may leave devices idle); a
process group turns it into one DDP rank per process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from gradstar.client.process_group.protocol import CollectiveGroup
from gradstar.client.torch_common import module_device
from gradstar.errors import ConfigurationError
from gradstar.sync_modes import Synchronous, SyncMode

from .devices import DeviceLike, resolve_device, resolve_devices
from .replicas import parallel_apply, replicate
from .scatter import Shard, gather, place, scatter


class DataParallel(nn.Module):
    """Runs ``module`` on several local devices at once, splitting each batch along dim 0.

    A drop-in for ``torch.nn.DataParallel``: ``forward`` returns the module's output for the
    whole batch on ``output_device``, ``loss.backward()`` leaves the gradient of the whole
    batch in the wrapped module's ``.grad``, ``.module`` is the wrapped module and
    ``state_dict()`` keys carry the ``module.`` prefix. Build the optimizer on
    ``model.parameters()`` (the wrapped module's). See the module docstring for the protocol.

    Args:
        module: the model, with every parameter and buffer on ``device_ids[0]``.
        device_ids: the replicas' devices, one replica each: CUDA indices, ``torch.device``
            objects or strings, ``"cpu"`` included (for tests); default every visible CUDA
            device.
        output_device: where outputs are gathered; default ``device_ids[0]``.
        process_group: a blocking :class:`gradstar.ProcessGroup` (one process per host): the
            gradients are then averaged over its processes after every backward, as with
            :class:`gradstar.DDP`. Every process must construct the wrapper with the same
            module structure and run the same forwards and backwards.
        sync_mode: with a process group, when a step of the processes is complete, as DDP's
            ``sync_mode`` (:mod:`gradstar.sync_modes`; default Synchronous; later
            :meth:`set_sync_mode`). Each process contributes its replicas' summed gradient.
        optimizer: the torch optimizer over ``module``'s parameters, which every mode but
            Synchronous needs (its ``step()`` then applies the hub's aggregates), as DDP's.

    Raises:
        ConfigurationError: no devices (an empty ``device_ids``, or None where no CUDA device
            is visible: the message says "no devices"), a device that is not the CPU or a
            visible CUDA device, a module not on ``device_ids[0]``, a ``sync_mode`` or
            ``optimizer`` without a process group, or (with one) what :class:`gradstar.DDP`
            refuses.
        CollectiveError and subclasses: the process group's construction broadcast failed.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None,
                 process_group: CollectiveGroup | None = None, *, sync_mode: SyncMode | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.device_ids: list[torch.device] = resolve_devices(device_ids)
        self.output_device = (self.device_ids[0] if output_device is None
                              else resolve_device(output_device, "output_device"))
        device = module_device("DataParallel", module)
        if device != self.device_ids[0]:
            raise ConfigurationError(
                f"DataParallel's module must be on device_ids[0] ({self.device_ids[0]}), the "
                f"primary replica's device; it is on {device}: move it there with "
                ".to(device) first")
        if process_group is None and (sync_mode is not None or optimizer is not None):
            raise ConfigurationError(_NO_GROUP.format(call="sync_mode= or optimizer="))
        self.module = module
        self.process_group = process_group
        # Neither is a registered submodule: state_dict(), train() and to() see the user's
        # module once, under "module.", as with torch's DataParallel.
        object.__setattr__(self, "_replicated", _ReplicatedForward(self))
        object.__setattr__(self, "_ddp", None)
        if process_group is not None:
            from gradstar.client.ddp import DistributedDataParallel

            object.__setattr__(self, "_ddp", DistributedDataParallel(
                self._replicated, process_group, find_unused_parameters=True,
                sync_mode=sync_mode, optimizer=optimizer))

    def forward(self, *inputs, **kwargs):
        """Scatter, replicate, run the replicas in parallel, gather (module docstring).

        Raises:
            ConfigurationError: the replicas returned differently structured outputs.
            CollectiveError and subclasses: with a process group, the buffer broadcast failed.
            Exception: whatever the module raised, with a note naming the replica and device.
        """
        if self._ddp is not None:
            return self._ddp(*inputs, **kwargs)
        return self._replicated(*inputs, **kwargs)

    def forward_parallel(self, inputs: Sequence, kwargs: Sequence[Mapping] | None = None) -> list:
        """One forward per device, each on its own input: ``inputs[i]`` (a tuple or list of
        positional arguments, or one argument) and ``kwargs[i]`` go to the replica on
        ``device_ids[i]``, and output ``i`` comes back on that device, not gathered: torch's
        ``parallel_apply(replicate(module, device_ids), inputs, kwargs)`` in one call, for
        inputs that are not one batch to split. Tensors in an input are moved to its device.
        Backward through the outputs sums every replica's gradient into the wrapped module's
        ``.grad``, as after :meth:`forward`; with a process group the backward also averages
        over processes (every process calls it likewise, with as many devices).

        Raises:
            ConfigurationError: ``inputs`` or ``kwargs`` has not one entry per device.
            CollectiveError and subclasses: with a process group, the buffer broadcast failed.
            Exception: whatever the module raised, with a note naming the replica and device.
        """
        shards = _Placed(place(inputs, kwargs, self.device_ids))
        return self._ddp(shards) if self._ddp is not None else self._replicated(shards)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside accumulate gradients in this process only
        (the next synchronising backward, or :meth:`sync_gradients`, averages the sums over
        processes). Without a process group there is nothing to skip: a plain context."""
        with self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext():
            yield

    def sync_gradients(self) -> None:
        """Average every parameter's current ``.grad`` over the processes now (every process
        must call it), for gradients accumulated in :meth:`no_sync`. Without a process group:
        nothing to do.

        Raises:
            CollectiveError and subclasses: an all_reduce failed.
        """
        if self._ddp is not None:
            self._ddp.sync_gradients()

    # -- sync modes (with a process group: its DDP's) ------------------------------------------

    @property
    def sync_mode(self) -> SyncMode:
        """When a step of the processes is complete; Synchronous without a process group."""
        return Synchronous() if self._ddp is None else self._ddp.sync_mode

    def set_sync_mode(self, mode: SyncMode) -> None:
        """Switch sync mode, as :meth:`gradstar.DDP.set_sync_mode` (every process, between
        steps; every mode but Synchronous needs ``optimizer=`` at construction).

        Raises:
            ConfigurationError: no process group, not a sync mode, or a mode other than
                Synchronous without ``optimizer=``.
        """
        if self._ddp is None:
            raise ConfigurationError(_NO_GROUP.format(call="set_sync_mode()"))
        self._ddp.set_sync_mode(mode)

    def synchronize(self) -> None:
        """Every process: wait until every gradient sent so far is aggregated and applied, as
        :meth:`gradstar.DDP.synchronize`; nothing to do without a process group or in
        Synchronous mode.

        Raises:
            StepTimeoutError: the other live processes did not arrive in time.
        """
        if self._ddp is not None:
            self._ddp.synchronize()

    def sync_stats(self):
        """What this process saw of its sync mode (:class:`~gradstar.client.steps.stats.
        SyncStats`), as :meth:`gradstar.DDP.sync_stats`; None without a process group or
        before any mode other than Synchronous."""
        return None if self._ddp is None else self._ddp.sync_stats()

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        world = "" if self.process_group is None else \
            f", processes={self.process_group.world_size}"
        return f"device_ids=[{devices}], output_device={self.output_device}{world}"


class _ReplicatedForward(nn.Module):
    """The primary module behind one forward over every replica: what DDP wraps when a process
    group is given (its parameters and buffers are the primary's)."""

    def __init__(self, wrapper: DataParallel) -> None:
        super().__init__()
        self.module = wrapper.module
        self.device_ids = wrapper.device_ids
        self.output_device = wrapper.output_device

    def forward(self, *inputs, **kwargs):
        # forward_parallel's inputs come through DDP's forward (which arms its hooks) as one
        # _Placed argument: already one per device, and their outputs stay apart.
        placed = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], _Placed) else None
        shards = placed.shards if placed is not None else scatter(inputs, kwargs,
                                                                  self.device_ids)
        devices = self.device_ids[:len(shards)]
        replicas = [self.module, *replicate(self.module, devices[1:])]
        outputs = parallel_apply(replicas, shards, devices)
        return outputs if placed is not None else gather(outputs, self.output_device)


class _Placed:
    """forward_parallel's inputs, one (args, kwargs) per device (an object DDP's forward passes
    on untouched)."""

    def __init__(self, shards: list[Shard]) -> None:
        self.shards = shards


_NO_GROUP = ("DataParallel.{call} needs a process_group: a sync mode decides when a step of "
             "several processes is complete, and one process's replicas always step together")

__all__ = ["DataParallel"]

"""UnitRuntime: what happens to FSDP's sharding units during forward and backward.

Every rank follows this protocol in the same order, so the hub matches the collectives.

Forward. A pre-forward hook on each unit's module all-gathers the unit (or waits for its
prefetched gather) and, with ``prefetch``, first starts the gather of the next unit in the
recorded forward order so that it overlaps this unit's compute. The gathered flat buffer goes
through :class:`_UnitGather`, an autograd Function from the unit's shard to the full buffer,
and views of its output shaped like the original parameters become the modules' attributes
(:meth:`ShardingUnit.bind`). A post-forward hook drops the views and frees the buffer (reshard
after forward). For that freeing to be real, :meth:`UnitRuntime.run` runs the module under
``torch.autograd.graph.saved_tensors_hooks``: a tensor autograd would keep for backward that
lives in a gathered buffer (a weight, ``weight.t()``, ...) is kept as a reference (unit, shape,
strides, offset) instead of the tensor.

Backward. Unpacking such a reference gathers its unit again (prefetching the next one in the
recorded backward order) and returns the same view of the new buffer; a unit whose backward
needs no parameter (a first layer, whose input needs no gradient) is not gathered at all. Once
every parameter of a unit has its gradient, autograd calls ``_UnitGather.backward`` with the
gradient of the unit's whole flat buffer (every view's gradient in place, zeros in the
padding): the unit is freed again and the gradient is reduce-scattered with ``op="mean"``
(``async_op=True``) while backward goes on, at most :data:`REDUCTIONS_IN_FLIGHT` at a time (a
further one first waits for the oldest, whose unit-sized gradient is then freed). A callback
queued with the autograd engine waits for the rest when backward ends and adds the mean of
this rank's shard to ``shard.grad`` (so ``.grad`` accumulates over backward passes, as in
torch) before ``loss.backward()`` returns.

Without sync. A forward run inside ``FSDP.no_sync()`` marks its graph: that backward frees each
unit as usual but adds the unit's whole (unsharded, unreduced) gradient to ``unit.kept_grad``
instead of reducing it, at the cost of one unit-sized buffer per unit until it is reduced, as
torch's FSDP ``no_sync`` costs. The next synchronising backward adds a unit's kept gradient to
its own before the reduce-scatter; ``FSDP.sync_gradients()`` reduce-scatters every kept one at
once (in unit order, tagged "sync_gradients" in ``last_collectives``). Either clears it, so a
gradient is never reduced twice, and ``sync_gradients()`` with nothing kept issues nothing.

Memory. At most the running unit, the units enclosing it and one prefetched unit are gathered at
a time (the autograd engine runs a unit's ``_UnitGather.backward`` after all of the unit's own
operations, so a unit gathered for backward is freed before the previous unit's backward
starts, except for enclosing units, whose forward also enclosed it). The forward and backward
orders are recorded in the first forward and backward; until then nothing is prefetched.

Devices. Units live on the module's device (the CPU or one CUDA device). The process group
copies a CUDA shard or gradient to host memory when its collective is issued and returns the
result on the same device, so gathered buffers and ``shard.grad`` are always on the unit's
device.

Branches (``find_unused_parameters``): units stay gathered from forward to backward and are
reduced when backward ends, in unit order, as :mod:`~gradstar.client.fsdp.unused` describes.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections import deque
from collections.abc import Sequence

import torch

from ..process_group.protocol import CollectiveGroup
from .records import BackwardPass, SavedParam, UnitCollective
from .unit import ShardingUnit
from .unused import UnusedUnits

# Each reduction in flight holds a whole unit's gradient until the hub has taken it; backward
# computes faster than the hub reduces, so without a bound every unit's gradient would pile up.
REDUCTIONS_IN_FLIGHT = 2


class _UnitGather(torch.autograd.Function):
    """Autograd's edge from a unit's shard to its gathered flat buffer (see the module
    docstring). Returns no gradient itself: the runtime writes ``shard.grad`` when backward
    ends."""

    @staticmethod
    def forward(ctx, shard, runtime, unit):
        # Whether this graph's backward reduces is decided at forward time, as with no_sync().
        ctx.runtime, ctx.unit, ctx.sync = runtime, unit, runtime.require_sync
        # A new tensor object on the same memory: the unit's buffer itself stays a plain tensor.
        return unit.full.detach()

    @staticmethod
    def backward(ctx, grad):
        if ctx.sync:
            ctx.runtime.reduce_unit_gradient(ctx.unit, grad)
        else:
            ctx.runtime.keep_unit_gradient(ctx.unit, grad)
        return None, None, None


class UnitRuntime:
    """Gathers, frees and reduces ``units`` over ``pg`` around forward and backward.

    ``last_collectives`` lists every :class:`UnitCollective` since the last :meth:`run` began;
    ``peak_gathered_numel`` is the most flat-buffer elements gathered, or being gathered, at once
    since then.
    """

    def __init__(self, units: list[ShardingUnit], pg: CollectiveGroup, *, prefetch: bool,
                 wire: str | None = None, find_unused: bool = False) -> None:
        self.units = units
        self.process_group = pg
        self.prefetch = prefetch
        self.wire = wire  # the compressed format of the gradients' reduce-scatter
        self.last_collectives: list[UnitCollective] = []
        self.peak_gathered_numel = 0
        self.require_sync = True  # False inside FSDP.no_sync(): backward keeps gradients
        self.unused = UnusedUnits(units, pg, self._start_reduction) if find_unused else None
        self._by_storage: dict[int, ShardingUnit] = {}  # gathered buffers, by storage address
        self._forward_next: dict[int, int] | None = None  # recorded orders, as successor maps
        self._backward_next: dict[int, int] | None = None
        self._forward_seen: list[int] = []
        self._backward: BackwardPass | None = None
        me = weakref.ref(self)  # the hooks must not keep a discarded runtime alive
        self._hook_handles = []
        for unit in units:
            self._hook_handles += [
                unit.module.register_forward_pre_hook(_pre_hook(me, unit), prepend=True),
                unit.module.register_forward_hook(_post_hook(me, unit), always_call=True),
            ]

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass through the units is running (its callback is queued)."""
        return self._backward is not None

    def close(self) -> None:
        """Remove the hooks from the units' modules: they run as plain modules again."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # -- forward -------------------------------------------------------------------------------

    def run(self, module, *inputs, **kwargs):
        """``module(*inputs, **kwargs)`` with what autograd saves of gathered buffers replaced
        by references, so the buffers can be freed after each unit's forward.

        Raises:
            CollectiveError and subclasses: a gather failed (every unit is sharded again).
        """
        self._abandon_unfinished_backward()
        self.last_collectives = []
        self.peak_gathered_numel = self._gathered_numel()
        self._forward_seen = []
        finished = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                output = module(*inputs, **kwargs)
            finished = True
        finally:
            self._end_forward(finished)
        if self._forward_next is None:
            self._forward_next = _successors(self._forward_seen)
        return output

    def before_unit_forward(self, unit: ShardingUnit) -> None:
        unit.active += 1
        if unit.active > 1:
            return  # a re-entrant call: the parameters are already bound
        if unit.index not in self._forward_seen:
            self._forward_seen.append(unit.index)
        flat = self._materialise(unit, "forward")
        if torch.is_grad_enabled() and unit.shard.requires_grad:
            flat = _UnitGather.apply(unit.shard, self, unit)
        unit.bind(flat)

    def after_unit_forward(self, unit: ShardingUnit) -> None:
        if unit.active == 0:
            return  # its pre-forward hook failed before counting it
        unit.active -= 1
        if unit.active == 0:
            unit.unbind()
            if not self._kept_for_backward(unit):
                self._release(unit)  # reshard after forward

    def _end_forward(self, finished: bool) -> None:
        """Free what is still gathered: prefetches nobody used, or everything after a failure
        (without waiting for gathers in flight then, so nothing blocks the error)."""
        error = None
        for unit in self.units:
            if unit.active:
                unit.active = 0
                unit.unbind()
            try:
                if not (finished and self._kept_for_backward(unit)):
                    self._release(unit, wait=finished)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def _kept_for_backward(self, unit: ShardingUnit) -> bool:
        """find_unused: a unit forwarded with grad stays gathered until backward frees it (a
        frozen one too: its weights may be needed for an input's gradient, and a gather in
        backward would be issued only on the ranks that reach it)."""
        return (self.unused is not None and torch.is_grad_enabled() and unit.full is not None
                and unit.index in self._forward_seen)

    # -- gathering -----------------------------------------------------------------------------

    def _materialise(self, unit: ShardingUnit, during: str) -> torch.Tensor:
        """The unit's gathered buffer: waits for its prefetch or gathers it now, and first
        starts the prefetch of the unit expected next."""
        if unit.full is None:
            if not unit.gathering:
                self._start_gather(unit, during)
            self._prefetch_after(unit, during)
            full = unit.finish_gather()
            self._by_storage[full.untyped_storage().data_ptr()] = unit
        return unit.full

    def _start_gather(self, unit: ShardingUnit, during: str) -> None:
        unit.start_gather(self.process_group)
        self.peak_gathered_numel = max(self.peak_gathered_numel, self._gathered_numel())
        self.last_collectives.append(
            UnitCollective("all_gather", unit.index, during, _dtype_name(unit.wire_dtype)))
        if during.startswith("backward") and self._backward is not None:
            self._backward.gathered.add(unit.index)

    def _prefetch_after(self, unit: ShardingUnit, during: str) -> None:
        order = self._forward_next if during == "forward" else self._backward_next
        if not self.prefetch or order is None or unit.index not in order:
            return
        following = self.units[order[unit.index]]
        if following.holding:
            return
        if during == "forward" and following.index in self._forward_seen:
            return
        bw = self._backward
        if during == "backward" and (bw is None or following.index in bw.gathered
                                     or following.index in bw.reduced):
            return
        self._start_gather(following, f"{during} prefetch")

    def _release(self, unit: ShardingUnit, *, wait: bool = True) -> None:
        if not unit.holding:
            return
        if unit.full is not None:
            self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
        unit.release(wait=wait)

    def _gathered_numel(self) -> int:
        return sum(unit.layout.padded_numel for unit in self.units if unit.holding)

    # -- what autograd saves -------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor):
        if not self._by_storage:
            return tensor
        try:
            address = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage (subclasses, meta)
            return tensor
        unit = self._by_storage.get(address)
        # Addresses are only unique within one device's memory: the device must match too.
        if unit is None or tensor.dtype != unit.full.dtype or tensor.device != unit.full.device:
            return tensor
        return SavedParam(unit, tensor.shape, tensor.stride(),
                          tensor.storage_offset() - unit.full.storage_offset(),
                          unit.shard._version)

    def _unpack(self, saved):
        if not isinstance(saved, SavedParam):
            return saved
        unit = saved.unit
        if unit.shard._version != saved.version:
            raise RuntimeError(
                f"the shard of sharding unit {unit.label} was modified in place (for example "
                "by optimizer.step() or load_full_state_dict()) between the forward and this "
                "backward, which needs the parameters the forward used"
            )
        bw = self._backward_pass()
        if unit.full is None and bw is not None:
            if unit.index not in bw.order:
                bw.order.append(unit.index)
            bw.gathered.add(unit.index)
        full = self._materialise(unit, "backward")
        view = full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)
        if bw is None:
            self._release(unit)  # read outside a backward pass: nothing else would free it
        return view

    # -- backward ------------------------------------------------------------------------------

    def _backward_pass(self) -> BackwardPass | None:
        """This backward pass's bookkeeping; the first call queues its end-of-backward
        callback. None outside a backward pass (a saved tensor read by hand)."""
        if self._backward is None:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            except RuntimeError:
                return None
            self._backward = BackwardPass()
        return self._backward

    def reduce_unit_gradient(self, unit: ShardingUnit, grad: torch.Tensor) -> None:
        """``_UnitGather.backward``: free the unit, start reducing its gradient."""
        bw = self._backward_pass()
        self._release(unit)  # reshard after backward
        if self.unused is not None:
            return self.unused.hold(bw.held, unit, grad)  # reduced when backward ends
        kept, unit.kept_grad = unit.kept_grad, None
        grad = grad.detach() if kept is None else kept.add_(grad)
        bw.in_flight.append((unit, self._start_reduction(unit, grad, "backward")))
        bw.reduced.add(unit.index)
        while len(bw.in_flight) > REDUCTIONS_IN_FLIGHT:
            oldest, work = bw.in_flight.popleft()
            bw.means.append((oldest, work.wait()))

    def keep_unit_gradient(self, unit: ShardingUnit, grad: torch.Tensor) -> None:
        """``_UnitGather.backward`` inside ``no_sync()``: free the unit, add its whole
        gradient to what this rank keeps of it, unreduced."""
        self._backward_pass()
        self._release(unit)
        if unit.kept_grad is None:
            unit.kept_grad = grad.detach().clone(memory_format=torch.contiguous_format)
        else:
            unit.kept_grad.add_(grad)

    def sync_kept_gradients(self) -> None:
        """Reduce-scatter every unit's kept gradient, in unit order, and add the means to
        ``shard.grad``; nothing (no collective) when no unit keeps one."""
        if self.unused is not None:
            held = {u.index: u.kept_grad for u in self.units if u.kept_grad is not None}
            self.drop_kept_gradients()
            return self._add_means(self.unused.reduce(held, "sync_gradients") if held else [])
        means, in_flight = [], deque()
        for unit in self.units:
            grad, unit.kept_grad = unit.kept_grad, None
            if grad is None:
                continue
            in_flight.append((unit, self._start_reduction(unit, grad, "sync_gradients")))
            if len(in_flight) > REDUCTIONS_IN_FLIGHT:
                oldest, work = in_flight.popleft()
                means.append((oldest, work.wait()))
        means += [(unit, work.wait()) for unit, work in in_flight]
        self._add_means(means)

    def drop_kept_gradients(self) -> None:
        for unit in self.units:
            unit.kept_grad = None

    def _start_reduction(self, unit: ShardingUnit, grad: torch.Tensor, during: str):
        wire = grad if grad.dtype == unit.wire_dtype else grad.to(unit.wire_dtype)
        layout = unit.layout
        work = self.process_group.reduce_scatter(
            wire.reshape(layout.world_size, layout.shard_numel), op="mean", async_op=True,
            wire=self.wire)
        self.last_collectives.append(
            UnitCollective("reduce_scatter", unit.index, during, _dtype_name(wire.dtype)))
        return work

    def _end_of_backward(self) -> None:
        """The engine's callback: wait for the reductions, free what is left, write ``.grad``.

        All or nothing: if a reduction failed no gradient is written and its error is raised
        (from ``loss.backward()``) without waiting for the others, which cannot succeed on a
        process group that lost a rank or went out of step.
        """
        bw, self._backward = self._backward, None
        if bw is None:
            return
        means, error = bw.means, None
        for unit, work in bw.in_flight:
            try:
                means.append((unit, work.wait()))
            except BaseException as exc:
                error = exc
                break
        for unit in self.units:  # backward prefetches that were not needed after all
            try:
                self._release(unit, wait=error is None)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        if self._backward_next is None:
            self._backward_next = _successors(bw.order)
        if bw.held:
            means = self.unused.reduce(bw.held, "backward")
        self._add_means(means)

    def _add_means(self, means: list) -> None:
        """Add each (unit, this rank's mean gradient) to the unit's ``shard.grad``."""
        with torch.no_grad():
            for unit, mean in means:
                mean = mean.reshape(-1)
                if mean.dtype != unit.shard.dtype:
                    mean = mean.to(unit.shard.dtype)
                if unit.shard.grad is None:
                    unit.shard.grad = mean
                else:
                    unit.shard.grad.add_(mean)

    def _abandon_unfinished_backward(self) -> None:
        if self._backward is not None:
            # A backward pass raised before the engine's callback ran; the ranks that did the
            # same are in step, and its reductions are dropped.
            warnings.warn("FullyShardedDataParallel: the previous backward pass did not finish; "
                          "its gradients were not reduced", RuntimeWarning, stacklevel=4)
            self._backward = None
        for unit in self.units:
            self._release(unit, wait=False)


def _pre_hook(runtime_ref: weakref.ref, unit: ShardingUnit):
    def hook(module, args):
        runtime = runtime_ref()
        if runtime is not None:
            runtime.before_unit_forward(unit)

    return hook


def _post_hook(runtime_ref: weakref.ref, unit: ShardingUnit):
    def hook(module, args, output):
        runtime = runtime_ref()
        if runtime is not None:
            runtime.after_unit_forward(unit)

    return hook


def _successors(order: Sequence[int]) -> dict[int, int]:
    return dict(itertools.pairwise(order))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["UnitRuntime"]

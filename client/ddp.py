"""DistributedDataParallel: torch's DDP on the CPU or a CUDA device, with gradient buckets
reduced through the hub.

How a backward pass is synchronised (the protocol every rank follows):

1. At construction the parameters are grouped into :class:`~gradstar.client.buckets.BucketPlan`
   buckets of ``bucket_cap_mb``, in reverse registration order, and every parameter gets a
   post-accumulate-grad hook. Parameters and buffers are broadcast from rank 0.
2. A forward pass with grad enabled and outside :meth:`no_sync` *arms* the hooks (torch decides
   at forward time too). Armed hooks stay armed until the next forward, so a second backward
   over the same graph is reduced as well instead of silently diverging.
3. The first armed hook of a backward pass queues an autograd-engine callback
   (``Variable._execution_engine.queue_callback``) that runs when the engine has finished the
   whole backward, before ``loss.backward()`` returns.
4. Each hook marks its parameter ready. When a bucket's last parameter is ready the bucket is
   *launched*: its gradients are copied into the bucket's flat buffer (cast to the compression
   dtype if any) and ``pg.all_reduce(flat, op="mean", async_op=True)`` starts on the process
   group's loop thread while backward continues. Buckets launch strictly in index order on every
   rank: a bucket that is ready early waits for the earlier ones, so every rank issues the same
   collectives in the same order even when gradients become ready in a different order.
5. The end-of-backward callback launches every bucket not launched yet (a parameter that got no
   gradient contributes its ``.grad`` if it still holds one from :meth:`no_sync` steps, else
   zeros), waits for all the Work handles and writes the means into ``.grad``. So when
   ``loss.backward()`` returns every gradient holds the mean over ranks, as with torch's DDP.

Unused parameters. With ``find_unused_parameters=True`` the last bucket also carries one flag
per parameter ("this rank has a gradient for it"); a parameter no rank has a gradient for keeps
``grad=None`` (so optimizers skip it, as with torch), one that some ranks have gets the mean with
zeros from the others. With the flag off, a parameter whose hook did not fire is an error: the
missing buckets are still sent (with zeros) so the other ranks' collectives complete, the means
are written, and then :class:`~gradstar.errors.ConfigurationError` names the parameters.

Devices. The module lives on the CPU or on one CUDA device, and so do its gradients and the
buckets' flat buffers. A CUDA bucket is copied to host memory when its all_reduce is issued and
its mean comes back as a tensor on the module's device (the process group stages it, see
:mod:`gradstar.client.device`), so every ``.grad`` stays on the parameter's device.

Where this differs from torch: unused parameters are found when backward ends rather than by
walking the autograd graph after forward, so a bucket holding one launches at the end of
backward (same gradients, less overlap for that bucket); the buckets are planned once (torch
re-plans them after the first step in the order gradients arrived, and uses a 1 MB first
bucket); a second backward of the same forward is reduced as well (torch ignores it).

Compressed wire formats. ``wire="int8"`` (or ``"int4"``, ``"bf16"``, ``"fp16"``; see
:mod:`gradstar.wire.formats`) sends every bucket in that format: the buckets are float32 on the
rank, each rank's contribution is encoded, the hub adds in float32 and encodes the mean once.
With error feedback (on by default with a format; ``error_feedback=False`` turns it off) each
rank keeps, per bucket, the residual of its own contribution (what encoding lost) and adds it to
that bucket at the next synchronising step (see :mod:`gradstar.client.error_feedback`); it
costs one float32 buffer per bucket (the model's size in float32, once more) and one extra
encode and decode of each bucket on the rank.
``no_sync()`` steps send nothing, so the residual waits for the next synchronising step;
:meth:`sync_gradients` sends like a backward pass, residual included; a parameter without a
gradient on this rank sends zeros and keeps its residual; the ``find_unused_parameters`` flags
travel apart, exactly (a flag must not share a block's scale with gradients). Residuals are not
in ``state_dict()``: a restarted rank starts from zero residuals (its first step loses one
rounding, as a step without feedback does); :meth:`reset_error_feedback` zeroes them. The
buckets are planned once, so each residual belongs to one bucket for the wrapper's life.

Sync modes. ``sync_mode=gradstar.Quorum(...)``, ``BoundedStaleness(...)`` or ``Asynchronous()``
(with ``optimizer=``) sends each backward's whole gradient to the hub's step ledger when
backward ends, and ``optimizer.step()`` applies the hub's aggregates in step order (see
:mod:`gradstar.client.steps.sync` and :mod:`gradstar.sync_modes`): a slow or dead rank holds
nobody, and replicas stay bitwise identical. Buffers are not broadcast in these modes (each
rank keeps its own), and the gradient travels after backward, in float32, not in buckets.

``gradient_compression="bf16"|"fp16"`` is the older, narrower knob: it makes the buckets
themselves half precision (half the bucket memory on the rank, no feedback; on one host they
ride shared memory in that dtype). ``wire="bf16", error_feedback=False`` rounds the same way on
the wire; the two cannot be combined.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref

import torch
from torch import nn

from gradstar.errors import ConfigurationError
from gradstar.sync_modes import Synchronous, SyncMode, check_mode

from .buckets import BucketLaunch, BucketPlan, StepTimeline, SyncStep, TensorSpec, cap_bytes_of
from .convert import is_cpu_tensor
from .error_feedback import check_error_feedback
from .process_group import ProcessGroup
from .steps.modes import SyncModes, resumes_from_hub
from .torch_common import (
    GRAD_DTYPES,
    broadcast_from_rank0,
    check_wrapper_arguments,
    wire_dtype_of,
)


class DistributedDataParallel(SyncModes, nn.Module):
    """Wraps ``module`` so that every backward leaves the mean gradient over ranks in ``.grad``.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` with one device per process:
    ``forward``, ``parameters()``, ``state_dict()`` (keys prefixed ``module.`` as in torch),
    ``train()`` and ``eval()`` behave the same, and ``.module`` is the wrapped module; ``device``
    is the module's device. Every rank must construct it with the same module structure and
    settings and run the same number of forward passes (buffers are broadcast in forward) and
    synchronising backward passes. See the module docstring for the protocol.

    Args:
        module: the model; parameters and buffers all on the CPU or all on one CUDA device.
        pg: the blocking :class:`gradstar.ProcessGroup` (hooks run synchronously in autograd).
        bucket_cap_mb: bucket size bound in MB (2**20 bytes) of parameter data.
        broadcast_buffers: re-broadcast rank 0's buffers at the start of each forward (as torch).
        find_unused_parameters: allow parameters that get no gradient on some steps.
        gradient_compression: "bf16" or "fp16" makes the buckets that dtype (the hub sums in
            float32, the mean is cast back to each parameter's dtype); None keeps the
            parameters' dtypes. Not together with ``wire``.
        wire: a compressed wire format for every bucket ("bf16", "fp16", "int8", "int4"); the
            buckets are then float32 on the rank. None: no format.
        error_feedback: keep each bucket's residual and add it to the next step (default: on
            whenever ``wire`` is given). Costs one float32 buffer per bucket.
        sync_mode: when a step is complete (:mod:`gradstar.sync_modes`); default Synchronous.
        optimizer: the torch optimizer over the module's parameters; needed by every mode but
            Synchronous, whose ``step()`` then applies the hub's aggregates.

    Raises:
        ConfigurationError: ``pg`` is not a blocking process group, an argument is invalid, the
            module has no trainable parameter, a parameter is not floating point, or the
            module is not on the CPU or one CUDA device (named); an unknown ``wire``,
            ``wire`` with ``gradient_compression``, ``error_feedback=True`` without ``wire``;
            a sync mode other than Synchronous without ``optimizer``.
        CollectiveError and subclasses: the initial broadcast failed.
    """

    def __init__(self, module: nn.Module, pg: ProcessGroup, bucket_cap_mb: float = 25,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_compression: str | None = None, wire: str | None = None,
                 error_feedback: bool | None = None, sync_mode: SyncMode | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.device = check_wrapper_arguments("DistributedDataParallel", module, pg,
                                              ("all_reduce", "broadcast"))
        wire_dtype = wire_dtype_of("gradient_compression", gradient_compression)
        if wire is not None and gradient_compression is not None:
            raise ConfigurationError(
                f"pass either wire={wire!r} or gradient_compression={gradient_compression!r}, "
                "not both: gradient_compression makes the buckets half precision, wire encodes "
                f"float32 buckets (wire={gradient_compression!r}, error_feedback=False rounds "
                "as gradient_compression does)")
        self._feedback = check_error_feedback(wire, error_feedback)
        if wire is not None:
            wire_dtype = torch.float32  # formats encode float32 (and residuals are float32)
        self.wire = wire
        self.error_feedback = self._feedback is not None
        self.module = module
        self.process_group = pg
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_compression = gradient_compression
        self.bucket_cap_mb = bucket_cap_mb
        cap = cap_bytes_of(bucket_cap_mb)

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigurationError(
                "DistributedDataParallel needs a module with at least one parameter that "
                "requires grad; there is nothing to synchronise"
            )
        for name, p in named:
            if p.dtype not in GRAD_DTYPES:
                raise ConfigurationError(
                    f"parameter {name} has dtype {p.dtype}; gradients travel as float32, "
                    "float64, float16 or bfloat16"
                )
        self._param_names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self.bucket_plan = BucketPlan(
            [TensorSpec(p.numel(), p.element_size(), p.dtype) for p in self._params], cap)
        # The last bucket launches after every other, when every parameter's state is known, so
        # it carries the "has a gradient" flags of find_unused_parameters without an extra
        # round trip.
        self._flags = self.find_unused_parameters
        # In a block format a flag would share its block's scale with gradients (a flag of 1/n
        # next to a gradient of 100 rounds to 0), so with a format they travel apart, exactly.
        self._flags_apart = self._flags and wire is not None
        self._flag_flat = (torch.zeros(len(self._params), device=self.device)
                           if self._flags_apart else None)
        last = len(self.bucket_plan) - 1
        self._flat = [
            torch.zeros(b.numel + (len(self._params) if self._flags and not self._flags_apart
                                   and b.index == last else 0),
                        dtype=wire_dtype or b.dtype, device=self.device)
            for b in self.bucket_plan
        ]
        self._broadcast_cap = cap

        self._require_backward_grad_sync = True  # False inside no_sync()
        self._require_forward_param_sync = True  # as torch: sync buffers in the next forward
        self._expect_hooks = False  # armed by a synchronising forward
        self._step: SyncStep | None = None
        self.last_step_timeline: StepTimeline | None = None

        mode = check_mode(sync_mode or Synchronous())
        joining = mode.on_ledger and resumes_from_hub(pg, "ddp")  # state from the hub
        if not joining:
            broadcast_from_rank0(pg, [*module.parameters(), *module.buffers()], cap)
        self.sync_mode: SyncMode = Synchronous()
        self._optimizer = optimizer
        self._steps = None  # the StepSync of the ledger modes, made at the first one
        self._weight: float | None = None  # contribution_weight; None: plain means
        self.set_sync_mode(mode)
        if joining:  # it took a lost rank's place mid-training: the others cannot broadcast
            self._steps.join()
        me = weakref.ref(self)  # the hooks must not keep a discarded wrapper alive
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_make_hook(me, i))
            for i, p in enumerate(self._params)
        ]

    # -- the nn.Module surface -----------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module; broadcast buffers first and arm the gradient hooks, as torch.

        Raises:
            CollectiveError and subclasses: the buffer broadcast failed.
        """
        self._drop_unfinished_step()
        buffers = list(self.module.buffers())
        if (self._require_forward_param_sync and self.broadcast_buffers and buffers
                and not self.sync_mode.on_ledger):
            broadcast_from_rank0(self.process_group, buffers, self._broadcast_cap)
        output = self.module(*inputs, **kwargs)
        sync = torch.is_grad_enabled() and self._require_backward_grad_sync
        self._require_forward_param_sync = sync
        self._expect_hooks = sync
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward passes of forwards run inside do not reduce.

        The first synchronising backward after it reduces the accumulated ``.grad`` (put the
        forward inside the context, as with torch; or call :meth:`sync_gradients`)."""
        previous = self._require_backward_grad_sync
        self._require_backward_grad_sync = False
        try:
            yield
        finally:
            self._require_backward_grad_sync = previous

    def sync_gradients(self) -> None:
        """Reduce every parameter's current ``.grad`` to the mean over ranks, now (blocking).

        For loops whose backward does not synchronise: backward through ``.module`` directly,
        or gradients left accumulated by :meth:`no_sync` steps. Every rank must call it. It is
        the end-of-backward step run by hand, with the same rules: a parameter whose ``.grad``
        is None contributes zeros; with ``find_unused_parameters=True`` it stays None if no
        rank has a gradient for it, otherwise it is an error once the means are written.
        Calling it after a synchronised backward reduces the (identical) means again, which
        leaves them unchanged up to rounding.

        Raises:
            ConfigurationError: some ``.grad`` is None and ``find_unused_parameters`` is off.
            CollectiveError and subclasses: a bucket's all_reduce failed.
        """
        self._drop_unfinished_step()
        if self.sync_mode.on_ledger:
            self._steps.contribute(self.contribution_weight)
            return
        step = SyncStep(len(self._params), self.bucket_plan)
        for index in range(len(self.bucket_plan)):
            self._launch(step, index, "sync_gradients")
        missing = [i for i, p in enumerate(self._params) if p.grad is None]
        self._complete(step, missing, "when sync_gradients() was called")

    @property
    def bucket_dtypes(self) -> list[torch.dtype]:
        """The dtype of each bucket on the rank (the compression dtype, if any; float32 with a
        ``wire`` format, which then decides the bytes on the wire)."""
        return [flat.dtype for flat in self._flat]

    @property
    def error_feedback_residuals(self) -> list[torch.Tensor | None]:
        """Each bucket's residual: what this rank's last contribution lost to the format
        (None before the bucket's first compressed step, or without error feedback)."""
        residuals = self._feedback.residuals if self._feedback is not None else {}
        return [residuals.get(index) for index in range(len(self.bucket_plan))]

    def reset_error_feedback(self) -> None:
        """Zero every residual, e.g. after loading a checkpoint (residuals are not in
        ``state_dict()``). Each rank may call it on its own: residuals are rank-local."""
        if self._feedback is not None:
            self._feedback.reset()

    def extra_repr(self) -> str:
        return (f"world_size={self.process_group.world_size}, buckets={len(self.bucket_plan)}, "
                f"bucket_cap_mb={self.bucket_cap_mb}, "
                f"find_unused_parameters={self.find_unused_parameters}, "
                f"gradient_compression={self.gradient_compression!r}, wire={self.wire!r}, "
                f"error_feedback={self.error_feedback}")

    # -- the backward protocol -----------------------------------------------------------------

    def _on_grad_ready(self, index: int) -> None:
        """A parameter's hook: its gradient is accumulated. Launch what became launchable."""
        if not self._expect_hooks:
            return
        step = self._step
        if step is None:
            step = self._step = SyncStep(len(self._params), self.bucket_plan)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.sync_mode.on_ledger:
            return  # the whole gradient goes to the hub's ledger when backward ends
        step.timeline.hooks.append((self._param_names[index], time.perf_counter()))
        if step.ready[index]:
            return  # the same leaf twice in one pass (cannot happen with AccumulateGrad)
        step.ready[index] = True
        bucket, _ = self.bucket_plan.location[index]
        step.pending[bucket] -= 1
        try:
            while (step.next_launch < len(self.bucket_plan)
                   and step.pending[step.next_launch] == 0):
                self._launch(step, step.next_launch, "backward")
        except BaseException:
            self._step = None
            raise

    def _end_of_backward(self) -> None:
        """The engine's callback: launch the rest, wait, write the means into ``.grad``."""
        step, self._step = self._step, None
        if step is None:
            return
        step.timeline.backward_end = time.perf_counter()
        if self.sync_mode.on_ledger:
            self._steps.contribute(self.contribution_weight)
            return
        for index in range(step.next_launch, len(self.bucket_plan)):
            self._launch(step, index, "end of backward")
        self._complete(step, [i for i, ready in enumerate(step.ready) if not ready],
                       "in this backward pass")

    def _launch(self, step: SyncStep, index: int, during: str) -> None:
        bucket = self.bucket_plan[index]
        flat = self._flat[index]
        with torch.no_grad():
            for member, offset, numel in zip(bucket.members, bucket.offsets, bucket.numels,
                                             strict=True):
                grad = self._params[member].grad
                if grad is None:
                    flat[offset:offset + numel].zero_()
                elif grad.is_sparse:
                    raise ConfigurationError(
                        f"parameter {self._param_names[member]} has a sparse gradient; "
                        "DistributedDataParallel reduces dense gradients only"
                    )
                else:
                    flat[offset:offset + numel].copy_(grad.reshape(-1))
            if self._feedback is not None:
                keep = [(offset, numel) for member, offset, numel
                        in zip(bucket.members, bucket.offsets, bucket.numels, strict=True)
                        if self._params[member].grad is None]
                self._feedback.compensate(index, flat[:bucket.numel], keep)
            if self._flags and index == len(self.bucket_plan) - 1:
                flags = self._flag_flat if self._flags_apart else flat[bucket.numel:]
                flags.copy_(torch.tensor([p.grad is not None for p in self._params]))
            if self._weight is not None:  # weighted: sums of w*g, divided by the sum of w
                flat[:bucket.numel].mul_(self._weight)
        # The flat buffer is reused next step: it is not written again until this Work is
        # waited for in _complete. A CPU bucket takes its means in place (no fresh array to
        # fault in, no copy); a CUDA one is staged through host memory and comes back new.
        step.works[index] = self.process_group.all_reduce(
            flat, op="mean" if self._weight is None else "sum", async_op=True,
            out=flat if is_cpu_tensor(flat) else None, wire=self.wire)
        if self._weight is not None and index == len(self.bucket_plan) - 1:
            step.weight_work = self.process_group.all_reduce(
                torch.tensor([self._weight], dtype=torch.float64), op="sum", async_op=True)
        if self._flags_apart and index == len(self.bucket_plan) - 1:
            step.flags_work = self.process_group.all_reduce(
                self._flag_flat, op="max", async_op=True,
                out=self._flag_flat if is_cpu_tensor(self._flag_flat) else None)
        step.timeline.launches.append(BucketLaunch(index, time.perf_counter(), during))
        step.next_launch = index + 1

    def _complete(self, step: SyncStep, missing: list[int], when: str) -> None:
        """Wait for every bucket, write the means, then report parameters without gradients."""
        results, error = [], None
        for work in [*step.works, step.flags_work, step.weight_work]:
            try:
                results.append(None if work is None else work.wait())
            except BaseException as exc:  # wait for the others before raising the first
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        total = results.pop()
        flags = results.pop()
        used = None
        if self._flags:
            flags = flags if self._flags_apart else results[-1][self.bucket_plan[-1].numel:]
            used = (flags > 0).tolist()
        with torch.no_grad():
            for bucket, result in zip(self.bucket_plan, results, strict=True):
                if total is not None:  # the weighted mean: sum(w*g) / sum(w), or 0 for no weight
                    weights = float(total[0])
                    result[:bucket.numel].mul_(1.0 / weights if weights > 0 else 0.0)
                for member, offset, numel in zip(bucket.members, bucket.offsets, bucket.numels,
                                                 strict=True):
                    if used is not None and not used[member]:
                        continue  # no rank has a gradient: keep None, as torch does
                    param = self._params[member]
                    mean = result[offset:offset + numel].view(param.shape)
                    if param.grad is None:
                        param.grad = mean.to(param.dtype, copy=True)
                    else:
                        param.grad.copy_(mean)
        step.timeline.finished = time.perf_counter()
        self.last_step_timeline = step.timeline
        if missing and not self.find_unused_parameters:
            names = ", ".join(self._param_names[i] for i in missing)
            raise ConfigurationError(
                f"rank {self.process_group.rank} got no gradient for {len(missing)} "
                f"parameter(s) {when}: {names}. Their buckets were sent with "
                "zeros so no rank is left waiting, and the means were written to .grad; if "
                "these parameters take no part in the loss on some steps, construct "
                "DistributedDataParallel with find_unused_parameters=True (or set "
                "requires_grad=False on parameters that are never trained)"
            )

    def _drop_unfinished_step(self) -> None:
        if self._step is not None:
            # A backward pass raised before the engine's callback ran; its launched buckets are
            # abandoned (ranks that did the same stay in step).
            warnings.warn("DistributedDataParallel: the previous backward pass did not finish; "
                          "its gradients were not synchronised", RuntimeWarning, stacklevel=3)
            self._step = None


def _make_hook(ddp_ref: weakref.ref, index: int):
    def hook(param: torch.Tensor) -> None:
        ddp = ddp_ref()
        if ddp is not None:
            ddp._on_grad_ready(index)

    return hook


DDP = DistributedDataParallel

__all__ = ["DDP", "BucketLaunch", "DistributedDataParallel", "StepTimeline"]

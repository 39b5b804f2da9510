"""DistributedDataParallel: torch's DDP on the CPU or a CUDA device, with gradient buckets
reduced through the hub (the buckets and their protocol: :mod:`gradstar.client.ddp.reducer`).

How a backward pass is synchronised: at construction every parameter gets a
post-accumulate-grad hook and parameters and buffers are broadcast from rank 0. A forward pass
with grad enabled and outside :meth:`no_sync` *arms* the hooks (torch decides at forward time
too); armed hooks stay armed until the next forward, so a second backward over the same graph is
reduced as well instead of silently diverging. The first armed hook of a backward pass queues an
autograd-engine callback (``Variable._execution_engine.queue_callback``) that runs when the
engine has finished the whole backward, before ``loss.backward()`` returns: it launches the
buckets not launched yet, waits for them and writes the means into ``.grad``. So when
``loss.backward()`` returns every gradient holds the mean over ranks, as with torch's DDP.

Devices. The module lives on the CPU or on one CUDA device, and so do its gradients and the
buckets' flat buffers. A CUDA bucket is copied to host memory when its all_reduce is issued and
its mean comes back as a tensor on the module's device (the process group stages it, see
:mod:`gradstar.client.device`), so every ``.grad`` stays on the parameter's device.

Where this differs from torch: unused parameters are found when backward ends rather than by
walking the autograd graph after forward, so a bucket holding one launches at the end of
backward (same gradients, less overlap for that bucket; ``static_graph=True`` restores the
overlap after the first step); the buckets follow ``bucket_cap_mb`` and are re-planned only when
it is assigned (torch re-plans them after the first step in the order gradients arrived, and
uses a 1 MB first bucket); a second backward of the same forward is reduced as well (torch
ignores it).

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
travel apart, exactly, in the step's control all_reduce (a flag must not share a block's scale
with gradients). Residuals are not in ``state_dict()``: a restarted rank starts from zero
residuals (its first step loses one rounding, as a step without feedback does);
:meth:`reset_error_feedback` zeroes them. When ``bucket_cap_mb`` changes each residual moves
with its parameters to their new buckets.

Sync modes. ``sync_mode=gradstar.Quorum(...)``, ``BoundedStaleness(...)`` or ``Asynchronous()``
(with ``optimizer=``) sends each backward's whole gradient to the hub's step ledger when
backward ends, and ``optimizer.step()`` applies the hub's aggregates in step order (see
:mod:`gradstar.client.steps.sync` and :mod:`gradstar.sync_modes`): a slow or dead rank holds
nobody, and replicas stay bitwise identical. Buffers are not broadcast in forward in these
modes: with ``broadcast_buffers=True`` they travel with each contribution instead, each step's
aggregate carries their weighted mean and every rank writes it into its buffers as it applies
the step (integer buffers rounded; bool buffers stay each rank's), so they stay identical; with
``broadcast_buffers=False`` each rank keeps its own. The gradient travels after backward, in
float32, not in buckets.

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

from gradstar.errors import BucketCapMismatchError, ConfigurationError
from gradstar.sync_modes import Synchronous, SyncMode, check_mode

from ..buckets import BucketPlan, StepTimeline, cap_bytes_of
from ..error_feedback import check_error_feedback
from ..process_group.protocol import CollectiveGroup
from ..steps.modes import SyncModeState
from ..steps.stats import SyncStats
from ..torch_common import (
    GRAD_DTYPES,
    broadcast_from_rank0,
    check_wrapper_arguments,
    wire_dtype_of,
)
from .elastic import ElasticSteps, ModuleState
from .inputs import inputs_to_device
from .reducer import Reducer


class DistributedDataParallel(nn.Module):
    """Wraps ``module`` so that every backward leaves the mean gradient over ranks in ``.grad``.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` with one device per process:
    ``forward``, ``parameters()``, ``state_dict()`` (keys prefixed ``module.`` as in torch),
    ``train()`` and ``eval()`` behave the same, and ``.module`` is the wrapped module; ``device``
    is the module's device. Every rank must construct it with the same module structure and
    settings and run the same number of forward passes (buffers are broadcast in forward) and
    synchronising backward passes. See the module docstring for the protocol.

    Args:
        module: the model; parameters and buffers all on the CPU or all on one CUDA device
            (on a CUDA device, ``forward`` moves its inputs there, as torch's DDP does with
            ``device_ids``).
        pg: the blocking :class:`gradstar.ProcessGroup` (hooks run synchronously in autograd).
        bucket_cap_mb: bucket size bound in MB (2**20 bytes) of parameter data; can be
            assigned later, on every rank (see :attr:`bucket_cap_mb`).
        broadcast_buffers: re-broadcast rank 0's buffers at the start of each forward (as torch);
            in the other sync modes, send them with each contribution (module docstring).
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
        gradient_as_bucket_view: each ``.grad`` is a view into its bucket (as torch): backward
            accumulates into the bucket, two copies per step and the gradients' own memory
            are saved. The buckets must be in the parameters' dtypes (no
            ``gradient_compression``; a ``wire`` format only over float32 parameters).
        static_graph: the set of parameters that get a gradient is the same at every step (as
            torch): it is learned at the first synchronising step; later steps skip the
            used-parameter flags and launch the buckets of unused parameters during backward.
            A step that uses other parameters is a ConfigurationError.
        delay_all_reduce: launch every bucket when backward ends instead of overlapping the
            all_reduces with backward (torch's ``delay_all_reduce_named_params`` for all
            parameters).

    Raises:
        ConfigurationError: ``pg`` is not a blocking process group, an argument is invalid, the
            module has no trainable parameter, a parameter is not floating point, or the
            module is not on the CPU or one CUDA device (named); an unknown ``wire``,
            ``wire`` with ``gradient_compression``, ``error_feedback=True`` without ``wire``;
            ``gradient_as_bucket_view`` with buckets of another dtype than a parameter's;
            a sync mode other than Synchronous without ``optimizer``.
        CollectiveError and subclasses: the initial broadcast failed.
    """

    def __init__(self, module: nn.Module, pg: CollectiveGroup, bucket_cap_mb: float = 25,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 gradient_compression: str | None = None, wire: str | None = None,
                 error_feedback: bool | None = None, sync_mode: SyncMode | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce: bool = False) -> None:
        super().__init__()
        self.device = check_wrapper_arguments("DistributedDataParallel", module, pg)
        wire_dtype = wire_dtype_of("gradient_compression", gradient_compression)
        if wire is not None and gradient_compression is not None:
            raise ConfigurationError(
                f"pass either wire={wire!r} or gradient_compression={gradient_compression!r}, "
                "not both: gradient_compression makes the buckets half precision, wire encodes "
                f"float32 buckets (wire={gradient_compression!r}, error_feedback=False rounds "
                "as gradient_compression does)")
        feedback = check_error_feedback(wire, error_feedback)
        if wire is not None:
            wire_dtype = torch.float32  # formats encode float32 (and residuals are float32)
        self.wire = wire
        self.error_feedback = feedback is not None
        self.module = module
        self.process_group = pg
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_compression = gradient_compression
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.delay_all_reduce = bool(delay_all_reduce)
        cap = cap_bytes_of(bucket_cap_mb)
        self._bucket_cap_mb = self._cap_mb_in_effect = bucket_cap_mb

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
        self.reducer = Reducer(pg, self._params, self._param_names, cap, self.device,
                               wire_dtype, wire, feedback,
                               find_unused=self.find_unused_parameters,
                               static_graph=self.static_graph,
                               as_view=self.gradient_as_bucket_view)
        self._broadcast_cap = cap

        self._require_backward_grad_sync = True  # False inside no_sync()
        self._require_forward_param_sync = True  # as torch: sync buffers in the next forward
        self._expect_hooks = False  # armed by a synchronising forward
        self._step = None  # the SyncStep of the backward pass under way
        # True from a completed synchronisation until a gradient accumulates again: then
        # .grad holds the means and sync_gradients() has nothing to send.
        self._grads_synced = False
        self.last_step_timeline: StepTimeline | None = None

        mode = check_mode(sync_mode or Synchronous())
        replacing = mode.on_ledger and pg.replacement  # a lost rank's place: nobody broadcasts
        #: Step boundaries: the job growing and shrinking while it trains (:mod:`.elastic`).
        self.elastic = ElasticSteps(pg, ModuleState(module, optimizer), not mode.on_ledger)
        if not replacing and not self.elastic.start_state():
            broadcast_from_rank0(pg, [*module.parameters(), *module.buffers()], cap)
        #: The sync mode, its weight and its ledger driver (:mod:`gradstar.client.steps.modes`).
        self._modes = SyncModeState(module, self._params, optimizer, pg, wire=wire,
                                    compression=gradient_compression, feedback=feedback,
                                    broadcast_buffers=self.broadcast_buffers)
        self.set_sync_mode(mode)
        # State from the hub: in a lost rank's place, or while the hub holds a snapshot (a
        # restarted job or coordinator, or ranks of this start that already stepped: the
        # snapshot continues the state all of them broadcast, so each rank may decide alone).
        if replacing or (mode.on_ledger and self._modes.steps.hub_holds_snapshot()):
            self._modes.steps.join()
        me = weakref.ref(self)  # the hooks must not keep a discarded wrapper alive
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_make_hook(me, i))
            for i, p in enumerate(self._params)
        ]
        self.elastic.declare()

    # -- the nn.Module surface -----------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module; broadcast buffers first and arm the gradient hooks, as torch.
        On a CUDA device, tensors in ``inputs`` and ``kwargs`` (nested in tuples, lists and
        dicts too) are moved to it first, as torch's DDP does with ``device_ids``.

        Raises:
            CollectiveError and subclasses: the buffer broadcast failed.
        """
        self._drop_unfinished_step()
        buffers = list(self.module.buffers())
        if (self._require_forward_param_sync and self.broadcast_buffers and buffers
                and not self.sync_mode.on_ledger):
            self.elastic.cross()
            broadcast_from_rank0(self.process_group, buffers, self._broadcast_cap)
        if self.device.type != "cpu":
            inputs, kwargs = inputs_to_device(inputs, kwargs, self.device)
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
        A no-op right after a synchronising backward (or another ``sync_gradients()``): the
        means are already in ``.grad``, so nothing is sent, as with FSDP. It sends again once a
        gradient accumulates into a parameter (any backward reaching it, synchronising or not);
        a ``.grad`` assigned or zeroed by hand in between is not seen, and stays as it is.

        Raises:
            ConfigurationError: some ``.grad`` is None and ``find_unused_parameters`` is off.
            BucketCapMismatchError: ranks assigned different ``bucket_cap_mb`` values.
            CollectiveError and subclasses: a bucket's all_reduce failed.
        """
        self._drop_unfinished_step()
        if self._grads_synced:
            return  # every rank's last backward synchronised too: none of them sends
        if self.sync_mode.on_ledger:
            self._modes.steps.contribute(self.contribution_weight)
        else:
            self.elastic.cross()
            step = self.reducer.new_step()
            self.reducer.launch_rest(step, "sync_gradients", self._modes.weight)
            missing = [i for i, p in enumerate(self._params)
                       if p.grad is None and not step.ready[i]]
            self._finish(step, missing, "when sync_gradients() was called")
        self._grads_synced = True

    def broadcast_parameters(self, src: int = 0) -> None:
        """Overwrite every parameter and buffer with rank ``src``'s (blocking; every rank must
        call it, between steps), as the construction does from rank 0: to restart from one
        rank's checkpoint, or to bring replicas back together.

        Raises:
            ConfigurationError: ``src`` is not a rank of the process group.
            CollectiveError and subclasses: a broadcast failed.
        """
        world = self.process_group.world_size
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
            raise ConfigurationError(
                f"broadcast_parameters(src={src!r}): src must be a rank, 0 to {world - 1}")
        broadcast_from_rank0(self.process_group,
                             [*self.module.parameters(), *self.module.buffers()],
                             self._broadcast_cap, src=src)

    @property
    def bucket_cap_mb(self) -> float:
        """The bucket size bound in MB, as last assigned. Assigning it (every rank, the same
        value, between steps) re-plans the buckets: the next synchronising step tells every
        rank whether all of them assigned one, the step after it compares the values and
        rebuilds the buckets when it completes (with a wire format the first step does both).
        Ranks that disagree all get :class:`~gradstar.errors.BucketCapMismatchError` at the
        step that finds it and keep their buckets (the plan in effect: ``bucket_plan``).

        Raises:
            ConfigurationError: the value is not a positive number.
        """
        return self._bucket_cap_mb

    @bucket_cap_mb.setter
    def bucket_cap_mb(self, value: float) -> None:
        self.reducer.requested_cap = cap_bytes_of(value)
        self._bucket_cap_mb = value

    @property
    def bucket_plan(self) -> BucketPlan:
        """The buckets in effect (rebuilt when :attr:`bucket_cap_mb` changes)."""
        return self.reducer.plan

    @property
    def bucket_dtypes(self) -> list[torch.dtype]:
        """The dtype of each bucket on the rank (the compression dtype, if any; float32 with a
        ``wire`` format, which then decides the bytes on the wire)."""
        return [flat.dtype for flat in self.reducer.flats]

    @property
    def error_feedback_residuals(self) -> list[torch.Tensor | None]:
        """Each bucket's residual: what this rank's last contribution lost to the format
        (None before the bucket's first compressed step, or without error feedback)."""
        feedback = self.reducer.feedback
        residuals = feedback.residuals if feedback is not None else {}
        return [residuals.get(index) for index in range(len(self.bucket_plan))]

    def reset_error_feedback(self) -> None:
        """Zero every residual, e.g. after loading a checkpoint (residuals are not in
        ``state_dict()``). Each rank may call it on its own: residuals are rank-local."""
        if self.reducer.feedback is not None:
            self.reducer.feedback.reset()

    def extra_repr(self) -> str:
        return (f"world_size={self.process_group.world_size}, buckets={len(self.bucket_plan)}, "
                f"bucket_cap_mb={self.bucket_cap_mb}, "
                f"find_unused_parameters={self.find_unused_parameters}, "
                f"gradient_compression={self.gradient_compression!r}, wire={self.wire!r}, "
                f"error_feedback={self.error_feedback}, "
                f"gradient_as_bucket_view={self.gradient_as_bucket_view}, "
                f"static_graph={self.static_graph}, delay_all_reduce={self.delay_all_reduce}")

    # -- the sync mode (:class:`~gradstar.client.steps.modes.SyncModeState`) --------------------

    @property
    def sync_mode(self) -> SyncMode:
        """The sync mode in effect (:mod:`gradstar.sync_modes`; :meth:`set_sync_mode`)."""
        return self._modes.mode

    def set_sync_mode(self, mode: SyncMode) -> None:
        """Switch sync mode (every rank, between steps): leaving or changing a ledger mode
        synchronizes first, so every rank switches at the same step.

        Raises:
            ConfigurationError: not a sync mode; a mode other than Synchronous without
                ``optimizer=``; Synchronous with a ``wire`` format and a contribution weight.
        """
        self._modes.set(mode)

    def synchronize(self) -> None:
        """Every rank: wait until every gradient sent so far is aggregated and applied, so the
        replicas are bitwise identical (before evaluating, checkpointing, at the end).
        Synchronous steps are always complete: nothing to do.

        Raises:
            StepTimeoutError: the other live ranks did not arrive in time.
        """
        self._modes.synchronize()

    @property
    def contribution_weight(self) -> float:
        """Weight of this rank's gradients in their step's weighted mean (e.g. its samples per
        step; default 1). In Synchronous mode, set it on every rank or none: a weighted step
        all_reduces sums and the weights' sum instead of means, and not with a ``wire`` format
        (in the other modes the weight travels beside the gradient, with any format).

        Raises:
            ConfigurationError: (set) not a finite number >= 0, or in Synchronous mode with a
                ``wire`` format.
        """
        weight = self._modes.weight
        return 1.0 if weight is None else weight

    @contribution_weight.setter
    def contribution_weight(self, weight: float) -> None:
        self._modes.set_weight(weight)

    @property
    def contribution_residual(self) -> torch.Tensor | None:
        """In a sync mode other than Synchronous with error feedback: what this rank's
        contributions lost to the wire format so far (one flat float32 tensor over the
        parameters in DDP's order; read only). None otherwise, or before the first one."""
        return self._modes.residual

    def sync_stats(self) -> SyncStats | None:
        """What this rank saw of its sync mode (:class:`~gradstar.client.steps.stats.SyncStats`:
        steps applied, gradients dropped, staleness); None before any mode other than
        Synchronous."""
        return self._modes.stats

    # -- the backward protocol -----------------------------------------------------------------

    def _on_grad_ready(self, index: int) -> None:
        """A parameter's hook: its gradient is accumulated. Launch what became launchable."""
        self._grads_synced = False
        if not self._expect_hooks:
            return
        step = self._step
        if step is None:
            if not self.sync_mode.on_ledger:
                self.elastic.cross()
            step = self._step = self.reducer.new_step()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.sync_mode.on_ledger:
            return  # the whole gradient goes to the hub's ledger when backward ends
        step.timeline.hooks.append((self._param_names[index], time.perf_counter()))
        self.reducer.mark_ready(step, index)
        if self.delay_all_reduce:
            return  # every bucket launches when backward ends
        try:
            self.reducer.launch_ready(step, self._modes.weight)
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
            self._modes.steps.contribute(self.contribution_weight)
        else:
            self.reducer.launch_rest(step, "end of backward", self._modes.weight)
            self._finish(step, [i for i, ready in enumerate(step.ready) if not ready],
                         "in this backward pass")
        self._grads_synced = True

    def _finish(self, step, missing: list[int], when: str) -> None:
        requested = self.reducer.requested_cap is not None
        self.elastic.done()
        try:
            self.reducer.complete(step, missing, when)
        except BucketCapMismatchError:
            self._bucket_cap_mb = self._cap_mb_in_effect  # refused on every rank: kept
            raise
        finally:
            if step.timeline.finished is not None:
                self.last_step_timeline = step.timeline
            if requested and self.reducer.requested_cap is None:  # agreed (or refused)
                self._cap_mb_in_effect = self._bucket_cap_mb

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

__all__ = ["DDP", "DistributedDataParallel"]

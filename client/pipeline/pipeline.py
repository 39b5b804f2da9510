"""Pipeline parallelism: rank r runs stage r of a model split into world_size stages.

How a training step runs (the protocol every stage follows):

1. The first stage splits ``inputs`` along dim 0 into ``num_microbatches`` micro-batches
   (:func:`~gradstar.client.pipeline.schedules.split_sizes`: equal, the last taking the
   remainder); the last stage splits ``targets`` the same way.
2. Each stage runs its schedule's action list (:mod:`.schedules`): a forward
   receives micro-batch i's activation from stage r-1 over the peer stream, runs the stage with
   autograd recording, and sends the output to stage r+1; the last stage computes
   ``loss_fn(output, targets_i) * n_i / batch`` instead, so the micro-batch losses sum to the
   mean loss over the whole batch even when the split is uneven. A backward receives the
   gradient of the output from stage r+1 (the last stage starts from its weighted loss), runs
   ``torch.autograd.backward`` through the stage, and sends the gradient with respect to the
   stage's input — the real autograd gradient — to stage r-1. Parameter gradients accumulate
   over the micro-batches, so after the step they are those of the mean loss.
3. Sends are asynchronous and complete when the neighbour holds the message; receives are
   posted one micro-batch ahead, so communication overlaps compute. The step waits for its
   sends before returning. Every message is tagged ``("pipe", pipeline, call, micro, kind)``,
   so activations and gradients of different steps and micro-batches cannot be confused.

Forward and backward apart. :meth:`Pipeline.forward` with grad enabled runs every
micro-batch's forward as step 2 does and keeps each one's input and output; the last stage
returns the whole batch's output as a leaf that requires grad, the caller computes a loss from
it however it likes, and :meth:`Pipeline.backward` on every stage (the last one passing the
gradient with respect to that output) runs every micro-batch's backward in order 0..M-1, the
last stage splitting the gradient as its forward split the batch. The messages carry the
forward's call number. This is GPipe's order whatever the schedule (M micro-batches alive in
between), since no backward can start before the loss exists.

Devices. A stage runs on the CPU or on one CUDA device, the device of its parameters and
buffers (the CPU for a stage that has none); stages of one pipeline may use different devices.
Tensors are sent from wherever they are (the process group copies a CUDA tensor to host memory
when the send is issued) and arrive as CPU tensors, which the receiving stage copies to its
own device before it computes with them: activations and gradients from a neighbour always
land on this stage's device. The first stage's ``inputs`` and the last stage's ``targets``
are used as given, so pass them on the stage's device.

Memory. A micro-batch's activations are alive from the start of its forward until its backward
ends; :attr:`Pipeline.max_live_activations` is the most alive at once during the last step (M
under GPipe, at most ``stages - r`` under 1F1B), and :attr:`Pipeline.peak_activation_bytes` the
most bytes of tensors held for backward at once (saved tensors, excluding parameters, plus the
outputs kept for the backward pass).

Failure. A lost neighbour (or any lost rank of the generation) raises
:class:`~gradstar.errors.RankLostError` from ``step`` within seconds on every stage. An error
raised locally by one stage (say its ``loss_fn``) leaves its neighbours to raise
:class:`~gradstar.errors.CollectiveTimeoutError` after the process group's timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable

import torch
from torch import nn

from gradstar.client.process_group.protocol import CollectiveGroup
from gradstar.client.torch_common import module_device
from gradstar.errors import ConfigurationError, ProtocolError

from .exchange import Exchange
from .memory import ActivationMeter
from .schedules import FORWARD, SCHEDULES, schedule_actions, split_sizes

# Pipelines are numbered per process group, in construction order, which every rank shares.
_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _MicroBatch:
    """What stage r keeps of one micro-batch between its forward and its backward."""

    __slots__ = ("inp", "out", "release")

    def __init__(self, inp, out, release) -> None:
        self.inp, self.out, self.release = inp, out, release


class _PendingBackward:
    """What a forward with grad enabled keeps for the backward that follows it: its call
    number, its micro-batches and (on the last stage) the output's rows per micro-batch and
    whole shape."""

    def __init__(self, call: int, kept: dict[int, _MicroBatch], rows: list[int],
                 shape: torch.Size | None) -> None:
        self.call, self.kept, self.rows, self.shape = call, kept, rows, shape

    def release(self) -> None:
        for mb in self.kept.values():
            mb.release()
        self.kept.clear()


class Pipeline:
    """Runs stage ``pg.rank`` of a ``pg.world_size``-stage pipeline over peer streams.

    Every rank constructs its Pipeline with its own stage module and the same
    ``num_microbatches`` and ``schedule``, and calls :meth:`step` (or :meth:`forward`) the same
    number of times in the same order (and :meth:`backward` after a forward with grad
    enabled: on every stage or on none). See the module docstring for the protocol.

    Args:
        stage_module: this rank's stage; takes one tensor, returns one tensor. Its parameters
            and buffers are all on the CPU or all on one CUDA device (``device`` is that
            device), where received activations and gradients are put.
        pg: the blocking :class:`~gradstar.ProcessGroup` (rank r runs stage r).
        num_microbatches: M, the micro-batches each batch is split into.
        schedule: "gpipe" (all forwards, then all backwards) or "1f1b".
        timeout: seconds a stage waits for a neighbour's message (default: the process
            group's collective timeout).

    Raises:
        ConfigurationError: an AsyncProcessGroup, an unknown schedule, M < 1, or a stage that
            is not an nn.Module on the CPU or one CUDA device (the device is named).
    """

    def __init__(self, stage_module: nn.Module, pg: CollectiveGroup, num_microbatches: int,
                 schedule: str = "1f1b", *, timeout: float | None = None) -> None:
        if not isinstance(pg, CollectiveGroup):
            raise ConfigurationError(
                "Pipeline needs the blocking ProcessGroup from gradstar.init_process_group(), "
                f"not {type(pg).__name__}: stages compute in the calling thread while the "
                "process group's loop thread moves their messages")
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or \
                num_microbatches < 1:
            raise ConfigurationError(
                f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if schedule not in SCHEDULES:
            raise ConfigurationError(
                f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
        self.device = module_device("Pipeline", stage_module)
        self.module = stage_module
        self.pg = pg
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.timeout = timeout
        self.stage, self.stages = pg.rank, pg.world_size
        self.actions = schedule_actions(schedule, self.stages, self.stage, num_microbatches)
        numbers = _NUMBERS.setdefault(pg, itertools.count())
        #: This pipeline's number among its process group's, the same on every stage.
        self.number = next(numbers)
        self._calls = itertools.count()
        self.meter = ActivationMeter()
        #: Micro-batches forwarded and not yet backwarded, now and at most during the last step.
        self.live_activations = 0
        self.max_live_activations = 0
        self._pending: _PendingBackward | None = None  # what backward() needs of forward()
        #: Seconds the last step, forward or backward spent blocked on neighbours (the
        #: pipeline bubble, plus waiting for its own sends to be taken at the end).
        self.wait_seconds = 0.0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def peak_activation_bytes(self) -> int:
        """Most bytes held for backward at once during the last step (see the module doc)."""
        return self.meter.peak_bytes

    # -- public --------------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
             loss_fn: Callable | None = None) -> torch.Tensor | None:
        """One training step over a batch; gradients accumulate into the stage's ``.grad``.

        The first stage passes ``inputs``, the last stage ``targets`` and ``loss_fn`` (which
        must return the mean loss over a micro-batch, like ``nn.functional.mse_loss``); other
        stages pass None. ``loss_fn`` is ignored on other stages, so every rank may pass it.
        Afterwards every stage's parameter gradients are those of the mean loss over the
        whole batch (added to what ``.grad`` held, as with ``loss.backward()``).

        Returns:
            The mean loss over the batch (a detached scalar tensor) on the last stage; None
            on the others.

        Raises:
            ConfigurationError: arguments given to the wrong stage or missing, a batch smaller
                than ``num_microbatches``, or a stage output that is not one tensor.
            RankLostError, CollectiveTimeoutError: a neighbour was lost or never answered.
        """
        self._check_args(inputs, targets, loss_fn, training=True)
        micro_inputs = self._split(inputs, "inputs") if self.is_first else None
        batch, micro_targets = None, None
        if self.is_last:
            batch, micro_targets = targets.shape[0], self._split(targets, "targets")
        # Numbered only once the arguments are known good: a call refused here sends nothing,
        # so the next one must carry the number the other stages still wait for.
        call = next(self._calls)
        self._drop_pending()
        self._start_metering(inputs, targets)
        comm = Exchange(self, call)
        kept: dict[int, _MicroBatch] = {}
        try:
            total = self._run_schedule(comm, kept, micro_inputs, micro_targets, batch, loss_fn)
            comm.finish()
        finally:
            for mb in kept.values():  # only after a failure: a finished step keeps nothing
                mb.release()
        return total

    def _run_schedule(self, comm: Exchange, kept: dict[int, _MicroBatch], micro_inputs,
                      micro_targets, batch: int | None, loss_fn) -> torch.Tensor | None:
        total = None
        for action in self.actions:
            i = action.micro
            if action.kind == FORWARD:
                self._count_live(+1)
                inp = micro_inputs[i] if self.is_first else comm.recv_activation(i)
                with self.meter.hooks():
                    out = self._run_stage(inp)
                    if self.is_last:
                        if out.shape[:1] != micro_targets[i].shape[:1]:
                            raise ConfigurationError(
                                f"micro-batch {i} reached the last stage with {out.shape[0]} "
                                f"rows but its targets have {micro_targets[i].shape[0]}: pass "
                                "targets with as many rows as the first stage's inputs")
                        out = loss_fn(out, micro_targets[i]) * (micro_targets[i].shape[0] / batch)
                        total = out.detach() if total is None else total + out.detach()
                if not self.is_last:
                    comm.send_activation(i, out.detach())
                kept[i] = _MicroBatch(inp, out, self.meter.hold(out))
            else:
                mb = kept.pop(i)
                grad = None if self.is_last else self._received_gradient(comm, i, mb)
                self._backward_microbatch(comm, i, mb, grad)
                del mb
        return total

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """The model's forward through every stage, micro-batch by micro-batch.

        The first stage passes ``inputs``; the others pass nothing. With grad enabled (as
        torch records a graph) every stage keeps what :meth:`backward` needs: each
        micro-batch's input and output, alive until that backward (``max_live_activations``
        is then ``num_microbatches``: forward and backward run as GPipe does, whatever the
        schedule). Under ``torch.no_grad()`` nothing is kept: inference. A forward or step
        that follows without a backward drops what was kept, on every stage alike.

        Returns:
            On the last stage the output for the whole batch: with grad enabled a leaf that
            requires grad, so a loss computed from it leaves ``output.grad`` for
            :meth:`backward`. None on the others.

        Raises:
            ConfigurationError, RankLostError, CollectiveTimeoutError: as for :meth:`step`.
        """
        self._check_args(inputs, None, None, training=False)
        micro_inputs = self._split(inputs, "inputs") if self.is_first else None
        self._drop_pending()
        record = torch.is_grad_enabled()
        call = next(self._calls)
        if record:
            self._start_metering(inputs)
        comm = Exchange(self, call)
        kept: dict[int, _MicroBatch] = {}
        outputs = []
        try:
            for i in range(self.num_microbatches):
                inp = micro_inputs[i] if self.is_first else comm.recv_activation(i)
                with self.meter.hooks() if record else contextlib.nullcontext():
                    out = self._run_stage(inp)
                if record:
                    self._count_live(+1)
                    kept[i] = _MicroBatch(inp, out, self.meter.hold(out))
                if self.is_last:
                    outputs.append(out.detach())
                else:
                    comm.send_activation(i, out)
            comm.finish()
        except BaseException:
            for mb in kept.values():
                mb.release()
            raise
        if not self.is_last:
            if record:
                self._pending = _PendingBackward(call, kept, [], None)
            return None
        whole = torch.cat(outputs)
        if record:
            self._pending = _PendingBackward(call, kept, [o.shape[0] for o in outputs],
                                             whole.shape)
        return whole.requires_grad_(True) if record and whole.is_floating_point() else whole

    def backward(self, grad_outputs: torch.Tensor | None = None) -> None:
        """Backward through every stage for the last :meth:`forward` (run with grad enabled);
        parameter gradients accumulate into ``.grad`` as with ``loss.backward()``.

        The last stage passes the gradient of the loss with respect to the output its forward
        returned (``output.grad`` after ``loss.backward()``, or ``torch.autograd.grad``), of
        the output's shape; the other stages pass nothing. Every stage must call it. With a
        mean loss over the batch, the gradients equal those :meth:`step` leaves.

        Raises:
            ConfigurationError: no forward with grad enabled to go back through, or arguments
                given to the wrong stage, missing or of the wrong shape (before anything is
                sent: call again correctly; the other stages wait up to ``timeout``).
            RankLostError, CollectiveTimeoutError: a neighbour was lost or never answered.
        """
        pending = self._pending
        if pending is None:
            raise ConfigurationError(
                f"stage {self.stage}: backward() needs a forward() run with grad enabled before "
                "it (a step(), a forward under torch.no_grad() or a backward() already used it)")
        grads = self._split_grad_outputs(grad_outputs, pending)
        self._pending = None
        comm = Exchange(self, pending.call)
        try:
            for i in range(self.num_microbatches):
                mb = pending.kept.pop(i)
                grad = grads[i] if self.is_last else self._received_gradient(comm, i, mb)
                self._backward_microbatch(comm, i, mb, grad)
                del mb
            comm.finish()
        finally:
            pending.release()

    __call__ = forward

    # -- machinery -----------------------------------------------------------------------------

    def _drop_pending(self) -> None:
        """Forget a forward that was never backwarded (every stage does the same)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.release()
            self.live_activations = 0

    def _start_metering(self, *batch: torch.Tensor | None) -> None:
        # The parameters and the caller's batch are not activations (micro-batches are views).
        self.meter.exclude(itertools.chain(
            self.module.parameters(), self.module.buffers(),
            (t for t in batch if t is not None)))
        self.meter.reset_peak()
        self.max_live_activations = self.live_activations = 0

    def _count_live(self, change: int) -> None:
        self.live_activations += change
        self.max_live_activations = max(self.max_live_activations, self.live_activations)

    def _backward_microbatch(self, comm: Exchange, micro: int, mb: _MicroBatch,
                             grad: torch.Tensor | None) -> None:
        """Micro-batch ``micro``'s backward from ``grad``, the gradient of its output (None:
        the output is the loss), then its input's gradient to the previous stage; frees it."""
        if grad is None:
            mb.out.backward()
        elif mb.out.requires_grad:
            torch.autograd.backward(mb.out, grad_tensors=grad)
        if not self.is_first:
            g = mb.inp.grad if mb.inp.grad is not None else torch.zeros_like(mb.inp)
            comm.send_gradient(micro, g)
        mb.release()
        self._count_live(-1)

    def _received_gradient(self, comm: Exchange, micro: int, mb: _MicroBatch) -> torch.Tensor:
        grad = comm.recv_gradient(micro)
        if grad.shape != mb.out.shape:
            raise ProtocolError(
                f"stage {self.stage + 1} sent a gradient of shape {tuple(grad.shape)} for "
                f"micro-batch {micro}'s output of shape {tuple(mb.out.shape)}")
        return grad

    def _split_grad_outputs(self, grad_outputs, pending: _PendingBackward) -> list | None:
        """The last stage's ``grad_outputs`` split like its forward's outputs (on this stage's
        device); None elsewhere.

        Raises:
            ConfigurationError: given to a stage other than the last, missing there, or not
                shaped like the output.
        """
        if not self.is_last:
            if grad_outputs is not None:
                raise ConfigurationError(
                    f"stage {self.stage} is not the last stage (stage {self.stages - 1} is): its "
                    "output gradients come from stage "
                    f"{self.stage + 1}, pass grad_outputs=None")
            return None
        if not isinstance(grad_outputs, torch.Tensor):
            raise ConfigurationError(
                f"stage {self.stage} is the last stage: pass grad_outputs= the gradient of the "
                "loss with respect to forward()'s output (output.grad after loss.backward()), "
                f"got {type(grad_outputs).__name__}")
        if grad_outputs.shape != pending.shape:
            raise ConfigurationError(
                f"grad_outputs has shape {tuple(grad_outputs.shape)}, forward() returned "
                f"{tuple(pending.shape)}: pass the gradient with respect to that output")
        return list(torch.split(grad_outputs.to(self.device), pending.rows))

    def _check_args(self, inputs, targets, loss_fn, training: bool) -> None:
        r = self.stage
        if self.is_first and not isinstance(inputs, torch.Tensor):
            raise ConfigurationError(f"stage 0 is the first stage: pass inputs= a tensor, "
                                     f"got {type(inputs).__name__}")
        if not self.is_first and inputs is not None:
            raise ConfigurationError(
                f"stage {r} is not the first stage: its inputs come from stage {r - 1}, "
                "pass inputs=None")
        if not training:
            return
        if self.is_last:
            if not isinstance(targets, torch.Tensor):
                raise ConfigurationError(f"stage {r} is the last stage: pass targets= a tensor, "
                                         f"got {type(targets).__name__}")
            if loss_fn is None:
                raise ConfigurationError(f"stage {r} is the last stage: pass loss_fn=")
        elif targets is not None:
            raise ConfigurationError(
                f"stage {r} is not the last stage (stage {self.stages - 1} is): only the last "
                "stage takes targets, pass targets=None")

    def _split(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        if t.dim() == 0:
            raise ConfigurationError(f"{what} must have a batch dimension, got a 0-d tensor")
        sizes = split_sizes(t.shape[0], self.num_microbatches)
        return list(torch.split(t, sizes))

    def _run_stage(self, inp: torch.Tensor) -> torch.Tensor:
        out = self.module(inp)
        if not isinstance(out, torch.Tensor):
            raise ConfigurationError(
                f"stage {self.stage} returned {type(out).__name__}; a pipeline stage returns "
                "one tensor")
        return out

    def __repr__(self) -> str:
        return (f"Pipeline(stage={self.stage}/{self.stages}, num_microbatches="
                f"{self.num_microbatches}, schedule={self.schedule!r})")

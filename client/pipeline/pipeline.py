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

import itertools
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from gradstar.client.device import to_device
from gradstar.client.process_group import ProcessGroup
from gradstar.client.torch_common import module_device
from gradstar.errors import ConfigurationError, ProtocolError

from .memory import ActivationMeter
from .schedules import FORWARD, SCHEDULES, schedule_actions, split_sizes

# Pipelines are numbered per process group, in construction order, which every rank shares.
_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _MicroBatch:
    """What stage r keeps of one micro-batch between its forward and its backward."""

    __slots__ = ("inp", "out", "release")

    def __init__(self, inp, out, release) -> None:
        self.inp, self.out, self.release = inp, out, release


class Pipeline:
    """Runs stage ``pg.rank`` of a ``pg.world_size``-stage pipeline over peer streams.

    Every rank constructs its Pipeline with its own stage module and the same
    ``num_microbatches`` and ``schedule``, and calls :meth:`step` (or :meth:`forward`) the same
    number of times in the same order. See the module docstring for the protocol.

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

    def __init__(self, stage_module: nn.Module, pg: ProcessGroup, num_microbatches: int,
                 schedule: str = "1f1b", *, timeout: float | None = None) -> None:
        if not isinstance(pg, ProcessGroup):
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
        self._number = next(numbers)
        self._calls = itertools.count()
        self.meter = ActivationMeter()
        #: Micro-batches forwarded and not yet backwarded, now and at most during the last step.
        self.live_activations = 0
        self.max_live_activations = 0
        #: Seconds the last step or forward spent blocked on neighbours (the pipeline bubble,
        #: plus waiting for its own sends to be taken at the end).
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
        # The parameters and the caller's batch are not activations (micro-batches are views).
        self.meter.exclude(itertools.chain(
            self.module.parameters(), self.module.buffers(),
            (t for t in (inputs, targets) if t is not None)))
        self.meter.reset_peak()
        self.max_live_activations = self.live_activations = 0
        comm = _Exchange(self, call)
        kept: dict[int, _MicroBatch] = {}
        try:
            total = self._run_schedule(comm, kept, micro_inputs, micro_targets, batch, loss_fn)
            comm.finish()
        finally:
            for mb in kept.values():  # only after a failure: a finished step keeps nothing
                mb.release()
        return total

    def _run_schedule(self, comm: _Exchange, kept: dict[int, _MicroBatch], micro_inputs,
                      micro_targets, batch: int | None, loss_fn) -> torch.Tensor | None:
        total = None
        for action in self.actions:
            i = action.micro
            if action.kind == FORWARD:
                self.live_activations += 1
                self.max_live_activations = max(self.max_live_activations,
                                                self.live_activations)
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
                if self.is_last:
                    mb.out.backward()
                else:
                    grad = comm.recv_gradient(i)
                    if grad.shape != mb.out.shape:
                        raise ProtocolError(
                            f"stage {self.stage + 1} sent a gradient of shape "
                            f"{tuple(grad.shape)} for micro-batch {i}'s output of shape "
                            f"{tuple(mb.out.shape)}")
                    if mb.out.requires_grad:
                        torch.autograd.backward(mb.out, grad_tensors=grad)
                if not self.is_first:
                    g = mb.inp.grad if mb.inp.grad is not None else torch.zeros_like(mb.inp)
                    comm.send_gradient(i, g)
                mb.release()
                del mb
                self.live_activations -= 1
        return total

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """Inference through the whole pipeline, micro-batch by micro-batch, without autograd.

        The first stage passes ``inputs``; the others pass nothing.

        Returns:
            The model's output for the whole batch on the last stage; None on the others.

        Raises:
            ConfigurationError, RankLostError, CollectiveTimeoutError: as for :meth:`step`.
        """
        self._check_args(inputs, None, None, training=False)
        micro_inputs = self._split(inputs, "inputs") if self.is_first else None
        call = next(self._calls)
        comm = _Exchange(self, call)
        outputs = []
        with torch.no_grad():
            for i in range(self.num_microbatches):
                inp = micro_inputs[i] if self.is_first else comm.recv_activation(i)
                out = self._run_stage(inp)
                if self.is_last:
                    outputs.append(out)
                else:
                    comm.send_activation(i, out)
        comm.finish()
        return torch.cat(outputs) if self.is_last else None

    __call__ = forward

    # -- machinery -----------------------------------------------------------------------------

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


class _Exchange:
    """One call's messages: sends in flight, and receives posted one micro-batch ahead."""

    def __init__(self, pipe: Pipeline, call: int) -> None:
        self.pipe = pipe
        pipe.wait_seconds = 0.0
        self.call = call
        self.sends: list = []
        self.posted: dict[tuple[str, int], object] = {}

    def _tag(self, micro: int, kind: str) -> tuple:
        return ("pipe", self.pipe._number, self.call, micro, kind)

    def _recv(self, src: int, kind: str, micro: int) -> torch.Tensor:
        pg, m = self.pipe.pg, self.pipe.num_microbatches
        for i in (micro, micro + 1):
            if i < m and (kind, i) not in self.posted:
                self.posted[kind, i] = pg.recv(src, self._tag(i, kind), async_op=True,
                                               timeout=self.pipe.timeout)
        started = time.perf_counter()
        value = self.posted.pop((kind, micro)).wait()
        self.pipe.wait_seconds += time.perf_counter() - started
        if not isinstance(value, torch.Tensor):
            value = torch.from_numpy(value)
        if value.device != self.pipe.device:
            # The wire carries no device: a message arrives in host memory.
            value = to_device(value, self.pipe.device)
        return value

    def recv_activation(self, micro: int) -> torch.Tensor:
        x = self._recv(self.pipe.stage - 1, "act", micro)
        if x.is_floating_point() and torch.is_grad_enabled():
            x.requires_grad_(True)
        return x

    def recv_gradient(self, micro: int) -> torch.Tensor:
        return self._recv(self.pipe.stage + 1, "grad", micro)

    def send_activation(self, micro: int, out: torch.Tensor) -> None:
        self._send(self.pipe.stage + 1, "act", micro, out)

    def send_gradient(self, micro: int, grad: torch.Tensor) -> None:
        self._send(self.pipe.stage - 1, "grad", micro, grad)

    def _send(self, dst: int, kind: str, micro: int, t: torch.Tensor) -> None:
        self.sends.append(self.pipe.pg.send(t.detach(), dst, self._tag(micro, kind),
                                            async_op=True, timeout=self.pipe.timeout))

    def finish(self) -> None:
        """Wait until every neighbour holds what this stage sent."""
        started = time.perf_counter()
        for work in self.sends:
            work.wait()
        self.pipe.wait_seconds += time.perf_counter() - started

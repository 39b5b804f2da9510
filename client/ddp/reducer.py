"""The Reducer: DDP's gradient buckets, and what one synchronisation does with them.

:class:`~gradstar.client.ddp.DistributedDataParallel` owns one; its hooks tell it when a gradient
is ready, and it launches, completes and re-plans the buckets. The protocol every rank follows:

1. Parameters are grouped into :class:`~gradstar.client.buckets.BucketPlan` buckets of the cap,
   in reverse registration order, each bucket one flat tensor on the module's device.
2. A parameter's hook marks it ready (:meth:`Reducer.mark_ready`). When a bucket's last parameter
   is ready the bucket is *launched*: its gradients are copied into the flat tensor (cast to the
   compression dtype if any) and ``pg.all_reduce(flat, op="mean", async_op=True)`` starts while
   backward continues. Buckets launch strictly in index order on every rank, so every rank issues
   the same collectives in the same order even when gradients become ready in another order.
3. When backward ends every bucket not launched yet is launched (a parameter that got no gradient
   contributes its ``.grad`` if it still holds one from ``no_sync()`` steps, else zeros). The
   last bucket carries the step's *control* values in a tail of its own: a 1 where this rank
   assigned a new ``bucket_cap_mb`` and, when needed, one "this rank has a gradient" flag per
   parameter. Their means are exact (0 and 1 are exact in every float dtype; the ranks all read
   the same bytes, so they all decide alike). With a wire format (which rounds whole blocks) they
   travel apart instead, in a float64 all_reduce with op max beside the last bucket.
4. :meth:`Reducer.complete` waits for every Work, writes the means into ``.grad``, then reads
   the control values. Nobody assigned a cap: nothing to do (the default costs no collective).
   Some ranks did and others did not: every rank raises
   :class:`~gradstar.errors.BucketCapMismatchError` and keeps its buckets. Every rank did: the
   next step sends a float64 all_reduce (op max) of each rank's cap and its negation beside its
   last bucket, and when it completes every rank rebuilds its buckets for the step after, or,
   if the values differ, raises the same error and keeps them. (With a wire format the caps
   travel at every step, so the rebuild follows the step of the assignment.) Either way every
   rank issued the same collectives: a cap changed on some ranks only never misaligns them.

Unused parameters: with the flags a parameter no rank has a gradient for keeps ``grad=None``, one
some ranks have gets the mean with zeros from the others. ``static_graph`` sends the flags at the
first step only and remembers the answer: a parameter unused there counts as ready from the start
of each later step (its bucket no longer waits for the end of backward), one unused everywhere
keeps ``grad=None``. A later step whose used parameters differ is an error once its means are
written.

Gradients as bucket views (``gradient_as_bucket_view``): each ``.grad`` is a view into its
bucket's flat tensor, so autograd accumulates straight into the bucket, the copy in before the
all_reduce and the copy out after are skipped, and the gradients take no memory of their own. A
``.grad`` that is not the view (``zero_grad(set_to_none=True)`` left None and autograd allocated
a new one) is copied in at launch and replaced by the view, as torch's reducer does.
"""

from __future__ import annotations

import time

import torch

from gradstar.errors import BucketCapMismatchError, ConfigurationError

from ..buckets import BucketLaunch, BucketPlan, MiB, SyncStep, TensorSpec
from ..convert import is_cpu_tensor
from ..error_feedback import ErrorFeedback
from ..process_group.protocol import CollectiveGroup


class Reducer:
    """The buckets of ``params`` and their synchronisation (see the module docstring).

    Raises:
        ConfigurationError: ``as_view`` with buckets of another dtype than a parameter's.
    """

    def __init__(self, pg: CollectiveGroup, params: list[torch.Tensor], names: list[str],
                 cap_bytes: int, device: torch.device, bucket_dtype: torch.dtype | None,
                 wire: str | None, feedback: ErrorFeedback | None, *, find_unused: bool,
                 static_graph: bool, as_view: bool) -> None:
        self.pg, self.params, self.names, self.device = pg, params, names, device
        self.bucket_dtype, self.wire, self.feedback = bucket_dtype, wire, feedback
        self.find_unused, self.static_graph, self.as_view = find_unused, static_graph, as_view
        if as_view and bucket_dtype is not None:
            for name, p in zip(names, params, strict=True):
                if p.dtype != bucket_dtype:
                    raise ConfigurationError(
                        f"gradient_as_bucket_view=True needs buckets of each gradient's dtype; "
                        f"parameter {name} is {p.dtype} and the buckets {bucket_dtype} (a wire "
                        "format or gradient_compression): drop one of the two options")
        self.static_unused: set[int] | None = None  # static_graph: unused here at step one
        self.unused_everywhere: set[int] = set()  # static_graph: unused on every rank
        self.requested_cap: int | None = None  # a cap assigned, agreed with the next steps
        # Without a wire format the control values ride exactly in the last bucket's tail (no
        # collective of their own); a format rounds blocks, so they then travel apart.
        self.tail_control = wire is None
        self.confirming = False  # every rank asked for a new cap: compare the values this step
        self._build(cap_bytes)

    def _build(self, cap_bytes: int) -> None:
        self.plan = BucketPlan(
            [TensorSpec(p.numel(), p.element_size(), p.dtype) for p in self.params], cap_bytes)
        last = len(self.plan) - 1
        self.flats = [torch.zeros(b.numel + (self._tail_length() if b.index == last else 0),
                                  dtype=self.bucket_dtype or b.dtype, device=self.device)
                      for b in self.plan]
        self.views = [None] * len(self.params)
        for bucket, flat in zip(self.plan, self.flats, strict=True):
            for member, offset, numel in _slices(bucket):
                self.views[member] = flat[offset:offset + numel].view(self.params[member].shape)
        if self.as_view:  # gradients already there move into the buckets (torch does too)
            with torch.no_grad():
                for param, view in zip(self.params, self.views, strict=True):
                    if param.grad is not None and not param.grad.is_sparse:
                        view.copy_(param.grad)
                        param.grad = view

    def _tail_length(self) -> int:
        """The last bucket's control slots: "I assigned a new cap", and the flags if sent."""
        if not self.tail_control:
            return 0
        return 1 + (len(self.params) if self._sends_flags() else 0)

    # -- one step ------------------------------------------------------------------------------

    def new_step(self) -> SyncStep:
        """A synchronisation's bookkeeping; with a learned static graph the parameters unused
        at step one are ready from the start."""
        step = SyncStep(len(self.params), self.plan)
        for index in self.static_unused or ():
            step.ready[index] = True
            step.pending[self.plan.location[index][0]] -= 1
        return step

    def mark_ready(self, step: SyncStep, index: int) -> None:
        """Parameter ``index``'s gradient is accumulated."""
        if step.ready[index]:
            if self.static_unused and index in self.static_unused:
                step.unexpected.append(index)  # the static graph changed: an error at the end
            return
        step.ready[index] = True
        step.pending[self.plan.location[index][0]] -= 1

    def launch_ready(self, step: SyncStep, weight: float | None) -> None:
        """Launch, in index order, every bucket whose parameters are all ready."""
        while step.next_launch < len(self.plan) and step.pending[step.next_launch] == 0:
            self.launch(step, step.next_launch, "backward", weight)

    def launch_rest(self, step: SyncStep, during: str, weight: float | None) -> None:
        for index in range(step.next_launch, len(self.plan)):
            self.launch(step, index, during, weight)

    def launch(self, step: SyncStep, index: int, during: str, weight: float | None) -> None:
        bucket, flat = self.plan[index], self.flats[index]
        with torch.no_grad():
            for member, offset, numel in _slices(bucket):
                param = self.params[member]
                grad = param.grad
                if grad is None:
                    flat[offset:offset + numel].zero_()
                elif grad.is_sparse:
                    raise ConfigurationError(
                        f"parameter {self.names[member]} has a sparse gradient; "
                        "DistributedDataParallel reduces dense gradients only")
                elif not (self.as_view and _same(grad, self.views[member])):
                    flat[offset:offset + numel].copy_(grad.reshape(-1))
                    if self.as_view:
                        param.grad = self.views[member]  # the fresh gradient is freed now
            if self.feedback is not None:
                keep = [(offset, numel) for member, offset, numel in _slices(bucket)
                        if self.params[member].grad is None]
                self.feedback.compensate(index, flat, keep)
            if weight is not None:  # weighted: sums of w*g, divided by the sum of w
                flat[:bucket.numel].mul_(weight)
            last = index == len(self.plan) - 1
            if last and self.tail_control:
                changed = self.requested_cap not in (None, self.plan.cap_bytes)
                flat[bucket.numel:].copy_(torch.tensor([changed, *self._flags()]))
        # The flat tensor is not written again until this Work is waited for in complete(): a
        # CPU bucket takes its means in place; a CUDA one is staged and comes back new.
        step.works[index] = self.pg.all_reduce(
            flat, op="mean" if weight is None else "sum", async_op=True,
            out=flat if is_cpu_tensor(flat) else None, wire=self.wire)
        if last and (self.confirming or not self.tail_control):
            control = torch.tensor(self._control_values(), dtype=torch.float64)
            step.control_work = self.pg.all_reduce(
                control, op="max", async_op=True,
                out=control if is_cpu_tensor(control) else None)
        if last and weight is not None:
            step.weight_work = self.pg.all_reduce(
                torch.tensor([weight], dtype=torch.float64), op="sum", async_op=True)
        step.timeline.launches.append(BucketLaunch(index, time.perf_counter(), during))
        step.next_launch = index + 1

    def _sends_flags(self) -> bool:
        if self.static_graph:  # the first step finds what the others take as known
            return self.static_unused is None
        return self.find_unused

    def _flags(self) -> list[bool]:
        """One "this rank has a gradient" flag per parameter, when they are sent."""
        return [p.grad is not None for p in self.params] if self._sends_flags() else []

    def _control_values(self) -> list[float]:
        cap = self.requested_cap or self.plan.cap_bytes
        flags = [] if self.tail_control else self._flags()
        return [cap, -cap, *flags]  # max of -cap is -(the smallest cap)

    def complete(self, step: SyncStep, missing: list[int], when: str) -> None:
        """Wait for every bucket, write the means, then act on the control values and report
        parameters without gradients.

        Raises:
            BucketCapMismatchError: the ranks asked for different caps (the plan is kept).
            ConfigurationError: a parameter got no gradient (unless allowed), or a static
                graph changed.
            CollectiveError and subclasses: a collective failed (after all were waited for).
        """
        flagged = self._sends_flags()
        results, error = [], None
        for work in [*step.works, step.control_work, step.weight_work]:
            try:
                results.append(None if work is None else work.wait())
            except BaseException as exc:  # wait for the others before raising the first
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        total, control = results.pop(), results.pop()
        tail = results[-1][self.plan[-1].numel:].double() if self.tail_control else None
        if flagged:
            used = ((tail[1:] if self.tail_control else control[2:]) > 0).tolist()
        else:
            used = [i not in self.unused_everywhere for i in range(len(self.params))]
        self._write_means(results, used, None if total is None else float(total[0]))
        step.timeline.finished = time.perf_counter()
        learning = self.static_graph and self.static_unused is None
        if learning:
            self.static_unused = set(missing)
            self.unused_everywhere = {i for i, u in enumerate(used) if not u}
            if self.tail_control:
                self._build(self.plan.cap_bytes)  # the flags' slots are not needed any more
        if control is not None:
            self.confirming = False
            self._agree_on_cap(int(control[0]), int(-control[1]))
        else:
            # Each rank put 1 for "I assigned a new cap": the mean (the sum when weighted) says
            # whether nobody, everybody (compare the values at the next step) or only some did.
            everybody = 1.0 if total is None else float(self.pg.world_size)
            self._count_requests(float(tail[0]), everybody)
        if self.static_graph and not learning and (missing or step.unexpected):
            changed = ", ".join(self.names[i] for i in sorted({*missing, *step.unexpected}))
            raise ConfigurationError(
                f"static_graph=True, but the parameters rank {self.pg.rank} used {when} differ "
                f"from its first step's: {changed}. The step's means were written, but a "
                "gradient may have been sent incomplete; with a graph that changes, drop "
                "static_graph (and use find_unused_parameters=True)")
        if missing and not (self.find_unused or self.static_graph):
            names = ", ".join(self.names[i] for i in missing)
            raise ConfigurationError(
                f"rank {self.pg.rank} got no gradient for {len(missing)} "
                f"parameter(s) {when}: {names}. Their buckets were sent with "
                "zeros so no rank is left waiting, and the means were written to .grad; if "
                "these parameters take no part in the loss on some steps, construct "
                "DistributedDataParallel with find_unused_parameters=True (or set "
                "requires_grad=False on parameters that are never trained)")

    def _write_means(self, results: list, used: list[bool], weights: float | None) -> None:
        with torch.no_grad():
            for bucket, flat, result in zip(self.plan, self.flats, results, strict=True):
                if weights is not None:  # the weighted mean: sum(w*g) / sum(w), or 0 for none
                    result[:bucket.numel].mul_(1.0 / weights if weights > 0 else 0.0)
                if self.as_view and result.data_ptr() != flat.data_ptr():
                    flat.copy_(result)  # a staged bucket's means came back as a new tensor
                for member, offset, numel in _slices(bucket):
                    if not used[member]:
                        continue  # no rank has a gradient: keep None, as torch does
                    param = self.params[member]
                    if self.as_view:
                        if param.grad is None or not _same(param.grad, self.views[member]):
                            param.grad = self.views[member]
                        continue
                    mean = result[offset:offset + numel].view(param.shape)
                    if param.grad is None:
                        param.grad = mean.to(param.dtype, copy=True)
                    else:
                        param.grad.copy_(mean)

    # -- the bucket cap ------------------------------------------------------------------------

    def _count_requests(self, share: float, everybody: float) -> None:
        if share == 0:
            return
        if share == everybody:
            self.confirming = True
            return
        requested, self.requested_cap = self.requested_cap, None
        mine = (f"assigned {requested / MiB:g} MB" if requested is not None
                else f"kept {self.plan.cap_bytes / MiB:g} MB")
        raise BucketCapMismatchError(
            f"some ranks assigned bucket_cap_mb before this step and others did not (rank "
            f"{self.pg.rank} {mine}); every rank keeps its buckets of "
            f"{self.plan.cap_bytes / MiB:g} MB. Assign the same bucket_cap_mb on every rank "
            "between the same two steps")

    def _agree_on_cap(self, highest: int, lowest: int) -> None:
        requested, self.requested_cap = self.requested_cap, None
        if highest != lowest:
            mine = requested or self.plan.cap_bytes
            raise BucketCapMismatchError(
                f"the ranks asked for different bucket caps at this step: from "
                f"{lowest / MiB:g} to {highest / MiB:g} MB (rank {self.pg.rank}: "
                f"{mine / MiB:g} MB); every rank keeps its buckets of "
                f"{self.plan.cap_bytes / MiB:g} MB. Assign the same bucket_cap_mb on every "
                "rank between the same two steps")
        if highest != self.plan.cap_bytes:
            self.rebuild(highest)

    def rebuild(self, cap_bytes: int) -> None:
        """New buckets of ``cap_bytes`` (between steps): gradient views and error-feedback
        residuals move to their parameters' new places."""
        old_plan, residuals = self.plan, (self.feedback.residuals if self.feedback else {})
        self._build(cap_bytes)
        if not residuals:
            return
        moved = {b.index: torch.zeros_like(f) for b, f in zip(self.plan, self.flats,
                                                                strict=True)}
        for index, residual in residuals.items():
            if not isinstance(index, int):  # not a bucket's (a sync mode's "steps"): kept
                moved[index] = residual
                continue
            for member, offset, numel in _slices(old_plan[index]):
                new_index, position = self.plan.location[member]
                start = self.plan[new_index].offsets[position]
                moved[new_index][start:start + numel] = residual[offset:offset + numel]
        self.feedback.load(moved)


def _slices(bucket):
    return zip(bucket.members, bucket.offsets, bucket.numels, strict=True)


def _same(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``grad`` is ``view`` (the same memory and shape): autograd accumulated into it."""
    return grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


__all__ = ["Reducer"]

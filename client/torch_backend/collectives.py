"""The collectives of gradstar's torch.distributed process group: what each of torch's collective
calls (``allreduce``, ``broadcast``, the gathers and scatters, ``barrier``) becomes in gradstar.

:class:`Collectives` is mixed into :class:`~gradstar.client.torch_backend.group.
ProcessGroupGradstar`, which gives it ``gradstar_group`` (the gradstar ProcessGroup),
``rank()``, ``size()`` and its ``launcher`` (:class:`~.launcher.Launcher`: start gradstar
collectives in order and wrap them in one Work), all public. Every method starts its collectives
here, in the caller's thread, and writes the results into torch's tensors when the Work is
settled; the rules (order, in place, dtypes, devices, bitwise ops, errors) are in :mod:`.group`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from gradstar.client.convert import is_cpu_tensor
from gradstar.client.device import check_device
from gradstar.errors import CollectiveTimeoutError, ConfigurationError

from .convert import (
    BITWISE_OPS,
    CallOptions,
    bitwise_reduce,
    check_dense,
    check_numel,
    for_bitwise,
    for_reduction,
    for_transfer,
    reduce_op_name,
    tensor_list,
    write_rows,
)
from .profiling import record_collectives


class MonitoredBarrierError(CollectiveTimeoutError, RuntimeError):
    """Some ranks did not reach a ``monitored_barrier`` in time (a RuntimeError, as gloo's)."""


#: dtypes numpy views as they are that the hub reduces (bfloat16 needs ml_dtypes' view).
_NUMPY_REDUCED = {torch.float32, torch.float64, torch.float16, torch.int32, torch.int64}


def _numpy_in_place(tensors: list[torch.Tensor], op: str):
    """The numpy view of the one tensor of a waited all_reduce that the SDK can reduce in
    place, its result written straight into the tensor's memory (``out=``) with nothing to
    write afterwards: a dense tensor the wire may write into (:func:`_viewable`) of a dtype in
    :data:`_NUMPY_REDUCED`, not a negated view, reduced by the hub (not a bitwise op). None
    for anything else, which takes the general path."""
    if len(tensors) != 1 or op in BITWISE_OPS:
        return None
    t = tensors[0]
    # dtype and layout first: a sparse tensor has no is_contiguous() to ask.
    if (t.dtype in _NUMPY_REDUCED and t.layout == torch.strided and _viewable(t)
            and not t.is_neg()):
        return t.numpy()
    return None


def _viewable(t: torch.Tensor) -> bool:
    """Whether the result may be written into ``t``'s memory straight from the wire: a
    contiguous CPU tensor (a CUDA one is staged through host memory) that does not require
    grad. (The write is not autograd's; ``finish``'s ``copy_`` of the tensor onto itself then
    bumps its version counter as any in-place write does.)"""
    return is_cpu_tensor(t) and t.is_contiguous() and not t.requires_grad


@record_collectives
class Collectives:
    """torch's collective calls over gradstar's all_reduce, broadcast, all_gather,
    reduce_scatter and barrier (a mixin of the process group; see the module docstring)."""

    def _reduce(self, tensors: list[torch.Tensor], op: str, how: CallOptions,
                write: Callable[[int, torch.Tensor], None], *, in_place: bool = False,
                wire: str | None = None):
        """All_reduce each of ``tensors`` and ``write(i, result)``. ``in_place``: the result
        may overwrite the tensor itself (all_reduce, not reduce), so a contiguous CPU tensor
        of a dtype the hub reduces receives it straight from the wire (``out=``): no result
        array to allocate and fault in, no copy (and ``write``'s copy_ is then a no-op).
        ``wire``: a compressed wire format (float tensors, not the bitwise ops). ``how``: the
        call's timeout, and whether its caller waits at once (see :meth:`.Launcher.launch`)."""
        if op in BITWISE_OPS:
            return self._gather(
                [for_bitwise(t, op) for t in tensors], how,
                lambda i, parts: write(i, bitwise_reduce(parts, op).reshape(tensors[i].shape)),
                tensors)
        prepared = [for_reduction(t, op) for t in tensors]
        starts = [self.launcher.call(self.gradstar_group.all_reduce, w, op, timeout=how.timeout,
                                     out=w if in_place and w is t and _viewable(t) else None,
                                     wire=wire)
                  for (w, _), t in zip(prepared, tensors, strict=True)]

        def finish(results):
            for i, ((_, restore), result) in enumerate(zip(prepared, results, strict=True)):
                write(i, restore(result))
            return tensors

        return self.launcher.launch(starts, finish, tensors, settle=how.settle)

    def _gather(self, inputs: list[torch.Tensor], how: CallOptions,
                write: Callable[[int, list[torch.Tensor]], None], result):
        prepared = [for_transfer(t) for t in inputs]
        starts = [self.launcher.call(self.gradstar_group.all_gather, w, timeout=how.timeout)
                  for w, _ in prepared]

        def finish(results):
            for i, ((_, restore), parts) in enumerate(zip(prepared, results, strict=True)):
                write(i, [restore(p) for p in parts])
            return result

        return self.launcher.launch(starts, finish, [inputs, result], settle=how.settle)

    def _scatter_reduce(self, outputs: list[torch.Tensor], flats: list[torch.Tensor], op: str,
                        how: CallOptions):
        world = self.size()
        for out, flat in zip(outputs, flats, strict=True):
            check_dense(flat)  # before reshape(), whose own error would not say why
            check_numel("reduce_scatter's input", flat.numel(), out.numel() * world)
        if op in BITWISE_OPS:
            me = self.rank()

            def write(i, parts):
                whole = bitwise_reduce([p.reshape(world, -1) for p in parts], op)
                outputs[i].copy_(whole[me].reshape(outputs[i].shape))

            return self._gather([for_bitwise(flat, op) for flat in flats], how, write, outputs)
        prepared = [for_reduction(flat.reshape(world, -1), op) for flat in flats]
        starts = [self.launcher.call(self.gradstar_group.reduce_scatter, w, op,
                                     timeout=how.timeout)
                  for w, _ in prepared]

        def finish(results):
            for out, (_, restore), shard in zip(outputs, prepared, results, strict=True):
                out.copy_(restore(shard).reshape(out.shape))
            return outputs

        return self.launcher.launch(starts, finish, [outputs, flats], settle=how.settle)

    def allreduce(self, tensors, opts=None):
        tensors = tensor_list(tensors)
        op, how = reduce_op_name(opts), CallOptions.of(opts)
        if how.settle and (arr := _numpy_in_place(tensors, op)) is not None:
            # dist.all_reduce(t) of a CPU tensor: the SDK reduces into t's memory, and the
            # Work comes back settled. A result written counts as an in-place op (t's version,
            # which autograd checks), once; a failed call leaves the version as it was, as
            # the general path's copy_ and torch's own failed in-place ops do.
            work = self.launcher.settled(tensors, self.gradstar_group.all_reduce, arr, op,
                                         timeout=how.timeout, out=arr)
            if work.is_success():
                increment_version(tensors[0])
            return work
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, op, how.timeout)
        return self._reduce(tensors, op, how, lambda i, r: tensors[i].copy_(r), in_place=True)

    def allreduce_wire(self, tensor: torch.Tensor, op: str = "mean", *, wire: str,
                       timeout: float | None = None):
        """gradstar's own all_reduce of one dense float ``tensor`` in place, sent in the
        compressed format ``wire`` (the hub decodes and reduces in float32, and encodes the
        result once); not a torch.distributed call. ``op``: gradstar's name ("sum", "mean",
        "min", "max"). For communication hooks (:mod:`.comm_hooks`).

        Raises:
            ConfigurationError: an unknown format, an op or dtype the format does not take.
        """
        if op not in ("sum", "mean", "min", "max", "prod"):
            raise ConfigurationError(
                f"allreduce_wire reduces with sum, mean, min, max or prod, not {op!r}")
        return self._reduce([tensor], op, CallOptions(timeout), lambda _i, r: tensor.copy_(r),
                            in_place=True, wire=wire)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: str, timeout: float | None):
        """Sum sparse COO tensors as gloo does: every rank gathers every rank's indices and
        values and coalesces them. Ranks hold different numbers of entries, so the counts go
        first (one small all_gather, waited for here), then indices and values padded to the
        largest count; the result replaces each input in place."""
        if op != "sum":
            raise ConfigurationError(
                f"sparse all_reduce supports SUM only (as gloo does), got {op.upper()}")
        if len(tensors) != 1 or tensors[0].layout != torch.sparse_coo:
            raise ConfigurationError("sparse all_reduce takes one sparse COO tensor per call")
        check_device(tensors[0])
        t = tensors[0].coalesce()
        # Every rank's entries travel in host tensors; a CUDA tensor's are copied there now, in
        # the caller's thread, after what its stream computed (copy_ to the host waits for it).
        indices, values = t.indices(), t.values()
        counts = self.gradstar_group.all_gather(torch.tensor([indices.shape[1]]),
                                                timeout=timeout)
        counts = [int(c[0]) for c in counts]
        most = max(counts)
        padded_indices = torch.zeros((indices.shape[0], most), dtype=torch.int64)
        padded_indices[:, :indices.shape[1]] = indices
        padded_values = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
        padded_values[:values.shape[0]] = values
        gathered: list = []

        def write(i, parts):
            gathered.append(parts)
            if len(gathered) == 2:
                every_index = torch.cat([p[:, :n] for p, n in zip(gathered[0], counts,
                                                                  strict=True)], dim=1)
                every_value = torch.cat([p[:n] for p, n in zip(gathered[1], counts,
                                                               strict=True)])
                total = torch.sparse_coo_tensor(every_index, every_value, t.shape).coalesce()
                tensors[0].copy_(total.to(tensors[0].device))

        return self._gather([padded_indices, padded_values], CallOptions(timeout), write, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = tensor_list(tensors)
        op, how = reduce_op_name(opts), CallOptions.of(opts)
        if op in BITWISE_OPS:
            return self._reduce(tensors, op, CallOptions(how.timeout),
                                lambda i, r: tensors[i].copy_(r))
        prepared = [for_reduction(t, op) for t in tensors]

        def finish(results):
            for t, (_, restore), r in zip(tensors, prepared, results[0], strict=True):
                t.copy_(restore(r))
            return tensors

        start = self.launcher.call(self.gradstar_group.all_reduce_coalesced,
                                   [w for w, _ in prepared], op, timeout=how.timeout)
        return self.launcher.launch([start], finish, tensors, settle=how.settle)

    def reduce(self, tensors, opts=None):
        """torch's reduce, as an all_reduce whose result only the root keeps."""
        tensors = tensor_list(tensors)
        root = getattr(opts, "rootRank", 0)

        def write(i, r):
            if self.rank() == root:
                tensors[i].copy_(r)

        return self._reduce(tensors, reduce_op_name(opts), CallOptions.of(opts), write)

    def broadcast(self, tensors, opts=None):
        tensors = tensor_list(tensors)
        return self._broadcast(tensors, getattr(opts, "rootRank", 0), CallOptions.of(opts),
                               lambda i, r: tensors[i].copy_(r), tensors)

    def _broadcast(self, tensors: list[torch.Tensor], root: int, how: CallOptions,
                   write: Callable[[int, torch.Tensor], None], result):
        prepared = [for_transfer(t) for t in tensors]
        starts = [self.launcher.call(self.gradstar_group.broadcast, w, root, timeout=how.timeout)
                  for w, _ in prepared]

        def finish(results):
            if self.rank() != root:
                for i, ((_, restore), r) in enumerate(zip(prepared, results, strict=True)):
                    write(i, restore(r))
            return result

        return self.launcher.launch(starts, finish, [tensors, result], settle=how.settle)

    def allgather(self, output_tensors, input_tensors, opts=None):
        inputs = tensor_list(input_tensors)
        for outs, t in zip(output_tensors, inputs, strict=True):
            check_numel("all_gather's output list", len(outs), self.size())
            for out in outs:
                check_numel("an all_gather output", out.numel(), t.numel())

        def write(i, parts):
            for out, part in zip(output_tensors[i], parts, strict=True):
                out.copy_(part.reshape(out.shape))

        return self._gather(inputs, CallOptions.of(opts), write, output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """torch's all_gather_coalesced: ``output_lists[rank][i]`` receives input ``i`` of
        ``rank`` (lists by rank, unlike allgather's lists by input), one all_gather per input."""
        inputs = tensor_list(input_list)
        check_numel("all_gather_coalesced's output list", len(output_lists), self.size())
        for outs in output_lists:
            check_numel("an all_gather_coalesced output list", len(outs), len(inputs))
            for out, t in zip(outs, inputs, strict=True):
                check_numel("an all_gather_coalesced output", out.numel(), t.numel())

        def write(i, parts):
            for outs, part in zip(output_lists, parts, strict=True):
                outs[i].copy_(part.reshape(outs[i].shape))

        return self._gather(inputs, CallOptions.of(opts), write, output_lists)

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        return self.all_gather_single_coalesced([output_tensor], [input_tensor], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        outputs, inputs = tensor_list(outputs), tensor_list(inputs)
        for out, t in zip(outputs, inputs, strict=True):
            check_numel("all_gather_into_tensor's output", out.numel(), t.numel() * self.size())
        return self._gather(inputs, CallOptions.of(opts),
                            lambda i, parts: write_rows(outputs[i], parts), outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        """torch's gather, as an all_gather whose result only the root keeps."""
        inputs = tensor_list(input_tensors)
        root = getattr(opts, "rootRank", 0)

        def write(i, parts):
            if self.rank() == root:
                for out, part in zip(output_tensors[i], parts, strict=True):
                    out.copy_(part.reshape(out.shape))

        return self._gather(inputs, CallOptions.of(opts), write, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """torch's scatter, as a broadcast of the root's inputs of which each rank keeps its own."""
        outputs = tensor_list(output_tensors)
        root, world, me = getattr(opts, "rootRank", 0), self.size(), self.rank()
        stacked = []
        for i, out in enumerate(outputs):
            check_dense(out)  # before the root writes its own part below
            if me == root:
                parts = input_tensors[i]
                check_numel("scatter's input list", len(parts), world)
                stacked.append(torch.stack([p.reshape(out.shape) for p in parts]))
            else:
                stacked.append(out.new_empty((world, *out.shape)))
        if me == root:
            for out, whole in zip(outputs, stacked, strict=True):
                out.copy_(whole[me])
        return self._broadcast(stacked, root, CallOptions.of(opts),
                               lambda i, whole: outputs[i].copy_(whole[me]), outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        outputs = tensor_list(output_tensors)
        for out, parts in zip(outputs, input_tensors, strict=True):
            check_numel("reduce_scatter's input list", len(parts), self.size())
            for part in parts:
                check_dense(part)
                check_numel("a reduce_scatter input", part.numel(), out.numel())
        flats = [torch.cat([p.reshape(-1) for p in parts]) for parts in input_tensors]
        return self._scatter_reduce(outputs, flats, reduce_op_name(opts), CallOptions.of(opts))

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        return self.reduce_scatter_single_coalesced([output_tensor], [input_tensor], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        outputs, inputs = tensor_list(outputs), tensor_list(inputs)
        return self._scatter_reduce(outputs, inputs, reduce_op_name(opts),
                                    CallOptions.of(opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        how = CallOptions.of(opts)
        if how.settle:  # dist.barrier(): run to its end here, the Work back settled
            return self.launcher.settled([], self.gradstar_group.barrier, timeout=how.timeout)
        return self.launcher.launch(
            [self.launcher.call(self.gradstar_group.barrier, timeout=how.timeout)],
            lambda _results: [], [], settle=how.settle)

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """torch's ``ProcessGroup.monitored_barrier``, called on the group (torch's
        ``dist.monitored_barrier`` itself accepts gloo groups only): a barrier that, if some
        ranks do not reach it within ``timeout`` (default: the group's), raises on the ranks
        that did, naming the first rank missing (all of them with ``wait_all_ranks``) in gloo's
        words. Blocks.

        Raises:
            MonitoredBarrierError: some ranks did not arrive in time.
            GradstarError: the barrier failed otherwise (a lost rank, a closed group).
        """
        seconds = None if timeout is None else max(timeout.total_seconds(), 0.001)
        opts = dist.BarrierOptions()
        if seconds is not None:
            opts.timeout = timedelta(seconds=seconds)
        try:
            self.barrier(opts).wait()
        except CollectiveTimeoutError as error:
            spent = "the group's timeout" if seconds is None else f"{seconds * 1000:g} ms"
            missing = error.missing_ranks
            who = (f"Ranks {', '.join(map(str, missing))}" if wait_all_ranks else
                   f"Rank {missing[0]}") if missing else "Some ranks"
            raise MonitoredBarrierError(
                f"Rank {self.rank()} timed out in monitoredBarrier after {spent}: {who} failed "
                f"to pass monitoredBarrier in {spent} ({error})", missing_ranks=missing) from None


__all__ = ["Collectives", "MonitoredBarrierError"]

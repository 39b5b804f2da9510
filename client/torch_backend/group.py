"""ProcessGroupGradstar: the torch.distributed process group of gradstar's backend.

A pure-Python subclass of ``torch.distributed.ProcessGroup`` wrapping one blocking gradstar
:class:`~gradstar.client.process_group.ProcessGroup` (one gradstar job). torch uses it directly
as the group: ``dist.all_reduce``, DDP's reducer and FSDP2 call the methods below, each of which
starts gradstar collectives with ``async_op=True`` and returns a
:class:`~gradstar.client.torch_backend.work.GradstarWork`.

* **Order.** Every gradstar collective takes its sequence number when it is started, here, in
  the caller's thread, so collectives match on the hub in the order torch issued them.
* **In place.** As with torch's own backends the results land in the tensors torch passed
  (all_reduce, broadcast, the output tensors of gathers and scatters), written when the Work is
  settled: by ``wait()`` or by a completion thread, whichever comes first.
* **dtypes.** See :mod:`gradstar.client.torch_backend.convert`: every dtype moves, most reduce.
* **Devices.** Tensors on the CPU or a CUDA device, as with gloo; others (mps, xpu, meta, ...)
  are refused with a :class:`~gradstar.errors.ConfigurationError` naming the device. A CUDA
  collective first waits, in the caller's thread, for what the caller queued on its current
  streams (the tensors' producers), then copies its inputs to host memory there (gradstar's
  SDK does, see :mod:`gradstar.client.device`); its results are written on the device by the
  thread that settles the Work and are complete for every stream by the time ``wait()`` returns
  or the Work's future completes (see :mod:`.work`).
* **Bitwise ops.** The hub reduces SUM, AVG, MIN, MAX and PRODUCT; BAND, BOR and BXOR run as an
  all_gather that every rank reduces itself (exact, and cheap for the small tensors they suit).
* **Errors.** An invalid argument (unsupported reduce op or dtype, wrong sizes) raises at once,
  as a ``ValueError`` (:class:`~gradstar.errors.ConfigurationError` or
  :class:`~gradstar.errors.InvalidCollectiveError`); a collective that fails later fails its Work.
  What the backend does not do (send/recv without gradstar's peer streams) raises
  :class:`BackendUnsupportedError`, a NotImplementedError.
* **Profiler.** Each collective records a ``gradstar:<op>`` event with its inputs' shapes
  while torch's profiler runs, as gloo's record ``gloo:<op>`` (see :mod:`.profiling`).
* **all_to_all** rides gradstar's ``all_to_all_single`` (plans checked through the hub, payload
  over peer streams); torch's list form is one flat ``all_to_all_single`` of the concatenated
  tensors. **recv from any source** reports the sender as torch's Work does
  (``work._source_rank()``, which ``dist.recv`` returns).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gradstar.client.convert import is_cpu_tensor
from gradstar.client.device import check_device, synchronize
from gradstar.client.process_group import ProcessGroup
from gradstar.errors import (
    CollectiveTimeoutError,
    ConfigurationError,
    GradstarError,
    InvalidCollectiveError,
    ProcessGroupClosedError,
)

from .convert import (
    BITWISE_OPS,
    bitwise_reduce,
    check_dense,
    check_numel,
    cuda_devices,
    for_bitwise,
    for_reduction,
    for_transfer,
    reduce_op_name,
    rows_for_transfer,
    seconds_of,
    tensor_list,
    tensors_in,
    write_rows,
)
from .profiling import record_collectives
from .work import CompletionThreads, GradstarWork


class BackendUnsupportedError(GradstarError, NotImplementedError):
    """The gradstar torch.distributed backend does not implement this operation (yet)."""


class MonitoredBarrierError(CollectiveTimeoutError, RuntimeError):
    """Some ranks did not reach a ``monitored_barrier`` in time (a RuntimeError, as gloo's)."""


def _viewable(t: torch.Tensor) -> bool:
    """Whether the result may be written into ``t``'s memory straight from the wire: a
    contiguous CPU tensor (a CUDA one is staged through host memory) that does not require
    grad. (The write is not autograd's; ``finish``'s ``copy_`` of the tensor onto itself then
    bumps its version counter as any in-place write does.)"""
    return is_cpu_tensor(t) and t.is_contiguous() and not t.requires_grad


# -- the group ---------------------------------------------------------------------------------


@record_collectives
class ProcessGroupGradstar(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a gradstar coordinator.

    Created by torch through the registered backend (see :mod:`gradstar.client.torch_backend`),
    one per torch group; ``gradstar_group`` is the gradstar ProcessGroup it wraps.
    """

    def __init__(self, group: ProcessGroup, completions: CompletionThreads, *,
                 options: dict | None = None,
                 on_shutdown: Callable[[ProcessGroupGradstar], None] | None = None) -> None:
        super().__init__(group.rank, group.world_size)
        self.gradstar_group = group
        self.options = dict(options or {})  # how it joined: subgroups inherit these
        self._completions = completions
        self._on_shutdown = on_shutdown
        self._group_name = ""
        self._group_desc = ""
        self._closed = False
        self._in_flight: weakref.WeakSet[GradstarWork] = weakref.WeakSet()
        self._error_label = f"[Rank {group.rank}] "  # before the messages of failed Works
        self._lock = threading.Lock()

    # -- what torch asks about the group -------------------------------------------------------

    def getBackendName(self) -> str:
        return "gradstar"

    def name(self) -> str:
        return "gradstar"

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def __repr__(self) -> str:
        return (f"ProcessGroupGradstar(job={self.gradstar_group.job!r}, rank={self.rank()}, "
                f"size={self.size()}, name={self._group_name!r})")

    # -- machinery -----------------------------------------------------------------------------

    def _launch(self, starts: Sequence[Callable[[], object]],
                finish: Callable[[list], object], tensors,
                work_type: type[GradstarWork] = GradstarWork) -> GradstarWork:
        """Start gradstar collectives (in order, here) and wrap them in one Work.

        ``tensors`` (nested lists allowed) are every tensor the collectives read or write. On a
        CUDA device, what the caller queued on its current stream is finished before anything
        starts: results are written on another thread's stream, which would not wait for it
        (an input's copy to the host waits for it too, but not every output is an input).

        Raises:
            ConfigurationError: a tensor on a device other than the CPU or CUDA, named.
            ValueError: other invalid arguments (gradstar's own, raised by ``starts``); any
                other gradstar error fails the Work instead.
        """
        every = list(tensors_in(tensors))
        for t in every:
            check_device(t)
        devices = cuda_devices(every)
        for device in devices:
            synchronize(device)
        try:
            pending = [start() for start in starts]
        except ValueError:
            raise
        except GradstarError as error:
            return GradstarWork.failed(error, self._completions, label=self._error_label)
        work = work_type(pending, finish, self._completions, label=self._error_label,
                         devices=devices,
                         inference=any(t.is_inference() for t in every))
        with self._lock:
            self._in_flight.add(work)
        return work

    def _reduce(self, tensors: list[torch.Tensor], op: str, timeout: float | None,
                write: Callable[[int, torch.Tensor], None], *, in_place: bool = False):
        """All_reduce each of ``tensors`` and ``write(i, result)``. ``in_place``: the result
        may overwrite the tensor itself (all_reduce, not reduce), so a contiguous CPU tensor
        of a dtype the hub reduces receives it straight from the wire (``out=``): no result
        array to allocate and fault in, no copy (and ``write``'s copy_ is then a no-op)."""
        if op in BITWISE_OPS:
            return self._gather(
                [for_bitwise(t, op) for t in tensors], timeout,
                lambda i, parts: write(i, bitwise_reduce(parts, op).reshape(tensors[i].shape)),
                tensors)
        prepared = [for_reduction(t, op) for t in tensors]
        starts = [lambda w=w, t=t: self.gradstar_group.all_reduce(
                      w, op, async_op=True, timeout=timeout,
                      out=w if in_place and w is t and _viewable(t) else None)
                  for (w, _), t in zip(prepared, tensors, strict=True)]

        def finish(results):
            for i, ((_, restore), result) in enumerate(zip(prepared, results, strict=True)):
                write(i, restore(result))
            return tensors

        return self._launch(starts, finish, tensors)

    def _gather(self, inputs: list[torch.Tensor], timeout: float | None,
                write: Callable[[int, list[torch.Tensor]], None], result):
        prepared = [for_transfer(t) for t in inputs]
        starts = [lambda w=w: self.gradstar_group.all_gather(w, async_op=True, timeout=timeout)
                  for w, _ in prepared]

        def finish(results):
            for i, ((_, restore), parts) in enumerate(zip(prepared, results, strict=True)):
                write(i, [restore(p) for p in parts])
            return result

        return self._launch(starts, finish, [inputs, result])

    def _scatter_reduce(self, outputs: list[torch.Tensor], flats: list[torch.Tensor], op: str,
                        timeout: float | None):
        world = self.size()
        for out, flat in zip(outputs, flats, strict=True):
            check_dense(flat)  # before reshape(), whose own error would not say why
            check_numel("reduce_scatter's input", flat.numel(), out.numel() * world)
        if op in BITWISE_OPS:
            me = self.rank()

            def write(i, parts):
                whole = bitwise_reduce([p.reshape(world, -1) for p in parts], op)
                outputs[i].copy_(whole[me].reshape(outputs[i].shape))

            return self._gather([for_bitwise(flat, op) for flat in flats], timeout, write,
                                outputs)
        prepared = [for_reduction(flat.reshape(world, -1), op) for flat in flats]
        starts = [lambda w=w: self.gradstar_group.reduce_scatter(w, op, async_op=True,
                                                                 timeout=timeout)
                  for w, _ in prepared]

        def finish(results):
            for out, (_, restore), shard in zip(outputs, prepared, results, strict=True):
                out.copy_(restore(shard).reshape(out.shape))
            return outputs

        return self._launch(starts, finish, [outputs, flats])

    # -- collectives ---------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensors = tensor_list(tensors)
        if any(t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, reduce_op_name(opts), seconds_of(opts))
        return self._reduce(tensors, reduce_op_name(opts), seconds_of(opts),
                            lambda i, r: tensors[i].copy_(r), in_place=True)

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

        return self._gather([padded_indices, padded_values], timeout, write, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = tensor_list(tensors)
        op, timeout = reduce_op_name(opts), seconds_of(opts)
        if op in BITWISE_OPS:
            return self._reduce(tensors, op, timeout, lambda i, r: tensors[i].copy_(r))
        prepared = [for_reduction(t, op) for t in tensors]

        def finish(results):
            for t, (_, restore), r in zip(tensors, prepared, results[0], strict=True):
                t.copy_(restore(r))
            return tensors

        return self._launch([lambda: self.gradstar_group.all_reduce_coalesced(
            [w for w, _ in prepared], op, async_op=True, timeout=timeout)], finish, tensors)

    def reduce(self, tensors, opts=None):
        """torch's reduce, as an all_reduce whose result only the root keeps."""
        tensors = tensor_list(tensors)
        root = getattr(opts, "rootRank", 0)

        def write(i, r):
            if self.rank() == root:
                tensors[i].copy_(r)

        return self._reduce(tensors, reduce_op_name(opts), seconds_of(opts), write)

    def broadcast(self, tensors, opts=None):
        tensors = tensor_list(tensors)
        return self._broadcast(tensors, getattr(opts, "rootRank", 0), seconds_of(opts),
                               lambda i, r: tensors[i].copy_(r), tensors)

    def _broadcast(self, tensors: list[torch.Tensor], root: int, timeout: float | None,
                   write: Callable[[int, torch.Tensor], None], result):
        prepared = [for_transfer(t) for t in tensors]
        starts = [lambda w=w: self.gradstar_group.broadcast(w, root, async_op=True,
                                                            timeout=timeout)
                  for w, _ in prepared]

        def finish(results):
            if self.rank() != root:
                for i, ((_, restore), r) in enumerate(zip(prepared, results, strict=True)):
                    write(i, restore(r))
            return result

        return self._launch(starts, finish, [tensors, result])

    def allgather(self, output_tensors, input_tensors, opts=None):
        inputs = tensor_list(input_tensors)
        for outs, t in zip(output_tensors, inputs, strict=True):
            check_numel("all_gather's output list", len(outs), self.size())
            for out in outs:
                check_numel("an all_gather output", out.numel(), t.numel())

        def write(i, parts):
            for out, part in zip(output_tensors[i], parts, strict=True):
                out.copy_(part.reshape(out.shape))

        return self._gather(inputs, seconds_of(opts), write, output_tensors)

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

        return self._gather(inputs, seconds_of(opts), write, output_lists)

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        return self.all_gather_single_coalesced([output_tensor], [input_tensor], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        outputs, inputs = tensor_list(outputs), tensor_list(inputs)
        for out, t in zip(outputs, inputs, strict=True):
            check_numel("all_gather_into_tensor's output", out.numel(), t.numel() * self.size())
        return self._gather(inputs, seconds_of(opts),
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

        return self._gather(inputs, seconds_of(opts), write, output_tensors)

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
        return self._broadcast(stacked, root, seconds_of(opts),
                               lambda i, whole: outputs[i].copy_(whole[me]), outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        outputs = tensor_list(output_tensors)
        for out, parts in zip(outputs, input_tensors, strict=True):
            check_numel("reduce_scatter's input list", len(parts), self.size())
            for part in parts:
                check_dense(part)
                check_numel("a reduce_scatter input", part.numel(), out.numel())
        flats = [torch.cat([p.reshape(-1) for p in parts]) for parts in input_tensors]
        return self._scatter_reduce(outputs, flats, reduce_op_name(opts), seconds_of(opts))

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        return self.reduce_scatter_single_coalesced([output_tensor], [input_tensor], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        outputs, inputs = tensor_list(outputs), tensor_list(inputs)
        return self._scatter_reduce(outputs, inputs, reduce_op_name(opts), seconds_of(opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        return self._launch([lambda: self.gradstar_group.barrier(
            async_op=True, timeout=seconds_of(opts))], lambda _results: [], [])

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

    # -- point to point ------------------------------------------------------------------------

    def _peer(self, name: str):
        method = getattr(self.gradstar_group, name, None)
        if method is None:
            raise BackendUnsupportedError(
                f"torch.distributed {name} over the gradstar backend rides gradstar's peer "
                f"streams (ProcessGroup.send/recv, issue 5), which this gradstar does not have "
                "yet; use collectives, or backend 'gloo' for point-to-point traffic"
            )
        return method

    def send(self, tensors, dst, tag=0):
        send = self._peer("send")
        tensors = tensor_list(tensors)
        prepared = [for_transfer(t) for t in tensors]
        return self._launch([lambda w=w: send(w, dst, tag, async_op=True)
                             for w, _ in prepared], lambda _results: tensors, tensors)

    def recv(self, tensors, src, tag=0):
        recv = self._peer("recv")
        tensors = tensor_list(tensors)
        prepared = [for_transfer(t) for t in tensors]

        def finish(results):
            for t, (_, restore), r in zip(tensors, prepared, results, strict=True):
                t.copy_(restore(torch.as_tensor(r)).reshape(t.shape))
            return tensors

        return self._launch([lambda: recv(src, tag, async_op=True) for _ in prepared],
                            finish, tensors)

    def recv_anysource(self, tensors, tag=0):
        """torch's recv with ``src=None``: the next message with ``tag`` from any rank; the
        Work's ``_source_rank()`` names its sender."""
        recv = self._peer("recv")
        tensors = tensor_list(tensors)
        prepared = [for_transfer(t) for t in tensors]

        def finish(results):
            for t, (_, restore), (_, r) in zip(tensors, prepared, results, strict=True):
                t.copy_(restore(torch.as_tensor(r)).reshape(t.shape))
            return tensors

        return self._launch([lambda: recv(None, tag, async_op=True) for _ in prepared],
                            finish, tensors, AnySourceWork)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """torch's all_to_all_single: rows (dim 0) of ``input`` split by
        ``input_split_sizes`` go to the ranks; ``output`` receives their splits for this rank,
        ``output_split_sizes[i]`` rows from rank ``i`` (empty sizes: equal splits)."""
        world = self.size()
        check_dense(output)
        if output.dtype != input.dtype:
            raise InvalidCollectiveError(
                f"all_to_all_single's output is {output.dtype} but its input is {input.dtype}")
        if output.dim() == 0:
            raise InvalidCollectiveError("all_to_all_single needs tensors of at least 1 "
                                         "dimension")
        wire, write = rows_for_transfer(input)
        outs = list(output_split_sizes) or None
        if outs is None:
            if output.shape[0] % world:
                raise InvalidCollectiveError(
                    f"output_split_sizes is empty, so the output's dim 0 ({output.shape[0]}) "
                    f"must be divisible by world_size {world}")
            outs = [output.shape[0] // world] * world
        if len(outs) == world and sum(outs) != output.shape[0]:
            raise InvalidCollectiveError(
                f"output_split_sizes {outs} sums to {sum(outs)}, but the output's dim 0 is "
                f"{output.shape[0]}")
        ins = list(input_split_sizes) or None

        def finish(results):
            write(torch.as_tensor(results[0]), output)
            return [output]

        return self._launch([lambda: self.gradstar_group.all_to_all_single(
            wire, outs, ins, async_op=True, timeout=seconds_of(opts))], finish, [output, input])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """torch's all_to_all: ``input_tensors[j]`` goes to rank ``j``; ``output_tensors[i]``
        receives rank ``i``'s. One flat all_to_all_single of the concatenated tensors, so every
        rank checks every size (a rank sending other sizes than another expects fails all)."""
        world = self.size()
        inputs, outputs = tensor_list(input_tensors), tensor_list(output_tensors)
        check_numel("all_to_all's input list", len(inputs), world)
        check_numel("all_to_all's output list", len(outputs), world)
        sent = [for_transfer(t) for t in inputs]
        taken = [for_transfer(o) for o in outputs]
        flat = torch.cat([w.reshape(-1) for w, _ in sent])
        sizes = [w.numel() for w, _ in taken]

        def finish(results):
            parts = torch.split(torch.as_tensor(results[0]), sizes)
            for out, (_, restore), part in zip(outputs, taken, parts, strict=True):
                out.copy_(restore(part).reshape(out.shape))
            return outputs

        return self._launch([lambda: self.gradstar_group.all_to_all_single(
            flat, sizes, [w.numel() for w, _ in sent], async_op=True,
            timeout=seconds_of(opts))], finish, [outputs, inputs])

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the gradstar job and close its connection (torch's destroy_process_group calls
        this). Collectives still running fail with ProcessGroupClosedError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = list(self._in_flight)
        try:
            self.gradstar_group.close()
        finally:
            closed = ProcessGroupClosedError(
                f"the gradstar process group {self._group_name!r} was shut down while this "
                "collective was running")
            for work in in_flight:
                work.abandon(closed)
            if self._on_shutdown is not None:
                self._on_shutdown(self)

    abort = shutdown


class AnySourceWork(GradstarWork):
    """The Work of a receive from any rank: :meth:`_source_rank` names the sender (what torch's
    ``dist.recv(src=None)`` returns), once the message is in torch's tensor."""

    def __init__(self, pending, finish, completions: CompletionThreads, **options) -> None:
        senders: list[int] = []

        def noted(results):
            senders.extend(sender for sender, _ in results)
            return finish(results)

        super().__init__(pending, noted, completions, **options)
        self._senders = senders

    def _source_rank(self) -> int:
        """The rank the message came from; waits for it.

        Raises:
            GradstarError: the receive failed.
        """
        self.wait()
        return self._senders[0]

    source_rank = _source_rank


__all__ = ["AnySourceWork", "BackendUnsupportedError", "MonitoredBarrierError",
           "ProcessGroupGradstar"]

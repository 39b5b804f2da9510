"""ProcessGroupGradstar: the torch.distributed process group of gradstar's backend.

A pure-Python subclass of ``torch.distributed.ProcessGroup`` wrapping one blocking gradstar
:class:`~gradstar.client.process_group.ProcessGroup` (one gradstar job). torch uses it directly
as the group: ``dist.all_reduce``, DDP's reducer and FSDP2 call the methods below, each of which
starts gradstar collectives (with ``async_op=True``, or to their end for a waited call) and
returns a :class:`~gradstar.client.torch_backend.work.GradstarWork`. The group itself (here) is
what torch asks about it, the machinery that starts collectives and its shutdown; the calls are
in two mixins, :mod:`.collectives` (what goes through the hub) and :mod:`.point_to_point`
(send, recv and all_to_all, over peer streams).

* **Order.** Every gradstar collective takes its sequence number when it is started, here, in
  the caller's thread, so collectives match on the hub in the order torch issued them.
* **Waited calls.** A call torch waits for at once (``opts.asyncOp`` False: ``dist.all_reduce(t)``
  without ``async_op=True``) runs its gradstar collective to its end in the caller's thread and
  returns a settled Work (see ``_launch``); the others return at once.
* **In place.** As with torch's own backends the results land in the tensors torch passed
  (all_reduce, broadcast, the output tensors of gathers and scatters), written when the Work is
  settled: by ``wait()`` or by a completion thread, whichever comes first.
* **dtypes.** See :mod:`gradstar.client.torch_backend.convert`: every dtype moves, most reduce.
* **Devices.** Tensors on the CPU or a CUDA device, as with gloo; others (mps, xpu, meta, ...)
  are refused with a :class:`~gradstar.errors.ConfigurationError` naming the device. A CUDA
  collective copies its inputs to host memory in the caller's thread, after what the caller
  queued on its current streams (the tensors' producers; gradstar's SDK does, see
  :mod:`gradstar.client.device`); its results are written on the device by the thread that
  settles the Work and are complete for every stream by the time ``wait()`` returns or the
  Work's future completes (see :mod:`.work`). A waited one (``async_op=False``) is settled on
  the caller's thread, its copies on the caller's current streams (over the direct lane all of
  it runs on the caller's thread; a larger one runs on the group's loop and its result is
  copied to the device on a worker thread, on the stream taken from the caller); one that a
  completion thread settles first waits, in the caller's thread, for what the caller queued on
  its current streams.
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
from dataclasses import dataclass

import torch.distributed as dist

from gradstar.client.device import check_device, synchronize
from gradstar.client.process_group.protocol import BackendGroup
from gradstar.errors import GradstarError, ProcessGroupClosedError

from .collectives import Collectives, MonitoredBarrierError
from .convert import cuda_devices, tensors_in
from .point_to_point import AnySourceWork, BackendUnsupportedError, PointToPoint
from .work import CompletionThreads, GradstarWork


@dataclass(frozen=True)
class Call:
    """A start for :meth:`ProcessGroupGradstar._launch`: the gradstar ProcessGroup's collective
    ``method`` with these arguments, started with ``async_op=True`` (calling it) or run to its
    end now (:meth:`settled`)."""

    group: BackendGroup
    method: str
    args: tuple
    kwargs: dict

    def __call__(self):
        return getattr(self.group, self.method)(*self.args, async_op=True, **self.kwargs)

    def settled(self):
        return self.group.settled(self.method, *self.args, **self.kwargs)


class ProcessGroupGradstar(Collectives, PointToPoint, dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a gradstar coordinator.

    Created by torch through the registered backend (see :mod:`gradstar.client.torch_backend`),
    one per torch group; ``gradstar_group`` is the gradstar ProcessGroup it wraps.
    """

    def __init__(self, group: BackendGroup, completions: CompletionThreads, *,
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

    def _call(self, method: str, *args, **kwargs) -> Call:
        """A start for :meth:`_launch`: ``gradstar_group.<method>(*args, **kwargs)``."""
        return Call(self.gradstar_group, method, args, kwargs)

    def _launch(self, starts: Sequence[Callable[[], object]],
                finish: Callable[[list], object], tensors,
                work_type: type[GradstarWork] = GradstarWork, *,
                settle: bool = False) -> GradstarWork:
        """Start gradstar collectives (in order, here) and wrap them in one Work.

        ``settle``: the caller waits for the Work at once (torch's ``async_op=False``,
        :func:`.convert.caller_waits`). One collective (a :class:`Call`) then runs to its end
        here and the Work comes back settled (:meth:`~gradstar.client.process_group.
        ProcessGroup.settled`): a small one on this thread over gradstar's direct lane, and no
        completion thread either way -- the same collective, checks and errors. On CUDA
        tensors its copies run on this thread's current streams (a large one's result copy on
        a worker thread, on the stream taken from this thread), in order after what the
        caller queued there.

        ``tensors`` (nested lists allowed) are every tensor the collectives read or write. On a
        CUDA device, a Work that completes on a completion thread first finishes what the
        caller queued on its current stream: results are written on that thread's stream,
        which would not wait for it (an input's copy to the host waits for it too, but not
        every output is an input).

        Raises:
            ConfigurationError: a tensor on a device other than the CPU or CUDA, named.
            ValueError: other invalid arguments (gradstar's own, raised by ``starts``); any
                other gradstar error fails the Work instead.
        """
        every = list(tensors_in(tensors))
        for t in every:
            check_device(t)
        devices = cuda_devices(every)
        inference = any(t.is_inference() for t in every)
        if (settle and len(starts) == 1 and isinstance(starts[0], Call)
                and work_type is GradstarWork):
            # Settled: nothing left to abandon at shutdown.
            return GradstarWork([starts[0].settled()], finish, self._completions,
                                label=self._error_label, devices=devices, inference=inference,
                                settled=True)
        for device in devices:
            synchronize(device)
        try:
            pending = [start() for start in starts]
        except ValueError:
            raise
        except GradstarError as error:
            return GradstarWork.failed(error, self._completions, label=self._error_label)
        work = work_type(pending, finish, self._completions, label=self._error_label,
                         devices=devices, inference=inference)
        with self._lock:
            self._in_flight.add(work)
        return work

    def _settled(self, value, method: str, *args, **kwargs) -> GradstarWork:
        """``gradstar_group.<method>(*args, **kwargs)`` settled on this thread, for a call
        torch waits for at once whose collective touches no CUDA tensor and leaves nothing to
        write afterwards (it writes its result into the tensor's memory itself, or has none):
        the Work comes back settled (:meth:`GradstarWork.from_settled`) with ``value``, or with
        the collective's error (:meth:`~gradstar.client.process_group.ProcessGroup.settled`
        says which errors are the Work's), for a fraction of :meth:`_launch`'s cost per call.
        A ``ValueError`` (invalid arguments, nothing sent) is raised, as ``_launch`` does."""
        return GradstarWork.from_settled(self.gradstar_group.settled(method, *args, **kwargs),
                                         value, self._completions, label=self._error_label)

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


__all__ = ["AnySourceWork", "BackendUnsupportedError", "Call", "MonitoredBarrierError",
           "ProcessGroupGradstar"]

"""ProcessGroupGradstar: the torch.distributed process group of gradstar's backend.

A pure-Python subclass of ``torch.distributed.ProcessGroup`` wrapping one blocking gradstar
:class:`~gradstar.client.process_group.ProcessGroup` (one gradstar job). torch uses it directly
as the group: ``dist.all_reduce``, DDP's reducer and FSDP2 call the methods below, each of which
starts gradstar collectives (with ``async_op=True``, or to their end for a waited call) and
returns a :class:`~gradstar.client.torch_backend.work.GradstarWork`. The group itself (here) is
what torch asks about it and its shutdown; it holds the machinery that starts collectives, its
``launcher`` (:mod:`.launcher`), and its calls are in two mixins that use only that and the
group's public face: :mod:`.collectives` (what goes through the hub) and
:mod:`.point_to_point` (send, recv and all_to_all, over peer streams).

* **Order.** Every gradstar collective takes its sequence number when it is started, here, in
  the caller's thread, so collectives match on the hub in the order torch issued them.
* **Waited calls.** A call torch waits for at once (``opts.asyncOp`` False: ``dist.all_reduce(t)``
  without ``async_op=True``) runs its gradstar collective to its end in the caller's thread and
  returns a settled Work (see :meth:`.Launcher.launch`); the others return at once.
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
from collections.abc import Callable

import torch.distributed as dist

from gradstar.client.process_group.protocol import BackendGroup
from gradstar.errors import ProcessGroupClosedError

from .collectives import Collectives, MonitoredBarrierError
from .launcher import Call, Launcher
from .point_to_point import AnySourceWork, BackendUnsupportedError, PointToPoint
from .work import CompletionThreads


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
        #: Starts the gradstar collectives of each call and keeps their Works (:mod:`.launcher`).
        self.launcher = Launcher(group, completions)
        self._on_shutdown = on_shutdown
        self._group_name = ""
        self._group_desc = ""
        self._closed = False
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

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the gradstar job and close its connection (torch's destroy_process_group calls
        this). Collectives still running fail with ProcessGroupClosedError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        in_flight = self.launcher.in_flight()
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

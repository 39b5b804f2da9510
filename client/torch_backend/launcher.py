"""How gradstar's torch process group starts collectives: :class:`Launcher`, the machinery
every call of :class:`~gradstar.client.torch_backend.group.ProcessGroupGradstar` shares (its
:mod:`.collectives` and :mod:`.point_to_point` reach it as the group's ``launcher``, never
through the group's private state).

A torch call becomes gradstar collectives started here, in the caller's thread and in order
(each takes its sequence number as it starts), wrapped in one
:class:`~gradstar.client.torch_backend.work.GradstarWork`; a call torch waits for at once is
settled on the caller's thread instead (:meth:`Launcher.launch` with ``settle``,
:meth:`Launcher.settled`). The Works still running are kept (weakly) for the group's shutdown,
which fails them (:meth:`Launcher.in_flight`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gradstar.client.device import check_device, synchronize
from gradstar.client.process_group.protocol import BackendGroup
from gradstar.errors import GradstarError

from .convert import cuda_devices, tensors_in
from .work import CompletionThreads, GradstarWork


@dataclass(frozen=True)
class Call:
    """A start for :meth:`Launcher.launch`: the gradstar ProcessGroup's collective
    ``method`` (``group.all_reduce``, ...) with these arguments, started with ``async_op=True``
    (calling it) or run to its end now (:meth:`settled`)."""

    group: BackendGroup
    method: Callable
    args: tuple
    kwargs: dict

    def __call__(self):
        return self.method(*self.args, async_op=True, **self.kwargs)

    def settled(self):
        return self.group.settled(self.method, *self.args, **self.kwargs)


class Launcher:
    """Starts the gradstar collectives of one torch call on ``group`` and wraps them in one
    Work, completed on ``completions``; see the module docstring."""

    def __init__(self, group: BackendGroup, completions: CompletionThreads) -> None:
        self.group = group
        self.completions = completions
        #: Before the messages of failed Works, as torch's own backends name the rank.
        self.label = f"[Rank {group.rank}] "
        self._in_flight: weakref.WeakSet[GradstarWork] = weakref.WeakSet()
        self._lock = threading.Lock()

    def call(self, method: Callable, *args, **kwargs) -> Call:
        """A start for :meth:`launch`: ``method(*args, **kwargs)``, one of ``group``'s
        collectives (``group.all_reduce``, ...)."""
        return Call(self.group, method, args, kwargs)

    def launch(self, starts: Sequence[Callable[[], object]],
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
            return GradstarWork([starts[0].settled()], finish, self.completions,
                                label=self.label, devices=devices, inference=inference,
                                settled=True)
        for device in devices:
            synchronize(device)
        try:
            pending = [start() for start in starts]
        except ValueError:
            raise
        except GradstarError as error:
            return GradstarWork.failed(error, self.completions, label=self.label)
        work = work_type(pending, finish, self.completions, label=self.label,
                         devices=devices, inference=inference)
        with self._lock:
            self._in_flight.add(work)
        return work

    def settled(self, value, method: Callable, *args, **kwargs) -> GradstarWork:
        """``method(*args, **kwargs)``, one of ``group``'s collectives, settled on this
        thread, for a call
        torch waits for at once whose collective touches no CUDA tensor and leaves nothing to
        write afterwards (it writes its result into the tensor's memory itself, or has none):
        the Work comes back settled (:meth:`GradstarWork.from_settled`) with ``value``, or with
        the collective's error (:meth:`~gradstar.client.process_group.ProcessGroup.settled`
        says which errors are the Work's), for a fraction of :meth:`launch`'s cost per call.
        A ``ValueError`` (invalid arguments, nothing sent) is raised, as :meth:`launch` does."""
        return GradstarWork.from_settled(self.group.settled(method, *args, **kwargs),
                                         value, self.completions, label=self.label)

    def in_flight(self) -> list[GradstarWork]:
        """The Works started and not settled on the caller's thread, still alive."""
        with self._lock:
            return list(self._in_flight)


__all__ = ["Call", "Launcher"]

"""gradstar's collectives in torch's profiler, named and shaped as gloo's are.

gloo's Work records one event per collective, ``gloo:all_reduce``, ``gloo:broadcast``, ...,
with the input tensors' shapes (``record_shapes=True``), from the call to the collective's
end, marked async (it ends on another thread than the one that started it). This backend
records ``gradstar:<op>`` the same way, with gloo's op names (``all_reduce`` for
``allreduce_coalesced`` too, ``all_gather`` for every gather into all ranks, ``recvAnySource``).

:func:`record_collectives` wraps the group's methods that torch calls (their names are torch's
ProcessGroup interface) after the class is defined; what differs between them is the table
:data:`TITLES`. A method called from inside another one (``_allgather_base`` runs
``all_gather_single_coalesced``) records nothing more. With no profiler running, the wrapper
costs one check.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

from .convert import tensors_in

try:  # records the inputs' shapes, as gloo's events have them (torch >= 2.2)
    from torch._C._profiler import _RecordFunctionFast
except ImportError:  # pragma: no cover - older torch: names without shapes
    _RecordFunctionFast = None

#: torch's ProcessGroup method -> (the event's op name, the position of the argument that
#: holds the collective's input tensors, or None).
TITLES: dict[str, tuple[str, int | None]] = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "reduce": ("reduce", 0),
    "broadcast": ("broadcast", 0),
    "allgather": ("all_gather", 1),
    "allgather_coalesced": ("all_gather", 1),
    "_allgather_base": ("all_gather", 1),
    "all_gather_single": ("all_gather", 1),
    "all_gather_single_coalesced": ("all_gather", 1),
    "allgather_into_tensor_coalesced": ("all_gather", 1),
    "gather": ("gather", 1),
    "scatter": ("scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "alltoall": ("all_to_all", 1),
    "alltoall_base": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "barrier": ("barrier", None),
    "send": ("send", 0),
    "recv": ("recv", 0),
    "recv_anysource": ("recvAnySource", 0),
}

_inside = threading.local()


class CollectiveRecord:
    """One collective's profiler event: started now (on the calling thread), ended by
    :meth:`end` (from the Work, on a completion thread)."""

    def __init__(self, title: str, inputs: list[torch.Tensor]) -> None:
        name = f"gradstar:{title}"
        if _RecordFunctionFast is not None:
            self._record = _RecordFunctionFast(name, inputs)
            self._record.__enter__()
            self._handle = None
        else:  # pragma: no cover - older torch
            self._record = None
            self._handle = torch.ops.profiler._record_function_enter_new(name, None)

    def end(self) -> None:
        if self._record is not None:
            self._record.__exit__(None, None, None)
        else:  # pragma: no cover - older torch
            torch.ops.profiler._record_function_exit(self._handle)


def profiled(method: Callable, title: str, inputs_at: int | None) -> Callable:
    """``method`` recording a ``gradstar:<title>`` event while torch's profiler runs."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(_inside, "call", False) or not torch.autograd._profiler_enabled():
            return method(self, *args, **kwargs)
        inputs = tensors_in(args[inputs_at]) if inputs_at is not None and inputs_at < len(
            args) else []
        record = CollectiveRecord(title, inputs)
        _inside.call = True
        try:
            work = method(self, *args, **kwargs)
        except BaseException:
            record.end()
            raise
        finally:
            _inside.call = False
        work.record_until_done(record)
        return work

    return wrapper


def record_collectives(cls: type) -> type:
    """Wrap each of :data:`TITLES`' methods that ``cls`` defines with :func:`profiled`."""
    for name, (title, inputs_at) in TITLES.items():
        method = cls.__dict__.get(name)
        if method is not None:
            setattr(cls, name, profiled(method, title, inputs_at))
    return cls


__all__ = ["TITLES", "CollectiveRecord", "profiled", "record_collectives"]

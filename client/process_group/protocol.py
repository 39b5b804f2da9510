"""What gradstar's wrappers need of a process group, as a type: :class:`CollectiveGroup`.

DDP, FSDP, Pipeline and DataParallel call a group's collectives from inside autograd hooks and
the training thread, so they need the *blocking* calls (a hook cannot await), and a loop to
run their own asyncio calls on (:meth:`CollectiveGroup.submit`). The blocking
:class:`~gradstar.client.process_group.ProcessGroup` is such a group; the
:class:`~gradstar.client.process_group.AsyncProcessGroup` is not (it has no ``submit``: its
calls are awaited on the caller's own loop). torch's backend (``ProcessGroupGradstar``) needs
more of the group it wraps: :class:`BackendGroup`; its send and recv, a group's point-to-point
calls over peer streams: :class:`PeerGroup`. A Synchronous DDP crosses step boundaries (the
job growing and shrinking while it trains) over a group that can: :class:`ElasticGroup`.

The collectives return one of three kinds, named here rather than hidden behind ``Any``: an
array of the input's type (:data:`~gradstar.client.convert.ArrayLike`: all_reduce, broadcast,
reduce_scatter, recv), a list of them (all_gather), or nothing (barrier, send); with
``async_op=True``, a
:class:`~gradstar.client.work.Work` whose ``wait()`` returns that.

Example::

    def check(pg: object) -> CollectiveGroup:
        if not isinstance(pg, CollectiveGroup):   # every member present, as a Protocol checks
            raise ConfigurationError("needs the blocking gradstar.ProcessGroup")
        return pg
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from gradstar.config import ClientSettings

from ..convert import ArrayLike

if TYPE_CHECKING:
    from ..work import Work
    from .membership import Resized

#: What a collective resolves to, as the function that restores its result to the caller's type
#: returns it (internals typed by that function).
Result = TypeVar("Result")


@runtime_checkable
class CollectiveGroup(Protocol):
    """What a wrapper needs of a process group (see the module docstring)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, x: ArrayLike, op: str = "sum", *, async_op: bool = False,
                   timeout: float | None = None, out: ArrayLike | None = None,
                   wire: str | None = None) -> ArrayLike | Work: ...

    def broadcast(self, x: ArrayLike, src: int = 0, *, async_op: bool = False,
                  timeout: float | None = None) -> ArrayLike | Work: ...

    def all_gather(self, x: ArrayLike, *, async_op: bool = False,
                   timeout: float | None = None) -> list[ArrayLike] | Work: ...

    def reduce_scatter(self, x: ArrayLike, op: str = "sum", *, async_op: bool = False,
                       timeout: float | None = None,
                       wire: str | None = None) -> ArrayLike | Work: ...

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None:
        ...

    def send(self, x: ArrayLike, dst: int, tag: int = 0, *, async_op: bool = False,
             timeout: float | None = None) -> Work | None: ...

    def recv(self, src: int | None = None, tag: int = 0, *, async_op: bool = False,
             timeout: float | None = None) -> ArrayLike | Work: ...

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run ``coro`` on the group's loop (a wrapper's own asyncio calls)."""
        ...

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """``await closer()`` on the group's loop as the group closes."""
        ...


@runtime_checkable
class ElasticGroup(CollectiveGroup, Protocol):
    """A group whose rank moves to the job's next generation at step boundaries
    (:mod:`~gradstar.client.process_group.membership`): what a Synchronous DDP resizes over."""

    @property
    def newcomer(self) -> bool: ...

    @property
    def departed(self) -> bool: ...

    def move_at_boundaries(self, on: bool = True) -> None: ...

    def step_boundary(self, welcome: Callable[[Resized], bool] | None = None
                      ) -> Resized | None: ...

    def depart(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class PeerGroup(Protocol):
    """A group's point-to-point calls over peer streams (what torch's send and recv ride)."""

    def send(self, x: ArrayLike, dst: int, tag: int = 0, *, async_op: bool = False,
             timeout: float | None = None) -> Work | None: ...

    def recv(self, src: int | None = None, tag: int = 0, *, async_op: bool = False,
             timeout: float | None = None) -> ArrayLike | Work: ...


@runtime_checkable
class BackendGroup(CollectiveGroup, Protocol):
    """What torch's backend needs of the gradstar group it wraps, beyond a wrapper's: the job's
    name and settings, collectives settled on the caller's thread, all_to_all, and closing."""

    @property
    def job(self) -> str: ...

    @property
    def settings(self) -> ClientSettings: ...

    def settled(self, method: Callable[..., object], *args, **kwargs) -> Work:
        """This group's collective ``method`` (``group.all_reduce``, ...) run to its end now;
        its failure is the Work's."""
        ...

    def all_to_all_single(self, x: ArrayLike, output_split_sizes=None, input_split_sizes=None,
                          *, async_op: bool = False,
                          timeout: float | None = None) -> ArrayLike | Work: ...

    def close(self) -> None: ...


__all__ = ["ArrayLike", "BackendGroup", "CollectiveGroup", "ElasticGroup", "PeerGroup",
           "Result"]

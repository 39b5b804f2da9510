"""The blocking process group: :class:`ProcessGroup` runs an
:class:`~gradstar.client.process_group.AsyncProcessGroup` on a private event-loop thread
(:class:`_LoopThread`) and waits for each call, or with ``async_op=True`` hands back a
:class:`~gradstar.client.work.Work`. It wraps the asyncio group and never re-implements it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable

from gradstar.errors import ConfigurationError, GradstarError, ProcessGroupClosedError
from gradstar.proto.v1 import rendezvous_pb2 as rpb

from ..collective.direct import SettledCall
from ..loop_thread import LoopThread as _LoopThread
from ..work import SettledWork, Work
from .group import AsyncProcessGroup
from .join import init_process_group_async, open_group
from .membership import Resized


class ProcessGroup:
    """Blocking process group; each method wraps the :class:`AsyncProcessGroup` method.

    ``async_op=True`` returns a :class:`Work` instead of blocking, as in torch.distributed.
    """

    def __init__(self, group: AsyncProcessGroup, runner: _LoopThread) -> None:
        self._group = group
        self._runner = runner
        self._closers: list[Callable[[], Awaitable[None]]] = []

    rank = property(lambda self: self._group.rank)
    world_size = property(lambda self: self._group.world_size)
    generation = property(lambda self: self._group.generation)
    job = property(lambda self: self._group.job)
    peers = property(lambda self: self._group.peers)
    shards = property(lambda self: self._group.shards)
    shared_memory = property(lambda self: self._group.shared_memory)
    peer_bytes = property(lambda self: self._group.peer_bytes)
    peer_routes = property(lambda self: self._group.peer_routes)
    settings = property(lambda self: self._group.settings)
    replacement = property(lambda self: self._group.replacement)
    collective_address = property(lambda self: self._group.collective_address)
    member_id = property(lambda self: self._group.member_id)
    reconnects = property(lambda self: self._group.reconnects)
    #: This rank joined the job at a resize's step boundary: it takes the others' state.
    newcomer = property(lambda self: self._group.rank in self._group.joined.newcomers)
    joined = property(lambda self: self._group.joined)
    session = property(lambda self: self._group.session)

    @property
    def steps_begun(self) -> int:
        """Synchronising steps the job's ranks have begun, as :meth:`step_boundary` counts
        them (a rank that joined at a resize starts at its boundary)."""
        membership = self._group.membership
        return membership.boundary if membership is not None else 0

    # -- resizing at step boundaries (:mod:`.membership`) ----------------------------------------

    def move_at_boundaries(self, on: bool = True) -> None:
        """Say that this rank moves to the job's next generation at step boundaries
        (:meth:`step_boundary` before each synchronising step), so that a join past the world
        size or a departure resizes the job there: what a Synchronous DDP does."""
        session = self._group.session
        self._runner.call(session.send, rpb.SessionRequest(boundaries=on))

    def step_boundary(self, welcome=None) -> Resized | None:
        """Before the first collective of a synchronising step (every rank, at the same
        steps): None, or, when the job resizes at this boundary, what changed, once this rank
        is in the next generation (its rank and world size may differ). ``welcome(resized)``
        (every rank of it) brings the newcomers in, e.g. sends them the state, and says
        whether every one of them took it; if not, the one that did not departs, and the
        others move once more at this same boundary, without it.

        Raises:
            ProcessGroupClosedError: this rank departed at this boundary (:meth:`depart`).
            RendezvousError and subclasses: the resize failed (a rank lost meanwhile).
        """
        membership = self._group.membership
        if membership is None:
            return None
        resized = None
        while (action := membership.crossing()) != "go":
            old = self._group
            if action == "leave":
                raise ProcessGroupClosedError(
                    f"rank {old.rank} of job {old.job!r} left the job at step boundary "
                    f"{membership.boundary} (depart()): run no more steps, close the group")
            new = self._move(old, membership)
            arrived = tuple(new.joined.newcomers)
            # Newcomers of an earlier move at this boundary keep their ranks while nobody left.
            kept = (resized.newcomers if resized is not None
                    and new.world_size - len(arrived) == old.world_size else ())
            resized = Resized(new.generation, new.world_size, new.rank,
                              resized.previous_world_size if resized else old.world_size,
                              resized.previous_rank if resized else old.rank,
                              tuple(sorted({*kept, *arrived})), new.joined.boundary)
            if arrived and welcome is not None and not welcome(resized):
                membership.hold()  # a newcomer refused: the coordinator names this boundary again
            # Crossing again: the step begins here, unless another resize (a joiner that came
            # meanwhile, a refused newcomer) named this same boundary: then the rank moves again.
        return resized

    def _move(self, old: AsyncProcessGroup, membership) -> AsyncProcessGroup:
        """Leave ``old``'s generation and join the next one, as a resize's mover."""
        moving = rpb.MovingFrom(generation=old.generation, rank=old.rank,
                                member_id=old.member_id)

        async def move():
            old.session.send(rpb.SessionRequest(advance=True))
            await old.close()
            return await open_group(old.settings, old.peer_address_given, moving_from=moving,
                                    membership=membership)

        new = self._runner.submit(move()).result()
        new.peer_address_given = old.peer_address_given
        self._group = new
        watch = new.open_direct_lane(self._runner.submit)
        if watch is not None:
            self._runner.submit(watch)
        return new

    def depart(self) -> None:
        """Leave the job for good at the next step boundary every rank reaches (the others
        go on without this rank, in a new generation): returns once the coordinator took the
        request; :attr:`departed` turns True at that boundary.

        Raises:
            ConfigurationError: the job would fall below its ``min_world_size``.
            RendezvousError: no answer from the coordinator within the timeout.
        """
        session = self._group.session
        self._group.membership.depart(lambda request: self._runner.call(session.send, request))

    @property
    def departed(self) -> bool:
        """Whether this rank, having asked to :meth:`depart`, reached the boundary it leaves
        at (waiting for the coordinator to name it first): stop the loop, close the group."""
        membership = self._group.membership
        return membership is not None and membership.at_departure()

    def _call(self, awaitable, async_op: bool):
        if isinstance(awaitable, SettledCall):  # small: on this thread, unless async_op
            if not async_op:
                return awaitable.settle()
            awaitable = awaitable.coroutine()
        future = self._runner.submit(awaitable)
        return Work(future) if async_op else Work(future).wait()

    def all_reduce(self, x, op: str = "sum", *, async_op: bool = False, timeout=None,
                   out=None, wire: str | None = None):
        return self._call(self._group.all_reduce(x, op, timeout=timeout, out=out, wire=wire),
                          async_op)

    def broadcast(self, x, src: int = 0, *, async_op: bool = False, timeout=None):
        return self._call(self._group.broadcast(x, src, timeout=timeout), async_op)

    def all_gather(self, x, *, async_op: bool = False, timeout=None):
        return self._call(self._group.all_gather(x, timeout=timeout), async_op)

    def reduce_scatter(self, x, op: str = "sum", *, async_op: bool = False, timeout=None,
                       wire: str | None = None):
        return self._call(self._group.reduce_scatter(x, op, timeout=timeout, wire=wire),
                          async_op)

    def all_reduce_coalesced(self, arrays, op: str = "mean", bucket_cap_mb: float = 25, *,
                             async_op: bool = False, timeout=None, wire: str | None = None):
        return self._call(self._group.all_reduce_coalesced(arrays, op, bucket_cap_mb,
                                                           timeout=timeout, wire=wire), async_op)

    def barrier(self, *, async_op: bool = False, timeout=None):
        return self._call(self._group.barrier(timeout=timeout), async_op)

    def sync_global_model(self, x, *, model: str, rule: str, outer_lr: float = 0.0,
                          outer_momentum: float = 0.0, async_op: bool = False, timeout=None,
                          wire: str | None = None):
        return self._call(self._group.sync_global_model(
            x, model=model, rule=rule, outer_lr=outer_lr, outer_momentum=outer_momentum,
            timeout=timeout, wire=wire), async_op)

    def send(self, x, dst: int, tag=0, *, async_op: bool = False, timeout=None):
        return self._call(self._group.send(x, dst, tag, timeout=timeout), async_op)

    def recv(self, src: int | None = None, tag=0, *, async_op: bool = False, timeout=None):
        return self._call(self._group.recv(src, tag, timeout=timeout), async_op)

    def all_to_all(self, inputs, *, async_op: bool = False, timeout=None):
        return self._call(self._group.all_to_all(inputs, timeout=timeout), async_op)

    def all_to_all_single(self, x, output_split_sizes=None, input_split_sizes=None, *,
                          async_op: bool = False, timeout=None):
        return self._call(self._group.all_to_all_single(
            x, output_split_sizes, input_split_sizes, timeout=timeout), async_op)

    def settled(self, method: Callable, *args, **kwargs) -> Work:
        """This group's collective ``method`` (``pg.all_reduce``, ``pg.barrier``, ...; the
        arguments as that method's, without ``async_op``) run to its end now, as a settled
        Work: for a caller
        that waits at once but wants the collective's failure as the Work's, as torch's
        ``dist.all_reduce(t)`` does. A small collective runs on this thread (the direct lane),
        as the blocking call does; a larger one on the loop, waited for here.

        Raises:
            ValueError: invalid arguments (:class:`~gradstar.errors.ConfigurationError`,
                :class:`~gradstar.errors.InvalidCollectiveError`), raised before anything is
                sent; ConfigurationError too for a ``method`` that is not one of this group's
                collectives. Every other failure is the Work's, raised by ``wait``: the
                collective's own, and a gradstar error raised as it was issued (a closed or
                failed group).
        """
        start = _SETTLED.get(getattr(method, "__func__", None))
        if start is None or getattr(method, "__self__", None) is not self:
            raise ConfigurationError(f"settled() runs one of this group's collectives "
                                     f"(pg.all_reduce, pg.barrier, ...), not {method!r}")
        try:
            awaitable = start(self._group, *args, **kwargs)
        except ValueError:
            raise
        except GradstarError as error:
            return SettledWork(error=error)
        if isinstance(awaitable, SettledCall):
            try:
                return SettledWork(awaitable.settle())
            except Exception as error:  # the collective's failure, kept for wait()
                return SettledWork(error=error)
        future = self._runner.submit(awaitable)
        concurrent.futures.wait([future])
        return Work(future)

    def submit(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the group's event-loop thread: gradstar's wrappers make their own
        calls there (grpc.aio serves one event loop per process).

        Raises:
            ProcessGroupClosedError: the group was closed.
        """
        if isinstance(coro, SettledCall):  # a collective of the group's, issued on this thread
            coro = coro.coroutine()
        if self._runner is None:
            coro.close()
            raise ProcessGroupClosedError("the process group was closed")
        return self._runner.submit(coro)

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """``await closer()`` on the group's loop when the group closes, before it leaves the
        job (a wrapper's own channels and goodbyes)."""
        self._closers.append(closer)
    def straggler_stats(self, *, limit: int = 0, timeout: float = 10.0):
        """The job's arrival summary (see :meth:`AsyncProcessGroup.straggler_stats`): a
        :class:`~gradstar.client.stragglers.StragglerStats`, ranks slowest first."""
        return self._runner.submit(self._group.straggler_stats(limit=limit, timeout=timeout)
                                   ).result(timeout + 5)

    def close(self) -> None:
        """Leave the job, close the connection and stop the loop thread. Idempotent."""
        if self._runner is None:
            return
        try:
            for closer in self._closers:
                with contextlib.suppress(Exception):  # the group closes whatever they do
                    self._runner.submit(closer()).result(timeout=15)
            self._runner.submit(self._group.close()).result(timeout=15)
        finally:
            self._runner.stop()
            self._runner = None

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._group).replace("AsyncProcessGroup", "ProcessGroup", 1)


#: The collectives :meth:`ProcessGroup.settled` runs, keyed by the blocking group's methods
#: themselves: the asyncio group's method each one wraps.
_SETTLED: dict[Callable, Callable] = {
    ProcessGroup.all_reduce: AsyncProcessGroup.all_reduce,
    ProcessGroup.broadcast: AsyncProcessGroup.broadcast,
    ProcessGroup.all_gather: AsyncProcessGroup.all_gather,
    ProcessGroup.reduce_scatter: AsyncProcessGroup.reduce_scatter,
    ProcessGroup.all_reduce_coalesced: AsyncProcessGroup.all_reduce_coalesced,
    ProcessGroup.barrier: AsyncProcessGroup.barrier,
    ProcessGroup.sync_global_model: AsyncProcessGroup.sync_global_model,
    ProcessGroup.send: AsyncProcessGroup.send,
    ProcessGroup.recv: AsyncProcessGroup.recv,
    ProcessGroup.all_to_all: AsyncProcessGroup.all_to_all,
    ProcessGroup.all_to_all_single: AsyncProcessGroup.all_to_all_single,
}


def init_process_group(
    coordinator: str | None = None, job: str | None = None, world_size: int | None = None,
    rank: int | None = None, token: str | None = None, **options,
) -> ProcessGroup:
    """Blocking form of :func:`init_process_group_async`; same arguments, same errors."""
    runner = _LoopThread()
    try:
        group = runner.submit(init_process_group_async(
            coordinator, job, world_size, rank, token, **options)).result()
    except BaseException:
        runner.stop()
        raise
    watch = group.open_direct_lane(runner.submit)
    if watch is not None:
        runner.submit(watch)
    return ProcessGroup(group, runner)


__all__ = ["ProcessGroup", "init_process_group"]

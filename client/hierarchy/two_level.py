"""One rank's two-level collectives: joins the host and leaders groups and runs the
:class:`~gradstar.client.hierarchy.programs.Program` of each call (see
:mod:`gradstar.client.hierarchy`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from gradstar import ops
from gradstar.errors import CoordinatorUnavailableError, GradstarError
from gradstar.node_shard import HOST_GROUP
from gradstar.proto.v1 import collective_pb2 as pb

from ..collective.stream import issue
from ..convert import delivered
from . import programs
from .layout import plan
from .programs import LOCAL, Program

T = TypeVar("T")

log = logging.getLogger(__name__)

#: A two-level all_reduce of at least 2 x this many bytes is cut into segments of at least this
#: size (at most MAX_SEGMENTS), run as a pipeline: a segment's host all_reduce (shared memory)
#: runs while the segment before it crosses the links, instead of every host stage waiting for
#: the whole tensor (the figures behind the size: docs/performance.md, "Figures behind the
#: code").
MIN_SEGMENT_BYTES = 8 << 20
MAX_SEGMENTS = 4
#: dtypes whose reduction is exact or accumulated in their own precision at both levels.
_DTYPES = frozenset(np.dtype(d) for d in ("float32", "float64", "int32", "int64"))
_FLOATS = frozenset(np.dtype(d) for d in ("float32", "float64"))


class HostHierarchy:
    """One rank's two-level all_reduce, broadcast, all_gather and reduce_scatter.

    Each call's stages take their seqs in their groups when the call is made, on the caller's
    thread (:meth:`AsyncProcessGroup.reserve`), and are issued one after the other as the
    stage before ends: every rank reserves a group's stages in call order, so they pair up on
    the hub however the earlier stages' timing differs between ranks.
    """

    def __init__(self, group, hosts: dict[int, str],
                 join: Callable[[str, int, int], Awaitable]) -> None:
        self._group = group
        on = group.settings.hierarchical and bool(group.shards)
        self.plan = plan(group.rank, hosts) if on else None
        self._join = join
        self.local = None
        self.leaders = None

    @property
    def active(self) -> bool:
        return self.plan is not None

    async def start(self) -> None:
        """Join the host group (and, on a leader, the leaders group), at most as long as the
        rank's own generation lives.

        Raises:
            GradstarError: a join failed, or the rank's generation failed meanwhile.
        """
        if self.plan is None:
            return
        p, g = self.plan, self._group
        base = f"{g.job}/g{g.generation}"
        joins = [self._join(f"{base}{HOST_GROUP}{p.host}", p.local_size, p.local_rank)]
        if p.leader:
            joins.append(self._join(f"{base}/leaders", p.hosts, p.host_index))
        joined = asyncio.gather(*joins)
        failed = asyncio.ensure_future(g.session.failure_within(g.settings.join_timeout))
        try:
            await asyncio.wait((joined, failed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if not joined.done() and g.session.failure is not None:
            joined.cancel()
            with contextlib.suppress(asyncio.CancelledError, GradstarError):
                await joined
            raise g.session.failure
        groups = await joined
        self.local = groups[0]
        self.leaders = groups[1] if p.leader else None

    def takes(self, op: int, arr: np.ndarray, reduce_op: int = 0) -> bool:
        """Whether this collective goes through the two levels. Every rank answers alike: it
        depends on the layout and on what the hub checks to be equal on every rank.

        Reductions keep to float32/64 and int32/64 (half precision and integer ``mean`` stay
        flat, where the hub accumulates every rank's contribution in float32 once); broadcast
        moves bytes and takes every dtype; all_gather and reduce_scatter need every host to
        run as many ranks (equal segments across hosts; padding would carry zeros over links).
        """
        if self.local is None:
            return False
        if op == ops.BROADCAST:
            return True
        if op == ops.ALL_GATHER:
            return self.plan.uniform
        if arr.dtype not in _DTYPES or (reduce_op == pb.REDUCE_OP_MEAN
                                        and arr.dtype not in _FLOATS):
            return False
        return op == ops.ALL_REDUCE or (op == ops.REDUCE_SCATTER and self.plan.uniform)

    def all_reduce(self, arr: np.ndarray, reduce_op: int, out: np.ndarray,
                   restore: Callable[[np.ndarray], T],
                   timeout: float | None, wire: str | None = None) -> Awaitable[T]:
        """``out`` holding the reduction, through ``restore``; see :meth:`run`. A large one
        runs as a pipeline of segments (:data:`MIN_SEGMENT_BYTES`): every rank cuts alike, as
        it depends on the size alone. A ``wire`` format applies to the leaders' stages."""
        pieces = segments(arr.size, arr.itemsize)
        if len(pieces) == 1:
            return self.run(programs.all_reduce(self.plan, arr, reduce_op, out, wire),
                            restore, timeout)
        flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
        parts = [programs.all_reduce(self.plan, flat_in[s], reduce_op, flat_out[s], wire)
                 for s in pieces]

        def finish() -> np.ndarray:
            for part in parts:  # each divides its own slice of ``out`` for a mean
                part.finish()
            return out

        return self.run(programs.Program(
            tuple(st for part in parts for st in part.stages), finish,
            starts=tuple(itertools.accumulate((len(part.stages) for part in parts[:-1]),
                                              initial=0))), restore, timeout)

    def broadcast(self, arr: np.ndarray, src: int, restore: Callable[[np.ndarray], T],
                  timeout: float | None) -> Awaitable[T]:
        """Rank ``src``'s ``arr``, through ``restore``; see :meth:`run`."""
        return self.run(programs.broadcast(self.plan, arr, src), restore, timeout)

    def all_gather(self, arr: np.ndarray, restore: Callable[[np.ndarray], T],
                   timeout: float | None) -> Awaitable[T]:
        """Every rank's ``arr`` stacked in rank order, through ``restore``; see :meth:`run`."""
        return self.run(programs.all_gather(self.plan, arr), restore, timeout)

    def reduce_scatter(self, arr: np.ndarray, reduce_op: int, restore,
                       timeout: float | None, wire: str | None = None) -> Awaitable[T]:
        """This rank's rows of the reduction, through ``restore``; see :meth:`run`."""
        return self.run(programs.reduce_scatter(self.plan, arr, reduce_op, wire), restore,
                        timeout)

    def run(self, program: Program, restore: Callable[[np.ndarray], T],
            timeout: float | None) -> Awaitable[T]:
        """Reserve every stage of ``program`` in its group now, then run the stages in order;
        resolves to ``restore(program.finish())``. Called on the loop, it returns a running
        task; from another thread (the blocking API), the coroutine to submit to the loop, as
        :func:`~gradstar.client.collective.stream.issue` does.

        A stage that fails, or a call cancelled, gives up the stages not yet issued, so that
        the other ranks' stages fail at once instead of at their timeout.

        Raises (from the awaitable):
            GradstarError: a stage failed: the rank's generation's failure when the hub
                reports one within the session's verdict grace (naming global ranks), else
                the stage's (naming the subgroup's ranks).
        """
        reserved = []
        refused: GradstarError | None = None
        try:
            for stage in program.stages:
                reserved.append(self._member(stage.level).reserve(
                    stage.op, stage.like, reduce_op=stage.reduce_op, root=stage.root,
                    timeout=timeout, wire=stage.wire))
        except GradstarError as error:  # a subgroup closed or failed: raised from the run
            refused = error
        return issue(lambda: self._run(program, reserved, restore, refused),
                     lambda: self._give_up(program, reserved, 0))

    def _member(self, level: str):
        """This rank's group of ``level``."""
        return self.local if level == LOCAL else self.leaders

    async def _give_up(self, program: Program, reserved: list, issued: int) -> None:
        """Give up the reserved stages from ``issued`` on (a coroutine for :func:`issue`'s
        cancelled-before-it-ran case; the telling itself runs on tasks of its own)."""
        for stage, slot in zip(program.stages[issued:], reserved[issued:], strict=False):
            self._member(stage.level).give_up(slot)

    async def _run(self, program: Program, reserved: list, restore,
                   refused: GradstarError | None):
        issued: set[int] = set()
        try:
            if refused is not None:
                raise refused
            await self._run_pieces(program, reserved, issued)
        except BaseException as error:
            for i, (stage, slot) in enumerate(zip(program.stages, reserved, strict=False)):
                if i not in issued:
                    self._member(stage.level).give_up(slot)
            if isinstance(error, GradstarError):
                log.debug("a two-level stage failed after %d of %d: %s", len(issued),
                          len(program.stages), error)
                raise await self._named(error) from None
            raise
        return await delivered(restore, program.finish())

    async def _run_pieces(self, program: Program, reserved: list, issued: set[int]) -> None:
        """Run the program's pieces (:attr:`Program.starts`), each piece's stages in order; a
        piece starts once the piece before it finished its first stage (a pipeline). The first
        failure cancels the pieces still running and is raised."""
        bounds = [*program.starts, len(program.stages)]
        first_done = [asyncio.Event() for _ in program.starts]

        async def piece(k: int) -> None:
            if k:
                await first_done[k - 1].wait()
            for i in range(bounds[k], bounds[k + 1]):
                stage = program.stages[i]
                issued.add(i)
                result = await self._member(stage.level).run_reserved(reserved[i], stage.send,
                                                                      stage.out)
                if result is not stage.out:
                    np.copyto(stage.out, result)
                first_done[k].set()

        if len(program.starts) == 1:
            await piece(0)
            return
        tasks = [asyncio.ensure_future(piece(k)) for k in range(len(program.starts))]
        try:
            for done in asyncio.as_completed(tasks):
                await done  # the first failure ends the wait
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _named(self, error: GradstarError) -> GradstarError:
        """The rank's own generation's failure, if the hub reports one, else ``error``. A
        coordinator gone away while the group rides through restarts: the subgroups' riders
        issue their stages again where they can; a stage that failed anyway is not issued
        again here (the program's other stages went on without it), and the error says so."""
        session = self._group.session
        verdict = await session.verdict() or error
        ride = session.ride
        if ride is not None and ride.away and isinstance(verdict, CoordinatorUnavailableError):
            return CoordinatorUnavailableError(
                f"the coordinator at {ride.target} went away, and a two-level collective was "
                "cut by a coordinator restart where its stages cannot be issued again (a "
                "host's ranks combine on their node-local shard first): start the job again "
                "(GRADSTAR_HIERARCHICAL=0 keeps every collective on the flat path, which "
                "rides through)")
        return verdict

    async def close(self) -> None:
        for group in (self.leaders, self.local):
            if group is not None:
                await group.close()
        self.local = self.leaders = None


def segments(numel: int, itemsize: int) -> list[slice]:
    """The pieces a two-level all_reduce of ``numel`` elements is run in (see
    :data:`MIN_SEGMENT_BYTES`): one for a small tensor, else up to :data:`MAX_SEGMENTS` equal
    slices (the last takes the remainder)."""
    count = min(MAX_SEGMENTS, numel * itemsize // MIN_SEGMENT_BYTES)
    if count < 2:
        return [slice(0, numel)]
    step = numel // count
    return [slice(k * step, numel if k == count - 1 else (k + 1) * step) for k in range(count)]


__all__ = ["HostHierarchy", "segments"]

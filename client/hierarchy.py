"""The two-level all_reduce: a host's ranks combine on their host before anything crosses its link.

Why. Across hosts the cost is bytes on links. With one node-local shard per host
(:mod:`gradstar.node_shard`) and every rank striping its tensor over all of them, a host with R
ranks sends and receives R·2(H-1)/H·S per all_reduce of S bytes: R times what a ring moves. A
host should send its ranks' *sum* once.

How. Each rank joins, right after its generation formed, up to two more groups of the same
coordinator (every rank derives them from the generation's peer table, which carries each
rank's host key, :func:`gradstar.transport.shm.host_key`):

- ``JOB/gN/host-KEY``: the ranks of its host, in global rank order. Its generations stripe
  over the job's shard on that host alone (:meth:`ShardRegistry.stripes_for`), reached over
  shared memory: nothing crosses a link.
- ``JOB/gN/leaders``: one rank per host, the lowest, in rank order. Its generations stripe over
  every node-local shard of the job: each host link carries 2(H-1)/H·S each way.

An all_reduce is then (1) an all_reduce of the host group (every local rank gets the host's
partial result; over shared memory, cheap next to a link), (2) on each host's leader, an
all_reduce of the partials in the leaders group, in place, and (3) a broadcast from the leader
in the host group. ``mean`` sums at both levels and divides by the world size at the end.
Integer dtypes are bit-identical to one hub; floats differ only in the order of additions
(the host's ranks first). Half-precision and integer ``mean`` stay on the flat path, where the
hub accumulates every rank's contribution in float32 once.

Order. Collectives are matched by their order on each rank, and a stage 2 or 3 can only be
issued once the stage before it has finished, which happens at different times on different
ranks. So each stage is issued in the order the all_reduces were called (a chain of futures
per stage), whatever order their earlier stages finish in.

Failures. A failure in a subgroup names that subgroup's ranks; the rank's own generation
fails too when a rank is lost, so the error raised is the generation's (naming global ranks)
when the hub reports one within the session's verdict grace, else the subgroup's.

It is active when the generation spans more than one host, at least one host runs more than
one rank, the generation has shards (node-local ones: without them there is no host shard to
combine on) and ``hierarchical`` is on (``GRADSTAR_HIERARCHICAL=0`` turns it off).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from gradstar.errors import GradstarError
from gradstar.node_shard import HOST_GROUP
from gradstar.proto.v1 import collective_pb2 as pb

from .convert import delivered

#: dtypes whose reduction is exact or accumulated in their own precision at both levels.
_DTYPES = frozenset(np.dtype(d) for d in ("float32", "float64", "int32", "int64"))
_FLOATS = frozenset(np.dtype(d) for d in ("float32", "float64"))


@dataclass(frozen=True)
class HostPlan:
    """Where one rank stands in the two levels."""

    host: str  #: this rank's host key
    local_rank: int
    local_size: int
    leader: bool  #: the lowest rank of its host: it carries the host's partial across
    host_index: int  #: the host's place among the hosts, ordered by their leaders' ranks
    hosts: int


def plan(rank: int, hosts: dict[int, str]) -> HostPlan | None:
    """This rank's place in the two levels, or None when they would not help (one host, one
    rank per host, or a rank that announced no host)."""
    if not hosts or any(not key for key in hosts.values()):
        return None
    by_host: dict[str, list[int]] = {}
    for r in sorted(hosts):
        by_host.setdefault(hosts[r], []).append(r)
    if len(by_host) < 2 or all(len(ranks) == 1 for ranks in by_host.values()):
        return None
    mine = by_host[hosts[rank]]
    leaders = sorted(ranks[0] for ranks in by_host.values())
    return HostPlan(hosts[rank], mine.index(rank), len(mine), mine[0] == rank,
                    leaders.index(mine[0]), len(leaders))


class HostHierarchy:
    """One rank's two-level all_reduce (see the module docstring)."""

    def __init__(self, group, hosts: dict[int, str],
                 join: Callable[[str, int, int], Awaitable]) -> None:
        self._group = group
        on = group.settings.hierarchical and bool(group.shards)
        self.plan = plan(group.rank, hosts) if on else None
        self._join = join
        self.local = None
        self.leaders = None
        #: All_reduces numbered in call order (taken on the caller's thread, as seqs are), and
        #: per stage 2 and 3 the number of the last one that issued it: the next waits its turn.
        self._tickets = itertools.count(1)
        self._issued = [0, 0]
        self._turns: asyncio.Condition | None = None
        #: Set when an all_reduce failed here: later ones raise it rather than issue stages
        #: that the other ranks would pair with the failed one's.
        self._broken: BaseException | None = None

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
        failed = asyncio.ensure_future(g._session.failure_within(g.settings.join_timeout))
        try:
            await asyncio.wait((joined, failed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if not joined.done() and g._session.failure is not None:
            joined.cancel()
            with contextlib.suppress(asyncio.CancelledError, GradstarError):
                await joined
            raise g._session.failure
        groups = await joined
        self.local = groups[0]
        self.leaders = groups[1] if p.leader else None

    def takes(self, arr: np.ndarray, reduce_op: int) -> bool:
        """Whether this all_reduce goes through the two levels."""
        if self.local is None or arr.dtype not in _DTYPES:
            return False
        return reduce_op != pb.REDUCE_OP_MEAN or arr.dtype in _FLOATS

    def all_reduce(self, arr: np.ndarray, reduce_op: int, out: np.ndarray, restore,
                   timeout: float | None, wire: str | None = None) -> Awaitable:
        """Issue stage 1 now and the later stages in call order; resolves to ``restore(out)``.
        A ``wire`` format applies to stage 2 alone, the leaders' across hosts: the host's
        stages stay in the tensor's dtype over shared memory, where bytes are cheap.
        Called on the loop, it returns a running task; from another thread (the blocking API),
        the coroutine to submit to the loop, as :func:`.collective_stream.issue` does.

        Raises:
            GradstarError: an earlier all_reduce of the two levels failed on this rank.
        """
        self._raise_if_broken()
        level = pb.REDUCE_OP_SUM if reduce_op == pb.REDUCE_OP_MEAN else reduce_op
        op_name = _NAMES[level]
        first = self.local.all_reduce(arr, op_name, timeout=timeout, out=out)
        run = self._finish(first, next(self._tickets), op_name, reduce_op, out, restore,
                           timeout, wire)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return run
        return asyncio.ensure_future(run)

    async def _turn(self, stage: int, ticket: int) -> None:
        """Wait until every all_reduce called before this one issued ``stage``."""
        if self._turns is None:
            self._turns = asyncio.Condition()
        async with self._turns:
            await self._turns.wait_for(lambda: self._issued[stage] >= ticket - 1)

    async def _took_turn(self, stage: int, ticket: int) -> None:
        async with self._turns:
            self._issued[stage] = max(self._issued[stage], ticket)
            self._turns.notify_all()

    async def _finish(self, first, ticket: int, op_name: str, reduce_op: int, out: np.ndarray,
                      restore, timeout: float | None, wire: str | None):
        taken = [False, False]
        try:
            try:
                await first
            finally:
                await self._turn(0, ticket)
            self._raise_if_broken()
            second = (self.leaders.all_reduce(out, op_name, timeout=timeout, out=out, wire=wire)
                      if self.leaders is not None else None)  # only a host's leader crosses
            taken[0] = True
            await self._took_turn(0, ticket)
            if second is not None:
                await second
            await self._turn(1, ticket)
            self._raise_if_broken()
            third = self.local.broadcast(out, src=0, timeout=timeout)
            taken[1] = True
            await self._took_turn(1, ticket)
            result = await third
        except GradstarError as error:
            self._broken = await self._named(error)
            raise self._broken from None
        except BaseException as error:  # cancelled: later stages would pair wrongly
            self._broken = GradstarError(f"a two-level all_reduce was interrupted ({error!r}); "
                                         "this rank's later all_reduces cannot be matched")
            raise
        finally:
            for stage in (0, 1):  # a failed one still lets the next take its turn (and fail)
                if not taken[stage]:
                    await self._took_turn(stage, ticket)
        if result is not out:
            np.copyto(out, result)
        if reduce_op == pb.REDUCE_OP_MEAN:
            np.divide(out, self._group.world_size, out=out)
        return await delivered(restore, out)

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise self._broken

    async def _named(self, error: GradstarError) -> GradstarError:
        """The rank's own generation's failure, if the hub reports one, else ``error``."""
        return await self._group._session.verdict() or error

    async def close(self) -> None:
        for group in (self.leaders, self.local):
            if group is not None:
                await group.close()
        self.local = self.leaders = None


_NAMES = {pb.REDUCE_OP_SUM: "sum", pb.REDUCE_OP_MIN: "min", pb.REDUCE_OP_MAX: "max",
          pb.REDUCE_OP_PROD: "prod"}


__all__ = ["HostHierarchy", "HostPlan", "plan"]

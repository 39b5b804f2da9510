"""What each two-level collective is, as data: a :class:`Program` per op and rank, a list of
:class:`Stage` s (one collective each, in the host group or the leaders group) and a ``finish``
that turns the stage buffers into the rank's result. Pure numpy, no I/O: one interpreter
(:class:`~gradstar.client.hierarchy.two_level.HostHierarchy`) runs every program, and the unit
tests run them against an in-memory hub.

Every rank of a host gets the same host-group stages in the same order for a call, and every
leader the same leaders stages, whatever its role: that is what lets each group match them by
the order they were reserved in (:mod:`gradstar.client.hierarchy`).

Stages, in order (host group: over shared memory; leaders: across hosts):

- all_reduce: host all_reduce of the inputs; leaders' all_reduce of the host partials; host
  broadcast from the leader.
- broadcast: on src's host, host broadcast from src, then the leaders' broadcast from that
  host's leader; on every other host, the leaders' broadcast, then a host broadcast from the
  leader.
- all_gather: host all_gather (the host's block); leaders' all_gather of the blocks; host
  broadcast of every block.
- reduce_scatter: host all_reduce of the rows in host-block order; leaders' reduce_scatter (each
  leader gets its host's rows); host broadcast, each rank keeping its own rows.

``mean`` sums at both levels and divides by the world size in ``finish``. Rows of all_gather and
reduce_scatter are in *host-block order* (:attr:`HostPlan.order`) across hosts and put back in
global rank order at the end, so hosts whose ranks are not contiguous give the flat path's
result; both need every host to run as many ranks (:attr:`HostPlan.uniform`), else the caller
keeps the flat path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gradstar import ops
from gradstar.errors import CollectiveMismatchError
from gradstar.proto.v1 import collective_pb2 as pb

from .layout import HostPlan

LOCAL = "local"  #: the host group, ``JOB/gN/host-KEY``
LEADERS = "leaders"  #: one rank per host, ``JOB/gN/leaders``
#: The type of a broadcast's src tag (:func:`broadcast`).
_TAG = np.dtype("<i8")


@dataclass(frozen=True, eq=False)
class Stage:
    """One collective of a two-level op, in group ``level``.

    ``like`` is the array whose shape and dtype the collective's header carries (this rank's
    input as that group sees it); ``send`` is what the op's input layout cuts (for all_gather
    the whole result buffer, this rank's segment filled, as the flat path sends); the result
    lands in ``out``.
    """

    level: str
    op: int
    like: np.ndarray
    send: np.ndarray
    out: np.ndarray
    root: int = 0
    reduce_op: int = 0
    #: A compressed wire format (:mod:`gradstar.wire.formats`): only on a leaders' stage.
    wire: str | None = None

    def describe(self) -> str:
        return f"{ops.op_name(self.op)} in the {self.level} group"


@dataclass(frozen=True, eq=False)
class Program:
    """One rank's part in one two-level collective: the stages it takes part in, in order,
    then ``finish()``, its result (a numpy array)."""

    stages: tuple[Stage, ...]
    finish: Callable[[], np.ndarray]
    #: Where each piece's stages begin: one piece (the default) runs its stages in order; a
    #: segmented all_reduce is several, each starting once the one before ended its first stage.
    starts: tuple[int, ...] = (0,)


def _level(reduce_op: int) -> int:
    """The reduce op both levels apply: a mean is a sum, divided once at the end."""
    return pb.REDUCE_OP_SUM if reduce_op == pb.REDUCE_OP_MEAN else reduce_op


def _finished(result: np.ndarray, reduce_op: int, world_size: int) -> np.ndarray:
    if reduce_op == pb.REDUCE_OP_MEAN:
        np.divide(result, world_size, out=result)
    return result


def all_reduce(p: HostPlan, arr: np.ndarray, reduce_op: int, out: np.ndarray,
               wire: str | None = None) -> Program:
    """``out`` receives the reduction of every rank's ``arr`` (``out`` may be ``arr``); a
    ``wire`` format applies to the leaders' stage alone, across hosts."""
    level = _level(reduce_op)
    stages = [Stage(LOCAL, ops.ALL_REDUCE, arr, arr, out, reduce_op=level)]
    if p.leader:  # only a host's leader crosses its link, in place
        stages.append(Stage(LEADERS, ops.ALL_REDUCE, out, out, out, reduce_op=level,
                            wire=wire))
    stages.append(Stage(LOCAL, ops.BROADCAST, out, out, out))
    return Program(tuple(stages), lambda: _finished(out, reduce_op, p.world_size))


def broadcast(p: HostPlan, arr: np.ndarray, src: int) -> Program:
    """Rank ``src``'s ``arr`` on every rank.

    The hub checks that the ranks of each stage agree on its root, but a rank of another host
    only ever meets its own leader: it could not tell whose tensor it was handed. So the buffer
    carries a tag after the tensor, the src's rank as the src wrote it, and each rank checks it
    in ``finish``.

    Raises:
        ValueError: ``src`` is not a rank of the layout.
        CollectiveMismatchError (from ``finish``): the tensor this rank got is not ``src``'s
            (the ranks disagree on src).
    """
    src_host, src_local = p.place(src)
    flat = arr.reshape(-1)
    buf = np.empty(flat.size + -(-_TAG.itemsize // arr.dtype.itemsize), arr.dtype)
    tag = buf[flat.size:].view(np.uint8)[:_TAG.itemsize].view(_TAG)
    if p.rank == src:
        buf[:flat.size] = flat
        tag[0] = src
    else:
        tag[0] = -1  # still so when nothing arrived: never taken for a src's tag
    across = Stage(LEADERS, ops.BROADCAST, buf, buf, buf, root=src_host)
    if p.host_index == src_host:  # src's host first gets it to its leader, which sends it out
        stages = [Stage(LOCAL, ops.BROADCAST, buf, buf, buf, root=src_local)]
        stages += [across] if p.leader else []
    else:  # every other host's leader receives it once and hands it on
        stages = [across] if p.leader else []
        stages.append(Stage(LOCAL, ops.BROADCAST, buf, buf, buf))

    def finish() -> np.ndarray:
        if tag[0] != src:
            raise CollectiveMismatchError(
                f"rank {p.rank} called broadcast with src={src}, but the tensor it received "
                f"is not rank {src}'s (tagged {int(tag[0])}): the ranks disagree on src")
        return buf[:flat.size].reshape(arr.shape)

    return Program(tuple(stages), finish)


def all_gather(p: HostPlan, arr: np.ndarray) -> Program:
    """Every rank's ``arr``, stacked in global rank order: shape ``(world_size, *arr.shape)``.

    Needs a uniform layout (:attr:`HostPlan.uniform`)."""
    gathered = np.empty((p.hosts, p.local_size, *arr.shape), arr.dtype)
    block = gathered[p.host_index]  # the leaders' segment of this host, written in place
    block[p.local_rank] = arr
    stages = [Stage(LOCAL, ops.ALL_GATHER, arr, block, block)]
    if p.leader:
        stages.append(Stage(LEADERS, ops.ALL_GATHER, block, gathered, gathered))
    stages.append(Stage(LOCAL, ops.BROADCAST, gathered, gathered, gathered))

    def finish() -> np.ndarray:
        rows = gathered.reshape(p.world_size, *arr.shape)
        if p.in_rank_order:
            return rows
        ranked = np.empty_like(rows)
        ranked[list(p.order)] = rows
        return ranked

    return Program(tuple(stages), finish)


def reduce_scatter(p: HostPlan, arr: np.ndarray, reduce_op: int,
                   wire: str | None = None) -> Program:
    """Rows ``[rank·m, (rank+1)·m)`` of the reduction of every rank's ``arr``, where
    ``m = arr.shape[0] // world_size``, as the flat reduce_scatter gives (``wire``: a format
    for the leaders' stage alone).

    Needs a uniform layout and ``arr.shape[0]`` divisible by the world size (the caller
    checked it)."""
    level = _level(reduce_op)
    m = arr.shape[0] // p.world_size
    if p.in_rank_order:
        rows, partial = arr, np.empty_like(arr)
    else:  # each host's ranks' rows side by side, hosts in leader order: a leaders' segment
        rows = np.concatenate([arr[r * m:(r + 1) * m] for r in p.order])
        partial = rows  # a copy of our own already: reduce into it
    block = np.empty((p.local_size * m, *arr.shape[1:]), arr.dtype)
    stages = [Stage(LOCAL, ops.ALL_REDUCE, rows, rows, partial, reduce_op=level)]
    if p.leader:
        stages.append(Stage(LEADERS, ops.REDUCE_SCATTER, partial, partial, block,
                            reduce_op=level, wire=wire))
    stages.append(Stage(LOCAL, ops.BROADCAST, block, block, block))

    def finish() -> np.ndarray:
        mine = block[p.local_rank * m:(p.local_rank + 1) * m].copy()
        return _finished(mine, reduce_op, p.world_size)

    return Program(tuple(stages), finish)


__all__ = ["LEADERS", "LOCAL", "Program", "Stage", "all_gather", "all_reduce", "broadcast",
           "reduce_scatter"]

"""A Synchronous DDP's part in a job that grows and shrinks while it trains: ``ddp.elastic``.

Before the first collective of each synchronising step (the forward's buffer broadcast, or the
first bucket of backward) the DDP crosses a *step boundary*
(:meth:`~gradstar.client.process_group.ProcessGroup.step_boundary`). When the job resizes
there (a rank joined past the world size, within ``max_world_size``, or one departed) every
rank moves to the job's next generation without restarting anything, and the new rank 0 sends
its state to the ranks that joined: the module's parameters and buffers and the optimizer's
state (when the DDP has ``optimizer=``), as one snapshot (:mod:`gradstar.client.steps.
snapshot`: no pickle; the newcomer checks it against its own module and optimizer). The
snapshot is taken where the others stand: before the step's optimizer update, so a newcomer
that received it in its constructor runs that very step with them. Nothing is written into
the parameters of the ranks that were already there (backward may be using them).

A rank leaves for good with :meth:`ElasticSteps.leave` (between steps; e.g. on a spot
instance's notice): the others go on without it from the next boundary every rank reaches,
which may be one step later than the call; the loop checks :attr:`ElasticSteps.left`::

    for batch in loader:
        if ddp.elastic.left:
            break
        ...
    pg.close()

Hooks (:meth:`ElasticSteps.on_resize`) run on every rank that moved, after the move, with the
:class:`~gradstar.client.process_group.membership.Resized` record: the place to re-shard the
data (``sampler.num_replicas = r.world_size; sampler.rank = r.rank``).

What a newcomer receives is the wrapper's :class:`JoinState`: the DDP's :class:`ModuleState`
(module and optimizer); LocalSGD/DiLoCo, which cross a boundary after each round, send the
global model instead (:mod:`gradstar.client.outer.local_sgd`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from gradstar.errors import ConfigurationError, ProtocolError, RendezvousError

from ..process_group.membership import Resized
from ..process_group.protocol import CollectiveGroup, ElasticGroup
from ..steps.snapshot import pack, unpack


class _NoOptimizer:
    """What the snapshot carries for a DDP without ``optimizer=``: an empty state."""

    param_groups: list = []

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict) -> None:
        pass


class JoinState(Protocol):
    """What the ranks of a resized generation give their newcomers, with the same collectives
    on every rank: :meth:`send` on the ranks that were there (rank 0's state goes),
    :meth:`receive` on a newcomer."""

    def send(self, pg) -> None: ...

    def receive(self, pg) -> None:
        """Take the state rank 0 sends.

        Raises:
            ProtocolError: it does not fit this rank (another model); nothing was changed.
        """


class ModuleState:
    """A DDP's state for its newcomers: the module's parameters and buffers and the optimizer's
    state, as one snapshot taken where the ranks stand."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.module = module
        self.optimizer = optimizer if optimizer is not None else _NoOptimizer()

    def send(self, pg) -> None:
        _broadcast_snapshot(pg, pack(self.module, self.optimizer) if pg.rank == 0 else None,
                            self.module, self.optimizer)

    def receive(self, pg) -> None:
        _broadcast_snapshot(pg, None, self.module, self.optimizer)


class ElasticSteps:
    """Step boundaries of one wrapper (see the module docstring)."""

    def __init__(self, pg: CollectiveGroup, state: JoinState, synchronous: bool) -> None:
        self.pg, self.state = pg, state
        #: Whether this wrapper crosses boundaries: a Synchronous DDP (or LocalSGD) over a
        #: blocking process group that can move at boundaries (an ElasticGroup; the sync modes
        #: grow on the hub's step ledger instead).
        self.enabled = synchronous and isinstance(pg, ElasticGroup)
        self._crossed = False
        self._leaving = False
        self._hooks: list[Callable[[Resized], None]] = []
        #: The last resize this rank moved through, or None.
        self.last: Resized | None = None

    def declare(self) -> None:
        """Tell the coordinator how this rank's job takes a new rank (at a boundary, or at once
        on the hub's step ledger), once the wrapper is built: a joiner past the world size
        waits until every rank said so, so that it never arrives amid a wrapper's first
        collectives."""
        if isinstance(self.pg, ElasticGroup):
            self.pg.move_at_boundaries(self.enabled)

    def start_state(self) -> bool:
        """At construction: take the state from rank 0 if this rank joined at a resize's
        boundary (True), else leave the first broadcast to the caller (False).

        Raises:
            ProtocolError: the state does not fit this rank's module or optimizer (another
                model): this rank departed, and the others went on without it, undisturbed.
        """
        if not (self.enabled and self.pg.newcomer):
            return False
        try:
            self.state.receive(self.pg)
        except ProtocolError:
            _verdict(self.pg, ok=False)
            self.pg.depart()  # the others move on at this same boundary, without this rank
            departed = self.pg.departed  # (waits for the coordinator to name it)
            self.pg.close()
            if not departed:
                raise RendezvousError("a newcomer whose state did not fit could not leave "
                                      "at the boundary it joined at") from None
            raise
        _verdict(self.pg, ok=True)
        return True

    def cross(self) -> None:
        """Before the first collective of a synchronising step; once per step."""
        if not self.enabled or self._crossed:
            return
        self._crossed = True
        resized = self.pg.step_boundary(self._welcome)
        if resized is None:
            return
        self.last = resized
        for hook in self._hooks:
            hook(resized)

    def _welcome(self, resized: Resized) -> bool:
        """Send the newcomers this rank's state (rank 0's goes); whether they all took it."""
        self.state.send(self.pg)
        return _verdict(self.pg, ok=True)

    def done(self) -> None:
        """The step's synchronisation ended: the next collective begins a new step."""
        self._crossed = False

    def on_resize(self, hook: Callable[[Resized], None]) -> None:
        """Call ``hook(resized)`` on this rank after each move to a resized generation."""
        self._hooks.append(hook)

    def leave(self) -> None:
        """Leave the job for good at the next step boundary every rank reaches; returns once
        the coordinator took the request (:meth:`ProcessGroup.depart`, which raises what
        it raises). Calling it again is a no-op.

        Raises:
            ConfigurationError: not a Synchronous DDP over a blocking process group, or the
                job would fall below its ``min_world_size``.
        """
        if not self.enabled:
            raise ConfigurationError(
                "ddp.elastic.leave() needs a Synchronous DDP over a blocking process group; "
                "in the other sync modes close the process group: the others go on")
        if not self._leaving:
            self.pg.depart()
            self._leaving = True

    @property
    def left(self) -> bool:
        """Whether this rank, after :meth:`leave`, reached the boundary it leaves at: stop
        training and close the process group."""
        return self.enabled and self.pg.departed


def _verdict(pg, ok: bool) -> bool:
    """Whether every rank of the new generation has its state (a newcomer says whether the
    snapshot fitted): the same answer on every rank."""
    return bool(pg.all_reduce(np.array([1 if ok else 0], dtype=np.int64), op="min")[0])


def _broadcast_snapshot(pg, snapshot: tuple[str, bytes] | None, module: torch.nn.Module,
                        optimizer) -> None:
    """Rank 0 sends ``snapshot`` (layout, data); a newcomer loads what it receives; every other
    rank takes part and keeps its own state."""
    sizes = np.zeros(2, dtype=np.int64)
    if pg.rank == 0:
        layout, data = snapshot
        sizes[:] = (len(layout.encode()), len(data))
    sizes = pg.broadcast(sizes, src=0)
    blob = np.zeros(-(-int(sizes[0] + sizes[1]) // 8), dtype=np.int64)
    if pg.rank == 0:
        raw = layout.encode() + data
        blob.view(np.uint8)[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    blob = pg.broadcast(blob, src=0)
    if pg.newcomer:
        raw = blob.view(np.uint8).tobytes()
        unpack(raw[:sizes[0]].decode("utf-8", "replace"), raw[sizes[0]:sizes[0] + sizes[1]],
               module, optimizer)


__all__ = ["ElasticSteps", "JoinState", "ModuleState"]

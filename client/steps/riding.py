"""A sync-mode rank riding through a restart of its coordinator (or a standby's takeover):
the steps' half of :mod:`gradstar.client.reconnect`.

When a Steps call fails because the coordinator went away (or the one it reached does not know
the generation yet, or no longer leads), and the rank's session rides through restarts, the
call waits until the session rejoined (:meth:`StepsRide.back`), and the rank then *resumes* its
ledger on the coordinator that took it back (:meth:`StepsRide.resume`, the hub's half is
:mod:`gradstar.coordinator.steps.resume`): a new client (the new coordinator may listen
elsewhere), its step count, barriers and mode epoch told, the snapshot at the ledger's step
count loaded if the rank is behind it (or sent, by the rank the hub names). Then the rank's
call goes on (:class:`~.sync.StepSync` decides what: a gradient in flight is issued again only
if it was computed after the ledger's step count, else it counts as dropped; a barrier is
called again).

Without ``reconnect_timeout`` (no ride), or for a failure that is the call's own, nothing
waits: the error is raised as it was. With error feedback (``wire=``), a gradient counted as
dropped after a restart gives its residual back like any dropped one, though some applied step
may hold it: what the wire format lost of it is then lost once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import numpy as np

from gradstar.errors import (
    CoordinatorUnavailableError,
    GradstarError,
    LeadershipError,
    RendezvousError,
    StepResumeError,
)
from gradstar.proto.v1 import steps_pb2 as pb

from ..session import VERDICT_GRACE
from .client import StepsClient
from .snapshot import pack, unpack

log = logging.getLogger(__name__)

#: The failures that may mean the coordinator went away: it did, the one reached does not
#: know the generation (restarted, not rebuilt yet), or it no longer leads.
AWAY = (CoordinatorUnavailableError, RendezvousError, LeadershipError)


@dataclass
class Held:
    """A contribution kept until its step is applied, to issue again after a restart: the
    gradient as sent (residual added), what it was computed on, and its header's values."""

    flat: np.ndarray
    base: int
    weight: float
    hyper: tuple[float, ...]
    buffers: int


class StepsRide:
    """One StepSync's rides through coordinator restarts (see the module docstring).

    ``pg``: the blocking process group (its session's ride, its loop); ``model``: the ledger.
    """

    def __init__(self, pg, model: str) -> None:
        self._pg = pg
        self._model = model
        self._submit: Callable[[Coroutine], object] = pg.submit
        self._ride = pg.session.ride  # None where the group rides through nothing
        #: The session's rejoins when this ledger was last known (resumed or first used).
        self.epoch = 0 if self._ride is None else self._ride.epoch
        #: How many times the ledger was resumed.
        self.resumes = 0

    @property
    def moved(self) -> bool:
        """Whether the session rejoined a coordinator since the ledger was last known."""
        return self._ride is not None and self._ride.epoch != self.epoch

    def back(self, error: GradstarError) -> bool:
        """After a Steps call failed with ``error``: whether it failed because the
        coordinator went away, once the session rejoined (waits for that; False at once for
        a failure that is the call's own, or without a ride).

        Raises:
            GradstarError: the session's failure, when its ride ended in one.
        """
        if self._ride is None or not isinstance(error, AWAY):
            return False
        return self._submit(self._until_back(error)).result()

    async def _until_back(self, error: GradstarError) -> bool:
        ride = self._ride
        if not ride.away and ride.epoch == self.epoch:
            await ride.verdict(VERDICT_GRACE)  # the session finds the coordinator gone
        return await ride.until_back(self.epoch, error)

    def resume(self, sync, old: StepsClient) -> StepsClient:
        """Resume ``sync``'s ledger on the coordinator the session rejoined: its new client
        (``old``, the client of the coordinator that went away, closed), with ``sync``
        loaded from the snapshot if it was behind (its ``have`` moves on to the snapshot's
        step count); riding through again if the coordinator goes away meanwhile.

        Raises:
            StepResumeError: the coordinator cannot take the rank's steps back, or its
                snapshot is behind the step count the ledger goes on from.
            StepTimeoutError: the other ranks did not resume within the timeout.
        """
        # After the group's own rejoin callbacks: its collective address is the new one.
        self._submit(self._ride.until_back(self.epoch)).result()
        while True:
            epoch = self._ride.epoch
            self._submit(old.close())  # its calls failed already; closed in the background
            old = client = self._run(_client_for(self._pg, self._model))
            try:
                self._resume(sync, client)
            except GradstarError as error:
                if self.back(error):
                    continue
                raise
            self.epoch = epoch
            self.resumes += 1
            return client

    def _resume(self, sync, client: StepsClient) -> None:
        reply = self._run(client.resume(sync.have, sync.barriers_done, sync.mode_epoch,
                                        sync.timeout))
        rank = client.key.rank
        if reply.load_snapshot:
            steps, layout, data = self._run(client.get_snapshot(sync.timeout))
            if steps < reply.steps:
                raise StepResumeError(
                    f"rank {rank} resumes the steps of model {self._model!r} at {reply.steps} "
                    f"aggregates, but the snapshot it was given is of {steps}")
            unpack(layout, data, sync.module, sync.optimizer)
            log.warning("rank %d loaded the snapshot of step %d after a coordinator restart "
                        "(it had applied %d aggregates)", rank, steps, sync.have)
            sync.have = sync.stats.step = steps
        if reply.send_snapshot:  # the ranks behind wait for it: sent now, not in the background
            layout, data = pack(sync.module, sync.optimizer)
            self._run(client.put_snapshot(sync.have, layout, data, sync.timeout))
        log.info("rank %d resumed the steps of model %r at %d aggregates", rank, self._model,
                 reply.steps)

    def _run(self, coro):
        return self._submit(coro).result()


def dropped_by_restart(have: int, base: int) -> pb.Contributed:
    """The verdict on a contribution computed after ``base`` aggregates that the coordinator
    which took the ledger back at ``have`` cannot take: it may be in a step some rank
    applied."""
    return pb.Contributed(accepted=False, steps=have, staleness=have - base, reason=(
        f"computed after {base} aggregates, and the coordinator that took the job back goes "
        f"on from {have}: it may be in a step already applied, so it counts as dropped"))


async def _client_for(pg, model: str) -> StepsClient:
    return StepsClient.for_group(pg, model)  # on the group's loop


__all__ = ["AWAY", "Held", "StepsRide", "dropped_by_restart"]

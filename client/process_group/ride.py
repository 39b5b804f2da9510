"""The process group's half of riding through a restart of its coordinator: its collectives
are held and issued again (:mod:`gradstar.client.collective.reissue`) while its session
rejoins (:mod:`gradstar.client.reconnect`). :class:`Rider` is the object an
:class:`~gradstar.client.process_group.AsyncProcessGroup` owns for that when its session rides
through restarts; once the session rejoined, the group opens its data plane and direct lane
anew (the restarted coordinator may serve collectives on another port) and the rider issues
again the collectives the coordinator names.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine

import numpy as np

from gradstar import ops
from gradstar.errors import GradstarError
from gradstar.proto.v1 import rendezvous_pb2 as rpb

from ..collective.direct import DirectLane
from ..collective.reissue import Attempt, Reissue, Seqs
from ..reconnect import Ride

#: How a rider runs a collective once: ``attempt(call, timeout)`` is what runs ``call`` over
#: the group's data plane as it is when the attempt starts (sending ``send``, into ``out``).
Attempts = Callable[[ops.CollectiveCall, float], Attempt]


class Rider:
    """The collectives of one group held for issuing again while ``ride`` (its session's
    rides through restarts) goes on: every collective is held from its start, and one that
    failed because the coordinator went away is issued again, same seq, once it is back.
    ``seqs`` are the group's sequence numbers (what a rejoin claims); ``attempts`` runs a
    collective once."""

    def __init__(self, seqs: Seqs, ride: Ride, attempts: Attempts) -> None:
        self.reissue = Reissue(seqs)
        self.ride = ride
        self.attempts = attempts
        self._tasks: set[asyncio.Task] = set()  # the loop holds tasks only weakly

    def claim(self, joined: rpb.Joined) -> rpb.Rejoin:
        """What this rank holds of generation ``joined``, as its rejoin claims it."""
        return self.reissue.claim(joined)

    @property
    def waits(self) -> list[float]:
        """How long each ride through a coordinator restart lasted (seconds), oldest first."""
        return list(self.ride.waits)

    async def run(self, call: ops.CollectiveCall, send: np.ndarray | None, out: np.ndarray,
                  timeout: float) -> np.ndarray:
        """Run ``call`` as :func:`~gradstar.client.collective.stream.run_collective` does,
        issued again after a restart."""
        held = self.reissue.hold(call, send, out, self.attempts(call, timeout))
        return await self.reissue.run(held, out, self.ride)

    def replay(self, joined: rpb.Joined) -> None:
        """Issue again what the coordinator that answered ``joined`` names (its replay set)."""
        self.reissue.replay(joined.replay, self.ride)

    def keep(self, coroutine: Coroutine) -> None:
        """Run ``coroutine`` on its own task, held until it ends (a closing data plane, the new
        direct lane's watch)."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class RidingLane:
    """The direct lane of a group that rides through restarts: each collective is held like
    the loop's, and one that failed because the coordinator went away is issued again on
    the loop once the session rejoined (there, the new lane or the new data plane takes it).
    ``submit`` runs a coroutine on the group's loop."""

    def __init__(self, rider: Rider, lane: DirectLane,
                 submit: Callable[[Coroutine], concurrent.futures.Future]) -> None:
        self._rider = rider
        self._lane = lane
        self._submit = submit
        self.takes = lane.takes

    def run(self, call: ops.CollectiveCall, send: np.ndarray | None, out: np.ndarray,
            timeout: float) -> np.ndarray:
        """As :meth:`DirectLane.run`, on the caller's thread; issued again on the loop after a
        restart of the coordinator."""
        rider = self._rider
        reissue, ride = rider.reissue, rider.ride
        held = reissue.hold(call, send, out, rider.attempts(call, timeout))
        began = ride.epoch
        try:
            result = self._lane.run(call, held.send, out, timeout)
        except GradstarError as error:
            if not self._submit(ride.until_back(began, error)).result():
                reissue.dropped(held)
                raise
            return self._submit(reissue.run(held, out, ride)).result()
        except BaseException:
            reissue.dropped(held)
            raise
        reissue.completed(held)
        return result


__all__ = ["Attempts", "Rider", "RidingLane"]

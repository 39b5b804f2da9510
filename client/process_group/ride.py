"""The process group's half of riding through a restart of its coordinator: its collectives
are held and issued again (:mod:`gradstar.client.collective.reissue`) while its session
rejoins (:mod:`gradstar.client.reconnect`), and once it rejoined, the group's data plane and
direct lane are opened anew (the restarted coordinator may serve collectives on another port)
and the collectives the coordinator names are issued again. Mixed into
:class:`~gradstar.client.process_group.AsyncProcessGroup`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

import numpy as np

from gradstar import ops
from gradstar.config import ClientSettings
from gradstar.errors import GradstarError
from gradstar.proto.v1 import rendezvous_pb2 as rpb

from ..collective.data_plane import DataPlane
from ..collective.direct import DirectLane
from ..collective.reissue import Reissue, Seqs
from ..collective.stream import run_collective
from ..session import Session

log = logging.getLogger(__name__)


class RidesThrough:
    """Mixin: what :class:`AsyncProcessGroup` does to ride through coordinator restarts.

    It reads the group's ``settings``, ``_session``, ``_plane``, ``_metadata``, ``direct``
    and ``_targets(call)``, and replaces ``_plane`` (and ``direct``) after a rejoin."""

    settings: ClientSettings
    joined: rpb.Joined
    _session: Session
    _plane: DataPlane
    direct: DirectLane | None
    _submit: Callable[[Coroutine], object] | None = None

    def _ride_along(self, seqs: Seqs) -> None:
        """Hold this group's collectives for issuing again, if its session rides through
        restarts (``reconnect_timeout`` above 0)."""
        self._reissue = Reissue(seqs)
        self._ride_tasks: set[asyncio.Task] = set()  # the loop holds tasks only weakly
        ride = self._session.ride
        if ride is not None:
            ride.claim = lambda: self._reissue.claim(self._session.joined)
            ride.on_rejoined.append(self._rejoined)

    @property
    def reconnects(self) -> list[float]:
        """How long each ride through a coordinator restart lasted (seconds), oldest first."""
        ride = self._session.ride
        return [] if ride is None else list(ride.waits)

    async def _run_riding(self, call: ops.CollectiveCall, send: np.ndarray | None,
                          out: np.ndarray, timeout: float) -> np.ndarray:
        """Run ``call`` as :func:`run_collective` does, issued again after a restart."""
        held = self._reissue.hold(call, send, out, self._attempt(call, timeout))
        return await self._reissue.run(held, out, self._session.ride)

    def _attempt(self, call: ops.CollectiveCall, timeout: float):
        def attempt(send: np.ndarray | None, out: np.ndarray):
            return run_collective(self._targets(call), call, send, out, session=self._session,
                                  metadata=self._metadata, timeout=timeout)
        return attempt

    def _lane(self) -> DirectLane | RidingLane | None:
        """The direct lane, wrapped so that its collectives are held too when riding."""
        if self.direct is None or self._session.ride is None:
            return self.direct
        return RidingLane(self, self.direct)

    def _rejoined(self, joined: rpb.Joined) -> None:
        """The session rejoined: a new data plane (and direct lane) for the coordinator that
        answered, and the collectives it names issued again."""
        self.joined = joined
        # The coordinator that took the rank back may be another (under --ha, the new leader).
        self.settings = self.settings.model_copy(update={"coordinator": self._session.target})
        self._channel = self._session.channel
        old, self._plane = self._plane, DataPlane(self.settings, list(joined.shards),
                                                  joined.collectives)
        self.shards = self._plane.addresses
        self._keep(old.close())
        if self.direct is not None and self._submit is not None:
            self.direct.close()
            watch = self.open_direct_lane(self._submit)
            if watch is not None:
                self._keep(watch)
        self._reissue.replay(joined.replay, self._session.ride)


    def _keep(self, coroutine: Coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._ride_tasks.add(task)
        task.add_done_callback(self._ride_tasks.discard)


class RidingLane:
    """The direct lane of a group that rides through restarts: each collective is held like
    the loop's, and one that failed because the coordinator went away is issued again on
    the loop once the session rejoined (there, the new lane or the new data plane takes it)."""

    def __init__(self, group: RidesThrough, lane: DirectLane) -> None:
        self._group = group
        self._lane = lane
        self.takes = lane.takes

    def run(self, call: ops.CollectiveCall, send: np.ndarray | None, out: np.ndarray,
            timeout: float) -> np.ndarray:
        """As :meth:`DirectLane.run`, on the caller's thread; issued again on the loop after a
        restart of the coordinator."""
        group = self._group
        reissue, ride = group._reissue, group._session.ride
        held = reissue.hold(call, send, out, group._attempt(call, timeout))
        began = ride.epoch
        try:
            result = self._lane.run(call, held.send, out, timeout)
        except GradstarError as error:
            if not group._submit(ride.until_back(began, error)).result():
                reissue.dropped(held)
                raise
            return group._submit(reissue.run(held, out, ride)).result()
        except BaseException:
            reissue.dropped(held)
            raise
        reissue.completed(held)
        return result


__all__ = ["RidesThrough", "RidingLane"]

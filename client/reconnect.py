"""A rank riding through a restart of its coordinator: the session's half.

When the session stream breaks without the coordinator's verdict (it was killed, restarted,
upgraded, its pod moved), a rank whose ``reconnect_timeout`` is above 0 does not fail: it keeps
its group, its peers and its collectives' state, and :class:`Ride` rejoins the coordinator at
the same address, for at most ``reconnect_timeout`` seconds from the moment it went away:

1. Wait until the address takes connections again (the channel reconnects by itself, backing
   off at most 1 s: :mod:`gradstar.transport.channels`).
2. Rejoin with what the rank holds of its generation (``JoinRequest.rejoin``: the generation,
   the member id, the seqs of its collectives still pending and those it can issue again); the
   coordinator rebuilds the generation once every rank has rejoined
   (:mod:`gradstar.coordinator.rendezvous.rebuild`) and answers the seqs to issue again.
3. Collectives that failed because the coordinator went away wait for this (:meth:`Ride.until_back`)
   and are issued again with the same seq (:mod:`gradstar.client.collective.reissue`).

Each rejoin is one log line (WARNING: how long the rank waited, and why it had to). A refusal
(:class:`~gradstar.errors.RejoinRefusedError`, a token refused, ...) fails the session at once;
the time running out fails it with :class:`~gradstar.errors.CoordinatorLostError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Protocol

from gradstar.errors import (
    CoordinatorLostError,
    CoordinatorUnavailableError,
    GradstarError,
    JoinTimeoutError,
    LeadershipError,
    ProtocolError,
)
from gradstar.proto.v1 import rendezvous_pb2 as rpb

from .coordinators import REACH_S, Coordinators

log = logging.getLogger(__name__)

#: Pause between two rejoin attempts that found no coordinator answering.
RETRY_PAUSE = 0.2


async def first_of(*waits: Coroutine, timeout: float | None = None) -> None:
    """Wait until the first of ``waits`` is done (or ``timeout`` seconds passed); the others
    are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


class Rejoinable(Protocol):
    """What a :class:`Ride` needs of its session (:class:`gradstar.client.session.Session`)."""

    joined: rpb.Joined | None
    coordinators: Coordinators
    target: str

    def use(self, address: str) -> None: ...

    @property
    def failure(self) -> GradstarError | None: ...

    async def wait_failed(self) -> GradstarError: ...

    async def wait_ready(self, timeout: float, *, fail_fast: bool = False) -> None: ...

    async def rejoin(self, claim: rpb.Rejoin, timeout: float) -> rpb.Joined: ...

    def abandon(self, error: GradstarError) -> None: ...


class Ride:
    """A session's rides through coordinator restarts (see the module docstring); ``refused``
    and ``lost`` fail the session when a rejoin is refused and when the time is up.

    ``claim()`` (set by the group) says what the rank holds of its generation;
    ``on_rejoined`` callbacks run with the coordinator's answer before any collective waiting
    in :meth:`until_back` goes on.
    """

    def __init__(self, session: Rejoinable, timeout: float, target: str, *,
                 refused: Callable[[GradstarError], None],
                 lost: Callable[[GradstarError], None]) -> None:
        self._session = session
        self._fail = refused  # fails the session with a refusal (or its own account of it)
        self._lost = lost  # fails it once the time is up
        self.timeout = timeout
        self.target = target
        self.claim: Callable[[], rpb.Rejoin] = rpb.Rejoin
        self.on_rejoined: list[Callable[[rpb.Joined], None]] = []
        #: Rejoins so far: a collective that began before the latest is issued again.
        self.epoch = 0
        #: When the coordinator went away (monotonic), while it is away; else None.
        self.away_since: float | None = None
        #: How long each ride through lasted, in seconds (what the rank waited).
        self.waits: list[float] = []
        self._why: GradstarError | None = None
        self._gone = asyncio.Event()
        self._back = asyncio.Event()
        self._back.set()
        self._task: asyncio.Task | None = None

    @property
    def away(self) -> bool:
        return self.away_since is not None

    def away_error(self) -> CoordinatorUnavailableError:
        """What a collective that broke while the coordinator is away raises, to be issued
        again once it is back."""
        return CoordinatorUnavailableError(
            f"the coordinator at {self.target} went away ({self._why}); this rank is rejoining "
            f"it for up to {self.timeout:g} s")

    def went_away(self, why: GradstarError) -> None:
        """The session stream broke without a verdict: start rejoining (once)."""
        if self.away:
            return
        self.away_since, self._why = time.monotonic(), why
        self._back.clear()
        self._gone.set()
        self._task = asyncio.ensure_future(self._rejoin())

    async def verdict(self, grace: float) -> GradstarError | None:
        """The session's failure, or :meth:`away_error` once the coordinator is found gone,
        waiting up to ``grace`` seconds for either; None if neither comes."""
        s = self._session
        if s.failure is None and not self.away:
            await first_of(s.wait_failed(), self._gone.wait(), timeout=grace)
        return s.failure or (self.away_error() if self.away else None)

    async def until_back(self, epoch: int, error: GradstarError | None = None) -> bool:
        """Whether a collective that began at rejoin ``epoch`` and failed (with ``error``) is
        to be issued again: after waiting while the coordinator is away, True once the session
        rejoined since; False when it never went away (the failure is the collective's own).
        A coordinator that refused it because it no longer leads (LeadershipError) is left
        as one that went away.

        Raises:
            GradstarError: the session's failure, when the ride ended in one.
        """
        s = self._session
        if isinstance(error, LeadershipError) and not self.away and self.epoch == epoch:
            s.abandon(error)
        if not self.away and self.epoch == epoch:
            return False
        await first_of(self._back.wait(), s.wait_failed())
        if s.failure is not None:
            raise s.failure
        return True

    async def _rejoin(self) -> None:
        s = self._session
        deadline = self.away_since + self.timeout
        last: GradstarError = self._why
        several = s.coordinators.several
        address, leader = s.target, ""
        while (remaining := deadline - time.monotonic()) > 0:
            if several:  # the next coordinator that may lead (--ha), or the leader named
                address = s.coordinators.after(address, leader)
                s.use(address)
                self.target, leader = address, ""
            try:
                if several:
                    await s.wait_ready(min(remaining, REACH_S), fail_fast=True)
                else:
                    await s.wait_ready(remaining)
                claim = self.claim()
                claim.away_seconds = time.monotonic() - self.away_since
                claim.term = s.coordinators.term
                joined = await s.rejoin(claim, max(remaining, 1.0))
            except TimeoutError:
                if several:  # not listening, or stopped: the next one
                    await asyncio.sleep(RETRY_PAUSE)
                    continue
                break
            except (CoordinatorUnavailableError, ProtocolError) as error:
                last = error  # not listening again yet, or gone again during the rejoin
                await asyncio.sleep(RETRY_PAUSE)
                continue
            except LeadershipError as error:  # a standby, or a leader superseded
                last, leader = error, getattr(error, "leader", "")
                await asyncio.sleep(RETRY_PAUSE)
                continue
            except JoinTimeoutError as error:
                last = error
                break
            except GradstarError as error:  # refused: the generation cannot be taken back
                self._fail(error)
                return
            self._rejoined(joined)
            return
        where = (f"the coordinators at {', '.join(s.coordinators.addresses)}" if several
                 else f"the coordinator at {self.target}")
        self._lost(CoordinatorLostError(
            f"{where} went away and did not take rank "
            f"{s.joined.rank} of job {s.joined.job!r} back within reconnect_timeout "
            f"({self.timeout:g} s): {last}"))

    def _rejoined(self, joined: rpb.Joined) -> None:
        waited = time.monotonic() - self.away_since
        self.waits.append(waited)
        self.epoch += 1
        self.away_since = None
        self._gone.clear()
        for callback in self.on_rejoined:
            callback(joined)
        self._back.set()
        log.warning(
            "rank %d of job %r rejoined the coordinator at %s after %.2f s away (%s); "
            "generation %d, collectives issued again: %s", joined.rank, joined.job,
            self.target, waited, self._why, joined.generation,
            ", ".join(map(str, joined.replay)) or "none")

    def close(self) -> None:
        """The group is closing: stop rejoining."""
        if self._task is not None:
            self._task.cancel()
            self._task = None


__all__ = ["RETRY_PAUSE", "Rejoinable", "Ride", "first_of"]

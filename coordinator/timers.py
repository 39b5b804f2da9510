"""The hub's one way to time its tables (the Steps ledgers, the Rounds fragments): run a
table's due work at its earliest deadline, and let calls wait, bounded, for the table to change.

A table is anything with ``next_deadline()`` (the earliest deadline, on its ``clock()``, or
None), ``close_due()`` (close what is due) and ``clock()``. :class:`DeadlineTimer` keeps one
asyncio timer for it: set for the earliest deadline, kept while that does not change (a table
re-arms after every call that may move it), re-set after it fired; a deadline that came but
could not close (short of its minimum of ranks or replicas) is looked at again after
:data:`RELOOK` seconds rather than spun on. :class:`Changes` wakes every waiting call at each
change of the table; each rechecks its own condition, so one signal serves every ledger.
(The collectives' own timeouts, many per second and rarely due, share ticks instead:
``coordinator.collective.deadlines``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

#: Seconds before a deadline that came and could not close is looked at again.
RELOOK = 1.0


class Timed(Protocol):
    """What :class:`DeadlineTimer` runs: a table with deadlines."""

    def next_deadline(self) -> float | None: ...

    def close_due(self) -> None: ...

    def clock(self) -> float: ...


class DeadlineTimer:
    """Runs ``table.close_due()`` at the table's earliest deadline, ``grace`` seconds after it
    (so the table's own clock has passed it); see the module docstring. Call on the loop."""

    def __init__(self, table: Timed, grace: float) -> None:
        self.table, self.grace = table, grace
        self._timer: asyncio.TimerHandle | None = None
        self._at: float | None = None  # the deadline the timer was set for

    def arm(self) -> None:
        """Set the timer for the earliest deadline (kept if that is unchanged; none if none)."""
        deadline = self.table.next_deadline()
        if self._timer is not None:
            if deadline == self._at:
                return
            self._timer.cancel()
            self._timer = None
        if deadline is None:
            return
        self._set(deadline, max(0.0, deadline - self.table.clock()) + self.grace)

    def _set(self, deadline: float, delay: float) -> None:
        self._at = deadline
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.table.close_due()
        deadline = self.table.next_deadline()
        if deadline is None:
            return
        if deadline > self.table.clock():
            self.arm()
        else:  # due, and could not close: a contribution or a departure settles it
            self._set(deadline, RELOOK)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Changes:
    """Calls waiting for a table to change (:meth:`wait`), woken all at once (:meth:`wake`):
    a future and a timer per wait, no task."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future] = set()

    async def wait(self, ready: Callable[[], bool], seconds: float) -> None:
        """Until ``ready()`` or ``seconds`` passed, rechecked at every change."""
        loop = asyncio.get_running_loop()
        until = loop.time() + max(seconds, 0.0)
        while not ready() and loop.time() < until:
            woken = loop.create_future()
            self._waiters.add(woken)
            timer = loop.call_at(until, _wake, woken)
            try:
                await woken
            finally:
                timer.cancel()
                self._waiters.discard(woken)

    def wake(self, *_: object) -> None:
        """Wake every waiting call (any arguments, the table's callback's, are ignored)."""
        waiters, self._waiters = self._waiters, set()
        for woken in waiters:
            _wake(woken)


def _wake(woken: asyncio.Future) -> None:
    if not woken.done():
        woken.set_result(None)


__all__ = ["RELOOK", "Changes", "DeadlineTimer", "Timed"]

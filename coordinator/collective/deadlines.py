"""The hub's deadlines, one module: the collectives' timeouts (:class:`Deadlines`) and the
tables' (:class:`DeadlineTimer`, :class:`Changes`: the Steps ledgers, the Rounds fragments).

**The collectives'**: one timer per tick of deadlines, not one per collective.

A timer per collective (asyncio's ``call_later``: a ``TimerHandle`` pushed on the loop's heap,
ordered by a Python ``__lt__``, then cancelled and swept out again) is a share of a tiny
collective's hub Python worth saving (docs/performance.md, "Figures behind the code"), for a
timeout that almost never fires. Here a
deadline is rounded up to the next tick; the collectives due at one tick share one timer, and a
collective that ends leaves its tick at once (a dict entry out: nothing of it stays alive until
its deadline). A tick is :data:`TICK` for a timeout of up to :data:`SPAN` ticks and doubles
with the timeout beyond that, so a timeout fires at most 50 ms or 0.4% of itself late, and a
busy hub keeps at most about :data:`SPAN` ticks (their timers and empty entry tables) per
doubling of the timeouts in use.

**The tables'**: a table's due work runs at its earliest deadline, and calls wait, bounded,
for the table to change.

A table is anything with ``next_deadline()`` (the earliest deadline, on its ``clock()``, or
None), ``close_due()`` (close what is due) and ``clock()``. :class:`DeadlineTimer` keeps one
asyncio timer for it: set for the earliest deadline, kept while that does not change (a table
re-arms after every call that may move it), re-set after it fired; a deadline that came but
could not close (short of its minimum of ranks or replicas) is looked at again after
:data:`RELOOK` seconds rather than spun on. :class:`Changes` wakes every waiting call at each
change of the table; each rechecks its own condition, so one signal serves every ledger.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

#: Seconds between the deadlines a short timeout's timers are set for.
TICK = 0.05
#: Ticks one timeout may span before its ticks double.
SPAN = 512


class Expiring(Protocol):
    """What a :class:`Deadlines` entry is: told when its deadline passed (with the timeout it
    was added with)."""

    def expired(self, timeout: float) -> None: ...


# The ticket of an entry that is never due (an infinite timeout): nothing is ever put in it.
_NEVER: dict = {}


class Deadlines:
    """Entries due at a deadline each, by tick; :meth:`add` returns the ticket :meth:`remove`
    takes back."""

    def __init__(self, tick: float = TICK) -> None:
        self.tick = tick
        self._due: dict[tuple[int, int], dict[Expiring, float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Entries waiting for their deadline."""
        return sum(len(entries) for entries in self._due.values())

    @property
    def ticks(self) -> int:
        """Ticks with a timer set (some may have no entry left)."""
        return len(self._due)

    def add(self, entry: Expiring, timeout: float) -> dict[Expiring, float]:
        """Call ``entry.expired(timeout)`` once ``timeout`` seconds passed (at most a tick
        more), unless it is removed before; returns its ticket. An infinite timeout is never
        due; one that is not a number is due at once (as a timer of NaN seconds was). Call it
        on the loop."""
        if timeout == math.inf:
            return _NEVER
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Another loop (a test's, a restarted hub's): the ticks set on the last one are
            # its own to fire or drop.
            self._loop, self._due = loop, {}
        due = timeout if timeout == timeout else 0.0
        # The tick's size: TICK times the power of two that keeps the timeout within SPAN
        # ticks of it (frexp: the timeout's binary exponent, without a logarithm).
        doublings = max(0, math.frexp(due / (self.tick * SPAN))[1]) if due > 0 else 0
        size = self.tick * (1 << doublings)
        key = (doublings, math.ceil((loop.time() + due) / size))
        entries = self._due.get(key)
        if entries is None:
            entries = self._due[key] = {}
            loop.call_at(key[1] * size, self._expire, key)
        entries[entry] = timeout
        return entries

    @staticmethod
    def remove(ticket: dict[Expiring, float], entry: Expiring) -> None:
        """``entry`` is not due any more (it ended); nothing if it already expired. (Its tick
        stays, emptier, until it comes: the next collective is likely due at the same one.)"""
        ticket.pop(entry, None)

    def _expire(self, key: tuple[int, int]) -> None:
        for entry, timeout in list(self._due.pop(key, {}).items()):
            try:
                entry.expired(timeout)
            except Exception:
                # A bug must cost its own collective, never the timeouts of the others due at
                # the same tick.
                log.exception("a collective's timeout failed")


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


__all__ = ["RELOOK", "SPAN", "TICK", "Changes", "DeadlineTimer", "Deadlines", "Expiring", "Timed"]

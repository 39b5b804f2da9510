"""When pending collectives time out: one timer per tick of deadlines, not one per collective.

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
"""

from __future__ import annotations

import asyncio
import logging
import math
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


__all__ = ["SPAN", "TICK", "Deadlines", "Expiring"]

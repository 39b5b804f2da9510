"""When pending collectives time out: one timer per tick of deadlines, not one per collective.

A timer per collective (asyncio's ``call_later``: a ``TimerHandle`` pushed on the loop's heap,
ordered by a Python ``__lt__``, then cancelled and swept out again) cost a tiny collective's hub
about 4 us of its ~60 us of Python (issue 36), for a timeout that almost never fires. Here a
deadline is rounded up to the next :data:`TICK`; the collectives due at one tick share one
timer, and a collective that ends leaves its tick at once (a dict entry out, so nothing of it
stays alive until its deadline). A timeout fires at most one tick late.
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

#: Seconds between the deadlines timers are set for: how late a timeout may fire.
TICK = 0.05


class Expiring(Protocol):
    """What a :class:`Deadlines` entry is: told when its deadline passed (with the timeout it
    was added with)."""

    def expired(self, timeout: float) -> None: ...


class Deadlines:
    """Entries due at a deadline each, by tick; :meth:`add` returns the ticket :meth:`remove`
    takes back."""

    def __init__(self, tick: float = TICK) -> None:
        self.tick = tick
        self._due: dict[int, dict[Expiring, float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Entries waiting for their deadline."""
        return sum(len(entries) for entries in self._due.values())

    def add(self, entry: Expiring, timeout: float) -> dict[Expiring, float]:
        """Call ``entry.expired(timeout)`` once ``timeout`` seconds passed (at most a tick
        more), unless it is removed before; returns its ticket. Call it on the loop."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Another loop (a test's, a restarted hub's): the ticks set on the last one are
            # its own to fire or drop.
            self._loop, self._due = loop, {}
        tick = math.ceil((loop.time() + timeout) / self.tick)
        entries = self._due.get(tick)
        if entries is None:
            entries = self._due[tick] = {}
            loop.call_at(tick * self.tick, self._expire, tick)
        entries[entry] = timeout
        return entries

    @staticmethod
    def remove(ticket: dict[Expiring, float], entry: Expiring) -> None:
        """``entry`` is not due any more (it ended); nothing if it already expired."""
        ticket.pop(entry, None)

    def _expire(self, tick: int) -> None:
        for entry, timeout in list(self._due.pop(tick, {}).items()):
            entry.expired(timeout)


__all__ = ["TICK", "Deadlines", "Expiring"]

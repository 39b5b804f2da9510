"""The hub's collective timeouts by tick (coordinator/collective/deadlines.py), on a real loop."""

from __future__ import annotations

import asyncio

import pytest

from gradstar.coordinator.collective.deadlines import Deadlines

BOUND = 5.0  # no test waits longer than this for a deadline


class Entry:
    def __init__(self) -> None:
        self.fired: list[tuple[float, float]] = []  # (timeout, loop time when told)

    def expired(self, timeout: float) -> None:
        self.fired.append((timeout, asyncio.get_running_loop().time()))


async def _until(condition, bound: float = BOUND) -> None:
    async with asyncio.timeout(bound):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_an_entry_expires_after_its_timeout_and_at_most_a_tick_later():
    deadlines = Deadlines(tick=0.05)
    entries = [Entry() for _ in range(3)]
    start = asyncio.get_running_loop().time()
    for entry, timeout in zip(entries, (0.1, 0.1, 0.2), strict=True):
        deadlines.add(entry, timeout)

    await _until(lambda: all(e.fired for e in entries))

    for entry, timeout in zip(entries, (0.1, 0.1, 0.2), strict=True):
        assert [t for t, _ in entry.fired] == [timeout]  # told once, with its own timeout
        assert start + timeout <= entry.fired[0][1]  # never early (late is the loop's to say)
    assert len(deadlines) == 0


@pytest.mark.asyncio
async def test_a_removed_entry_never_expires_and_is_not_kept():
    deadlines = Deadlines(tick=0.05)
    gone, stays = Entry(), Entry()
    ticket = deadlines.add(gone, 0.05)
    deadlines.add(stays, 0.05)
    deadlines.remove(ticket, gone)
    assert len(deadlines) == 1  # the ended entry is not held until its deadline

    await _until(lambda: bool(stays.fired))
    await asyncio.sleep(0.1)

    assert gone.fired == [] and len(stays.fired) == 1
    deadlines.remove(ticket, gone)  # removing again (or after it expired) is harmless


def test_deadlines_set_on_a_closed_loop_do_not_hold_a_new_loops_entries():
    deadlines = Deadlines(tick=0.05)
    first, second = Entry(), Entry()

    async def add_and_leave():
        deadlines.add(first, 0.05)

    asyncio.run(add_and_leave())  # that loop closes before the tick fires

    async def add_and_wait():
        deadlines.add(second, 0.05)
        await _until(lambda: bool(second.fired))

    asyncio.run(add_and_wait())
    assert first.fired == [] and len(second.fired) == 1

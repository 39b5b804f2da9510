"""The hub's collective timeouts by tick (coordinator/collective/deadlines.py), on a real loop."""

from __future__ import annotations

import asyncio
import math

import pytest

from gradstar.coordinator.collective.deadlines import SPAN, Deadlines

BOUND = 5.0  # no test waits longer than this for a deadline


class Entry:
    def __init__(self) -> None:
        self.fired: list[tuple[float, float]] = []  # (timeout, loop time when told)
        self.told = asyncio.Event()

    def expired(self, timeout: float) -> None:
        self.fired.append((timeout, asyncio.get_running_loop().time()))
        self.told.set()


async def _told(*entries: Entry) -> None:
    async with asyncio.timeout(BOUND):
        for entry in entries:
            await entry.told.wait()


@pytest.mark.asyncio
async def test_an_entry_expires_after_its_timeout_and_at_most_a_tick_later():
    deadlines = Deadlines(tick=0.05)
    entries = [Entry() for _ in range(3)]
    start = asyncio.get_running_loop().time()
    for entry, timeout in zip(entries, (0.1, 0.1, 0.2), strict=True):
        deadlines.add(entry, timeout)

    await _told(*entries)

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

    await _told(stays)
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
        await _told(second)

    asyncio.run(add_and_wait())
    assert first.fired == [] and len(second.fired) == 1


@pytest.mark.asyncio
async def test_an_infinite_timeout_is_never_due_and_a_nan_one_at_once():
    deadlines = Deadlines(tick=0.05)
    never, nan, negative = Entry(), Entry(), Entry()
    ticket = deadlines.add(never, math.inf)
    deadlines.add(nan, math.nan)
    deadlines.add(negative, -1.0)

    await _told(nan, negative)
    await asyncio.sleep(0.1)

    assert never.fired == [] and len(deadlines) == 0
    assert math.isnan(nan.fired[0][0]) and negative.fired[0][0] == -1.0
    deadlines.remove(ticket, never)


@pytest.mark.asyncio
async def test_an_entry_that_fails_costs_no_other_entry_its_timeout(caplog):
    class Broken(Entry):
        def expired(self, timeout: float) -> None:
            raise RuntimeError("a bug in one collective's failure")

    deadlines = Deadlines(tick=0.05)
    entries = [Entry(), Broken(), Entry()]
    for entry in entries:
        deadlines.add(entry, 0.05)

    await _told(entries[0], entries[2])
    assert "a collective's timeout failed" in caplog.text


@pytest.mark.asyncio
async def test_a_long_timeout_shares_coarser_ticks():
    tick = 0.001
    deadlines = Deadlines(tick=tick)
    loop = asyncio.get_running_loop()
    timeout = tick * SPAN * 3  # three spans: its ticks are four ticks long
    entries, added = [], []
    for _ in range(40):
        entries.append(Entry())
        added.append(loop.time())
        deadlines.add(entries[-1], timeout)
        await asyncio.sleep(tick)
    # However long the sleeps took, the adds fall on ticks four ticks long: over the window
    # they span, at most one per four ticks (and the first and the last).
    window = added[-1] - added[0]
    assert deadlines.ticks <= window / (4 * tick) + 2
    await _told(*entries)
    assert all(e.fired[0][1] >= t + timeout for e, t in zip(entries, added, strict=True))

"""The hub's table timing (gradstar.coordinator.collective.deadlines: DeadlineTimer, Changes),
on a real event loop without sockets: a table's due work runs at its earliest deadline, a timer
is kept while that deadline is unchanged, a deadline due but short is looked at again, and
waiting calls wake on a change or at their bound."""

from __future__ import annotations

import asyncio

from gradstar.coordinator.collective import deadlines as timers
from gradstar.coordinator.collective.deadlines import Changes, DeadlineTimer


class Table:
    """Deadlines on the loop's clock; ``short``: a due deadline that cannot close yet."""

    def __init__(self) -> None:
        self.deadlines: list[float] = []
        self.closed: list[float] = []
        self.runs = 0
        self.short = False

    def clock(self) -> float:
        return asyncio.get_running_loop().time()

    def next_deadline(self) -> float | None:
        return min(self.deadlines, default=None)

    def close_due(self) -> None:
        self.runs += 1
        if self.short:
            return
        now = self.clock()
        self.closed += [d for d in self.deadlines if d <= now]
        self.deadlines = [d for d in self.deadlines if d > now]


async def test_due_work_runs_at_each_earliest_deadline_in_turn():
    table = Table()
    timer = DeadlineTimer(table, grace=0.001)
    now = table.clock()
    table.deadlines = [now + 0.05, now + 0.1]
    timer.arm()
    timer.arm()  # unchanged: the same timer, not a second one
    await asyncio.sleep(0.2)
    assert table.closed == [now + 0.05, now + 0.1] and table.runs == 2
    assert table.next_deadline() is None


async def test_a_deadline_due_but_short_is_looked_at_again_not_spun_on(monkeypatch):
    monkeypatch.setattr(timers, "RELOOK", 0.05)
    table = Table()
    timer = DeadlineTimer(table, grace=0.001)
    table.short = True
    table.deadlines = [table.clock() + 0.01]
    timer.arm()
    await asyncio.sleep(0.13)
    assert 2 <= table.runs <= 4  # at the deadline, then every RELOOK: not a busy loop
    table.short = False
    await asyncio.sleep(0.08)
    assert table.closed and table.next_deadline() is None
    timer.cancel()


async def test_waiting_calls_wake_at_a_change_or_at_their_bound():
    changes, state = Changes(), {"ready": False}
    loop = asyncio.get_running_loop()
    began = loop.time()
    waiting = asyncio.create_task(changes.wait(lambda: state["ready"], 5.0))
    await asyncio.sleep(0.02)
    changes.wake()  # a change that is not the one awaited: it waits on
    await asyncio.sleep(0.02)
    assert not waiting.done()
    state["ready"] = True
    changes.wake("job", "model", 0)  # a table's callback's arguments are ignored
    await asyncio.wait_for(waiting, 1.0)
    assert loop.time() - began < 1.0
    began = loop.time()
    await changes.wait(lambda: False, 0.05)  # nothing changes: back at the bound
    assert 0.05 <= loop.time() - began < 1.0
    assert not changes._waiters  # nothing left behind by a wait that timed out

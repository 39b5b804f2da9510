"""The traceml#252 case: a DDP job where one rank's backward alone is slow is named by the hub
(its buckets arrive late at every all_reduce), though a ring would make every rank wait alike.
Three real ranks of ``backward_straggler_script.py`` on a coordinator started here."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.integration.test_stragglers import as_rows, check_slow_first

from .conftest import run_world

SCRIPT = Path(__file__).with_name("backward_straggler_script.py")
WORLD, SLOW, DELAY, STEPS = 3, 1, 0.2, 8


def test_a_rank_whose_backward_alone_is_slow_is_named():
    reports = asyncio.run(run_world(SCRIPT, WORLD, "backward", str(SLOW), str(DELAY),
                                    str(STEPS), timeout=120))
    views = [as_rows(lines[-1]["ranks"]) for lines in reports]
    # The coordinator measured every collective before the last one returned, and the ranks
    # read it after: they all read the same figures.
    ranks = views[0]
    assert all(view == ranks for view in views), views
    # SLOW first, its buckets a backward's delay late, the others well below it, flags as the
    # flagging rule says (a quiet run flags SLOW alone): see check_slow_first.
    check_slow_first(ranks, [SLOW], WORLD, 0.7 * DELAY)
    # Each collective (DDP's first broadcast, then a bucket's all_reduce per step) counted once
    # for every rank.
    counts = {r["collectives"] for r in ranks}
    assert len(counts) == 1 and min(counts) >= STEPS, ranks

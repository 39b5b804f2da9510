"""The traceml#252 case: a DDP job where one rank's backward alone is slow is named by the hub
(its buckets arrive late at every all_reduce), though a ring would make every rank wait alike.
Three real ranks of ``backward_straggler_script.py`` on a coordinator started here."""

from __future__ import annotations

import asyncio
from pathlib import Path

from .conftest import run_world

SCRIPT = Path(__file__).with_name("backward_straggler_script.py")
WORLD, SLOW, DELAY, STEPS = 3, 1, 0.2, 8


def test_a_rank_whose_backward_alone_is_slow_is_named():
    reports = asyncio.run(run_world(SCRIPT, WORLD, "backward", str(SLOW), str(DELAY),
                                    str(STEPS), timeout=120))
    for lines in reports:
        stats = lines[-1]
        ranks = stats["ranks"]
        assert ranks[0]["rank"] == SLOW, ranks  # slowest first
        assert [r["rank"] for r in ranks if r["flagged"]] == [SLOW]
        # Its buckets come a backward's delay late (a loose band: scheduling noise).
        assert ranks[0]["median_lag_seconds"] >= 0.7 * DELAY
        assert all(r["median_lag_seconds"] < DELAY / 2 for r in ranks[1:])

"""A rank of the stragglers' cluster test (:mod:`tests.cluster.test_stragglers_hosts`), started
by ``gradstar worker`` on a host of the emulated cluster:
``python -m tests.cluster.straggler_rank OUT_DIR ROUNDS``. The ranks of a host whose
environment sets ``STRAGGLER_DELAY`` sleep that long before each of ROUNDS all_reduces (a slow
host). Then each writes ``OUT_DIR/stats-RANK.json``: the job's straggler summary as it reads it
(``pg.straggler_stats()``, once every collective is in it) and its host."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

import gradstar
from tests.cluster.report import write_report


def main() -> int:
    out, rounds = Path(sys.argv[1]), int(sys.argv[2])
    delay = float(os.environ.get("STRAGGLER_DELAY", "0"))
    with gradstar.init_process_group(timeout=120) as pg:
        x = np.ones(1 << 18, np.float32)
        for _ in range(rounds):
            time.sleep(delay)
            pg.all_reduce(x)
        deadline = time.monotonic() + 20
        while True:
            stats = pg.straggler_stats()
            complete = len(stats.ranks) == pg.world_size and all(
                r.collectives >= rounds for r in stats.ranks)
            if complete or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        report = {"rank": pg.rank, "host": os.environ.get("CLUSTER_HOST", ""),
                  "stats": stats.as_dict()}
        write_report(out, "stats", pg.rank, report)
        pg.barrier()  # nobody leaves before every rank has read the summary
    return 0


if __name__ == "__main__":
    sys.exit(main())

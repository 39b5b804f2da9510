"""A rank of the outbound-only hosts test, started by ``gradstar worker`` on a host of the
emulated cluster (``python -m tests.cluster.outbound_rank OUT_DIR``), one rank a host; host 0
(rank 0, the coordinator's) takes inbound connections, the others only dial out.

It checks an all_reduce across the hosts (int64, bit-identical), then point to point: the rank
on an outbound-only host sends to rank 0 (a reachable receiver: works), and rank 0's send to it
fails at once with the named error. Reports ``OUT_DIR/outbound-RANK.json``: the all_reduce's
agreement, the stripes the generation used, what rank 0 received, and the send's error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import gradstar
from gradstar.errors import ConfigurationError
from tests.cluster.report import write_report


def main() -> None:
    out = Path(sys.argv[1])
    with gradstar.init_process_group(timeout=60) as pg:
        world, rank = pg.world_size, pg.rank
        mine = np.arange(1000, dtype=np.int64) * (rank + 1)
        total = pg.all_reduce(mine)
        report = {"rank": rank, "shards": list(pg.shards),
                  "exact": bool(np.array_equal(total, np.arange(1000) * sum(range(1, world + 1))))}
        if rank == 1:
            pg.send(np.full(8, 7.0, np.float32), dst=0)
        if rank == 0:
            report["received"] = pg.recv(src=1).tolist()
            started = time.monotonic()
            try:
                pg.send(np.zeros(4, np.float32), dst=1)
            except ConfigurationError as error:
                report["send_error"] = str(error)
            report["send_seconds"] = time.monotonic() - started
        pg.barrier()
        write_report(out, "outbound", rank, report)


if __name__ == "__main__":
    main()

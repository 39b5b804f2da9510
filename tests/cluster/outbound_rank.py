"""A rank of the outbound-only hosts test, started by ``gradstar worker`` on a host of the
emulated cluster (``python -m tests.cluster.outbound_rank OUT_DIR``), one rank a host; host 0
(rank 0, the coordinator's) takes inbound connections, the others only dial out.

It checks an all_reduce across the hosts (int64, bit-identical), then point to point: the rank
on an outbound-only host sends to rank 0 (a reachable receiver: a direct stream), and rank 0 and
rank 2 send to it (through the coordinator's relay). Reports ``OUT_DIR/outbound-RANK.json``:
the all_reduce's agreement, the stripes the generation used, and what each rank received.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import gradstar
from tests.cluster.report import write_report


def main() -> None:
    out = Path(sys.argv[1])
    with gradstar.init_process_group(timeout=60) as pg:
        world, rank = pg.world_size, pg.rank
        mine = np.arange(1000, dtype=np.int64) * (rank + 1)
        total = pg.all_reduce(mine)
        report = {"rank": rank, "shards": list(pg.shards),
                  "exact": bool(np.array_equal(total, np.arange(1000) * sum(range(1, world + 1))))}
        # rank 1 (outbound-only) -> rank 0 (reachable): a direct stream; rank 0 -> rank 1 and
        # rank 2 -> rank 1 (both outbound-only): through the coordinator's relay.
        if rank == 1:
            pg.send(np.full(8, 7.0, np.float32), dst=0)
            report["from_0"] = pg.recv(src=0).tolist()
            report["from_2"] = pg.recv(src=2).tolist()
        if rank == 0:
            report["received"] = pg.recv(src=1).tolist()
            pg.send(np.arange(300_000, dtype=np.float32) % 97, dst=1)  # many chunks
        if rank == 2:
            pg.send(np.full(5, 2.0, np.float32), dst=1)
        pg.barrier()
        report["routes"] = {str(dst): how for dst, how in pg.peer_routes.items()}
        write_report(out, "outbound", rank, report)


if __name__ == "__main__":
    main()

"""A rank of the sync modes' cluster test (:mod:`tests.cluster.test_sync_modes_hosts`), started
by ``gradstar worker`` on a host of the emulated cluster (node-local shards on, the default):
``python -m tests.cluster.sync_modes_rank OUT_DIR STEPS [WIRE]``.

Its job mixes both paths: a ``pg.all_reduce`` across the hosts (through the node shards) before
and after training, and the MLP of :mod:`tests.parallel.sync_modes_script` trained for STEPS
iterations with ``gradstar.DDP(sync_mode=Quorum(min_ranks=world - per_host, timeout=0.02))``
(every host but one closes a step), in WIRE's format if given. The ranks of a host whose
environment sets ``STRAGGLER_DELAY`` sleep that long before each backward. Each rank writes
``OUT_DIR/result-RANK.json``: its host, the all_reduce sums, its parameters after
``ddp.synchronize()``, the steps it applied (who made each) and its contributions."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

import gradstar
from tests.cluster.report import write_report
from tests.parallel import sync_modes_script as script


def main() -> int:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    wire = sys.argv[3] if len(sys.argv) > 3 else None
    delay = float(os.environ.get("STRAGGLER_DELAY", "0"))
    per_host = int(os.environ["GRADSTAR_LOCAL_WORLD_SIZE"])
    with gradstar.init_process_group(timeout=120) as pg:
        rank, world = pg.rank, pg.world_size
        before = pg.all_reduce(np.full(1 << 16, rank + 1.0, np.float32))
        model = script.make_mlp()
        opt = script.make_optimizer(model)
        ddp = gradstar.DDP(model, pg, optimizer=opt, wire=wire,
                           sync_mode=gradstar.Quorum(min_ranks=world - per_host, timeout=0.02))
        contributions = []
        for i in range(steps):
            opt.zero_grad()
            time.sleep(delay)
            script.loss_of(ddp, rank, i).backward()
            c = ddp.sync_stats().recent_contributions[-1]
            contributions.append({"base": c.base, "step": c.step, "staleness": c.staleness,
                                  "iteration": i})
            opt.step()
        ddp.synchronize()
        after = pg.all_reduce(np.full(1 << 16, rank + 1.0, np.float32))
        stats = ddp.sync_stats()
        report = {
            "rank": rank, "host": os.environ.get("CLUSTER_HOST", ""),
            "sums": [float(before[0]), float(before[-1]), float(after[0]), float(after[-1])],
            "params": script.params_of(model), "contributions": contributions,
            "steps": [{"step": s.step, "ranks": list(s.ranks), "weights": list(s.weights),
                       "staleness": list(s.staleness), "hyper": list(s.hyper),
                       "factors": list(s.factors)} for s in stats.recent_steps],
            "dropped": stats.dropped, "replacement": pg.replacement,
        }
        write_report(out, "result", rank, report)
        pg.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())

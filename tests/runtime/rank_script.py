"""A rank for launcher tests: ``python rank_script.py SCENARIO``; the process group comes from
the GRADSTAR_* env vars the launcher sets. Prints ``pid N`` first, so tests can check that the
launcher stopped it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import gradstar


def main() -> None:
    scenario = sys.argv[1]
    print(f"pid {os.getpid()}", flush=True)
    with gradstar.init_process_group(timeout=30, join_timeout=30) as pg:
        pg.barrier()
        if scenario == "sum":
            total = pg.all_reduce(np.array([pg.rank + 1.0]), op="sum")
            if pg.rank == 0:
                print("x" * (3 << 19), flush=True)  # 1.5 MB in one line: longer than a read
                print("after the long line", flush=True)
            print(json.dumps({"rank": pg.rank, "world": pg.world_size, "sum": float(total[0]),
                              "local_rank": os.environ["GRADSTAR_LOCAL_RANK"],
                              "job": os.environ["GRADSTAR_JOB"]}), flush=True)
            return
        if pg.rank == 1:
            print("rank 1 fails now", file=sys.stderr, flush=True)
            if scenario == "crash":
                sys.exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the launcher must stop this rank long before


if __name__ == "__main__":
    main()

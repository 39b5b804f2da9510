"""A rank process for integration tests: ``python rank_script.py SCENARIO [ARGS]``.

Settings come from GRADSTAR_* env vars, as a launcher would set them. Prints one JSON line with
what it observed and exits 0, or prints the error and exits 3.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import gradstar
from gradstar.errors import GradstarError


def exact_inputs(rank: int, n: int) -> np.ndarray:
    # Integer-valued floats: sums are exact whatever order the hub folds ranks in.
    return (np.arange(n, dtype=np.float64) % 97 + rank).astype(np.float32)


def collectives(pg) -> dict:
    """Every collective once, checked exactly against what the other ranks must have sent."""
    r, w = pg.rank, pg.world_size
    n = 300_000  # > one 1 MiB chunk of float32
    checks = {}
    ref = sum(exact_inputs(k, n) for k in range(w))
    checks["all_reduce_sum"] = bool(np.array_equal(pg.all_reduce(exact_inputs(r, n)), ref))
    checks["all_reduce_max"] = bool(np.array_equal(
        pg.all_reduce(exact_inputs(r, n), op="max"), exact_inputs(w - 1, n)))
    checks["all_reduce_mean"] = bool(np.array_equal(
        pg.all_reduce(np.full(1000, float(r), np.float64), op="mean"),
        np.full(1000, (w - 1) / 2)))
    checks["all_reduce_prod_int"] = bool(np.array_equal(
        pg.all_reduce(np.full(10, r + 1, np.int64), op="prod"),
        np.full(10, np.prod(np.arange(1, w + 1)))))
    src = w - 1
    out = pg.broadcast(exact_inputs(r, n), src=src)
    checks["broadcast"] = bool(np.array_equal(out, exact_inputs(src, n)))
    gathered = pg.all_gather(exact_inputs(r, 5000))
    checks["all_gather"] = all(np.array_equal(gathered[k], exact_inputs(k, 5000)) for k in range(w))
    full = np.stack([exact_inputs(k, 4 * w * 1000).reshape(4 * w, 1000) for k in range(w)]).sum(0)
    shard = pg.reduce_scatter(exact_inputs(r, 4 * w * 1000).reshape(4 * w, 1000))
    checks["reduce_scatter"] = bool(np.array_equal(shard, full[4 * r:4 * (r + 1)]))
    pg.barrier()
    checks["barrier"] = True
    work = pg.all_reduce(np.array([r], np.int32), async_op=True)
    checks["async_op"] = int(work.wait(timeout=30)[0]) == sum(range(w))
    return {"rank": r, "checks": checks}


def allreduce_until_error(pg) -> dict:
    """All-reduce 8 MB repeatedly until a collective fails; report the error and its latency."""
    x = np.ones(2 << 20, np.float32)
    rounds = 0
    while True:
        started = time.monotonic()
        try:
            pg.all_reduce(x)
        except GradstarError as error:
            return {"rank": pg.rank, "rounds": rounds, "error": type(error).__name__,
                    "message": str(error), "lost_rank": getattr(error, "rank", None),
                    "seconds_in_failed_call": time.monotonic() - started,
                    "failed_at": time.time()}
        rounds += 1
        print(json.dumps({"progress": rounds}), flush=True)


def big_allreduce(pg) -> dict:
    """One all_reduce of ``sys.argv[2]`` MiB of float32, checked exactly."""
    mib = int(sys.argv[2])
    x = np.full(mib * (1 << 20) // 4, float(pg.rank + 1), np.float32)
    started = time.monotonic()
    out = pg.all_reduce(x)
    seconds = time.monotonic() - started
    want = float(sum(range(1, pg.world_size + 1)))
    return {"rank": pg.rank, "seconds": seconds,
            "exact": bool(out[0] == want and out[-1] == want and np.all(out == want))}


SCENARIOS = {"collectives": collectives, "allreduce_until_error": allreduce_until_error,
             "big_allreduce": big_allreduce}


def main() -> int:
    scenario = SCENARIOS[sys.argv[1]]
    try:
        with gradstar.init_process_group(timeout=60, join_timeout=60) as pg:
            result = scenario(pg)
    except GradstarError as error:
        print(json.dumps({"fatal": type(error).__name__, "message": str(error)}), flush=True)
        return 3
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

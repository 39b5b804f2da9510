"""A rank of the cluster tests, started by ``gradstar worker`` on a host of the emulated cluster:
``python -m tests.cluster.rank OUT_DIR NBYTES ITERS``. ``CLUSTER_HOST`` names its host and
``CLUSTER_REJOIN_WORLD`` the world size to form again with after the failure phase (0: stop).

Phases, each reported as ``OUT_DIR/PHASE-RANK.json`` (the coordinator assigns ranks):

1. ``exact``: all_reduce (int64 sum and max, float32 sum and mean, several at once),
   all_gather, broadcast and reduce_scatter of
   random inputs every rank can recompute, against numpy: int64 bit-identical, float32 within
   float32 rounding of a float64 sum;
2. ``bytes``: ITERS all_reduces of NBYTES of float32, with this host's ``eth0`` counters read
   before and after, each reading between two barriers (the host's shard's traffic included);
3. ``failure``: all_reduces until one fails (the test takes a host's link down): the error's
   class, message and the wall-clock time it was raised at;
4. ``again``: join ``JOB/again`` with ``CLUSTER_REJOIN_WORLD`` ranks and repeat phase 1.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

import gradstar
from gradstar.errors import GradstarError
from tests.cluster.report import write_report

N = 12_345  # not a multiple of any chunk: the last chunk is short
#: Large enough that its chunks across hosts are over 512 KiB (3 hosts: 768 KiB; 2 hosts: the
#: configured 2 MiB), and odd, so the last chunk is short.
LARGE = (36 << 20) // 8 + 1


def inputs(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7000 + rank)
    return (rng.standard_normal(N).astype(np.float32),
            rng.integers(-(1 << 40), 1 << 40, size=N, dtype=np.int64))


def exact(pg) -> dict:
    world, rank = pg.world_size, pg.rank
    floats, ints = zip(*(inputs(r) for r in range(world)), strict=True)
    got = pg.all_reduce(ints[rank])
    assert np.array_equal(got, np.sum(ints, axis=0)), "int64 all_reduce differs"
    got = pg.all_reduce(floats[rank])
    want = np.sum(np.asarray(floats, np.float64), axis=0)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * world), "float32 all_reduce differs"
    got = pg.all_reduce(floats[rank], op="mean")
    assert np.allclose(got, want / world, rtol=1e-5, atol=1e-5), "float32 mean differs"
    assert np.array_equal(pg.all_reduce(ints[rank], op="max"), np.max(ints, axis=0))
    big = np.arange(LARGE, dtype=np.int64)
    got = pg.all_reduce(big * (rank + 1) + rank)
    big *= world * (world + 1) // 2
    big += world * (world - 1) // 2
    assert np.array_equal(got, big), "a large int64 all_reduce differs"
    del big, got
    # Several in flight at once, of different sizes: each must pair with the same call on
    # every rank (the two-level all_reduce issues its later stages in call order).
    works = [pg.all_reduce(ints[rank][:n], async_op=True) for n in (N, 7, N // 2, 1, N)]
    for work, n in zip(works, (N, 7, N // 2, 1, N), strict=True):
        assert np.array_equal(work.wait(), np.sum(ints, axis=0)[:n]), "an async all_reduce"
    for a, b in zip(pg.all_gather(ints[rank]), ints, strict=True):
        assert np.array_equal(a, b), "all_gather differs"
    assert np.array_equal(pg.broadcast(ints[rank], src=world - 1), ints[world - 1])
    rows = np.stack([ints[rank]] * world)  # world rows: row r goes to rank r
    assert np.array_equal(pg.reduce_scatter(rows), np.sum(ints, axis=0)[None, :])
    return {"rank": rank, "world": world, "shards": list(pg.shards)}


def link_bytes() -> tuple[int, int]:
    stats = Path("/sys/class/net/eth0/statistics")
    return (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))


def measure(pg, nbytes: int, iters: int) -> dict:
    x = np.ones(nbytes // 4, np.float32)
    # A barrier on each side of each reading: no rank's traffic of the phase before or after
    # reaches this host (its shard) between the barriers and the reading.
    pg.barrier()
    rx0, tx0 = link_bytes()
    pg.barrier()
    for _ in range(iters):
        pg.all_reduce(x)
    pg.barrier()
    rx1, tx1 = link_bytes()
    pg.barrier()
    return {"rank": pg.rank, "rx": rx1 - rx0, "tx": tx1 - tx0, "nbytes": nbytes, "iters": iters}


def until_error(pg, nbytes: int) -> dict:
    x = np.ones(nbytes // 4, np.float32)
    try:
        while True:
            pg.all_reduce(x)
    except GradstarError as error:
        return {"rank": pg.rank, "error": type(error).__name__, "message": str(error),
                "at": time.time()}


def main() -> int:
    out, nbytes, iters = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    host = os.environ["CLUSTER_HOST"]

    def report(phase: str, rank: int, data: dict) -> None:
        write_report(out, phase, rank, {**data, "host": host})

    pg = gradstar.init_process_group(timeout=60, join_timeout=60)
    try:
        rank = pg.rank
        report("exact", rank, exact(pg))
        report("bytes", rank, measure(pg, nbytes, iters))
        report("failure", rank, until_error(pg, nbytes))
    finally:
        pg.close()
    world = int(os.environ.get("CLUSTER_REJOIN_WORLD", "0"))
    if world:
        with gradstar.init_process_group(job=os.environ["GRADSTAR_JOB"] + "/again",
                                         world_size=world, rank=None, timeout=60,
                                         join_timeout=60) as again:
            report("again", again.rank, exact(again))
    return 0


if __name__ == "__main__":
    sys.exit(main())

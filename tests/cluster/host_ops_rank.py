"""A rank of the two-level collectives' cluster test (:mod:`tests.cluster.test_host_collectives`),
started by ``gradstar worker`` on a host of the emulated cluster:
``python -m tests.cluster.host_ops_rank OUT_DIR NBYTES ITERS COUNTS``, COUNTS the ranks of each
host (``2,2``; ``2,1``: hosts of different sizes).

It joins three groups of the worker's job, each with ranks it picks so that the layout is
known: ``JOB`` (two-level) and ``JOB/flat`` (``hierarchical=False``: every rank striped over
the node shards) with the hosts' ranks interleaved (local rank 0 of every host first, in host
order, then local rank 1...: host 0 runs 0, 2, ... at 2x2), and ``JOB/contiguous`` (two-level)
with each host's ranks side by side. Then, reported as ``OUT_DIR/PHASE-RANK.json``:

1. ``exact``: broadcast (from the last rank: at 2x2 a rank that leads no host), all_gather and
   reduce_scatter (sum, and mean for floats) of int32 and float64 inputs every rank can
   recompute, in all three groups: each two-level result against the flat group's (integers
   and copies bit-identical, float sums within float64 rounding of a reordered sum) and every
   result against numpy; failures are reported as messages, for the test to quote;
2. ``bytes``: per op, ITERS calls of NBYTES per rank in the two-level group, then in the flat
   group, with this host's ``eth0`` counters read before and after each, each reading between
   two barriers (the host's shard's traffic included).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

import gradstar
from tests.cluster.report import write_report

ROWS = 4 * 3 * 5  # divisible by any world size of the test


def inputs(rank: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(9000 + rank)
    if dtype == "int32":
        return rng.integers(-(1 << 28), 1 << 28, size=(ROWS, 7), dtype=np.int32)
    return rng.standard_normal((ROWS, 7))


def call(g, name: str, x: np.ndarray) -> np.ndarray:
    """Collective ``name`` of the check on group ``g`` with this rank's ``x``."""
    world = g.world_size
    if name == "broadcast":
        return g.broadcast(x, src=world - 1)
    if name == "all_gather":
        return np.stack(g.all_gather(x))
    return g.reduce_scatter(x, op="mean" if name == "reduce_scatter mean" else "sum")


def check(pg, flat, problems: list[str], where: str) -> None:
    """Every op in ``pg`` against numpy and, with ``flat`` (same ranks), the flat group."""
    world, rank = pg.world_size, pg.rank
    mine = slice(rank * (ROWS // world), (rank + 1) * (ROWS // world))
    for dtype in ("int32", "float64"):
        xs = [inputs(r, dtype) for r in range(world)]
        floats = dtype == "float64"
        total = np.sum(xs, axis=0, dtype=dtype)
        cases = [("broadcast", xs[-1], True), ("all_gather", np.stack(xs), True),
                 ("reduce_scatter", total[mine], not floats)]
        if floats:
            cases.append(("reduce_scatter mean", total[mine] / world, False))
        for name, want, exact in cases:
            got = call(pg, name, xs[rank])
            reference = call(flat, name, xs[rank]) if flat is not None else None
            what = f"{where} {name} {dtype} on rank {rank}"
            if got.dtype != want.dtype or got.shape != want.shape:
                problems.append(f"{what}: {got.dtype}{got.shape}, not {want.dtype}{want.shape}")
            elif exact and not np.array_equal(got, want):
                problems.append(f"{what} differs from numpy")
            elif not exact and not np.allclose(got, want, rtol=1e-12, atol=1e-12):
                problems.append(f"{what} is off numpy by {np.abs(got - want).max()}")
            if reference is None:
                continue
            if exact and not np.array_equal(got, reference):
                problems.append(f"{what} differs from the flat path's")
            if not exact and not np.allclose(got, reference, rtol=1e-12, atol=1e-12):
                problems.append(f"{what} is off the flat path's by "
                                f"{np.abs(got - reference).max()}")


def link_bytes() -> tuple[int, int]:
    stats = Path("/sys/class/net/eth0/statistics")
    return (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))


def measure(pg, op: str, x: np.ndarray, iters: int) -> dict:
    # A barrier on each side of each reading: no rank's traffic of the phase before or after
    # reaches this host (its shard) between the barriers and the reading.
    pg.barrier()
    rx0, tx0 = link_bytes()
    pg.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call(pg, op, x)
    seconds = (time.perf_counter() - start) / iters  # printed, never asserted
    pg.barrier()
    rx1, tx1 = link_bytes()
    pg.barrier()
    return {"rx": rx1 - rx0, "tx": tx1 - tx0, "seconds": seconds}


def main() -> int:
    out, nbytes, iters = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    counts = [int(c) for c in sys.argv[4].split(",")]
    host = os.environ["CLUSTER_HOST"]
    number, local = int(host.removeprefix("host")), int(os.environ["GRADSTAR_LOCAL_RANK"])
    world, job = sum(counts), os.environ["GRADSTAR_JOB"]
    # (local rank, host) of each interleaved rank, in rank order
    places = sorted((lo, h) for h, c in enumerate(counts) for lo in range(c))
    interleaved = places.index((local, number))

    def report(phase: str, rank: int, data: dict) -> None:
        write_report(out, phase, rank, {**data, "host": host})

    options = {"timeout": 60, "join_timeout": 60}
    with gradstar.init_process_group(rank=interleaved, **options) as pg, \
            gradstar.init_process_group(job=f"{job}/flat", rank=interleaved, hierarchical=False,
                                        **options) as flat, \
            gradstar.init_process_group(job=f"{job}/contiguous",
                                        rank=sum(counts[:number]) + local, **options) as contiguous:
        problems: list[str] = []
        check(pg, flat, problems, "interleaved")
        check(contiguous, None, problems, "contiguous")
        report("exact", pg.rank, {"rank": pg.rank, "problems": problems,
                                  "shards": list(pg.shards)})

        x = np.ones(nbytes // 4, np.float32)
        rows = np.ones((world, nbytes // 4 // world), np.float32)
        ops = {"broadcast": x, "all_gather": x, "reduce_scatter": rows}
        measured = {op: {"two-level": measure(pg, op, arg, iters),
                         "flat": measure(flat, op, arg, iters)} for op, arg in ops.items()}
        report("bytes", pg.rank, {"rank": pg.rank, "ops": measured,
                                  "sizes": {op: arg.nbytes for op, arg in ops.items()},
                                  "iters": iters, "src_host": f"host{places[world - 1][1]}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

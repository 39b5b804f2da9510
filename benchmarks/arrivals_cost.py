"""What the hub's arrival lags cost per collective (issue 33), without sockets.

What is measured
    The work the collective engine adds per collective once every rank has arrived
    (``CollectiveMetrics.matched``: each rank's lag into its summary, the last rank's cost, the
    late ranks named in the END), for world sizes 2 to 1024, on ranks arriving 1 ms apart with
    the last one 0.2 s late (so the END names late ranks, the costlier case). Per world size:
    microseconds per collective (median of ``--repeats`` runs of ``--collectives`` each), and
    per rank. The arrival timestamps themselves are one ``time.monotonic()`` per rank, taken
    either way (the engine's Participant holds them). End to end, with and without the
    measurement in one run: ``benchmarks/allreduce.py --arrivals on off``.

How to reproduce
    .venv/bin/python benchmarks/arrivals_cost.py [--collectives 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from gradstar.coordinator.metrics import CollectiveMetrics


def per_collective(world: int, collectives: int) -> float:
    """Seconds of ``matched`` per collective of ``world`` ranks."""
    metrics = CollectiveMetrics()
    arrivals = [(r, 1e-3 * r) for r in range(world)]
    arrivals[-1] = (world - 1, 0.2)
    began = time.perf_counter()
    for _ in range(collectives):
        metrics.matched("bench", 0, arrivals)
    return (time.perf_counter() - began) / collectives


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collectives", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 64, 1024])
    args = parser.parse_args()
    print(f"{'ranks':>6} {'us/collective':>14} {'us/rank':>8}")
    for world in args.worlds:
        n = max(10, args.collectives * 8 // max(world, 8))
        t = statistics.median(per_collective(world, n) for _ in range(args.repeats))
        print(f"{world:>6} {t * 1e6:>14.1f} {t * 1e6 / world:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

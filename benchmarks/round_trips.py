"""Round trips per collective across far links: each op timed on the same hosts at 0 ms (through
delay lines) and at ``--rtt`` ms, in one run; (time at RTT - time at 0) / RTT is how many
round trips the op pays, the count docs/protocol.md writes down.

The cluster (:mod:`emulated_cluster`): ``--hosts`` hosts (default 4), one rank each, every link
``--rate`` each way, a delay line on every link; the coordinator (``--shards 0``: the hub) on
node0 beside rank 0, so the far ranks are one round trip from it. Each rank runs ``--iters``
timed calls of each op after a warm-up call, with a barrier before each call; the figure is
rank 0's median (rank 0 waits for the farthest rank, so its time is the collective's).

Columns: ms at 0 ms, ms at RTT, the difference in round trips, the line's CPU (the busiest
delay line's share of a core over the run).

How to reproduce (as root)::

    .venv/bin/python benchmarks/round_trips.py --rtt 100
    .venv/bin/python benchmarks/round_trips.py --rtt 50 --rate 1gbit --ops barrier all_reduce:4
    .venv/bin/python benchmarks/round_trips.py --rtt 100 --congestion-control bbr
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from emulated_cluster import CONGESTION_CONTROL, EmulatedCluster

REPO = Path(__file__).resolve().parents[1]
#: op:KiB pairs measured by default (KiB of float32 per rank; 0 for a barrier).
OPS = ["barrier", "all_reduce:4", "broadcast:4", "all_reduce:4096", "broadcast:4096"]

RANK = """
import json, statistics, sys, time
import numpy as np
import gradstar
rank, world, iters, ops = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
with gradstar.init_process_group(world_size=world, rank=rank) as pg:
    out = {}
    for spec in ops:
        name, _, kib = spec.partition(":")
        x = np.ones(int(kib or 0) * 256, dtype=np.float32)
        call = {"barrier": lambda: pg.barrier(), "all_reduce": lambda: pg.all_reduce(x),
                "broadcast": lambda: pg.broadcast(x, src=0)}[name]
        times = []
        for i in range(iters + 1):
            pg.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[spec] = statistics.median(times[1:])
    if rank == 0:
        print(json.dumps(out), flush=True)
"""


def measure(args: argparse.Namespace, rtt: float) -> tuple[dict[str, float], float]:
    """Rank 0's median seconds per op with every two hosts ``rtt`` ms apart, and the busiest
    delay line's CPU over the run (cores)."""
    names = [f"node{i}" for i in range(args.hosts)]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1",
           "GRADSTAR_TOKEN": "round-trips", "GRADSTAR_JOB": "rt"}
    with EmulatedCluster(names, rate=args.rate, rtt=rtt or None, force_delay_line=True,
                         congestion_control=args.congestion_control) as net:
        hub = net.popen("node0", [sys.executable, "-m", "gradstar", "coordinator", "--host",
                                  "0.0.0.0", "--port", "0", "--shards", "0", "--log-level",
                                  "WARNING"], env=env, cwd=REPO, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        line = ""
        while "gradstar coordinator listening on" not in line:
            line = hub.stdout.readline()
            if not line:
                raise SystemExit("the coordinator exited before it listened")
        port = re.search(r":(\d+)", line.split("listening on")[1])[1]
        env["GRADSTAR_COORDINATOR"] = f"{net.address('node0')}:{port}"
        cpu0, t0 = net.delay_line_cpu(), time.monotonic()
        ranks = [net.popen(host, [sys.executable, "-c", RANK, str(r), str(args.hosts),
                                  str(args.iters), *args.ops], env=env, cwd=REPO, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for r, host in enumerate(names)]
        outs = [p.communicate(timeout=args.timeout) for p in ranks]
        cpu1, spent = net.delay_line_cpu(), time.monotonic() - t0
        for r, (_, err) in enumerate(outs):
            if ranks[r].returncode != 0:
                raise SystemExit(f"rank {r} failed:\n{err[-2000:]}")
        line_cpu = max(cpu1[h] - cpu0[h] for h in cpu1) / spent
        return json.loads(outs[0][0]), line_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt", type=float, default=100.0, help="round trip, ms (default 100)")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--ops", nargs="+", default=OPS, metavar="OP[:KIB]")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--congestion-control", default=CONGESTION_CONTROL,
                        help="each host's TCP congestion control (default cubic, Linux's "
                             "default), e.g. bbr: a host setting that keeps a connection's "
                             "window across idle spells (docs/regions.md)")
    args = parser.parse_args()
    near, near_cpu = measure(args, 0.0)
    far, far_cpu = measure(args, args.rtt)
    print(f"{args.hosts} hosts x 1 rank, hub beside rank 0, {args.rate} links, TCP "
          f"{args.congestion_control}; load "
          f"{[round(v, 2) for v in os.getloadavg()]}")
    print(f"{'op':>18} | {'0 ms':>8} | {f'{args.rtt:g} ms':>8} | round trips | line CPU")
    for spec in args.ops:
        trips = (far[spec] - near[spec]) / (args.rtt / 1e3)
        print(f"{spec:>18} | {near[spec] * 1e3:8.1f} | {far[spec] * 1e3:8.1f} | "
              f"{trips:11.2f} | {near_cpu:.2f} / {far_cpu:.2f}")


if __name__ == "__main__":
    main()

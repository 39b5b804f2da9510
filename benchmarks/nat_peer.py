"""Peer streams between hosts behind NAT: punched through (NAT traversal, the default) against
relayed by the coordinator, on the emulated cluster, in one run.

What is measured
    3 hosts linked at ``--rate`` each way; host 0 runs the coordinator and rank 0, hosts 1 and
    2 take no inbound connections (nftables, as behind NAT) and run ranks 1 and 2. Rank 2
    sends ``--mb`` MiB of float32 to rank 1, ``--iters`` times after one untimed send, and rank
    1 sends it back (a Pipeline's activations and gradients between two stages behind NAT); per
    road the median time of one send there and back, the road each stream took
    (``pg.peer_routes``), the MB that crossed host 0's link per iteration (the veth counters:
    relayed bytes cross it twice each way) and the link-bound ideal (2 x the bytes over the
    rate). ``GRADSTAR_NAT_TRAVERSAL=0`` makes the relayed run. No node-local shards
    (``GRADSTAR_NODE_SHARD=0``: only the peer streams cross the links), so the NAT hosts' ranks
    say they are outbound-only (``GRADSTAR_OUTBOUND_ONLY=1``) instead of a shard's probe.

How to reproduce
    sudo .venv/bin/python benchmarks/nat_peer.py --mb 32 --iters 3 --rate 200mbit
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from emulated_cluster import ClusterUnavailable, EmulatedCluster  # noqa: E402

HOSTS = ["host0", "host1", "host2"]
PORT = 29611
RANK = """
import json, os, sys, time
import numpy as np
import gradstar
mb, iters = float(sys.argv[1]), int(sys.argv[2])
with gradstar.init_process_group(timeout=300) as pg:
    data = np.ones(int(mb * (1 << 20)) // 4, np.float32)
    times = []
    for i in range(iters + 1):
        pg.barrier()
        start = time.perf_counter()
        if pg.rank == 2:
            pg.send(data, dst=1)
            pg.recv(src=1)
        elif pg.rank == 1:
            pg.send(pg.recv(src=2), dst=2)
        times.append(time.perf_counter() - start)
    pg.barrier()
    print(json.dumps({"rank": pg.rank, "times": times[1:],
                      "routes": {str(k): v for k, v in pg.peer_routes.items()}}), flush=True)
"""


def one(cluster: EmulatedCluster, args, traversal: bool) -> dict:
    token = secrets.token_urlsafe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")} | {
        "GRADSTAR_TOKEN": token, "GRADSTAR_NAT_TRAVERSAL": "1" if traversal else "0"}
    hub = cluster.popen("host0", [sys.executable, "-u", "-m", "gradstar", "coordinator",
                                  "--host", "0.0.0.0", "--port", str(PORT), "--log-level",
                                  "WARNING"], env=env, cwd=REPO, text=True)
    address = f"{cluster.address('host0')}:{PORT}"
    rank_env = env | {"GRADSTAR_COORDINATOR": address, "GRADSTAR_JOB": "nat-peer",
                      "GRADSTAR_WORLD_SIZE": "3", "GRADSTAR_NODE_SHARD": "0"}
    before = cluster.link_bytes()["host0"]
    ranks = [cluster.popen(h, [sys.executable, "-c", RANK, str(args.mb), str(args.iters)],
                           env=rank_env | {"GRADSTAR_RANK": str(r),
                                           # no node-local shard to be probed: said so
                                           "GRADSTAR_OUTBOUND_ONLY": str(int(r > 0))},
                           cwd=REPO, text=True,
                           stdout=subprocess.PIPE)
             for r, h in enumerate(HOSTS)]
    try:
        outs = [json.loads(p.communicate(timeout=args.timeout)[0].strip().splitlines()[-1])
                for p in ranks]
    finally:
        cluster.stop_processes([*ranks, hub])
    after = cluster.link_bytes()["host0"]
    sent = (after.tx - before.tx + after.rx - before.rx) / 2 / (args.iters + 1) / 1e6
    times = outs[2]["times"]
    return {"road": "punched" if traversal else "relayed", "ms": statistics.median(times) * 1e3,
            "routes": outs[2]["routes"], "host0_mb": sent}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32.0)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    try:
        with EmulatedCluster(HOSTS, rate=args.rate) as cluster:
            for host in HOSTS[1:]:
                cluster.block_inbound(host)
            rows = [one(cluster, args, traversal) for traversal in (True, False)]
    except ClusterUnavailable as error:
        print(f"benchmarks/nat_peer.py: no emulated cluster here: {error}", file=sys.stderr)
        return 2
    bits = float(args.rate.removesuffix("mbit")) * 1e6 if args.rate.endswith("mbit") else None
    ideal = 2 * args.mb * (1 << 20) * 8 / bits * 1e3 if bits else float("nan")
    print(f"{args.mb:g} MiB rank 2 -> rank 1 -> rank 2, hosts 1 and 2 behind NAT, {args.rate}; "
          f"link-bound ideal {ideal:.0f} ms")
    for r in rows:
        print(f"{r['road']:8} {r['ms']:7.0f} ms  ({r['ms'] / ideal:.2f}x ideal)  "
              f"host0's link {r['host0_mb']:6.1f} MB each way per round trip  routes {r['routes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

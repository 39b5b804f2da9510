"""all_reduce across hosts at link speed: gloo's ring and gradstar's topologies on an emulated
cluster, in one run.

The cluster (:mod:`emulated_cluster`)
    Every host is a Linux network namespace with one interface on a shared bridge, its link
    limited to ``--rate`` (tc notation, default 200mbit) in BOTH directions by a token bucket
    (tbf on the host's eth0 and on its bridge port). The rank hosts are ``node0`` ..
    ``node{H-1}`` (``--hosts H``, ``--ranks-per-host r``: rank i on node i // r); the extra hosts
    ``hub`` and ``shard0`` .. ``shard{H-1}`` exist only for the topologies that use them. The run
    needs root, ``ip`` and ``tc``, and removes every namespace and process it made however it
    ends (errors, Ctrl-C, SIGTERM; only a SIGKILL of this script leaves them: ``ip netns list``
    shows ``gs-<tag>-*``).

Topologies (the rows; ``--topologies``)
    ``gloo``                torch.distributed gloo all_reduce (its ring), GLOO_SOCKET_IFNAME=eth0,
                            rendezvous on a TCP store at node0's address.
    ``gloo-bf16-hook``      the same with torch's ``bf16_compress_hook`` semantics: the tensor
                            divided by n, cast to bfloat16, all_reduced (added in bfloat16 at
                            every hop of the ring), cast back (and times n for the check).
    ``hub-on-rank0``        ``gradstar coordinator`` on node0, beside rank 0; no shards (what an
                            embedded hub or ``gradstar launch`` gives).
    ``hub-own-host``        the coordinator alone on host ``hub`` (docker-compose's shape).
    ``shards-extra-hosts``  the coordinator on ``hub`` (control plane only) and H ``gradstar
                            shard`` processes, one on each of ``shard0`` .. ``shard{H-1}``.
    ``node-local``          the coordinator on node0 and one ``gradstar shard --for-job`` on
                            every rank host, as gradstar's launchers start them by default
                            (advertised at the address gradstar picks); with several ranks on
                            a host they combine on its shard first (the two-level all_reduce).
    Each gradstar topology is one function below returning a :class:`Placement`; the processes
    are started from it by :func:`start_hub`. With ``--wire F ...`` each gradstar topology has
    a row per wire format (``none``: float32), named e.g. ``node-local wire=int8``: the ranks
    call ``all_reduce(x, wire=F)`` (compressed wire formats, ``gradstar.wire.formats``).

What is measured
    Each rank runs in its host's namespace (``ip netns exec``), with a float32 tensor of
    ``size`` MiB (numpy for gradstar, torch for gloo) whose elements are rank + 1. It runs
    ``--warmup`` all_reduce(sum) calls (checking the result exactly: n(n+1)/2 everywhere), then
    ``--iters`` timed iterations of ``barrier(); t0; all_reduce; t``. Rank 0 tells this script
    (JSON lines on its stdout; a line on its stdin lets the ranks go on) right before and right
    after the timed loop, while every rank waits at a barrier; there this script reads every
    host's link counters and the hub's CPU. Columns:

    * ms: rank 0's median iteration; x gloo: that over gloo's median at the same size.
    * ideal ms: the link-bound time, from the bytes the busiest host link must carry in one
      direction (links are full duplex, the bridge is not a bottleneck), at R bytes/s each way.
      For an all_reduce of S bytes over n ranks, one rank per host (see :func:`link_model`,
      which computes it from the flows for any ranks-per-host, where a host's ranks share its
      link)::

          ring (gloo)                  2(n-1)/n * S / R      every rank sends 2(n-1)/n*S to the next
          hub on rank 0's host         (n-1) * S / R         the hub's link carries the other ranks
          hub on a host of its own     n * S / R             the hub's link carries every rank's S
          K shards on extra hosts      max(S, n*S/K) / R     each rank S each way; a shard n*S/K
          node-local shards (K = H)    2(H-1)/H * S / R      S/H to and from each other host,
                                                             whatever the ranks per host

      This ignores latency and headers (TCP/IP, gRPC framing: a few per cent).
    * eff: ideal / ms.
    * link MB: bytes per collective over the busiest host link (the larger direction), from the
      veth counters over the timed loop divided by ``--iters`` (the barriers' few bytes
      included); model MB: what the flows above put there. A second table lists every host's
      link, out/in.
    * CPU-s/GB: CPU seconds over the timed loop per GB (1e9 bytes) of payload, S x n x iters.
      hub: the coordinator and its shards (user + system from /proc/PID/stat); ranks: the sum
      of the ranks' ``time.process_time()`` over the loop.
    * line CPU: with ``--rtt`` (or ``--delay-line``), the busiest delay line's CPU over the
      timed loop, in cores (user + system, /proc): the harness's own cost, beside the
      product's.

Far links (``--rtt``): ``--rtt MS`` puts a packet-level delay line on every host's link so
that every two hosts are MS apart; ``--rtt node0=5 node1=5 node2=45 node3=45`` gives each host
its round trip to the core (two hosts: the sum), a host left out none
(:mod:`emulated_cluster`). Without ``--rtt`` there is no delay line: the topology above.

Shared memory: a gradstar rank reaches a hub or shard on its own host through shared memory,
and streams to the others: gradstar tells hosts apart by boot id and network namespace
(``gradstar.transport.shm.host_id``), so each namespace here is a host of its own, and the
ranks run with gradstar's default (no ``GRADSTAR_SHARED_MEMORY`` set).

Every wait is bounded (``--timeout`` per topology and size); a row that fails is reported with
its error and the run goes on; the exit status is 1 if any row failed.

How to reproduce (as root)::

    .venv/bin/python benchmarks/cluster.py --hosts 4 --ranks-per-host 1 --sizes-mb 16 64 \\
        --iters 5
    .venv/bin/python benchmarks/cluster.py --hosts 2 --ranks-per-host 2 --sizes-mb 1 \\
        --topologies gloo node-local --rate 100mbit --json /tmp/cluster.json
    # compressed wire formats against gloo and gloo + bf16 hook (issue 25's targets)
    .venv/bin/python benchmarks/cluster.py --hosts 4 --sizes-mb 64 --iters 3 \\
        --topologies gloo gloo-bf16-hook node-local --wire none bf16 int8 int4
    # far links: every two hosts 100 ms apart, through delay lines
    .venv/bin/python benchmarks/cluster.py --hosts 4 --sizes-mb 4 64 --iters 3 \\
        --topologies gloo node-local --rtt 100
    # hosts tuned for far links, and gradstar's far-link settings forced (docs/regions.md)
    .venv/bin/python benchmarks/cluster.py --hosts 4 --sizes-mb 64 --rate 1gbit --rtt 200 \\
        --host-sysctl "net.ipv4.tcp_wmem=4096 16384 67108864" \\
        net.ipv4.tcp_slow_start_after_idle=0 --gradstar-env GRADSTAR_CONNECTIONS=2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_model import (
    DEFAULT_TOPOLOGIES,
    GB,
    MB,
    STORE_PORT,
    TOPOLOGIES,
    Layout,
    Placement,
    busiest,
    extra_hosts,
    link_model,
)
from _cluster_rank import rank_main
from _cluster_run import (
    Process,
    Run,
    add_far_link_arguments,
    far_description,
    far_links,
    line_columns,
    measure_row,
    on_emulated_cluster,
    print_failures,
    rank_env,
    sample,
    start_hub,
)
from _harness import (
    BenchmarkError,
    MiB,
    format_table,
    loadavg,
    median,
)
from emulated_cluster import (
    CONGESTION_CONTROL,
    LinkBytes,
    rate_bytes_per_second,
)

from gradstar.wire.formats import FORMATS


def run_size(run: Run, name: str, placement: Placement, hub: list[Process], size_mb: float,
             deadline: float, wire: str | None = None) -> dict:
    """The ranks of one row at one size (``wire``: the gradstar ranks' wire format); returns
    the row's measurements."""
    layout, args = run.layout, run.args
    nbytes = int(size_mb * MiB) // 4 * 4
    label = f"{name}-{size_mb:g}MiB" + (f"-{wire}" if wire else "")
    store = f"tcp://{run.cluster.address(layout.rank_hosts[0])}:{STORE_PORT}"
    ranks = []
    try:
        for rank, host in enumerate(layout.rank_hosts):
            spec = {"backend": "gloo" if placement.coordinator is None else "gradstar",
                    "workload": args.workload, "bucket_cap_mb": args.bucket_cap_mb,
                    "sync_mode": args.sync_mode, "rank": rank,
                    "ranks_per_host": layout.ranks_per_host,
                    "world_size": layout.world_size, "nbytes": nbytes,
                    "iters": args.iters, "warmup": args.warmup, "store": store,
                    # Stripes go to the shards every host can reach: dialed, or punched
                    # through NAT (not an outbound-only one without traversal).
                    "timeout": args.timeout, "shards": len(
                        [h for h in placement.shard_hosts
                         if args.nat_traversal or h not in args.outbound_only]),
                    "chunk_bytes": int(args.chunk_mb * MiB) if args.chunk_mb else None,
                    "wire": wire, "bf16_hook": placement.bf16_hook}
            ranks.append(run.start(host, f"{label}-rank{rank}",
                                   [sys.executable, "-u", __file__, "--rank-spec",
                                    json.dumps(spec)],
                                   rank_env(run, placement, f"{name}/{size_mb:g}MiB"
                                            + (f"/{wire}" if wire else "")),
                                   stdin=rank == 0))
        samples = []
        for phase in ("start", "end"):
            line = ranks[0].wait_for('"phase"', deadline)
            if json.loads(line)["phase"] != phase:
                raise BenchmarkError(f"{label}: rank 0 said {line.strip()}, expected {phase}")
            samples.append(sample(run, hub))
            ranks[0].proc.stdin.write("go\n")
            ranks[0].proc.stdin.flush()
        results = [json.loads(r.wait_for('"result"', deadline))["result"] for r in ranks]
        for r in ranks:
            r.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (BenchmarkError, subprocess.TimeoutExpired, OSError, ValueError) as error:
        raise BenchmarkError(f"{label}: {error}\n" + "\n".join(r.tail() for r in ranks)) \
            from None
    finally:
        run.cluster.stop_processes([r.proc for r in ranks])
    if args.workload == "ddp":
        for r in results[1:]:
            if r["sample"] != results[0]["sample"]:
                raise BenchmarkError(f"{label}: rank {r['rank']}'s parameters differ from "
                                     "rank 0's: the replicas diverged")
    before, after = samples
    links = {h: LinkBytes(round((after.links[h] - before.links[h]).rx / args.iters),
                          round((after.links[h] - before.links[h]).tx / args.iters))
             for h in after.links}
    gb = nbytes * layout.world_size * args.iters / GB or None  # None: a barrier's
    # A ledger mode's gradients go to the coordinator's step ledger, not over the shards.
    ledger = placement.coordinator is not None and args.sync_mode == "quorum"
    model = link_model(Placement(placement.coordinator) if ledger else placement, layout,
                       nbytes, wire)
    rate = rate_bytes_per_second(args.rate)
    return {"topology": name + (f" wire={wire}" if wire else ""), "size_mb": size_mb,
            "nbytes": nbytes, "wire": wire,
            "median_s": median(results[0]["times"]), "times": results[0]["times"],
            "ideal_s": round_trip_s(args.rtt) if args.workload == "barrier" else
            busiest(model) / rate, "links": {h: vars(b) for h, b in links.items()},
            "model": {h: vars(b) for h, b in model.items()},
            "hub_cpu_s_per_gb": (after.hub_cpu - before.hub_cpu) / gb if hub and gb else None,
            "ranks_cpu_s_per_gb": sum(r["cpu_s"] for r in results) / gb if gb else None,
            "shards": results[0]["shards"], "sample": results[0]["sample"],
            **line_columns(before, after)}


def round_trip_s(rtt: float | dict[str, float] | None) -> float:
    """The farthest two hosts' round trip in seconds (a barrier's ideal: the star's way in
    and out)."""
    if isinstance(rtt, dict):
        return sum(sorted(rtt.values())[-2:]) / 1e3
    return (rtt or 0.0) / 1e3


def run_topology(run: Run, name: str) -> tuple[list[dict], list[tuple[str, str]]]:
    """Every size of one row: its hub started once, fresh ranks (and job) per size."""
    placement = TOPOLOGIES[name](run.layout)
    rows, failures = [], []
    hub: list[Process] = []
    try:
        if placement.coordinator is not None:
            hub = start_hub(run, name, placement, time.monotonic() + 60)
        wires = [None] if placement.coordinator is None else [
            None if w == "none" else w for w in run.args.wire]
        for size_mb in run.args.sizes_mb:
            for wire in wires:
                measure_row(name + (f" wire={wire}" if wire else ""), size_mb,
                            run.args.timeout,
                            lambda deadline, size_mb=size_mb, wire=wire: run_size(
                                run, name, placement, hub, size_mb, deadline, wire),
                            rows, failures)
    except BenchmarkError as error:
        failures.append((name, str(error)))
        print(f"  {name:20s} FAILED to start", file=sys.stderr, flush=True)
    finally:
        run.cluster.stop_processes([p.proc for p in hub])
    return rows, failures


# -- report -------------------------------------------------------------------------------------


def tables(rows: list[dict]) -> str:
    gloo_s = {r["size_mb"]: r["median_s"] for r in rows if r["topology"] == "gloo"}

    def mb(x: float) -> str:
        return f"{x / MB:.1f}"

    def cpu(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    main = [[r["topology"], f"{r['size_mb']:g}",
             f"{r['median_s'] * 1e3:.{1 if r['median_s'] < 0.01 else 0}f}",
             f"{r['median_s'] / gloo_s[r['size_mb']]:.2f}" if r["size_mb"] in gloo_s else "-",
             f"{r['ideal_s'] * 1e3:.0f}", f"{r['ideal_s'] / r['median_s']:.0%}",
             mb(busiest({h: LinkBytes(**b) for h, b in r["links"].items()})),
             mb(busiest({h: LinkBytes(**b) for h, b in r["model"].items()})),
             cpu(r["hub_cpu_s_per_gb"]), cpu(r["ranks_cpu_s_per_gb"]),
             cpu(r.get("line_cpu"))] for r in rows]
    out = format_table(["topology", "MiB", "ms", "x gloo", "ideal ms", "eff", "link MB",
                        "model MB", "hub CPU-s/GB", "ranks CPU-s/GB", "line CPU"], main)
    hosts = sorted({h for r in rows for h, b in r["links"].items() if b["rx"] + b["tx"] > 1e5},
                   key=lambda h: (not h.startswith("node"), h))
    per_host = [[r["topology"], f"{r['size_mb']:g}",
                 *(f"{mb(r['links'][h]['tx'])}/{mb(r['links'][h]['rx'])}" for h in hosts)]
                for r in rows]
    out += "\n\nMB per collective over each host's link, out/in (veth counters):\n"
    return out + format_table(["topology", "MiB", *hosts], per_host)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4, help="rank hosts (default 4)")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64],
                        help="float32 payload per rank in MiB (default 1 16 64)")
    parser.add_argument("--rate", default="200mbit",
                        help="each host link's rate each way, tc notation (default 200mbit)")
    parser.add_argument("--workload", choices=["all_reduce", "ddp", "barrier"],
                        default="all_reduce",
                        help="all_reduce: of --sizes-mb; ddp: benchmarks/ddp_step.py's DDP "
                             "training step (its 37.7 MB of gradients; --sizes-mb ignored); "
                             "barrier: a barrier (ideal: one round trip)")
    parser.add_argument("--sync-mode", choices=["sync", "quorum"], default="sync",
                        help="--workload ddp: gradstar.DDP's sync mode, Synchronous or "
                             "Quorum(min_ranks=n - ranks per host, timeout=0) (default sync)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="--workload ddp: both DDPs' bucket size (default 25, torch's)")
    parser.add_argument("--congestion-control", default=CONGESTION_CONTROL,
                        help="each host's TCP congestion control (default cubic, Linux's "
                             "default; 'inherit' keeps the machine's)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations (default 1)")
    parser.add_argument("--chunk-mb", type=float,
                        help="gradstar ranks' chunk size in MiB (default: the client's)")
    parser.add_argument("--topologies", nargs="+", choices=list(TOPOLOGIES),
                        default=DEFAULT_TOPOLOGIES)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed per topology and size (default 300)")
    parser.add_argument("--wire", nargs="+", default=["none"],
                        choices=["none", *FORMATS],
                        help="gradstar rows per wire format (default: none, float32)")
    add_far_link_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)  # a rank process of this script
    args = parser.parse_args(argv)
    if args.rank_spec:
        return rank_main(json.loads(args.rank_spec))
    far_links(parser, args)
    if args.hosts < 2 or args.ranks_per_host < 1 or args.iters < 1:
        parser.error("--hosts must be at least 2, --ranks-per-host and --iters at least 1")
    rate_bytes_per_second(args.rate)
    if args.workload == "ddp" and args.wire != ["none"]:
        parser.error("--wire applies to the all_reduce workload (gradstar.DDP takes no wire "
                     "format yet)")

    # Ctrl-C (even where a shell started this with SIGINT ignored), SIGTERM and SIGHUP end the
    # run through the finally blocks that clean up.
    if args.workload == "ddp":  # one "size": the model's gradients
        from itertools import pairwise

        from ddp_step import WIDTHS

        params = sum(a * b + b for a, b in pairwise(WIDTHS))
        args.sizes_mb = [params * 4 / MiB]
    elif args.workload == "barrier":
        args.sizes_mb = [0.0]
    layout = Layout(args.hosts, args.ranks_per_host)

    def each(run: Run) -> tuple[list[dict], list[tuple[str, str]]]:
        rows, failures = [], []
        for name in args.topologies:
            got, failed = run_topology(run, name)
            rows += got
            failures += failed
        return rows, failures

    congestion = None if args.congestion_control == "inherit" else args.congestion_control
    rows, failures, logs = on_emulated_cluster(
        "cluster", layout.nodes + extra_hosts(args.topologies, layout), args, layout,
        congestion, each)
    what = {"ddp": "DDP step of benchmarks/ddp_step.py's MLP (MiB: its float32 gradients; "
                   "ideal: their all_reduce alone), gradstar in "
                   + ("Quorum(n - ranks per host, timeout=0)" if args.sync_mode == "quorum"
                      else "Synchronous"),
            "barrier": "barrier (ideal: the farthest hosts' round trip)"}.get(
                args.workload, "all_reduce, float32")
    print(f"\n{what}, {layout.hosts} hosts x {layout.ranks_per_host} ranks, each "
          f"host link {args.rate} each way{far_description(args)}; {args.iters} timed "
          f"iterations (median), {args.warmup} warm-up; load {loadavg()}")
    print("ideal = busiest host link's bytes in one direction / rate: ring 2(n-1)/n*S, hub on "
          "rank 0's host (n-1)*S, hub on its own host n*S, K extra-host shards max(S, n*S/K), "
          "node-local shards 2(n-1)/n*S (one rank per host)\n")
    print(tables(rows))
    lost = sum(r.get("line_lost", 0) for r in rows)
    if lost:
        print(f"\nThe delay lines dropped {lost} frames over the timed loops (queue full, "
              "oversize or refused: see --json)")
    print_failures(failures, logs)
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "cluster", "args": vars(args) | {"json": str(args.json)},
            "machine": platform.platform(), "cpus": os.cpu_count(), "rows": rows,
            "failures": failures}, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

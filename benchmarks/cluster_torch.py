"""all_reduce across emulated hosts through torch.distributed under torchrun: backend "gloo"
and backend "gradstar" with nothing set, beside gradstar's SDK rows, in one run.

The cluster is benchmarks/cluster.py's (:mod:`emulated_cluster`: a network namespace per
host, each link limited to ``--rate`` both ways); the hosts are ``node0`` .. ``node{H-1}``.

Rows (``--rows``)
    ``torchrun gloo``      on every host, real torchrun (``python -m torch.distributed.run
    ``torchrun gradstar``  --nnodes H --nproc-per-node r --node-rank i --master-addr <node0>
                           --master-port P``; its static rendezvous, the agent's store on node0)
                           runs :mod:`_cluster_torch_rank`, an ordinary script:
                           ``dist.init_process_group(BACKEND)`` and nothing else set (no
                           GRADSTAR_* variable; gloo gets GLOO_SOCKET_IFNAME=eth0, as in
                           cluster.py), then ``dist.all_reduce`` of a float32 torch tensor, in
                           place. With gradstar, rank 0 starts the hub as its child and each
                           host's local rank 0 a node shard (client/torch_backend/store_hub.py).
    ``gloo``, ``node-local``  benchmarks/cluster.py's rows of those names (its own rank
                           program: gloo with a copy of the input per call, gradstar's SDK on a
                           numpy array with the coordinator on node0 and a ``gradstar shard
                           --for-job`` per host).

Columns: ms (rank 0's median iteration), x gloo (over ``torchrun gloo`` for the torchrun rows,
over ``gloo`` for cluster.py's), ideal ms and eff (the link-bound time of the ring or of
node-local shards, :func:`_cluster_model.link_model`), link MB (the busiest host link per
call, veth counters), and CPU seconds per GB of payload (S x n x iters) over the timed loop:
``ranks`` the sum of the ranks' ``time.process_time()``, ``hub`` gradstar's coordinator and
shards (/proc; for the torchrun row, every process below a rank: the hub and node shards);
line CPU, with ``--rtt``, the busiest delay line's CPU in cores (benchmarks/cluster.py's).

How to reproduce (as root)::

    .venv/bin/python benchmarks/cluster_torch.py --hosts 2 --rate 10gbit --sizes-mb 64
    .venv/bin/python benchmarks/cluster_torch.py --hosts 4 --rate 5gbit --sizes-mb 64 \\
        --rows "torchrun gloo" "torchrun gradstar"
    .venv/bin/python benchmarks/cluster_torch.py --hosts 2 --rate 1gbit --sizes-mb 64 --rtt 50
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster
from _cluster_model import GB, MB, STORE_PORT, TOPOLOGIES, Layout, busiest, link_model
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
    sample,
)
from _harness import BenchmarkError, MiB, cpu_seconds_of, descendants, format_table, loadavg
from _harness import median as median_of
from emulated_cluster import (
    CONGESTION_CONTROL,
    LinkBytes,
    rate_bytes_per_second,
)

RANK_SCRIPT = Path(__file__).resolve().with_name("_cluster_torch_rank.py")
ROWS = ["torchrun gloo", "torchrun gradstar", "gloo", "node-local"]


def below(pids: Sequence[int]) -> float:
    """CPU seconds of every live process below ``pids`` (gradstar's hub and shards)."""
    return sum(cpu_seconds_of(p) or 0.0 for pid in pids for p in descendants(pid))


def run_torchrun(run: Run, backend: str, size_mb: float, port: int, deadline: float) -> dict:
    """One torchrun row at one size: a torchrun per host, the script timed; its measurements."""
    layout, args = run.layout, run.args
    nbytes = int(size_mb * MiB) // 4 * 4
    label = f"torchrun-{backend}-{size_mb:g}MiB"
    go = run.logs / f"go-{label}"
    go.mkdir()
    master = run.cluster.address(layout.nodes[0])
    env = run.env(GLOO_SOCKET_IFNAME="eth0") if backend == "gloo" else run.env()
    agents: list[Process] = []
    try:
        for node_rank, host in enumerate(layout.nodes):
            agents.append(run.start(host, f"{label}-{host}", [
                sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes",
                str(layout.hosts), "--nproc-per-node", str(layout.ranks_per_host),
                "--node-rank", str(node_rank), "--master-addr", master, "--master-port",
                str(port), "--max-restarts", "0", str(RANK_SCRIPT), "--backend", backend,
                "--nbytes", str(nbytes), "--iters", str(args.iters), "--warmup",
                str(args.warmup), "--go", str(go), "--timeout", str(args.timeout)], env))
        pids = [json.loads(a.wait_for('"pid"', deadline))["pid"]
                for a in agents for _ in range(layout.ranks_per_host)]
        samples = []
        for name in ("start", "end"):
            agents[0].wait_for(f'"phase": "{name}"', deadline)
            samples.append((sample(run, []), below(pids)))
            (go / name).touch()
        results = [json.loads(a.wait_for('"result"', deadline))["result"]
                   for a in agents for _ in range(layout.ranks_per_host)]
        for a in agents:
            a.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if a.proc.returncode:
                raise BenchmarkError(f"{a.name} exited with {a.proc.returncode}")
    except (BenchmarkError, OSError, ValueError) as error:
        raise BenchmarkError(f"{label}: {error}\n" + "\n".join(a.tail() for a in agents)) \
            from None
    finally:
        run.cluster.stop_processes([a.proc for a in agents])
    (before, cpu0), (after, cpu1) = samples
    links = {h: LinkBytes(round((after.links[h] - before.links[h]).rx / args.iters),
                          round((after.links[h] - before.links[h]).tx / args.iters))
             for h in after.links}
    gb = nbytes * layout.world_size * args.iters / GB
    placement = TOPOLOGIES["gloo" if backend == "gloo" else "node-local"](layout)
    model = link_model(placement, layout, nbytes)
    rank0 = next(r for r in results if r["rank"] == 0)
    return {"topology": f"torchrun {backend}", "size_mb": size_mb, "nbytes": nbytes,
            "median_s": median_of(rank0["times"]), "times": rank0["times"],
            "ideal_s": busiest(model) / rate_bytes_per_second(args.rate),
            "links": {h: vars(b) for h, b in links.items()},
            "model": {h: vars(b) for h, b in model.items()},
            "hub_cpu_s_per_gb": (cpu1 - cpu0) / gb if backend != "gloo" else None,
            "ranks_cpu_s_per_gb": sum(r["cpu_s"] for r in results) / gb,
            **line_columns(before, after)}


def run_row(run: Run, name: str, port: int) -> tuple[list[dict], list[tuple[str, str]]]:
    if not name.startswith("torchrun "):
        return cluster.run_topology(run, name)
    rows, failures = [], []
    for i, size_mb in enumerate(run.args.sizes_mb):
        measure_row(name, size_mb, run.args.timeout,
                    lambda deadline, size_mb=size_mb, i=i: run_torchrun(
                        run, name.split()[1], size_mb, port + i, deadline), rows, failures)
    return rows, failures


def tables(rows: list[dict]) -> str:
    gloo = {(r["topology"].startswith("torchrun"), r["size_mb"]): r["median_s"]
            for r in rows if r["topology"] in ("gloo", "torchrun gloo")}

    def ratio(r: dict) -> str:
        ref = gloo.get((r["topology"].startswith("torchrun"), r["size_mb"]))
        return "-" if ref is None else f"{r['median_s'] / ref:.2f}"

    def cpu(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    return format_table(
        ["row", "MiB", "ms", "x gloo", "ideal ms", "eff", "link MB", "hub CPU-s/GB",
         "ranks CPU-s/GB", "line CPU"],
        [[r["topology"], f"{r['size_mb']:g}", f"{r['median_s'] * 1e3:.0f}", ratio(r),
          f"{r['ideal_s'] * 1e3:.0f}", f"{r['ideal_s'] / r['median_s']:.0%}",
          f"{busiest({h: LinkBytes(**b) for h, b in r['links'].items()}) / MB:.1f}",
          cpu(r["hub_cpu_s_per_gb"]), cpu(r["ranks_cpu_s_per_gb"]), cpu(r.get("line_cpu"))]
         for r in rows])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="rank hosts (default 2)")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[64],
                        help="float32 payload per rank in MiB (default 64)")
    parser.add_argument("--rate", default="10gbit",
                        help="each host link's rate each way, tc notation (default 10gbit)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=ROWS)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed per row and size (default 300)")
    add_far_link_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    far_links(parser, args)
    if args.hosts < 2 or args.ranks_per_host < 1 or args.iters < 1 or args.warmup < 1:
        parser.error("--hosts must be at least 2; --ranks-per-host, --iters and --warmup at "
                     "least 1")
    rate_bytes_per_second(args.rate)
    # What cluster.py's own rows read from its arguments.
    args.workload, args.bucket_cap_mb, args.chunk_mb, args.wire = "all_reduce", 25.0, None, \
        ["none"]
    layout = Layout(args.hosts, args.ranks_per_host)

    def each(run: Run) -> tuple[list[dict], list[tuple[str, str]]]:
        rows, failures = [], []
        for i, name in enumerate(args.rows):
            got, failed = run_row(run, name, STORE_PORT + 10 * (i + 1))
            rows += got
            failures += failed
        return rows, failures

    rows, failures, logs = on_emulated_cluster("cluster_torch", layout.nodes, args, layout,
                                               CONGESTION_CONTROL, each)
    print(f"\nall_reduce, float32, {layout.hosts} hosts x {layout.ranks_per_host} ranks, each "
          f"host link {args.rate} each way{far_description(args)}; {args.iters} timed "
          f"iterations (median), {args.warmup} warm-up; load {loadavg()}\n")
    print(tables(rows))
    print_failures(failures, logs)
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "cluster_torch", "args": vars(args) | {"json": str(args.json)},
            "rows": rows, "failures": failures}, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

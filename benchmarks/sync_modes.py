"""Sync modes against a straggler: torch DDP over gloo and gradstar.DDP in Synchronous, Quorum,
BoundedStaleness and Asynchronous mode, on an emulated cluster, with one host slowed by a CPU
quota and without (issue 32's targets). Needs root (namespaces, tc, cgroups).

The cluster (:mod:`emulated_cluster`)
    Rank hosts ``node0`` .. ``node{H-1}`` (``--hosts``, ``--ranks-per-host``: rank i on
    node i // r) and ``hub``, each link ``--rate`` (default 200mbit) both ways, TCP cubic. The
    coordinator runs alone on ``hub`` (no shards): every mode's gradients cross the hub's link,
    and no rank host is special (a hub beside rank 0 would give that host shared memory).
    gloo's store listens on node0.

CPU: every rank host gets the same budget, the slow one a third of it
    A 2-core machine cannot give each of 4-8 ranks and the hub a core: uncapped ranks compete
    and a third of a core barely slows a rank that mostly waits (67 vs 69 it/s). So each rank
    host's processes share ``--host-cpu`` of one core (default 0.25; the hub is not limited),
    and the slow host (the last) gets 1/``--slowdown`` of that: 3x slow by construction, and
    the same whatever else runs on the machine while the budgets fit in it. One cgroup per host:
    cgroup v1's cpu controller (``/sys/fs/cgroup/cpu/NAME``: ``cpu.cfs_period_us`` 30000,
    ``cpu.cfs_quota_us`` period x cores; a short period, so a rank is throttled evenly) or v2's
    ``cpu.max`` where ``/sys/fs/cgroup`` is unified. Each rank's pid goes into its host's
    ``cgroup.procs`` once it has imported torch and gradstar (``ip netns exec`` execs: the pid
    is the rank's; its namespace's /sys has no cgroups), then it joins its group. A fixed
    Python loop timed outside, on a host and on the slow host (medians of 3) is printed.
    ``--scenarios even``: the slow host gets the others' budget.

The task
    The demo's spirals MLP (:func:`spirals`: ``gradstar.worker.demo.spirals``), ``--samples``
    points, rank r trains on every n-th training sample from r, ``--batch`` rows per iteration;
    ``--iters`` iterations on every rank (equal data per rank: a time budget would cut the
    straggler's share), torch SGD with ``--lr`` and momentum 0.9 and (``--schedule``) a cosine
    decay to 0 stepped per iteration, every mode alike: at a constant rate the stale modes'
    accuracy swings by points from one snapshot to the next, so their final accuracy would be
    wherever a swing ended; 1200 iterations converge. Quorum closes a step with
    ``min_ranks`` = n - ranks per host (every host but one; the slow one's late gradients are
    dropped) and ``timeout=0``; BoundedStaleness with ``--max-staleness`` (2); both stale modes
    with their default step scaling, or ``--scaling`` (``plain``: the rule before it).

What is measured
    Rank 0 (node0, never slowed) saves its parameters every ``--snap-every`` iterations with the
    seconds since its DDP wrapper was built (every rank had joined then), and once more after
    ``ddp.synchronize()`` at the end: the test-accuracy curve, evaluated afterwards. Columns:
    steps/s (optimizer steps rank 0 applied / its seconds to the end), it/s fast/slow (a rank's
    own iterations per second; median of the fast hosts' ranks / the slow host's), time to
    target (first snapshot at or above the Synchronous run's final accuracy - 1 point, same
    scenario), x sync / x gloo (their time to target over this one's), final accuracy (after
    synchronize; every rank's parameters must be bitwise equal), gradients dropped, staleness
    of the accepted ones (count per staleness), and MB over each host's link in the run (veth
    counters, out/in). Nothing is asserted: the figures are printed (``--json``: also saved).

Run as root: ``.venv/bin/python benchmarks/sync_modes.py --hosts 4 --ranks-per-host 1`` (and
``--ranks-per-host 2 --iters 800``), on a quiet machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import BenchmarkError, format_table, loadavg
from _host_cpu import HostCpu
from cluster import STORE_PORT, Layout, Placement, Run, rank_env, start_hub
from emulated_cluster import ClusterUnavailable, EmulatedCluster

from gradstar.sync_modes import SCALINGS

MODES = ("gloo", "sync", "quorum", "bounded", "async")
MB = 1e6


def spirals():
    """The demo's task module (one place to change if it moves)."""
    from gradstar.worker.demo import spirals as module

    return module


# -- the rank program ---------------------------------------------------------------------------


def make_mode(spec: dict):
    import gradstar

    if spec["mode"] == "quorum":  # every host but one: the slowest host's gradients dropped
        return gradstar.Quorum(min_ranks=spec["world_size"] - spec["ranks_per_host"],
                               timeout=0.0)
    scaling = {"scaling": spec["scaling"]} if spec["scaling"] else {}  # None: the default
    return {"bounded": gradstar.BoundedStaleness(max_staleness=spec["max_staleness"], **scaling),
            "async": gradstar.Asynchronous(**scaling)}.get(spec["mode"], gradstar.Synchronous())


def rank_main(spec: dict) -> int:
    """One rank: train ``iters`` iterations, synchronize, print ``{"result": ...}``."""
    import numpy as np
    import torch

    torch.set_num_threads(1)  # the ranks share the machine's cores
    task = spirals()
    rank, n = spec["rank"], spec["world_size"]
    data = task.make_spirals(spec["samples"], seed=0)
    x = torch.from_numpy(data.train.x[rank::n])
    y = torch.from_numpy(data.train.y[rank::n])
    model = task.make_model(data.features, data.classes, spec["hidden"])
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, spec["iters"]) if (
        spec["schedule"] == "cosine") else None  # stepped per own iteration, as users do
    import torch.distributed as dist

    import gradstar

    # Imported at full speed; the driver now moves this process into its host's cgroup.
    print(json.dumps({"ready": os.getpid()}), flush=True)
    if not sys.stdin.readline():
        raise SystemExit(f"rank {rank}: the benchmark went away")
    if spec["mode"] == "gloo":
        from datetime import timedelta
        dist.init_process_group("gloo", init_method=spec["store"], rank=rank, world_size=n,
                                timeout=timedelta(seconds=spec["timeout"]))
        ddp, close = torch.nn.parallel.DistributedDataParallel(model), dist.destroy_process_group
    else:
        pg = gradstar.init_process_group(rank=rank, timeout=spec["timeout"], join_timeout=120)
        ddp = gradstar.DDP(model, pg, sync_mode=make_mode(spec), optimizer=opt)
        close = pg.close
    began = time.time()
    snaps = Path(spec["snapshots"]) if rank == 0 else None

    def snapshot(label: str) -> None:
        np.save(snaps / f"{label}-{time.time() - began:.3f}.npy", task.flat_parameters(model))

    batches = len(y) // spec["batch"]
    for i in range(spec["iters"]):
        start = (i % batches) * spec["batch"]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[start:start + spec["batch"]]),
                                                 y[start:start + spec["batch"]])
        loss.backward()
        opt.step()
        if decay is not None:
            decay.step()
        if snaps and (i + 1) % spec["snap_every"] == 0:
            snapshot(f"{i + 1:06d}")
    loop_seconds = time.time() - began
    if spec["mode"] != "gloo":
        ddp.synchronize()
    end_seconds = time.time() - began
    if snaps:
        snapshot("final")
    stats = ddp.sync_stats() if spec["mode"] not in ("gloo", "sync") else None
    result = {"rank": rank, "iters": spec["iters"], "loop_s": loop_seconds, "end_s": end_seconds,
              "params_sha": hashlib.sha256(task.flat_parameters(model).tobytes()).hexdigest(),
              "steps": stats.steps_applied if stats else spec["iters"],
              "dropped": stats.dropped if stats else 0,
              "staleness": dict(stats.staleness) if stats else {"0": spec["iters"]},
              "step_sizes": dict(stats.step_sizes) if stats else {str(n): spec["iters"]},
              "waited_s": stats.waited_seconds if stats else None}
    print(json.dumps({"result": result}), flush=True)
    close()
    return 0


# -- the driver ---------------------------------------------------------------------------------


def run_mode(run: Run, mode: str, cpu: HostCpu, slow: bool, tmp: Path) -> dict:
    """One mode's run: a fresh coordinator on ``hub`` (none for gloo), the ranks, their results,
    the link bytes and rank 0's snapshots."""
    layout, args = run.layout, run.args
    label = f"{mode}-{'slow' if slow else 'even'}"
    placement = Placement(None) if mode == "gloo" else Placement("hub")
    snapshots = tmp / label
    snapshots.mkdir()
    deadline = time.monotonic() + args.timeout
    hub, ranks = [], []
    try:
        if placement.coordinator is not None:
            hub = start_hub(run, label, placement, deadline)
        before = run.cluster.link_bytes()
        for rank, host in enumerate(layout.rank_hosts):
            spec = {"mode": mode, "rank": rank, "world_size": layout.world_size,
                    "ranks_per_host": layout.ranks_per_host, "iters": args.iters,
                    "batch": args.batch, "hidden": args.hidden, "lr": args.lr,
                    "schedule": args.schedule,
                    "samples": args.samples, "max_staleness": args.max_staleness,
                    "scaling": args.scaling,
                    "snap_every": args.snap_every, "snapshots": str(snapshots),
                    "timeout": args.timeout,
                    "store": f"tcp://{run.cluster.address(layout.nodes[0])}:{STORE_PORT}"}
            ranks.append(run.start(host, f"{label}-rank{rank}", [
                sys.executable, "-u", __file__, "--rank-spec", json.dumps(spec)],
                rank_env(run, placement, f"bench-{label}"), stdin=True))
        for host, r in zip(layout.rank_hosts, ranks, strict=True):
            r.wait_for('"ready"', deadline)
            cpu.add(host, r.proc.pid)  # ip netns exec execs: the pid is the rank's
        for r in ranks:
            r.proc.stdin.write("go\n")
            r.proc.stdin.flush()
        results = [json.loads(r.wait_for('"result"', deadline))["result"] for r in ranks]
        for r in ranks:  # results in; one stuck closing its group (gloo, seen) is killed
            try:
                r.proc.wait(timeout=20.0)
            except subprocess.TimeoutExpired:
                print(f"  {label}: {r.name} did not exit after its result", file=sys.stderr)
        after = run.cluster.link_bytes()
    except (BenchmarkError, subprocess.TimeoutExpired, OSError, ValueError) as error:
        raise BenchmarkError(f"{label}: {error}\n" + "\n".join(r.tail() for r in ranks)) \
            from None
    finally:
        run.cluster.stop_processes([p.proc for p in ranks + hub])
    links = {h: after[h] - before[h] for h in after}
    return {"mode": mode, "slow": slow, "results": results,
            "links": {h: {"tx": b.tx, "rx": b.rx} for h, b in links.items()},
            "curve": curve(snapshots, args)}


def curve(snapshots: Path, args) -> list[tuple[float, float]]:
    """(seconds since rank 0's DDP was built, test accuracy) of each snapshot, in time order."""
    import numpy as np

    task = spirals()
    data = task.make_spirals(args.samples, seed=0)
    model = task.make_model(data.features, data.classes, args.hidden)
    points = []
    for path in snapshots.glob("*.npy"):
        task.load_flat_parameters(model, np.load(path))
        points.append((float(path.stem.rsplit("-", 1)[1]), task.evaluate(model, data.test)[1]))
    return sorted(points)


def summarize(row: dict, layout: Layout) -> dict:
    results = sorted(row["results"], key=lambda r: r["rank"])
    slow = {r for r, h in enumerate(layout.rank_hosts) if h == layout.nodes[-1]}
    rate = [r["iters"] / r["loop_s"] for r in results]
    staleness = Counter()
    for r in results:
        staleness.update({int(k): v for k, v in r["staleness"].items()})
    return {"steps_per_s": results[0]["steps"] / results[0]["end_s"],
            "fast_its": statistics.median(v for i, v in enumerate(rate) if i not in slow),
            "slow_its": statistics.median(v for i, v in enumerate(rate) if i in slow),
            "final": row["curve"][-1][1], "end_s": results[0]["end_s"],
            "dropped": sum(r["dropped"] for r in results),
            "staleness": dict(sorted(staleness.items())),
            "identical": len({r["params_sha"] for r in results}) == 1}


def reached(row: dict, target: float) -> float | None:
    return next((t for t, acc in row["curve"] if acc >= target), None)


def report(rows: list[dict], layout: Layout, args) -> str:
    """The tables of one scenario (slowed or not)."""
    for row in rows:
        row["summary"] = summarize(row, layout)
    by_mode = {r["mode"]: r for r in rows}
    target = by_mode["sync"]["summary"]["final"] - 0.01 if "sync" in by_mode else None
    times = {m: reached(r, target) if target is not None else None for m, r in by_mode.items()}

    def ratio(base: str, mode: str) -> str:
        if times.get(base) is None or times[mode] is None:
            return "-"
        return f"{times[base] / times[mode]:.2f}x"

    body = []
    for row in rows:
        s, mode = row["summary"], row["mode"]
        stale = " ".join(f"{k}:{v}" for k, v in s["staleness"].items())
        when = "never" if times[mode] is None else f"{times[mode]:.1f}"
        body.append([mode, f"{s['steps_per_s']:.1f}", f"{s['fast_its']:.1f}/{s['slow_its']:.1f}",
                     when, ratio("sync", mode), ratio("gloo", mode), f"{s['final']:.4f}",
                     f"{s['end_s']:.1f}", s["dropped"], stale,
                     "yes" if s["identical"] else "NO"])
    where = "slow host " + layout.nodes[-1] if rows[0]["slow"] else "no slow host"
    out = (f"\n{where}: target = Synchronous's final accuracy - 1 point = "
           + (f"{target:.4f}" if target is not None else "- (no sync row)") + "\n")
    out += format_table(["mode", "steps/s", "it/s fast/slow", "to target s", "x sync",
                         "x gloo", "final acc", "run s", "dropped", "staleness (count)",
                         "replicas equal"], body)
    hosts = [*layout.nodes, "hub"]
    per_host = [[r["mode"], *(f"{r['links'][h]['tx'] / MB:.1f}/{r['links'][h]['rx'] / MB:.1f}"
                              for h in hosts)] for r in rows]
    out += "\nMB over each host's link in the run, out/in:\n"
    return out + format_table(["mode", *hosts], per_host)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--rate", default="200mbit", help="each host link, both ways")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--scenarios", nargs="+", choices=["slow", "even"],
                        default=["slow", "even"],
                        help="slow: the last host gets 1/SLOWDOWN of the others' CPU; even: "
                             "the same")
    parser.add_argument("--host-cpu", type=float, default=0.25,
                        help="cores each rank host's processes may use (default 0.25)")
    parser.add_argument("--slowdown", type=float, default=3.0,
                        help="the slow host gets 1/SLOWDOWN of --host-cpu (default 3)")
    parser.add_argument("--iters", type=int, default=1200, help="iterations per rank")
    parser.add_argument("--batch", type=int, default=64, help="rows per rank and iteration")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's, every mode (momentum 0.9)")
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                        help="the learning rate over the run (cosine: to 0 at the end)")
    parser.add_argument("--samples", type=int, default=24_000)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--scaling", choices=sorted(SCALINGS), default=None,
                        help="BoundedStaleness and Asynchronous's step scaling (default: theirs; "
                             "plain: the rule before step scaling)")
    parser.add_argument("--snap-every", type=int, default=10, help="rank 0's iterations")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)  # a rank process of this script
    return parser


def main() -> int:
    args = arguments().parse_args()
    if args.rank_spec:
        return rank_main(json.loads(args.rank_spec))
    if args.hosts < 2:
        raise SystemExit("benchmarks/sync_modes.py: needs at least 2 hosts (one is slowed)")
    layout = Layout(args.hosts, args.ranks_per_host)
    logs = Path(tempfile.mkdtemp(prefix="gradstar-sync-modes-"))
    tables, scenarios, failures, cpu = [], {}, [], None
    slow_host = layout.nodes[-1]
    try:
        with EmulatedCluster([*layout.nodes, "hub"], rate=args.rate) as cluster:
            print(cluster.describe(), file=sys.stderr, flush=True)
            run = Run(cluster, layout, args, logs)
            cpu = HostCpu(layout.nodes, args.host_cpu)
            how = cpu.limit(slow_host, args.host_cpu / args.slowdown)
            loops = [[cpu.time_loop(h) for h in (None, layout.nodes[0], slow_host)]
                     for _ in range(3)]
            outside, fast, slow = (statistics.median(t) for t in zip(*loops, strict=True))
            print(f"every rank host: {args.host_cpu:g} of a core; slow host {slow_host}: {how}."
                  f" A fixed loop took {outside:.2f} s outside, {fast:.2f} s on a host, "
                  f"{slow:.2f} s on the slow host: {slow / fast:.2f}x slower", flush=True)
            for scenario in args.scenarios:
                cpu.limit(slow_host, args.host_cpu / (args.slowdown if scenario == "slow"
                                                      else 1.0))
                rows = []
                for mode in args.modes:
                    try:
                        rows.append(run_mode(run, mode, cpu, scenario == "slow", logs))
                    except BenchmarkError as error:  # reported; the other modes still run
                        lines = str(error).splitlines()
                        failures.append(" | ".join([f"{scenario} {lines[0]}", *sorted(
                            {line.strip() for line in lines[1:] if "Error:" in line})]))
                        print(f"  {scenario} {mode}: FAILED", file=sys.stderr, flush=True)
                        continue
                    print(f"  {scenario} {mode}: final {rows[-1]['curve'][-1][1]:.4f} at "
                          f"{rows[-1]['curve'][-1][0]:.1f} s", file=sys.stderr, flush=True)
                scenarios[scenario] = rows
                if rows:
                    tables.append(report(rows, layout, args))
    except ClusterUnavailable as error:
        print(f"benchmarks/sync_modes.py: no emulated cluster here: {error}", file=sys.stderr)
        return 2
    except BenchmarkError as error:
        print(f"benchmarks/sync_modes.py: {error}\nlogs: {logs}", file=sys.stderr)
        return 1
    finally:
        if cpu is not None:
            cpu.remove()
    if not failures:
        shutil.rmtree(logs, ignore_errors=True)
    print(f"\n{layout.hosts} hosts x {layout.ranks_per_host} ranks + hub, {args.rate} each "
          f"way, {args.host_cpu:g} core per rank host (the slow one / {args.slowdown:g}); "
          f"spirals MLP hidden {args.hidden}, {args.iters} iterations x {args.batch} rows per "
          f"rank, SGD lr {args.lr} ({args.schedule}) momentum 0.9; load {loadavg()}")
    print("\n".join(tables))
    for failure in failures:
        print(f"\nFAILED {failure}")
    if failures:
        print(f"\nEvery process's output: {logs}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "scenarios": scenarios, "failures": failures},
                                        indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

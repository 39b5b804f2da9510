"""What torch.distributed's backend "gradstar" costs on top of gradstar's own SDK, per byte.

What is measured
    One all_reduce(sum) of a float32 tensor of ``--sizes-mb`` MiB per rank, ``--ranks``
    processes on this host, three ways, in the same run and alternated ``--repeats`` times
    (gloo, SDK, backend, gloo, SDK, backend, ...), so that a change of load hits all three:

    * ``gloo``: ``dist.all_reduce(x)`` on a gloo group (``tcp://`` on 127.0.0.1);
    * ``sdk``: gradstar's blocking ProcessGroup, in place on the same torch tensor as gloo's
      (``pg.all_reduce(x, op="sum", out=x)``);
    * ``backend``: ``dist.all_reduce(x)`` on a group made with ``backend="gradstar"``
      (``gradstar://ADDR?job=...``) -- the drop-in, which reduces in place too.

    Both gradstar configurations run against a fresh ``gradstar coordinator`` (single hub) with
    the shared-memory path off (``GRADSTAR_SHARED_MEMORY=0`` for the hub and the ranks), so every
    payload byte rides the gRPC stream, as between hosts; each rank reports its data path and a
    run that took shared memory fails (``_paths.check_path``). Each rank runs ``--warmup``
    untimed calls, then ``--iters`` timed ones, each after an untimed barrier, and checks the
    first and last result exactly.

    Per configuration and repeat: rank 0's median time; ranks CPU s/GB (the sum of the ranks'
    ``process_time()``, every thread, over each timed call and the barrier before it) and hub
    CPU s/GB (the coordinator's user + system time over the timed loop, sampled while the
    ranks wait at a sync point, so it includes the barriers too);
    GB moved = bytes per rank x ranks x iters. The table shows the median over the repeats of
    each figure, and the ratios backend / SDK and each / gloo of those medians; "rank CPU
    us/call" is the ranks' CPU per rank and call (its barrier included), for tiny sizes.

How to reproduce
    .venv/bin/python benchmarks/backend_cost.py                          # 64 and 16 MiB, 2 ranks
    .venv/bin/python benchmarks/backend_cost.py --sizes-mb 64 --repeats 5 --json /tmp/cost.json
    .venv/bin/python benchmarks/backend_cost.py --profile /tmp/prof      # cProfile of rank 0
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _collective_runs import COLLECTIVE_TIMEOUT, hub_cpu, run_sampled, summarize
from _processes import free_port, loadavg, threads_cpu
from _ranks import run_ranks
from _report import MiB, environment, fmt, format_table, git_commit, median, write_json

CONFIGS = ("gloo", "sdk", "backend")


# -- rank bodies (spawned processes) -----------------------------------------------------------


def _loop(rank: int, world_size: int, x, all_reduce, barrier, warmup: int, iters: int,
          sync, profile: str | None) -> dict:
    """Warm up, then time ``iters`` calls of ``all_reduce()`` on ``x`` (restored before each
    call, untimed), checking the first and last result; ``sync`` (if any) brackets the timed
    loop for the hub's CPU samples. With ``profile``, rank 0's timed loop runs under cProfile
    (its thread only) and the stats go to ``profile``."""
    import cProfile

    import torch

    base = torch.ones_like(x) * (rank + 1)
    expected = world_size * (world_size + 1) / 2

    def check(what: str) -> None:
        if not bool((x == expected).all()):
            raise AssertionError(f"rank {rank}: {what} result differs from {expected}")

    for i in range(warmup):
        x.copy_(base)
        all_reduce()
        if i == 0:
            check("first warmup")
    if sync is not None:
        sync.reach(0)
    profiler = cProfile.Profile() if profile and rank == 0 else None
    times, cpu_s, threads0 = [], 0.0, threads_cpu()
    for _ in range(iters):
        x.copy_(base)  # neither timed nor counted: not communication
        cpu0 = time.process_time()
        barrier()
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.runcall(all_reduce)
        else:
            all_reduce()
        times.append(time.perf_counter() - t0)
        cpu_s += time.process_time() - cpu0
    threads = {name: cpu - threads0.get(name, 0.0) for name, cpu in threads_cpu().items()}
    if sync is not None:
        sync.reach(1)
    check("last")
    if profiler is not None:
        profiler.dump_stats(profile)
    return {"times": times, "cpu_s": cpu_s, "join_s": 0.0, "threads": threads}


def gloo_rank(rank: int, world_size: int, init_method: str, elements: int, warmup: int,
              iters: int, profile: str | None) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        x = torch.empty(elements, dtype=torch.float32)
        return _loop(rank, world_size, x, lambda: dist.all_reduce(x), dist.barrier, warmup,
                     iters, None, profile)
    finally:
        dist.destroy_process_group()


def sdk_rank(rank: int, world_size: int, address: str, job: str, elements: int, warmup: int,
             iters: int, sync, profile: str | None) -> dict:
    import torch
    from _paths import shm_report

    import gradstar

    torch.set_num_threads(1)
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=COLLECTIVE_TIMEOUT)
    try:
        x = torch.empty(elements, dtype=torch.float32)
        result = _loop(rank, world_size, x, lambda: pg.all_reduce(x, op="sum", out=x),
                       pg.barrier, warmup, iters, sync, profile)
        result |= shm_report(pg) | {"shards": len(pg.shards)}
        pg.barrier()
    finally:
        pg.close()
    return result


def backend_rank(rank: int, world_size: int, address: str, job: str, elements: int,
                 warmup: int, iters: int, sync, profile: str | None) -> dict:
    import datetime

    import torch
    import torch.distributed as dist
    from _paths import shm_report

    import gradstar  # noqa: F401  (registers backend "gradstar")

    torch.set_num_threads(1)
    dist.init_process_group("gradstar", init_method=f"gradstar://{address}?job={job}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        x = torch.empty(elements, dtype=torch.float32)
        result = _loop(rank, world_size, x, lambda: dist.all_reduce(x), dist.barrier, warmup,
                       iters, sync, profile)
        group = dist.distributed_c10d._get_default_group().gradstar_group
        result |= shm_report(group) | {"shards": len(group.shards)}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


# -- driver ------------------------------------------------------------------------------------


def run_one(config: str, ranks: int, elements: int, warmup: int, iters: int, timeout: float,
            profile: str | None) -> dict:
    """One configuration's timed loop: rank 0's median, ranks' and hub's CPU per GB."""
    label = f"{config} {elements * 4 / MiB:g}MiB"
    if config == "gloo":
        args = (f"tcp://127.0.0.1:{free_port()}", elements, warmup, iters, profile)
        results = run_ranks(gloo_rank, ranks, args, timeout=timeout, label=label)
        summary = summarize(results, elements * 4, iters)
        return summary | {"hub_cpu_s_per_gb": 0.0, "rank0_threads": results[0]["threads"]}
    target = sdk_rank if config == "sdk" else backend_rank
    job = f"bench-backend-cost-{config}-{uuid.uuid4().hex[:8]}"
    run = run_sampled(target, ranks, lambda address, sync: (address, job, elements, warmup,
                                                            iters, sync, profile),
                      shards=0, path="stream", nbytes=elements * 4, timeout=timeout,
                      label=label)
    summary = summarize(run.results, elements * 4, iters)
    return summary | hub_cpu(run.samples, summary["gb_moved"]) | {
        "rank0_threads": run.results[0]["threads"]}


def _total(result: dict) -> float | None:
    hub, ranks = result.get("hub_cpu_s_per_gb"), result.get("ranks_cpu_s_per_gb")
    return None if hub is None or ranks is None else hub + ranks


def _medians(runs: list[dict]) -> dict:
    """The median over repeats of each figure of a configuration."""

    def of(key):
        values = [r[key] if key != "total" else _total(r) for r in runs]
        values = [v for v in values if v is not None]
        return median(values) if values else None

    medians = {key: of(key) for key in ("median_ms", "ranks_cpu_s_per_gb",
                                        "hub_cpu_s_per_gb", "total")}
    calls = len(runs[0]["rank0_times_ms"]) * len(runs[0]["ranks_cpu_s_by_rank"])
    medians["rank_cpu_us_per_call"] = median([r["ranks_cpu_s"] for r in runs]) / calls * 1e6
    return medians


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def table(rows: dict) -> str:
    """One line per (size, configuration): medians over repeats, and ratios to SDK and gloo."""
    lines = []
    for size, by_config in rows.items():
        med = {c: _medians(runs) for c, runs in by_config.items() if runs}
        for config, m in med.items():
            sdk, gloo = med.get("sdk", {}), med.get("gloo", {})
            lines.append([f"{size:g}", config, fmt(m["median_ms"], ".2f"),
                          f"{m['rank_cpu_us_per_call']:.0f}",
                          fmt(m["ranks_cpu_s_per_gb"], ".3f"), fmt(m["hub_cpu_s_per_gb"], ".3f"),
                          fmt(m["total"], ".3f"),
                          _ratio(m["total"], sdk.get("total")),
                          _ratio(m["total"], gloo.get("total")),
                          _ratio(m["median_ms"], sdk.get("median_ms")),
                          _ratio(m["median_ms"], gloo.get("median_ms"))])
    return format_table(["MiB", "config", "ms", "rank CPU us/call", "ranks CPU s/GB",
                         "hub CPU s/GB", "total CPU s/GB", "CPU / sdk", "CPU / gloo",
                         "ms / sdk", "ms / gloo"],
                        lines)


def thread_lines(rows: dict) -> list[str]:
    """Rank 0's CPU per call by thread (median over repeats; the main thread's includes the
    untimed restore of the tensor), the busiest threads first."""
    lines = []
    for size, by_config in rows.items():
        for config, runs in by_config.items():
            calls = len(runs[0]["rank0_times_ms"])
            names = {name for r in runs for name in r["rank0_threads"]}
            per_call = {name: median([r["rank0_threads"].get(name, 0.0) for r in runs])
                        / calls * 1e3 for name in names}
            busy = sorted(((ms, name) for name, ms in per_call.items() if ms >= 0.05),
                          reverse=True)
            lines.append(f"{size:g} MiB {config}: " + ", ".join(
                f"{name} {ms:.2f}" for ms, name in busy))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="CPU per byte: torch.distributed backend 'gradstar' vs the SDK vs gloo.")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[64, 16])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10, help="timed calls per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each configuration, alternated (default 3)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed per run (default 300)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="write a cProfile of rank 0's timed calls per run into DIR")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 1 or args.repeats < 1 or args.ranks < 2:
        parser.error("--iters, --warmup and --repeats must be at least 1, --ranks at least 2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    env = environment() | {"git_commit": git_commit()}
    print(f"backend cost benchmark: torch {env['torch']}, gradstar {env['gradstar']} "
          f"({env['git_commit']}), {env['cpus']} CPUs, {args.ranks} ranks, gRPC stream path, "
          f"{args.warmup}+{args.iters} calls x {args.repeats} repeats, load average "
          f"{env['loadavg_at_start']}", flush=True)
    rows: dict[float, dict[str, list]] = {}
    for size in args.sizes_mb:
        elements = int(size * MiB) // 4
        rows[size] = {c: [] for c in args.configs}
        for repeat in range(args.repeats):
            for config in args.configs:
                profile = (str(args.profile / f"{config}-{size:g}MiB-{repeat}.prof")
                           if args.profile else None)
                result = run_one(config, args.ranks, elements, args.warmup, args.iters,
                                 args.timeout, profile)
                rows[size][config].append(result)
                print(f"  {size:g} MiB {config:8s} #{repeat}: {result['median_ms']:.1f} ms, "
                      f"ranks {fmt(result['ranks_cpu_s_per_gb'], '.3f')} + hub "
                      f"{fmt(result['hub_cpu_s_per_gb'], '.3f')} CPU s/GB", file=sys.stderr,
                      flush=True)
    print()
    print(table(rows))
    print("\nrank 0's CPU ms per call by thread (from /proc; the main thread's includes the "
          "untimed restore of the tensor):")
    for line in thread_lines(rows):
        print("  " + line)
    print(f"\nmedians over {args.repeats} alternated runs of rank 0's median ms and of CPU s/GB "
          f"(ranks: process_time of every rank; hub: the coordinator's user+system; GB = bytes "
          f"per rank x ranks x calls, 1e9); CPU / sdk, ms / gloo, ...: ratios of those medians. "
          f"commit {env['git_commit']}; load average at end {loadavg()}")
    if args.json:
        args.profile = str(args.profile) if args.profile else None
        write_json(args, "backend_cost", environment=env,
                   rows={f"{s:g}": runs for s, runs in rows.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

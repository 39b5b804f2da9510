"""all_to_all_single: gradstar's route (plans through the hub, payload over peer streams) vs
the hub's floor for a route through it, vs gloo.

What is measured
    ``--ranks`` spawned processes each run ``all_to_all_single`` of a float32 tensor of S bytes
    per rank, equal splits, for each S of ``--sizes`` (MB): ``--warmup`` untimed calls, then
    ``--iters`` timed ones, each after an untimed barrier. The table shows rank 0's median.

    * gloo: ``torch.distributed.all_to_all_single`` over backend gloo (tcp on loopback).
    * gradstar peer: ``pg.all_to_all_single`` (gradstar's SDK; what the torch backend calls):
      every rank's plan through the hub (one round trip, ``4 * (3 + 2N)`` bytes per rank), then
      each split straight to its rank over the ranks' peer streams.
    * gradstar torch: the same over ``torch.distributed`` with backend ``gradstar``
      (``--torch``).
    * hub floor and hub ceiling: what a route through the hub would cost, measured without
      building it. Such a route delivers S(N-1)/N bytes to every rank through the hub's
      forwarding path (the path of all_gather) and takes S(N-1)/N from each. ``pg.all_gather``
      of S/N bytes per rank delivers as much and takes less (a lower bound); of S(N-1)/N bytes
      it takes as much and delivers more (an upper bound). With 2 ranks both are exactly the
      traffic of a hub all_to_all, so only the floor runs. Both run with the hub's shared
      memory off (``shared_memory=False``): payloads cross gRPC as they would between hosts;
      "hub floor shm" is the floor with it on (ranks on the hub's host only).

    CPU columns (more robust than wall time on a loaded machine): rank 0's CPU time per call
    (its whole process) and the coordinator's (user + system, from /proc, sampled by rank 0
    between barriers). gradstar's results are checked against a reference computed locally on
    every call of the first size.

How to reproduce
    .venv/bin/python benchmarks/all_to_all.py                           # 2 ranks, 3 sizes
    .venv/bin/python benchmarks/all_to_all.py --ranks 4 --sizes 0.004 1 16 --torch --json a.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BenchmarkError,
    CoordinatorProcess,
    MiB,
    add_run_arguments,
    finish,
    format_table,
    loadavg,
    median,
    run_ranks,
)

COLLECTIVE_TIMEOUT = 120.0


def _elements(nbytes: int, world: int) -> int:
    return max(world, nbytes // 4 // world * world)


def _reference(rank: int, world: int, n: int):
    """What rank ``rank`` must receive when rank r sends ``arange(n) + r * n``, equal splits."""
    import numpy as np

    part = n // world
    return np.concatenate([np.arange(rank * part, (rank + 1) * part, dtype=np.float32) + r * n
                           for r in range(world)])


def _hub_cpu(pid: int | None) -> float:
    """The coordinator's user + system CPU seconds so far (Linux /proc; 0 without a pid)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(call, barrier, warmup: int, iters: int, hub_pid: int | None) -> dict:
    """Wall seconds of each timed call; CPU seconds per call of this process and of the hub."""
    for _ in range(warmup):
        call()
    times = []
    barrier()
    cpu, hub = time.process_time(), _hub_cpu(hub_pid)
    for _ in range(iters):
        barrier()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    barrier()
    return {"times": times, "cpu": (time.process_time() - cpu) / iters,
            "hub_cpu": (_hub_cpu(hub_pid) - hub) / iters}


def gradstar_rank(rank: int, world: int, address: str, job: str, hub_pid: int, sizes: list[int],
                  warmup: int, iters: int, mode: str) -> dict:
    import numpy as np

    import gradstar
    from gradstar.config import ClientSettings

    options = {}
    if "shared_memory" in ClientSettings.model_fields:  # the hub's same-host fast path
        options["shared_memory"] = mode.endswith("_shm")
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world, rank=rank,
                                     timeout=COLLECTIVE_TIMEOUT, **options)
    try:
        times = {}
        for i, nbytes in enumerate(sizes):
            n = _elements(nbytes, world)
            x = np.arange(n, dtype=np.float32) + rank * n
            if mode.startswith("hub_"):
                part = x[:n - n // world if mode == "hub_ceiling" else n // world].copy()

                def call(part=part):
                    return pg.all_gather(part)
            else:
                def call(x=x):
                    return pg.all_to_all_single(x)
            if mode == "peer" and i == 0:
                for _ in range(3):
                    if not np.array_equal(call(), _reference(rank, world, n)):
                        raise BenchmarkError(f"rank {rank}: all_to_all_single gave a wrong result")
            times[nbytes] = _timed(call, pg.barrier, warmup, iters, hub_pid)
        pg.barrier()
        return {"sizes": times}
    finally:
        pg.close()


def torch_rank(rank: int, world: int, init_method: str, backend: str, hub_pid: int | None,
               sizes: list[int], warmup: int, iters: int) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    if backend == "gradstar":
        import gradstar  # noqa: F401  (registers backend "gradstar")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        times = {}
        for i, nbytes in enumerate(sizes):
            n = _elements(nbytes, world)
            x = torch.arange(n, dtype=torch.float32) + rank * n
            out = torch.empty_like(x)
            if i == 0:
                dist.all_to_all_single(out, x)
                if not torch.equal(out, torch.from_numpy(_reference(rank, world, n))):
                    raise BenchmarkError(f"rank {rank}: {backend} gave a wrong result")
            times[nbytes] = _timed(lambda x=x, out=out: dist.all_to_all_single(out, x),
                                   dist.barrier, warmup, iters, hub_pid)
        dist.barrier()
        return {"sizes": times}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.004, 1.0, 16.0],
                        help="MB per rank")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--torch", action="store_true",
                        help="also run torch.distributed with backend gradstar")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(mb * MiB) for mb in args.sizes]
    common = (sizes, args.warmup, args.iters)
    print(f"all_to_all_single benchmark: {os.cpu_count()} CPUs, {args.ranks} ranks, sizes "
          f"{args.sizes} MB per rank, {args.warmup}+{args.iters} calls, load average "
          f"{loadavg()}", flush=True)

    def on_hub(mode: str) -> list:
        with CoordinatorProcess(shards=0) as coord:
            job = f"bench-a2a-{uuid.uuid4().hex[:8]}"
            return run_ranks(gradstar_rank, args.ranks,
                             (coord.address, job, coord.proc.pid, *common, mode),
                             timeout=args.timeout, label=mode)

    def gloo() -> list:
        with tempfile.TemporaryDirectory() as folder:
            return run_ranks(torch_rank, args.ranks, (f"file://{folder}/rendezvous", "gloo",
                                                      None, *common),
                             timeout=args.timeout, label="gloo")

    def gradstar_torch() -> list:
        with CoordinatorProcess(shards=0) as coord:
            job = f"bench-a2a-{uuid.uuid4().hex[:8]}"
            return run_ranks(torch_rank, args.ranks,
                             (f"gradstar://{coord.address}?job={job}", "gradstar",
                              coord.proc.pid, *common), timeout=args.timeout,
                             label="gradstar torch")

    configs = [("gloo", gloo), ("gradstar peer", lambda: on_hub("peer"))]
    if args.torch:
        configs.append(("gradstar torch", gradstar_torch))
    configs.append(("hub floor", lambda: on_hub("hub_floor")))
    if args.ranks > 2:
        configs.append(("hub ceiling", lambda: on_hub("hub_ceiling")))
    configs.append(("hub floor shm", lambda: on_hub("hub_floor_shm")))
    runs, failures = {}, []
    for name, run in configs:
        started = time.monotonic()
        try:
            runs[name] = run()
            print(f"  {name:15s} done ({time.monotonic() - started:.1f} s)", file=sys.stderr,
                  flush=True)
        except BenchmarkError as error:
            failures.append((name, str(error)))
            print(f"  {name:15s} FAILED", file=sys.stderr, flush=True)

    gloo = runs["gloo"][0]["sizes"] if "gloo" in runs else None
    rows, summary = [], {}
    for name, results in runs.items():
        summary[name] = {}
        for nbytes in sizes:
            measured = results[0]["sizes"][nbytes]
            ms = median(measured["times"]) * 1e3
            ratio = f"{ms / (median(gloo[nbytes]['times']) * 1e3):.2f}" if gloo else "-"
            gbs = nbytes * (args.ranks - 1) / args.ranks / (ms / 1e3) / 1e9
            hub = "-" if name == "gloo" else f"{measured['hub_cpu'] * 1e3:.1f}"
            rows.append([name, f"{nbytes / MiB:.3g}", f"{ms:.2f}", ratio, f"{gbs:.2f}",
                         f"{measured['cpu'] * 1e3:.1f}", hub])
            summary[name][nbytes] = {"median_ms": ms, "rank0_cpu_ms": measured["cpu"] * 1e3,
                                     "hub_cpu_ms": measured["hub_cpu"] * 1e3}
    print()
    print(format_table(["route", "MB/rank", "ms/call", "vs gloo", "GB/s out/rank",
                        "rank CPU ms", "hub CPU ms"], rows))
    print(f"\nrank 0's median over {args.iters} timed calls; GB/s: bytes each rank sends to "
          f"the others per second; CPU: per call, rank 0's process and the coordinator's; "
          f"load average at end {loadavg()}")
    return finish(args, "all_to_all", summary, failures)


if __name__ == "__main__":
    raise SystemExit(main())

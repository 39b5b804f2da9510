"""A tiny all_reduce's CPU by thread: which thread of the hub or a rank sets the pace (issue 36).

What is measured
    2 ranks on this host, ``--calls`` all_reduces of ``--numel`` float32 (default 25: 100 B)
    back to back after 200 untimed, first over torch.distributed gloo (``tcp://``), then over
    gradstar (a fresh ``gradstar coordinator --shards 0``, the blocking ProcessGroup, every
    byte on the gRPC stream: ``GRADSTAR_SHARED_MEMORY=0``). Prints per call: the slower rank's
    wall microseconds, each rank's CPU (``process_time``), rank 0's CPU by thread and the hub's
    CPU by thread (user + system from /proc, summed by thread name: ``_processes.threads_cpu``;
    the hub's over the whole run, warm-up and joins included). A thread whose CPU per call
    approaches the wall time per call is the one that sets the pace. Run it under ``taskset``
    to compare core counts.

How to reproduce
    .venv/bin/python benchmarks/tiny_threads.py
    .venv/bin/python benchmarks/tiny_threads.py --calls 5000 --numel 2500

Not asserted: any timing.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _processes import free_port, threads_cpu

WARMUP = 200


def _gloo_rank(rank: int, port: int, calls: int, numel: int, results) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    x = torch.full((numel,), rank + 1.0)
    for _ in range(WARMUP):
        dist.all_reduce(x)
    dist.barrier()
    x.fill_(rank + 1.0)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        dist.all_reduce(x)
    results.put((rank, time.perf_counter() - wall, time.process_time() - cpu, None))
    dist.destroy_process_group()


def _gradstar_rank(rank: int, port: int, calls: int, numel: int, results) -> None:
    import gradstar

    pg = gradstar.init_process_group(coordinator=f"127.0.0.1:{port}", job="tiny-threads",
                                     world_size=2, rank=rank, timeout=60)
    x = np.full(numel, rank + 1.0, dtype=np.float32)
    for _ in range(WARMUP):
        pg.all_reduce(x)
    pg.barrier()
    before = threads_cpu()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        y = pg.all_reduce(x)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = threads_cpu()
    if not (y == 3.0).all():
        raise SystemExit(f"rank {rank}: wrong all_reduce result")
    results.put((rank, wall, cpu, {k: after[k] - before.get(k, 0.0) for k in after}))
    pg.close()


def _ranks(target, port: int, args) -> list:
    results = mp.Queue()
    procs = [mp.Process(target=target, args=(r, port, args.calls, args.numel, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=args.timeout) for _ in procs)
    for p in procs:
        p.join(args.timeout)
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return got


def _us(seconds: float, calls: int) -> int:
    return round(seconds / calls * 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--numel", type=int, default=25, help="float32 elements (default 25)")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    mp.set_start_method("spawn")
    print(f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; {args.calls} calls of "
          f"{args.numel * 4} B; us per call", flush=True)
    got = _ranks(_gloo_rank, free_port(), args)
    print(f"gloo:     {max(_us(g[1], args.calls) for g in got)} wall; rank CPU "
          f"{[_us(g[2], args.calls) for g in got]}", flush=True)
    env = dict(os.environ, GRADSTAR_SHARED_MEMORY="0")
    os.environ["GRADSTAR_SHARED_MEMORY"] = "0"
    port = free_port()
    hub = subprocess.Popen([sys.executable, "-m", "gradstar", "coordinator", "--host",
                            "127.0.0.1", "--port", str(port), "--shards", "0", "--log-level",
                            "WARNING"], env=env, stdout=subprocess.DEVNULL)
    try:
        time.sleep(2.0)  # its start-up is not what is measured
        before = threads_cpu(hub.pid)
        got = _ranks(_gradstar_rank, port, args)
        after = threads_cpu(hub.pid)
    finally:
        hub.send_signal(signal.SIGINT)
        hub.wait(30)
    calls = args.calls + WARMUP + 1
    hub_threads = {k: _us(after[k] - before.get(k, 0.0), calls) for k in after}
    rank0 = {k: _us(v, args.calls) for k, v in got[0][3].items()}
    print(f"gradstar: {max(_us(g[1], args.calls) for g in got)} wall; rank CPU "
          f"{[_us(g[2], args.calls) for g in got]}; rank 0 by thread "
          f"{ {k: v for k, v in rank0.items() if v} }; hub by thread (warm-up and joins "
          f"included) { {k: v for k, v in hub_threads.items() if v} }")
    return 0


if __name__ == "__main__":
    sys.exit(main())

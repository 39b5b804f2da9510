"""The torch.distributed script that benchmarks/cluster_torch.py runs under torchrun on every
emulated host: an ordinary one, ``dist.init_process_group(BACKEND)`` with nothing else set (the
env:// rendezvous torchrun's environment gives), then ``dist.all_reduce`` of a float32 tensor.

It prints JSON lines on stdout: ``{"pid": ...}`` once joined (the benchmark counts the CPU of
the processes below it: gradstar's hub and node shard); on rank 0 ``{"phase": "start"}`` and
``{"phase": "end"}`` around the timed loop, each followed by a wait for the file of that name in
``--go`` (the benchmark samples links and CPU there, while every rank waits at a barrier); and
``{"result": ...}`` at the end.

The tensor is not reset between iterations (a reset is a 64 MiB copy that would count as the
ranks' CPU): every element starts at rank + 1 and after k sums holds n(n+1)/2 * n**(k-1),
exact in float32 while it stays below 2**24 (with a power-of-two n, always); beyond that it is
checked to float32's rounding. The result is checked after the warm-up and after the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gradstar  # noqa: F401  (registers backend "gradstar", as a user's script would)


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"rank 0: no {path} within {timeout:g} s")
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--go", type=Path, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # every rank shares the machine's cores with the others
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    print(json.dumps({"pid": os.getpid(), "rank": rank}), flush=True)
    x = torch.full((args.nbytes // 4,), float(rank + 1), dtype=torch.float32)
    calls = 0

    def check() -> None:
        want = n * (n + 1) / 2 * n ** (calls - 1)
        tolerance = 0.0 if want < 2**24 else want * 2.0**-20
        if not bool(((x - want).abs() <= tolerance).all()):
            raise SystemExit(f"rank {rank}: wrong all_reduce result (want {want})")

    def phase(name: str) -> None:
        dist.barrier()
        if rank == 0:
            print(json.dumps({"phase": name}), flush=True)
            wait_for_file(args.go / name, args.timeout)
        dist.barrier()

    for _ in range(args.warmup):
        dist.all_reduce(x)
        calls += 1
    check()
    phase("start")
    times = []
    cpu = time.process_time()
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu
    calls += args.iters
    check()
    phase("end")
    print(json.dumps({"result": {"rank": rank, "times": times, "cpu_s": cpu}}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

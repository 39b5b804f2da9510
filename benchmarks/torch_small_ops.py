"""What one small torch.distributed call costs, op by op: "gradstar" against gloo (issue 36).

What is measured
    ``--ranks`` spawned processes on this host call each op back to back on ``--numel``-element
    float32 CPU tensors, as a training loop's per-step extras do (loss averaging, metric syncs,
    barriers, a broadcast seed): ``dist.all_reduce``, ``dist.barrier``, ``dist.broadcast`` (from
    rank 0), ``dist.all_gather`` (a list), ``dist.all_gather_single`` and
    ``dist.reduce_scatter_single`` (``all_gather_into_tensor`` and ``reduce_scatter_tensor``
    before torch renamed them), and ``dist.all_gather_object`` (a small dict). Each op runs
    ``--calls`` times after 50 untimed calls and a barrier; the figure is rank 0's median
    milliseconds per call, each backend in its own process group: gloo, then gradstar on a fresh
    ``gradstar coordinator --shards 0`` (every byte on the gRPC stream: a payload this small
    rides it either way). Every result is checked against the value the op must produce.

    A gradstar call is one round trip through the hub (every rank sends, the hub answers each);
    gloo's differ by op (its broadcast root returns once its bytes are sent). Where the time of
    a gradstar all_reduce goes: ``benchmarks/call_python.py`` (a rank's Python),
    ``benchmarks/hub_python.py`` (the hub's), ``benchmarks/call_floor.py`` (gRPC's floor).

How to reproduce
    .venv/bin/python benchmarks/torch_small_ops.py                    # 2 ranks, 500 calls per op
    .venv/bin/python benchmarks/torch_small_ops.py --ranks 4 --calls 200

Not asserted: any timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _processes import CoordinatorProcess, free_port
from _ranks import run_ranks
from _report import environment, format_table

OPS = ("all_reduce", "barrier", "broadcast", "all_gather", "all_gather_single",
       "reduce_scatter_single", "all_gather_object")
WARMUP = 50


def _ops(rank: int, world: int, numel: int) -> dict:
    """Each op as (call, check): ``check()`` raises if the last call's result is wrong."""
    import torch
    import torch.distributed as dist

    t = torch.empty(numel)
    gathered = [torch.empty(numel) for _ in range(world)]
    flat = torch.empty(numel * world)
    shard = torch.empty(numel)
    objects: list = [None] * world
    want_gather = [float(r) for r in range(world)]

    def all_reduce():
        t.fill_(rank + 1.0)
        dist.all_reduce(t)

    def broadcast():
        t.fill_(float(rank))
        dist.broadcast(t, 0)

    def all_gather():
        dist.all_gather(gathered, torch.full((numel,), float(rank)))

    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def all_gather_single():
        gather_into(flat, torch.full((numel,), float(rank)))

    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def reduce_scatter_single():
        reduce_scatter(shard, torch.ones(numel * world))

    def all_gather_object():
        dist.all_gather_object(objects, {"rank": rank})

    def same(values, want):
        if values != want:
            raise AssertionError(f"rank {rank}: got {values}, want {want}")

    return {
        "all_reduce": (all_reduce, lambda: same(t[:1].tolist(), [world * (world + 1) / 2])),
        "barrier": (dist.barrier, lambda: None),
        "broadcast": (broadcast, lambda: same(t[:1].tolist(), [0.0])),
        "all_gather": (all_gather, lambda: same([g[0].item() for g in gathered], want_gather)),
        "all_gather_single": (all_gather_single, lambda: same(
            flat[::numel].tolist(), want_gather)),
        "reduce_scatter_single": (reduce_scatter_single, lambda: same(shard[:1].tolist(),
                                                                      [float(world)])),
        "all_gather_object": (all_gather_object, lambda: same(
            [o["rank"] for o in objects], list(range(world)))),
    }


def rank_main(rank: int, world: int, backend: str, init_method: str, numel: int,
              calls: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    if backend == "gradstar":
        import gradstar  # noqa: F401  (registers backend "gradstar")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    medians: dict[str, float] = {}
    try:
        for name, (call, check) in _ops(rank, world, numel).items():
            for _ in range(WARMUP):
                call()
            check()
            dist.barrier()
            times = []
            for _ in range(calls):
                began = time.perf_counter()
                call()
                times.append(time.perf_counter() - began)
            check()
            medians[name] = statistics.median(times) * 1e3
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--numel", type=int, default=25, help="float32 elements (default 25)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    run = (args.numel, args.calls)
    load_before = environment().get("loadavg_at_start")
    gloo = run_ranks(rank_main, args.ranks,
                     ("gloo", f"tcp://127.0.0.1:{free_port()}", *run),
                     timeout=args.timeout, label="gloo")[0]
    with CoordinatorProcess(shards=0, env={"GRADSTAR_SHARED_MEMORY": "0"}) as hub:
        ours = run_ranks(rank_main, args.ranks,
                         ("gradstar", f"gradstar://{hub.address}?job=small-ops", *run),
                         timeout=args.timeout, label="gradstar",
                         env={"GRADSTAR_SHARED_MEMORY": "0"})[0]
    print(format_table(["op", "gloo ms", "gradstar ms", "x gloo"],
                       [[op, f"{gloo[op]:.3f}", f"{ours[op]:.3f}", f"{ours[op] / gloo[op]:.2f}"]
                        for op in OPS]))
    env = environment()
    print(f"\n{args.ranks} ranks on one host, {args.numel} float32 per tensor, rank 0's median "
          f"of {args.calls} calls per op after {WARMUP}; python {env.get('python')}, torch "
          f"{env.get('torch')}, {env.get('cpus')} CPUs, load average before the gloo run "
          f"... after the gradstar run: {load_before} ... {env.get('loadavg_at_start')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

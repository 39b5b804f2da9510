"""DDP training step time: gradstar.DistributedDataParallel vs torch's DDP over gloo.

What is measured
    The same ~9.5M-parameter MLP (widths 1024-2048-2048-1024-1024, ReLU, float32, 37 MB of
    gradients) is trained with SGD by ``--ranks`` spawned processes (default 2), each on its own
    ``--batch`` rows of a deterministic random batch, in three configurations run one after the
    other in the same invocation:

    * gradstar: a ``gradstar coordinator --shards K`` subprocess on 127.0.0.1 (``--shards``,
      default 0: the single in-process hub; K > 0: K shard processes carry the collectives) and
      ``gradstar.DDP(model, pg, bucket_cap_mb=...)`` (optionally ``--compression bf16``), once
      per data path (``--paths``, default both): ``gradstar shm``, chunk payloads through the
      same-host shared-memory segments, and ``gradstar stream``, every byte on the gRPC stream
      (GRADSTAR_SHARED_MEMORY=1 / 0 for the coordinator and the ranks). Each rank reports the
      path its collectives took, and a configuration that did not take the path it is labelled
      with fails;
    * gloo: ``torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=...)`` over
      ``init_process_group("gloo", init_method="tcp://127.0.0.1:<free port>")``;
    * local: the bare model in each rank, no communication (the compute floor).

    Every rank runs ``--warmup`` untimed steps, then ``--iters`` timed steps of
    ``zero_grad(); loss = mse(model(x), y); loss.backward(); opt.step()`` (each preceded by a
    barrier so ranks start together; the barrier is not timed). Each rank uses one torch thread
    (``torch.set_num_threads(1)``) so that the ranks and the hub do not oversubscribe the cores
    for either backend. The table shows rank 0's median step time; ratio = gradstar / gloo.

    Correctness is checked, not assumed: ranks start from different seeds (DDP's broadcast must
    make them identical), every rank reports a sample of its final parameters, the run fails if
    the ranks of a backend disagree, and the largest difference between gradstar's and gloo's
    final parameters is printed (float32 rounding only without compression).

How to reproduce
    .venv/bin/python benchmarks/ddp_step.py                       # defaults: 2 ranks, 3+10 steps
    .venv/bin/python benchmarks/ddp_step.py --paths stream        # only the gRPC stream path
    .venv/bin/python benchmarks/ddp_step.py --ranks 2 --iters 20 --compression bf16 --json out.json
    .venv/bin/python benchmarks/ddp_step.py --ranks 4 --shards 2        # hub with 2 shards
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _collective_runs import check_shards, coordinator
from _harness import (
    BenchmarkError,
    add_paths_argument,
    add_run_arguments,
    check_path,
    finish,
    format_table,
    free_port,
    loadavg,
    median,
    path_env,
    run_configs,
    run_ranks,
    shm_report,
)

WIDTHS = [1024, 2048, 2048, 1024, 1024]
COLLECTIVE_TIMEOUT = 300.0
SAMPLE_EVERY = 997  # every 997th parameter is reported for the cross-checks


# -- rank bodies (run in spawned processes) ----------------------------------------------------


def _model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _data(rank: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(12345)
    x = torch.randn(batch * 64, WIDTHS[0], generator=g)
    y = torch.randn(batch * 64, WIDTHS[-1], generator=g)
    return x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]


def _train(model, step_model, barrier, rank: int, batch: int, warmup: int, iters: int) -> dict:
    import torch

    x, y = _data(rank, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + iters):
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(step_model(x), y)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"times": times, "sample": flat[::SAMPLE_EVERY].tolist(),
            "params": int(flat.numel())}


def gradstar_rank(rank: int, world_size: int, address: str, job: str, batch: int, warmup: int,
                  iters: int, bucket_cap_mb: float, compression: str | None) -> dict:
    import torch

    import gradstar

    torch.set_num_threads(1)
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=COLLECTIVE_TIMEOUT)
    try:
        model = _model(seed=rank)
        ddp = gradstar.DDP(model, pg, bucket_cap_mb=bucket_cap_mb,
                           gradient_compression=compression)
        result = _train(model, ddp, pg.barrier, rank, batch, warmup, iters)
        t = ddp.last_step_timeline
        result["buckets"] = len(ddp.bucket_plan)
        result["launched_during_backward"] = t.launched_during_backward
        result["shards"] = len(pg.shards)
        result |= shm_report(pg)
        pg.barrier()
    finally:
        pg.close()
    return result


def gloo_rank(rank: int, world_size: int, init_method: str, batch: int, warmup: int, iters: int,
              bucket_cap_mb: float) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        model = _model(seed=rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        result = _train(model, ddp, dist.barrier, rank, batch, warmup, iters)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def local_rank(rank: int, world_size: int, batch: int, warmup: int, iters: int) -> dict:
    import torch

    torch.set_num_threads(1)
    model = _model(seed=0)
    return _train(model, model, lambda: None, rank, batch, warmup, iters)


# -- driver ------------------------------------------------------------------------------------


def _check_ranks_agree(results: list[dict], label: str) -> None:
    first = results[0]["sample"]
    for rank, r in enumerate(results[1:], start=1):
        if r["sample"] != first:
            worst = max(abs(a - b) for a, b in zip(first, r["sample"], strict=True))
            raise BenchmarkError(f"[{label}] rank {rank}'s parameters differ from rank 0's "
                                 f"(max abs diff {worst:g}): the replicas diverged")


def run_on_hub(target: Callable, ranks: int, args: tuple, *, shards: int, path: str,
               timeout: float, label: str) -> list[dict]:
    """Run ``target(rank, ranks, address, job, *args)`` in ``ranks`` processes against a fresh
    :func:`coordinator` with ``shards``, the hub and the ranks set up for data path ``path``;
    returns the ranks' results. Raises :class:`BenchmarkError` if they fail, or did not use
    ``shards`` shards or the path ``path`` (each rank's result must carry ``shm_report``)."""
    env = path_env(path)
    with coordinator(shards, env) as coord:
        job = f"bench-step-{uuid.uuid4().hex[:8]}"
        results = run_ranks(target, ranks, (coord.address, job, *args), timeout=timeout,
                            label=label, env=env)
    check_shards(results, shards, label)
    check_path(results, path, label)
    return results


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The DDP-step options this benchmark shares with benchmarks/torch_backend.py."""
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--shards", type=int, default=0, metavar="K",
                        help="start gradstar's coordinator with --shards K (default 0: the "
                             "single in-process hub)")
    add_paths_argument(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DDP step time: gradstar vs torch gloo.")
    add_step_arguments(parser)
    parser.add_argument("--compression", choices=["bf16", "fp16"], default=None,
                        help="also run gradstar with this gradient compression")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if args.shards < 0:
        parser.error("--shards must be at least 0")
    if len(set(args.paths)) != len(args.paths):
        parser.error("--paths takes distinct values")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    print(f"gradstar DDP step benchmark: torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{args.ranks} ranks x batch {args.batch}, MLP {WIDTHS}, bucket_cap_mb "
          f"{args.bucket_cap_mb:g}, {args.warmup}+{args.iters} steps, coordinator --shards "
          f"{args.shards}, paths {' '.join(args.paths)}, load average {loadavg()}", flush=True)
    common = (args.batch, args.warmup, args.iters)

    def gradstar_config(compression, path):
        name = " ".join(filter(None, ("gradstar", compression, path)))
        return name, lambda: run_on_hub(gradstar_rank, args.ranks,
                                        (*common, args.bucket_cap_mb, compression),
                                        shards=args.shards, path=path, timeout=args.timeout,
                                        label=name)

    configs = [("local", lambda: run_ranks(local_rank, args.ranks, common,
                                           timeout=args.timeout, label="local")),
               ("gloo", lambda: run_ranks(gloo_rank, args.ranks,
                                          (f"tcp://127.0.0.1:{free_port()}", *common,
                                           args.bucket_cap_mb),
                                          timeout=args.timeout, label="gloo"))]
    configs += [gradstar_config(None, path) for path in args.paths]
    if args.compression:
        configs += [gradstar_config(args.compression, path) for path in args.paths]
    runs, failures = run_configs(configs, _check_ranks_agree)

    gloo = runs.get("gloo")
    gloo_ms = median(gloo[0]["times"]) * 1e3 if gloo else None
    rows, summary = [], {}
    for name, results in runs.items():
        if results is None:
            rows.append([name, "FAILED", "-", "-", "-"])
            continue
        ms = median(results[0]["times"]) * 1e3
        ratio = f"{ms / gloo_ms:.2f}" if gloo_ms else "-"
        diff = "-"
        if gloo and name.startswith("gradstar"):
            pairs = zip(results[0]["sample"], gloo[0]["sample"], strict=True)
            diff = f"{max(abs(a - b) for a, b in pairs):.1e}"
        overlap = (f"{results[0]['launched_during_backward']}/{results[0]['buckets']}"
                   if "buckets" in results[0] else "-")
        rows.append([name, f"{ms:.1f}", ratio, overlap, diff])
        summary[name] = {"median_ms": ms, "rank0_times_ms": [t * 1e3 for t in results[0]["times"]],
                         "median_ms_by_rank": [median(r["times"]) * 1e3 for r in results]}
        if name.startswith("gradstar"):
            summary[name]["shards"] = args.shards
            summary[name]["path"] = name.rsplit(" ", 1)[1]
    print()
    print(format_table(["backend", "ms/step", "ratio vs gloo", "buckets launched in backward",
                        "max |param - gloo param|"], rows))
    params = next((r[0]["params"] for r in runs.values() if r), None)
    print(f"\nrank 0's median over {args.iters} timed steps; {params} parameters; local = the "
          f"same step without communication; gradstar's hub: coordinator --shards "
          f"{args.shards}; shm / stream: data path between ranks and hub (shared-memory "
          f"segments / gRPC stream); load average at end {loadavg()}")
    return finish(args, "ddp_step", summary, failures)


if __name__ == "__main__":
    raise SystemExit(main())

"""torch's own DDP step time over torch.distributed backend "gradstar" vs backend "gloo".

What is measured
    The model, data, optimizer and step of ``ddp_step.py`` (a ~9.5M-parameter MLP, 37 MB of
    float32 gradients, SGD, ``--ranks`` spawned processes with one torch thread each), trained
    with ``torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=...)`` -- the same
    torch code in every configuration; only ``init_process_group`` differs:

    * gloo: ``init_process_group("gloo", init_method="file://...")``;
    * gradstar: a ``gradstar coordinator --shards K`` subprocess on 127.0.0.1 (``--shards``,
      default 0: the single in-process hub) and
      ``init_process_group("gradstar", init_method="gradstar://127.0.0.1:PORT?job=...")``, once
      per data path (``--paths``, default both): ``gradstar shm``, chunk payloads through the
      same-host shared-memory segments, and ``gradstar stream``, every byte on the gRPC stream
      (GRADSTAR_SHARED_MEMORY=1 / 0 for the coordinator and the ranks), each checked as in
      ``ddp_step.py``;
    * local: the bare model, no communication (the compute floor);
    * with ``--native``, also gradstar's own ``gradstar.DDP`` for comparison.

    Every rank runs ``--warmup`` untimed steps, then ``--iters`` timed steps, each preceded by an
    untimed barrier. The table shows rank 0's median step time and, for each backend, the largest
    difference of a sample of its final parameters from gloo's (float32 rounding only). The run
    fails if the ranks of a backend end with different parameters.

How to reproduce
    .venv/bin/python benchmarks/torch_backend.py                        # 2 ranks, 3+10 steps
    .venv/bin/python benchmarks/torch_backend.py --paths shm             # only shared memory
    .venv/bin/python benchmarks/torch_backend.py --ranks 4 --iters 20 --native --json out.json
    .venv/bin/python benchmarks/torch_backend.py --ranks 4 --shards 2    # hub with 2 shards
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    add_run_arguments,
    finish,
    format_table,
    loadavg,
    median,
    run_configs,
    run_ranks,
    shm_report,
)
from ddp_step import (
    COLLECTIVE_TIMEOUT,
    WIDTHS,
    _check_ranks_agree,
    _model,
    _train,
    add_step_arguments,
    gloo_rank,
    gradstar_rank,
    local_rank,
    run_on_hub,
)


def torch_ddp_on_gradstar_rank(rank: int, world_size: int, address: str, job: str, batch: int,
                               warmup: int, iters: int, bucket_cap_mb: float) -> dict:
    """ddp_step.gloo_rank with one line changed: the backend."""
    import datetime

    import torch
    import torch.distributed as dist

    import gradstar  # noqa: F401  (registers backend "gradstar")

    torch.set_num_threads(1)
    dist.init_process_group("gradstar", init_method=f"gradstar://{address}?job={job}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        model = _model(seed=rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        result = _train(model, ddp, dist.barrier, rank, batch, warmup, iters)
        result |= shm_report(dist.distributed_c10d._get_default_group().gradstar_group)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="torch DDP step time: gradstar vs gloo backend.")
    add_step_arguments(parser)
    parser.add_argument("--native", action="store_true", help="also run gradstar.DDP")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    if args.shards < 0:
        parser.error("--shards must be at least 0")
    if len(set(args.paths)) != len(args.paths):
        parser.error("--paths takes distinct values")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    print(f"torch DDP step benchmark, backend gradstar vs gloo: torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {args.ranks} ranks x batch {args.batch}, MLP {WIDTHS}, "
          f"bucket_cap_mb {args.bucket_cap_mb:g}, {args.warmup}+{args.iters} steps, "
          f"coordinator --shards {args.shards}, paths {' '.join(args.paths)}, load average "
          f"{loadavg()}", flush=True)
    common = (args.batch, args.warmup, args.iters)

    def on_hub(backend, path, target, *extra):
        name = f"{backend} {path}"
        return name, lambda: run_on_hub(target, args.ranks, (*common, *extra), shards=args.shards,
                                        path=path, timeout=args.timeout, label=name)

    def gloo():
        with tempfile.TemporaryDirectory() as folder:
            return run_ranks(gloo_rank, args.ranks, (f"file://{folder}/rendezvous", *common,
                                                     args.bucket_cap_mb),
                             timeout=args.timeout, label="gloo")

    configs = [("local", lambda: run_ranks(local_rank, args.ranks, common,
                                           timeout=args.timeout, label="local")),
               ("gloo", gloo)]
    configs += [on_hub("gradstar", path, torch_ddp_on_gradstar_rank, args.bucket_cap_mb)
                for path in args.paths]
    if args.native:
        configs += [on_hub("gradstar.DDP", path, gradstar_rank, args.bucket_cap_mb, None)
                    for path in args.paths]
    runs, failures = run_configs(configs, _check_ranks_agree)

    gloo_runs = runs.get("gloo")
    gloo_ms = median(gloo_runs[0]["times"]) * 1e3 if gloo_runs else None
    rows, summary = [], {}
    for name, results in runs.items():
        if results is None:
            rows.append([name, "FAILED", "-", "-"])
            continue
        ms = median(results[0]["times"]) * 1e3
        diff = "-"
        if gloo_runs and name != "local":
            pairs = zip(results[0]["sample"], gloo_runs[0]["sample"], strict=True)
            diff = f"{max(abs(a - b) for a, b in pairs):.1e}"
        rows.append([name, f"{ms:.1f}", f"{ms / gloo_ms:.2f}" if gloo_ms else "-", diff])
        summary[name] = {"median_ms": ms, "rank0_times_ms": [t * 1e3 for t in results[0]["times"]],
                         "median_ms_by_rank": [median(r["times"]) * 1e3 for r in results]}
        if name.startswith("gradstar"):
            summary[name]["shards"] = args.shards
            summary[name]["path"] = name.rsplit(" ", 1)[1]
    print()
    print(format_table(["backend", "ms/step", "ratio vs gloo", "max |param - gloo param|"],
                       rows))
    print(f"\nrank 0's median over {args.iters} timed steps of torch's DDP (gradstar.DDP: "
          f"gradstar's own wrapper); local = the same step without communication; gradstar's "
          f"hub: coordinator --shards {args.shards}; shm / stream: data path between ranks and "
          f"hub (shared-memory segments / gRPC stream); load average at end {loadavg()}")
    return finish(args, "torch_backend", summary, failures)


if __name__ == "__main__":
    raise SystemExit(main())

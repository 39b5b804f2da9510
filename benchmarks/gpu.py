"""Tensors on a GPU: all_reduce and a DDP step, gradstar vs torch.distributed gloo (issue #14).

How to reproduce
    .venv/bin/python benchmarks/gpu.py                        # CUDA: 2 ranks, 1-256 MiB, 25M MLP
    .venv/bin/python benchmarks/gpu.py --json /tmp/gpu.json   # ... and the rows + environment
    .venv/bin/python benchmarks/gpu.py --ranks 2 4 --paths shm --parts allreduce
    .venv/bin/python benchmarks/gpu.py --parts ddp --steps 20 --model-mparams 25
    # the same measurements on CPU tensors (a machine without CUDA; small settings)
    .venv/bin/python benchmarks/gpu.py --device cpu --sizes-mb 1 4 --iters 5 --warmup 1 \\
        --steps 3 --warmup-steps 1 --model-mparams 1

    The command line of a run is printed in its first lines (and stored in ``--json``).
    ``--device cuda`` (the default) on a machine where torch sees no CUDA device exits with
    code 2 and one line saying so; ``--device cpu`` measures CPU tensors instead.

Devices
    ``--device cuda``: rank r computes on ``cuda:{r % torch.cuda.device_count()}``
    (``torch.cuda.set_device`` first), so with one GPU every rank shares it, each with its own
    CUDA context. The tables name the GPU (``torch.cuda.get_device_name``). Every backend gets
    CUDA tensors: gloo stages them through host memory itself, gradstar through pinned host
    memory (:mod:`gradstar.client.device`). A timed interval starts after
    ``torch.cuda.synchronize()`` and ends with one, so queued copies and kernels are inside it
    for every backend alike. ``--device cpu``: the same code on CPU tensors.

Part 1, all_reduce (``--parts allreduce``)
    For each (``--ranks``, ``--sizes-mb``) configuration, one after the other in this run:

    * ``gloo``: ``torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:P")``
      and ``dist.all_reduce(x)`` of a float32 tensor ``full(size/4, r + 1)`` on the rank's
      device (restored from a saved copy, untimed, before every call: it reduces in place);
    * ``gradstar torch <path>``: the same ``dist.all_reduce(x)`` call, the process group
      created with ``init_process_group("gradstar", init_method="gradstar://HOST:PORT?job=J")``
      against a fresh ``gradstar coordinator --shards K`` subprocess (``--shards``, default 0);
    * ``gradstar sdk <path>``: gradstar's own API on the same hub kind:
      ``pg = gradstar.init_process_group(...)``, ``out = pg.all_reduce(x)`` (a new tensor on
      x's device).

    Each gradstar configuration runs once per data path (``--paths``, default both): ``shm``
    (payloads through the same-host shared-memory segments, GRADSTAR_SHARED_MEMORY=1) and
    ``stream`` (every byte on the gRPC stream, GRADSTAR_SHARED_MEMORY=0), set for the hub and
    the ranks and checked afterwards as in ``allreduce.py``. ``--backends`` picks among
    ``gloo``, ``torch`` and ``sdk``.

    Each rank runs ``warmup`` untimed calls, then ``iters`` timed ones: ``synchronize;
    barrier(); t0; all_reduce; synchronize; t``. Defaults by size as in ``allreduce.py`` (up to
    1 MiB 5+50, to 16 MiB 3+20, to 64 MiB 2+10, larger 1+5); ``--warmup`` / ``--iters`` set
    them for every size. The first and the last result of every rank are checked exactly
    (device, dtype, shape, every element = n(n+1)/2); a wrong one fails the configuration.
    Table: rank 0's median ms, ratio = gradstar / gloo (above 1: gradstar slower), GB/s/rank
    = bytes / median (GB = 1e9 B), and CPU seconds per GB moved over the timed loop only:
    ranks = the sum of the ranks' ``time.process_time()`` deltas, hub = the coordinator and its
    shard processes (/proc, sampled while every rank is held at a sync point before and after
    the loop); GB moved = bytes per rank x ranks x timed iterations.

Part 2, a DDP training step (``--parts ddp``)
    An MLP of ``--model-mparams`` million float32 parameters (default 25: widths
    1024-4096-4096-1024, ReLU, ~100 MB of gradients) on the rank's device, SGD (``--lr``,
    default 1e-2: the parameters move far beyond the tolerance below), MSE loss on ``--batch``
    rows per rank of a fixed random batch (each rank its own rows).
    Configurations, for each ``--ranks``:

    * ``local``: the bare model, no communication (the compute floor; its parameters, which
      must differ from gloo's, show what the check below sees when gradients are not averaged);
    * ``gloo``: ``torch.nn.parallel.DistributedDataParallel(model, device_ids=[the rank's
      device index] (cuda) / None (cpu), bucket_cap_mb=...)`` over backend gloo;
    * ``gradstar torch <path>``: the same torch DDP over backend gradstar;
    * ``gradstar.DDP <path>``: gradstar's own ``gradstar.DDP(model, pg, bucket_cap_mb=...)``
      (``--backends sdk``).

    Ranks build the model with seed = rank (DDP's initial broadcast must make them equal) and
    run ``--warmup-steps`` untimed then ``--steps`` timed steps of ``synchronize; barrier; t0;
    zero_grad; loss.backward(); opt.step(); synchronize; t`` with one torch CPU thread each.
    Table: rank 0's median step time, ratio vs gloo. Correctness: every rank hashes its final
    parameters and they must agree within a backend; rank 0 saves them, and each gradstar
    configuration's must equal gloo's within float32 rounding: ``|p - p_gloo| <= atol + rtol *
    |p_gloo|`` for every parameter (``--atol`` 1e-6, ``--rtol`` 1e-5, the tolerance of
    tests/parallel), else the configuration fails. The table prints max |p - p_gloo| (and
    under it, max |p_gloo - p_initial|: how far training moved the parameters meanwhile).

Not asserted: any timing. Measure on an otherwise idle machine (the load average is printed).
Every wait is bounded (``--timeout``: seconds per configuration; default scaled by size for
part 1, 600 s for part 2); a configuration that fails or times out is reported with its error,
its processes (ranks, coordinator, shards) are killed, and the run goes on; the exit code is 1
if any configuration failed, 2 for a usage error or ``--device cuda`` without CUDA.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _collective_runs import (
    DETAIL_HEADERS,
    default_timeout,
    detail_row,
    hub_cpu,
    run_sampled,
    schedule,
    summarize,
)
from _gpu_ddp import ddp_table, run_part_ddp
from _gpu_ranks import allreduce_rank, mlp_widths, parameter_count
from _paths import add_paths_argument
from _processes import BenchmarkError, free_port, loadavg
from _ranks import run_ranks
from _report import MiB, add_run_arguments, fmt, format_table, write_json
from _report import environment as common_environment

APIS = ("gloo", "torch", "sdk")  # torch.distributed gloo; backend "gradstar"; gradstar's SDK


# -- part 1: all_reduce ----------------------------------------------------------------------------


def run_allreduce_gloo(ranks: int, device: str, elements: int, warmup: int, iters: int,
                       timeout: float, label: str) -> dict:
    results = run_ranks(allreduce_rank, ranks,
                        ("gloo", device, f"tcp://127.0.0.1:{free_port()}", None, elements,
                         warmup, iters, None),
                        timeout=timeout, label=label)
    return summarize(results, elements * 4, iters)


def run_allreduce_gradstar(api: str, path: str, shards: int, ranks: int, device: str,
                           elements: int, warmup: int, iters: int, timeout: float,
                           label: str) -> dict:
    job = f"bench-gpu-{api}-n{ranks}-e{elements}-{uuid.uuid4().hex[:8]}"
    run = run_sampled(allreduce_rank, ranks,
                      lambda address, sync: (api, device, address, job, elements, warmup,
                                             iters, sync),
                      shards=shards, path=path, nbytes=elements * 4, timeout=timeout,
                      label=label)
    summary = summarize(run.results, elements * 4, iters)
    summary |= hub_cpu(run.samples, summary["gb_moved"])
    return summary | {"path": path, "shards": shards, "sync_errors": run.sync_errors}


def allreduce_configs(backends: list[str], paths: list[str]) -> list[dict]:
    """gloo, then one gradstar configuration per (API, data path): ``torch shm``, ..."""
    configs = [{"name": "gloo", "api": "gloo", "path": None}] if "gloo" in backends else []
    configs += [{"name": f"{api} {path}", "api": api, "path": path}
                for api in ("torch", "sdk") if api in backends for path in paths]
    return configs


def run_part_allreduce(args, failures: list) -> list[dict]:
    configs = allreduce_configs(args.backends, args.paths)
    rows = []
    for ranks in args.ranks:
        for size_mb in args.sizes_mb:
            elements = max(1, int(size_mb * MiB) // 4)
            warmup, iters = schedule(size_mb, args.warmup, args.iters)
            timeout = args.timeout or default_timeout(ranks, size_mb, warmup, iters)
            where = f"ranks={ranks} size={size_mb:g}MiB"
            row = {"ranks": ranks, "size_mb": size_mb, "bytes": elements * 4, "warmup": warmup,
                   "iters": iters, "results": {}}
            for config in configs:
                name = config["name"] if config["api"] == "gloo" else f"gradstar {config['name']}"
                label = f"allreduce {name} {where}"
                t0 = time.monotonic()
                try:
                    if config["api"] == "gloo":
                        result = run_allreduce_gloo(ranks, args.device, elements, warmup, iters,
                                                    timeout, label)
                    else:
                        result = run_allreduce_gradstar(config["api"], config["path"],
                                                        args.shards, ranks, args.device,
                                                        elements, warmup, iters, timeout, label)
                except BenchmarkError as error:
                    result = {"median_ms": None, "error": str(error)}
                    failures.append((label, str(error)))
                result["elapsed_s"] = round(time.monotonic() - t0, 2)
                row["results"][config["name"]] = result
                status = "FAILED" if result["error"] else f"median {result['median_ms']:.2f} ms"
                print(f"  {name:22s} {where:24s} {status:>20s}  ({warmup}+{iters} iters, "
                      f"{result['elapsed_s']:.1f} s)", file=sys.stderr, flush=True)
            gloo_ms = (row["results"].get("gloo") or {}).get("median_ms")
            for result in row["results"].values():
                ms = result.get("median_ms")
                result["ratio"] = ms / gloo_ms if ms is not None and gloo_ms else None
            rows.append(row)
    return rows



def allreduce_tables(rows: list[dict], configs: list[dict]) -> tuple[str, str]:
    """(one line per (ranks, size): ms (ratio) per backend; one line per backend: time,
    GB/s/rank and CPU s/GB)."""
    summary, detail = [], []
    for row in rows:
        line = [row["ranks"], f"{row['size_mb']:g}"]
        for config in configs:
            r = row["results"].get(config["name"])
            cell = "FAILED" if r is None or r["error"] else f"{r['median_ms']:.2f}"
            if r is not None and not r["error"] and config["api"] != "gloo":
                cell += f" ({fmt(r['ratio'], '.2f')})"
            line.append(cell)
            name = config["name"] if config["api"] == "gloo" else f"gradstar {config['name']}"
            detail.append(detail_row(row["ranks"], row["size_mb"], name,
                                     r or {"error": "not run"}, config["api"] != "gloo"))
        summary.append(line)
    headers = ["ranks", "size MB"] + [
        "gloo ms" if c["api"] == "gloo" else f"gradstar {c['name']} ms (ratio)" for c in configs]
    return format_table(headers, summary), format_table(DETAIL_HEADERS, detail)


# -- main ----------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import torch

    env = common_environment() | {
        "torch_cuda": torch.version.cuda, "device": device,
        "command": shlex.join([sys.executable, *sys.argv])}
    if device == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["gpus"] = names
        env["device_name"] = names[0] + (f" (x{len(names)})" if len(names) > 1 else "")
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()}, " \
                             f"{os.cpu_count()} cores)"
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="CUDA tensors: all_reduce and a DDP step, gradstar vs gloo in the same run.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="where the tensors and the model live (default cuda: rank r on "
                             "cuda:r %% GPUs; cpu: the same measurements on CPU tensors)")
    parser.add_argument("--parts", nargs="+", choices=["allreduce", "ddp"],
                        default=["allreduce", "ddp"], help="what to measure (default both)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2],
                        help="world sizes (default 2)")
    parser.add_argument("--backends", nargs="+", choices=APIS, default=list(APIS),
                        help="gloo; torch: backend 'gradstar' (dist.all_reduce, torch DDP); "
                             "sdk: gradstar's own API (pg.all_reduce, gradstar.DDP); "
                             "default all")
    parser.add_argument("--shards", type=int, default=0, metavar="K",
                        help="start gradstar's coordinator with --shards K (default 0: the "
                             "single in-process hub)")
    add_paths_argument(parser)
    part1 = parser.add_argument_group("part 1: all_reduce")
    part1.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256],
                       help="float32 payload per rank in MiB (default 1 4 16 64 256)")
    part1.add_argument("--iters", type=int, help="timed all_reduces per size (default by "
                       "size: 50 / 20 / 10 / 5)")
    part1.add_argument("--warmup", type=int, help="untimed all_reduces per size (default by "
                       "size: 5 / 3 / 2 / 1)")
    part2 = parser.add_argument_group("part 2: DDP step")
    part2.add_argument("--model-mparams", type=float, default=25.0,
                       help="MLP size in millions of float32 parameters (default 25)")
    part2.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    part2.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    part2.add_argument("--warmup-steps", type=int, default=3, help="untimed steps (default 3)")
    part2.add_argument("--bucket-cap-mb", type=float, default=25.0)
    part2.add_argument("--lr", type=float, default=1e-2,
                       help="SGD learning rate (default 1e-2: the parameters move well beyond "
                            "the tolerance, so that a wrong gradient shows)")
    part2.add_argument("--atol", type=float, default=1e-6,
                       help="allowed |p - p_gloo| on top of rtol x |p_gloo| (default 1e-6)")
    part2.add_argument("--rtol", type=float, default=1e-5, help="(default 1e-5)")
    add_run_arguments(parser, timeout=None)
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.ranks):
        parser.error("--ranks takes values >= 1")
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be at least 1 and --warmup-steps at least 0")
    if any(s <= 0 for s in args.sizes_mb) or args.model_mparams <= 0 or args.batch < 1:
        parser.error("--sizes-mb, --model-mparams and --batch must be positive")
    if args.shards < 0:
        parser.error("--shards must be at least 0")
    if len(set(args.paths)) != len(args.paths):
        parser.error("--paths takes distinct values")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu.py: --device cuda needs a CUDA GPU, but torch {torch.__version__} sees none "
              "here (torch.cuda.is_available() is False); run with --device cpu to take the "
              "same measurements on CPU tensors", file=sys.stderr)
        return 2
    # SIGTERM -> SystemExit, so the finally blocks kill every child before we exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    env = environment(args.device)
    widths = mlp_widths(args.model_mparams)
    sharing = ""
    if args.device == "cuda":
        gpus = len(env["gpus"])
        sharing = (f"; rank r on cuda:r%{gpus}" + (" (ranks share the GPU)"
                                                  if max(args.ranks) > gpus else ""))
    print(f"gradstar GPU benchmark on {env['device_name']}{sharing}: torch {env['torch']} "
          f"(CUDA {env['torch_cuda']}), gradstar {env['gradstar']}, {env['cpus']} CPUs, load "
          f"average {env['loadavg_at_start']}\ncommand: {env['command']}", flush=True)
    run_start = time.monotonic()
    failures: list[tuple[str, str]] = []
    allreduce_rows, ddp_rows = [], []
    if "allreduce" in args.parts:
        print("part 1: all_reduce", file=sys.stderr, flush=True)
        allreduce_rows = run_part_allreduce(args, failures)
    if "ddp" in args.parts:
        print(f"part 2: DDP step, MLP {widths} ({parameter_count(widths)} parameters)",
              file=sys.stderr, flush=True)
        ddp_rows = run_part_ddp(args, failures)

    device = f"{args.device} = {env['device_name']}"
    if allreduce_rows:
        summary, detail = allreduce_tables(allreduce_rows,
                                           allreduce_configs(args.backends, args.paths))
        print(f"\nall_reduce of float32 tensors on {device}, gloo vs gradstar\n")
        print(summary)
        print()
        print(detail)
        print("\nms: rank 0's median; size MB = MiB per rank; ratio = gradstar ms / gloo ms; "
              "torch = dist.all_reduce on backend 'gradstar', sdk = gradstar's pg.all_reduce; "
              "shm / stream = data path between ranks and hub; GB/s/rank = bytes / median "
              "(GB = 1e9 B); CPU s/GB over the timed loop only (hub = coordinator + shards, "
              "ranks = sum of process_time()); hub cores = hub CPU s / loop wall s.")
    if ddp_rows:
        print(f"\nDDP step of an MLP {widths} ({parameter_count(widths)} parameters) on "
              f"{device}, {args.batch} rows per rank\n")
        print(ddp_table(ddp_rows))
        moved = next((r.get("moved") for r in ddp_rows if r["backend"] == "gloo"
                      and r.get("moved") is not None), None)
        print(f"\nms/step: rank 0's median over {args.steps} timed steps (after "
              f"{args.warmup_steps}), SGD lr {args.lr:g}; gradstar torch = torch's DDP on "
              f"backend 'gradstar'; gradstar.DDP = gradstar's own; tolerance: |p - p_gloo| <= "
              f"{args.atol:g} + {args.rtol:g} x |p_gloo| for every parameter after all steps "
              f"(gloo moved them by up to {fmt(moved, '.1e')}); local = the same steps "
              f"without communication: its parameters are expected to differ from gloo's, and "
              f"by how much shows what an unaveraged gradient looks like to the check.")
    total = time.monotonic() - run_start
    print(f"\ncoordinator --shards {args.shards}; total runtime {total:.1f} s; load average at "
          f"end {loadavg()}")
    for label, error in failures:
        print(f"\nFAILED: {label}:\n{error}")
    if args.json:
        write_json(args, "gpu", environment=env, runtime_s=round(total, 2),
                   loadavg_at_end=loadavg(), mlp_widths=widths,
                   allreduce=allreduce_rows, ddp=ddp_rows)
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

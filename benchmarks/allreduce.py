"""all_reduce latency: gradstar (gRPC star through a coordinator hub) vs torch.distributed gloo.

What is measured
    For each (ranks, size) configuration, both backends run in the same invocation of this script,
    on the same machine, one after the other:

    * gradstar: a real ``gradstar coordinator`` subprocess on 127.0.0.1 (a fresh one per
      configuration, stopped with SIGTERM afterwards) and ``ranks`` spawned OS processes, each with
      ``gradstar.init_process_group(coordinator=..., job=<unique>, world_size=n, rank=r,
      timeout=300)`` and a float32 numpy array ``ones(size/4) * (r + 1)``.
    * gloo: ``ranks`` spawned processes with ``torch.distributed.init_process_group("gloo",
      init_method="tcp://127.0.0.1:<free port>")`` and a float32 tensor ``ones(size/4) * (r + 1)``
      (restored from a saved copy before every iteration, since gloo reduces in place).

    Each rank runs ``warmup`` untimed all_reduce(sum) calls, then ``iters`` timed iterations of
    ``barrier(); t0 = perf_counter(); all_reduce(x, sum); t = perf_counter() - t0``. The table shows
    rank 0's median ``t``. Every rank checks the first and the last result exactly (each element
    must equal n(n+1)/2) and the configuration fails loudly if one differs.

    "size MB" is MiB (2**20 bytes) of float32 payload per rank. algbw = payload bytes / median time
    (1 GB = 1e9 bytes), as in nccl-tests. ratio = gradstar ms / gloo ms (above 1: gradstar slower).
    Note that both backends share the machine's cores with all the ranks (and, for gradstar, the
    hub): with 4 ranks on a 2-core machine the CPUs are oversubscribed for both.

How to reproduce
    .venv/bin/python benchmarks/allreduce.py                       # default table
    .venv/bin/python benchmarks/allreduce.py --sizes-mb 1 16 --ranks 2 --iters 10 --warmup 2 \\
        --json /tmp/allreduce.json

    Defaults: sizes 1 16 64 256 MiB, ranks 2 4; iterations per size (warmup + timed): up to
    1 MiB 5+50, to 16 MiB 3+20, to 64 MiB 2+10, larger 1+5 (``--iters`` / ``--warmup`` override
    them for every size). Every wait is bounded (``--config-timeout``); a configuration that fails
    or times out is reported with its error, its processes are killed, and the run continues; the
    exit code is 1 if any configuration failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BenchmarkError,
    CoordinatorProcess,
    MiB,
    format_table,
    free_port,
    loadavg,
    median,
    run_ranks,
)

# size in MiB -> (warmup, timed iterations) when --warmup / --iters are not given
_SCHEDULE = [(1, 5, 50), (16, 3, 20), (64, 2, 10), (float("inf"), 1, 5)]
COLLECTIVE_TIMEOUT = 300.0  # gradstar's own per-collective timeout, as in the brief


def schedule(size_mb: float, warmup: int | None, iters: int | None) -> tuple[int, int]:
    for limit, w, i in _SCHEDULE:
        if size_mb <= limit:
            return (w if warmup is None else warmup), (i if iters is None else iters)
    raise AssertionError


def _expected(world_size: int) -> float:
    return world_size * (world_size + 1) / 2  # exact in float32 for any sane world size


# -- rank bodies (run in spawned processes) ----------------------------------------------------


def _check(out, world_size: int, elements: int, what: str) -> None:
    import numpy as np

    arr = out.numpy() if hasattr(out, "numpy") else out
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != (elements,):
        raise AssertionError(
            f"{what}: wrong result type: {type(out).__name__} "
            f"{getattr(arr, 'dtype', '?')} {getattr(arr, 'shape', '?')}, "
            f"expected float32 ({elements},)"
        )
    expected = np.float32(_expected(world_size))
    wrong = np.flatnonzero(arr != expected)
    if wrong.size:
        i = int(wrong[0])
        raise AssertionError(
            f"{what}: WRONG RESULT: {wrong.size} of {elements} elements differ from {expected}; "
            f"first at index {i}: {arr[i]!r}"
        )


def gradstar_rank(rank: int, world_size: int, address: str, job: str, elements: int,
                  warmup: int, iters: int) -> dict:
    import time

    import numpy as np

    import gradstar

    t_join = time.perf_counter()
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=COLLECTIVE_TIMEOUT)
    join_s = time.perf_counter() - t_join
    try:
        x = np.ones(elements, dtype=np.float32) * np.float32(rank + 1)
        out = None
        for i in range(warmup):
            out = pg.all_reduce(x, op="sum")
            if i == 0:
                _check(out, world_size, elements, f"gradstar rank {rank} warmup result")
        times = []
        for i in range(iters):
            pg.barrier()
            t0 = time.perf_counter()
            out = pg.all_reduce(x, op="sum")
            times.append(time.perf_counter() - t0)
            if i == 0 and warmup == 0:
                _check(out, world_size, elements, f"gradstar rank {rank} first result")
        if out is not None:
            _check(out, world_size, elements, f"gradstar rank {rank} last result")
        pg.barrier()  # nobody leaves while a peer is still in its last collective
    finally:
        pg.close()
    return {"times": times, "join_s": join_s}


def gloo_rank(rank: int, world_size: int, init_method: str, elements: int, warmup: int,
              iters: int) -> dict:
    import datetime
    import time

    import torch
    import torch.distributed as dist

    t_join = time.perf_counter()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    join_s = time.perf_counter() - t_join
    try:
        base = torch.ones(elements, dtype=torch.float32) * (rank + 1)
        x = base.clone()
        for i in range(warmup):
            x.copy_(base)
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            if i == 0:
                _check(x, world_size, elements, f"gloo rank {rank} warmup result")
        times = []
        for i in range(iters):
            x.copy_(base)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            times.append(time.perf_counter() - t0)
            if i == 0 and warmup == 0:
                _check(x, world_size, elements, f"gloo rank {rank} first result")
        if warmup + iters:
            _check(x, world_size, elements, f"gloo rank {rank} last result")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"times": times, "join_s": join_s}


# -- driver ------------------------------------------------------------------------------------


def _summary(results: list[dict], nbytes: int) -> dict:
    times = results[0]["times"]
    med = median(times) if times else float("nan")
    return {
        "median_ms": med * 1e3,
        "min_ms": min(times) * 1e3 if times else None,
        "max_ms": max(times) * 1e3 if times else None,
        "rank0_times_ms": [round(t * 1e3, 3) for t in times],
        "median_ms_by_rank": [round(median(r["times"]) * 1e3, 3) if r["times"] else None
                              for r in results],
        "algbw_gbps": nbytes / med / 1e9 if times else None,
        "join_s_max": max(r["join_s"] for r in results),
        "error": None,
    }


def run_gradstar(ranks: int, elements: int, warmup: int, iters: int, timeout: float,
                 label: str) -> dict:
    job = f"bench-allreduce-n{ranks}-e{elements}-{uuid.uuid4().hex[:8]}"
    coord = CoordinatorProcess()
    summary = None
    try:
        coord.start()
        cpu0 = coord.cpu_seconds()
        results = run_ranks(gradstar_rank, ranks,
                            (coord.address, job, elements, warmup, iters),
                            timeout=timeout, label=f"gradstar {label}")
        cpu1 = coord.cpu_seconds()
        if not coord.alive():
            raise BenchmarkError(f"[gradstar {label}] the coordinator exited during the run "
                                 f"(code {coord.proc.returncode}); log tail:\n{coord.log_tail()}")
        summary = _summary(results, elements * 4)
        summary["coordinator_cpu_s"] = (None if cpu0 is None or cpu1 is None
                                        else round(cpu1 - cpu0, 3))
    except BenchmarkError as error:
        tail = coord.log_tail() if coord.proc is not None else "(not started)"
        raise BenchmarkError(f"{error}\n--- coordinator log tail ---\n{tail}") from None
    finally:
        code = coord.stop()
        if summary is not None:
            summary["coordinator_exit_code"] = code
        if code not in (0, None):
            print(f"  note: the coordinator for {label} ended with exit code {code}",
                  file=sys.stderr)
    return summary


def run_gloo(ranks: int, elements: int, warmup: int, iters: int, timeout: float,
             label: str) -> dict:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = run_ranks(gloo_rank, ranks, (init_method, elements, warmup, iters),
                        timeout=timeout, label=f"gloo {label}")
    return _summary(results, elements * 4)


def default_timeout(ranks: int, size_mb: float, warmup: int, iters: int) -> float:
    """Generous but bounded: start-up, plus 0.1 s per MiB per rank per collective (gradstar
    measured ~0.01 s/MiB at 2 ranks), kept between 120 s and 600 s. gradstar's own collective
    timeout (300 s) fires first when a rank goes missing, so its error message is reported."""
    estimate = 60 + (warmup + iters + 3) * size_mb * ranks * 0.1
    return max(120.0, min(600.0, estimate))


def _environment() -> dict:
    import numpy
    import torch

    import gradstar

    root = Path(__file__).resolve().parent.parent
    try:
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
        # Uncommitted edits to the library itself (not to benchmarks/) make the commit inexact.
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "src", "client",
                                "coordinator", "worker", "protos"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if commit and dirty:
            commit += "+dirty"
    except Exception:
        commit = None
    return {
        "python": platform.python_version(), "numpy": numpy.__version__,
        "torch": torch.__version__, "gradstar": gradstar.__version__, "git_commit": commit,
        "cpus": os.cpu_count(), "machine": platform.machine(), "system": platform.system(),
        "loadavg_at_start": loadavg(),
    }



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="all_reduce: gradstar vs torch.distributed gloo, measured in the same run.")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256],
                        help="payload sizes in MiB per rank (default 1 16 64 256)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="world sizes (default 2 4)")
    parser.add_argument("--iters", type=int, help="timed iterations for every size "
                        "(default by size: 50 / 20 / 10 / 5)")
    parser.add_argument("--warmup", type=int, help="untimed iterations for every size "
                        "(default by size: 5 / 3 / 2 / 1)")
    parser.add_argument("--backends", nargs="+", choices=["gradstar", "gloo"],
                        default=["gradstar", "gloo"], help="which backends to run (default both)")
    parser.add_argument("--config-timeout", type=float,
                        help="seconds allowed per backend per configuration (default: scaled by "
                             "size, 120..600)")
    parser.add_argument("--json", type=Path, help="also write the rows (and environment) here")
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be at least 0")

    # SIGTERM -> SystemExit, so the finally blocks kill every child before we exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    env = _environment()
    print(f"gradstar all_reduce benchmark: python {env['python']}, torch {env['torch']}, "
          f"numpy {env['numpy']}, gradstar {env['gradstar']} ({env['git_commit']}), "
          f"{env['cpus']} CPUs, load average {env['loadavg_at_start']}", flush=True)
    run_start = time.monotonic()
    rows, failures = [], []
    for ranks in args.ranks:
        for size_mb in args.sizes_mb:
            elements = max(1, int(size_mb * MiB) // 4)
            nbytes = elements * 4
            warmup, iters = schedule(size_mb, args.warmup, args.iters)
            timeout = args.config_timeout or default_timeout(ranks, size_mb, warmup, iters)
            label = f"ranks={ranks} size={size_mb:g}MiB"
            row = {"ranks": ranks, "size_mb": size_mb, "bytes": nbytes, "warmup": warmup,
                   "iters": iters}
            for backend in ("gradstar", "gloo"):
                if backend not in args.backends:
                    row[backend] = None
                    continue
                runner = run_gradstar if backend == "gradstar" else run_gloo
                t0 = time.monotonic()
                try:
                    result = runner(ranks, elements, warmup, iters, timeout, label)
                except BenchmarkError as error:
                    result = {"median_ms": None, "algbw_gbps": None, "error": str(error)}
                    failures.append((backend, label, str(error)))
                result["elapsed_s"] = round(time.monotonic() - t0, 2)
                row[backend] = result
                status = ("FAILED" if result["error"] else
                          f"median {result['median_ms']:.2f} ms")
                print(f"  {backend:8s} {label:26s} {status:>22s}  "
                      f"({warmup}+{iters} iters, {result['elapsed_s']:.1f} s)",
                      file=sys.stderr, flush=True)
            g = (row["gradstar"] or {}).get("median_ms")
            b = (row["gloo"] or {}).get("median_ms")
            row["ratio"] = g / b if g is not None and b else None
            rows.append(row)

    total = time.monotonic() - run_start
    def cell(row: dict, backend: str, key: str, spec: str) -> str:
        result = row[backend]
        if result is None:
            return "-"  # not run (--backends)
        return "FAILED" if result["error"] else format(result[key], spec)

    table = format_table(
        ["ranks", "size MB", "gradstar ms", "gloo ms", "ratio (gradstar/gloo)",
         "gradstar algbw GB/s"],
        [[r["ranks"], f"{r['size_mb']:g}",
          cell(r, "gradstar", "median_ms", ".2f"),
          cell(r, "gloo", "median_ms", ".2f"),
          "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
          cell(r, "gradstar", "algbw_gbps", ".3f")] for r in rows],
    )
    print()
    print(table)
    print(f"\nmedian of rank 0's timed iterations; MB = MiB of float32 per rank; "
          f"algbw = bytes / median (GB = 1e9 B); total runtime {total:.1f} s; "
          f"load average at end {loadavg()}")
    for backend, label, error in failures:
        print(f"\nFAILED: {backend} {label}:\n{error}")
    if args.json:
        args.json.write_text(json.dumps(
            {"benchmark": "allreduce", "environment": env, "runtime_s": round(total, 2),
             "loadavg_at_end": loadavg(),
             "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

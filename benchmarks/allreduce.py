"""all_reduce latency: gradstar (gRPC star through a coordinator hub) vs torch.distributed gloo.

What is measured
    For each (ranks, size) configuration, both backends run in the same invocation of this script,
    on the same machine, one after the other; gradstar once per data path (``--paths``) and hub
    configuration (``--shards K`` and ``--chunk-mb C``), gloo once:

    * gradstar: a real ``gradstar coordinator --shards K`` subprocess on 127.0.0.1 (a fresh one
      per configuration, stopped with SIGTERM afterwards; K = 0: the single in-process hub, K > 0:
      K shard processes, children of the coordinator, each chunk i of a collective going to shard
      i % K) and ``ranks`` spawned OS processes, each with ``gradstar.init_process_group(
      coordinator=..., job=<unique>, world_size=n, rank=r, timeout=300[, chunk_bytes=C])`` and a
      float32 numpy array ``ones(size/4) * (r + 1)``. Every rank checks that its group is striped
      over exactly K shards.
    * the data path of a gradstar configuration (``--paths``, default both, labelled e.g.
      ``K=0 shm`` and ``K=0 stream``): ``shm``, the same-host fast path (chunk payloads move
      through a sealed memfd segment the hub maps; GRADSTAR_SHARED_MEMORY=1), or ``stream``,
      every payload byte on the gRPC stream as between hosts (GRADSTAR_SHARED_MEMORY=0). The
      variable is set for the coordinator (and so its shards) and for the ranks. The path is
      checked, not assumed: after the timed loop each rank reports whether it still offers
      every target (the hub or each shard) its segment, which it stops doing once a target
      refuses, and the script counts the ranks' segments the hub processes have mapped
      (/proc/PID/maps); a configuration whose ranks or hub did not take the path it is labelled
      with fails loudly.
    * gloo: ``ranks`` spawned processes with ``torch.distributed.init_process_group("gloo",
      init_method="tcp://127.0.0.1:<free port>")`` and a float32 tensor ``ones(size/4) * (r + 1)``
      (restored from a saved copy before every iteration, since gloo reduces in place).

    Each rank runs ``warmup`` untimed all_reduce(sum) calls, then ``iters`` timed iterations of
    ``barrier(); t0 = perf_counter(); all_reduce(x, sum); t = perf_counter() - t0``. The tables
    show rank 0's median ``t``. Every rank checks the first and the last result exactly (each
    element must equal n(n+1)/2) and the configuration fails loudly if one differs.

    CPU cost, over the timed loop only (the ``iters`` iterations with their barriers):

    * ranks CPU: the sum over ranks of each rank's ``time.process_time()`` delta across its timed
      loop (all threads of the rank process: gradstar's client loop thread, gloo's threads).
    * hub CPU (gradstar only): user + system time of the coordinator process plus all its child
      processes (the shards), read from /proc/<pid>/stat, sampled by this script right before and
      right after the timed loop while every rank is held at a sync point (so the hub is idle at
      both samples).
    * "GB moved" = bytes each rank contributes x ranks x iters (1 GB = 1e9 bytes): e.g. 4 ranks x
      64 MiB x 10 iterations = 2.68 GB. CPU s/GB = CPU seconds / GB moved.

    "size MB" is MiB (2**20 bytes) of float32 payload per rank. GB/s/rank (algbw) = payload bytes
    / median time (1 GB = 1e9 bytes), as in nccl-tests. ratio = gradstar ms / gloo ms (above 1:
    gradstar slower). hub cores = hub CPU s / wall seconds of the timed loop. Note that both
    backends share the machine's cores with all the ranks (and, for gradstar, the hub and its
    shards): with 4 ranks on a 2-core machine the CPUs are oversubscribed for both.

How to reproduce
    .venv/bin/python benchmarks/allreduce.py                       # default table (K = 0)
    # the two data paths side by side (the default), or one of them
    .venv/bin/python benchmarks/allreduce.py --ranks 2 4 --sizes-mb 1 16 64 256 \\
        --paths shm stream --json /tmp/allreduce-paths.json
    .venv/bin/python benchmarks/allreduce.py --paths stream
    .venv/bin/python benchmarks/allreduce.py --sizes-mb 1 16 --ranks 2 --iters 10 --warmup 2 \\
        --json /tmp/allreduce.json
    # hub scaling: one gradstar column per shard count and path, against the same gloo run
    .venv/bin/python benchmarks/allreduce.py --ranks 2 4 8 --sizes-mb 1 16 64 256 \\
        --shards 0 1 2 4 8 --json /tmp/allreduce-shards.json
    # the overhead of the hub's arrival lags (issue 33): with and without, side by side
    .venv/bin/python benchmarks/allreduce.py --backends gradstar --arrivals on off \\
        --paths shm --ranks 2 4 --sizes-mb 0.004 1 16 --iters 200
    # chunk size, chosen by measurement
    .venv/bin/python benchmarks/allreduce.py --ranks 4 --sizes-mb 64 --shards 4 \\
        --chunk-mb 0.5 1 2 4 8 --backends gradstar

    Defaults: sizes 1 16 64 256 MiB, ranks 2 4, shards 0, paths shm and stream, chunk: the
    client's default (2 MiB); iterations per size (warmup + timed): up to 1 MiB 5+50, to 16 MiB
    3+20, to 64 MiB 2+10, larger 1+5 (``--iters`` / ``--warmup`` override them for every
    size). Every wait is bounded (``--config-timeout``); a configuration that fails or times out
    is reported with its error, its processes are killed, and the run continues; the exit code
    is 1 if any configuration failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _collective_runs import (
    COLLECTIVE_TIMEOUT,
    DETAIL_HEADERS,
    default_timeout,
    detail_row,
    hub_cpu,
    run_sampled,
    schedule,
    summarize,
)
from _paths import add_paths_argument, shm_report
from _processes import BenchmarkError, free_port, loadavg
from _ranks import run_ranks
from _report import MiB, environment, format_table, git_commit


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
                  warmup: int, iters: int, chunk_bytes: int | None, in_place: bool,
                  sync) -> dict:
    import time

    import numpy as np

    import gradstar

    options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    t_join = time.perf_counter()
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=COLLECTIVE_TIMEOUT, **options)
    join_s = time.perf_counter() - t_join
    try:
        base = np.ones(elements, dtype=np.float32) * np.float32(rank + 1)
        x = base.copy()

        def all_reduce():
            # In place (out=x), as gloo reduces: x is restored from base first, untimed.
            return pg.all_reduce(x, op="sum", out=x) if in_place else pg.all_reduce(x, op="sum")

        out = None
        for i in range(warmup):
            if in_place:
                np.copyto(x, base)
            out = all_reduce()
            if i == 0:
                _check(out, world_size, elements, f"gradstar rank {rank} warmup result")
        sync.reach(0)  # the driver samples the hub's CPU while every rank waits here
        times = []
        cpu0 = time.process_time()
        for i in range(iters):
            if in_place:
                np.copyto(x, base)
            pg.barrier()
            t0 = time.perf_counter()
            out = all_reduce()
            times.append(time.perf_counter() - t0)
            if i == 0 and warmup == 0:
                _check(out, world_size, elements, f"gradstar rank {rank} first result")
        cpu_s = time.process_time() - cpu0
        sync.reach(1)  # ... and here
        if out is not None:
            _check(out, world_size, elements, f"gradstar rank {rank} last result")
        shards = len(pg.shards)
        report = shm_report(pg)
        pg.barrier()  # nobody leaves while a peer is still in its last collective
    finally:
        pg.close()
    return {"times": times, "join_s": join_s, "cpu_s": cpu_s, "shards": shards, **report}


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
        cpu0 = time.process_time()
        for i in range(iters):
            x.copy_(base)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            times.append(time.perf_counter() - t0)
            if i == 0 and warmup == 0:
                _check(x, world_size, elements, f"gloo rank {rank} first result")
        cpu_s = time.process_time() - cpu0
        if warmup + iters:
            _check(x, world_size, elements, f"gloo rank {rank} last result")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"times": times, "join_s": join_s, "cpu_s": cpu_s}


# -- driver ------------------------------------------------------------------------------------


def run_gradstar(ranks: int, elements: int, warmup: int, iters: int, timeout: float,
                 label: str, shards: int, chunk_bytes: int | None, path: str,
                 in_place: bool = False, arrivals: str = "on") -> dict:
    job = f"bench-allreduce-n{ranks}-e{elements}-k{shards}-{uuid.uuid4().hex[:8]}"
    label = f"gradstar {label}"
    run = run_sampled(gradstar_rank, ranks,
                      lambda address, sync: (address, job, elements, warmup, iters, chunk_bytes,
                                             in_place, sync),
                      shards=shards, path=path, nbytes=elements * 4, timeout=timeout,
                      label=label, extra_env={"GRADSTAR_MEASURE_ARRIVALS":
                                              "1" if arrivals == "on" else "0"})
    summary = summarize(run.results, elements * 4, iters)
    summary["path"] = path
    summary["hub_shm_mappings"] = run.hub_shm_mappings
    summary["shm_offered_by_rank"] = [r["shm_offered"] for r in run.results]
    summary |= hub_cpu(run.samples, summary["gb_moved"])
    summary["shards"] = shards
    summary["shards_seen_by_ranks"] = run.results[0]["shards"]
    summary["chunk_bytes"] = chunk_bytes
    summary["sync_errors"] = run.sync_errors
    summary["coordinator_exit_code"] = run.exit_code
    if summary.get("shard_pids_changed"):
        print(f"  note: [{label}] a shard process restarted during the timed loop",
              file=sys.stderr)
    return summary


def run_gloo(ranks: int, elements: int, warmup: int, iters: int, timeout: float,
             label: str) -> dict:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = run_ranks(gloo_rank, ranks, (init_method, elements, warmup, iters),
                        timeout=timeout, label=f"gloo {label}")
    return summarize(results, elements * 4, iters)


def gradstar_configs(shards: list[int], chunk_mb: list[float] | None,
                     paths: Sequence[str], arrivals: Sequence[str] = ("on",)) -> list[dict]:
    """One gradstar configuration per (K, chunk size, data path, arrival measurement), the
    paths of one hub side by side; named ``K=2 shm`` (``K=2 chunk=4MiB shm`` when more than
    one chunk size is measured, ``K=2 shm arrivals-off`` without the hub's arrival lags)."""
    chunks = [None] if not chunk_mb else [max(4, int(c * MiB)) // 4 * 4 for c in chunk_mb]
    configs = []
    for k in shards:
        for c, mb in zip(chunks, chunk_mb or [None], strict=True):
            for path in paths:
                for measure in arrivals:
                    name = (f"K={k}" + (f" chunk={mb:g}MiB" if len(chunks) > 1 else "")
                            + f" {path}" + (" arrivals-off" if measure == "off" else ""))
                    configs.append({"name": name, "shards": k, "chunk_bytes": c,
                                    "chunk_mb": mb, "path": path, "arrivals": measure})
    return configs


def _tables(rows: list[dict], configs: list[dict]) -> tuple[str, str]:
    """(one row per (ranks, size): gloo and one column per gradstar configuration with its
    ratio; one row per (ranks, size, backend): time, GB/s/rank and CPU s/GB)."""

    def ms(result: dict | None) -> str:
        if result is None:
            return "-"  # not run (--backends)
        return "FAILED" if result["error"] else f"{result['median_ms']:.2f}"

    summary_rows, detail_rows = [], []
    for r in rows:
        line = [r["ranks"], f"{r['size_mb']:g}", ms(r["gloo"])]
        for c in configs:
            result = r["gradstar"].get(c["name"])
            cell = ms(result)
            if result is not None and not result["error"] and result.get("ratio") is not None:
                cell += f" ({result['ratio']:.2f})"
            line.append(cell)
        summary_rows.append(line)
        backends = [("gloo", r["gloo"])] + [(f"gradstar {c['name']}", r["gradstar"].get(c["name"]))
                                            for c in configs]
        detail_rows += [detail_row(r["ranks"], r["size_mb"], name, result, name != "gloo")
                        for name, result in backends if result is not None]
    summary = format_table(["ranks", "size MB", "gloo ms"]
                           + [f"gradstar {c['name']} ms (ratio)" for c in configs], summary_rows)
    detail = format_table(DETAIL_HEADERS, detail_rows)
    return summary, detail


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
    parser.add_argument("--shards", type=int, nargs="+", default=[0], metavar="K",
                        help="run gradstar once per value, its coordinator started with "
                             "--shards K (0: the single in-process hub; default 0)")
    add_paths_argument(parser)
    parser.add_argument("--chunk-mb", type=float, nargs="+", metavar="MB",
                        help="gradstar chunk sizes in MiB (init_process_group(chunk_bytes=...)); "
                             "gradstar runs once per value (default: the client's default)")
    parser.add_argument("--in-place", action="store_true",
                        help="gradstar reduces in place, pg.all_reduce(x, out=x), as gloo does "
                             "(x restored from a saved copy before each call, untimed, as for "
                             "gloo); default: a new result array per call")
    parser.add_argument("--arrivals", nargs="+", choices=["on", "off"], default=["on"],
                        help="the hub's per-rank arrival lags (GRADSTAR_MEASURE_ARRIVALS): "
                             "gradstar runs once per value; 'on off' measures their overhead "
                             "in the same run (default on)")
    parser.add_argument("--config-timeout", type=float,
                        help="seconds allowed per backend per configuration (default: scaled by "
                             "size, 120..600)")
    parser.add_argument("--json", type=Path, help="also write the rows (and environment) here")
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if any(k < 0 for k in args.shards) or len(set(args.shards)) != len(args.shards):
        parser.error("--shards takes distinct values >= 0")
    if args.chunk_mb is not None:
        from gradstar.wire import MAX_CHUNK_BYTES

        if any(not 0 < c * MiB <= MAX_CHUNK_BYTES for c in args.chunk_mb):
            parser.error(f"--chunk-mb values must be in (0, {MAX_CHUNK_BYTES / MiB:g}]")
        if len(set(args.chunk_mb)) != len(args.chunk_mb):
            parser.error("--chunk-mb takes distinct values")
    if len(set(args.paths)) != len(args.paths):
        parser.error("--paths takes distinct values")
    configs = (gradstar_configs(args.shards, args.chunk_mb, args.paths, args.arrivals)
               if "gradstar" in args.backends else [])
    for config in configs if args.in_place else []:
        config["name"] += " in-place"

    # SIGTERM -> SystemExit, so the finally blocks kill every child before we exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    env = environment() | {"git_commit": git_commit()}
    from gradstar.wire import DEFAULT_CHUNK_BYTES

    env["client_default_chunk_bytes"] = DEFAULT_CHUNK_BYTES
    print(f"gradstar all_reduce benchmark: python {env['python']}, torch {env['torch']}, "
          f"numpy {env['numpy']}, gradstar {env['gradstar']} ({env['git_commit']}), "
          f"{env['cpus']} CPUs, load average {env['loadavg_at_start']}; gradstar hubs: "
          f"{', '.join(c['name'] for c in configs) or 'none'}", flush=True)
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
                   "iters": iters, "gb_moved": nbytes * ranks * iters / 1e9,
                   "gloo": None, "gradstar": {}}
            runs = [("gloo", None)] if "gloo" in args.backends else []
            runs += [("gradstar", c) for c in configs]
            for backend, config in runs:
                name = backend if config is None else f"gradstar {config['name']}"
                t0 = time.monotonic()
                try:
                    if config is None:
                        result = run_gloo(ranks, elements, warmup, iters, timeout, label)
                    else:
                        result = run_gradstar(ranks, elements, warmup, iters, timeout,
                                              f"{label} {config['name']}", config["shards"],
                                              config["chunk_bytes"], config["path"],
                                              args.in_place, config["arrivals"])
                except BenchmarkError as error:
                    result = {"median_ms": None, "algbw_gbps": None, "error": str(error)}
                    failures.append((name, label, str(error)))
                result["elapsed_s"] = round(time.monotonic() - t0, 2)
                if config is None:
                    row["gloo"] = result
                else:
                    result["config"] = config["name"]
                    row["gradstar"][config["name"]] = result
                status = ("FAILED" if result["error"] else
                          f"median {result['median_ms']:.2f} ms")
                print(f"  {name:34s} {label:26s} {status:>22s}  "
                      f"({warmup}+{iters} iters, {result['elapsed_s']:.1f} s)",
                      file=sys.stderr, flush=True)
            b = (row["gloo"] or {}).get("median_ms")
            for result in row["gradstar"].values():
                g = result.get("median_ms")
                result["ratio"] = g / b if g is not None and b else None
            rows.append(row)

    total = time.monotonic() - run_start
    summary, detail = _tables(rows, configs)
    print()
    print(summary)
    print()
    print(detail)
    chunk = env["client_default_chunk_bytes"]
    print(f"\nms: median of rank 0's timed iterations; MB = MiB of float32 per rank; ratio = "
          f"gradstar ms / gloo ms; K = coordinator --shards K (0: in-process hub); shm / "
          f"stream = data path between ranks and hub (shared-memory segments / gRPC stream, "
          f"GRADSTAR_SHARED_MEMORY=1 / 0); chunk: "
          f"{'client default ' + format(chunk / MiB, 'g') + ' MiB' if chunk else 'client default'}"
          f" unless named.\nGB/s/rank = bytes per rank / median (GB = 1e9 B). GB moved = bytes "
          f"each rank contributes x ranks x timed iterations. hub CPU = coordinator + its shard "
          f"processes (/proc, user+system), ranks CPU = sum of the ranks' process_time(), both "
          f"over the timed loop only; s/GB = CPU seconds / GB moved; total = hub + ranks; hub "
          f"cores = hub CPU s / loop wall s.\ntotal runtime {total:.1f} s; load average at end "
          f"{loadavg()}")
    for backend, label, error in failures:
        print(f"\nFAILED: {backend} {label}:\n{error}")
    if args.json:
        args.json.write_text(json.dumps(
            {"benchmark": "allreduce", "environment": env, "runtime_s": round(total, 2),
             "loadavg_at_end": loadavg(), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in vars(args).items()},
             "gradstar_configs": configs, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

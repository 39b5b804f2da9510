"""DDP with ``gradient_as_bucket_view``: the memory it saves and its step time, against the default
in the same run, for gradstar and for torch's DDP over gloo.

What is measured
    The MLP of ``ddp_step.py`` (~9.5M parameters, 37 MB of float32 gradients) is trained with SGD
    by ``--ranks`` spawned processes (default 2), each on its own ``--batch`` rows, in these
    configurations run one after the other in the same invocation:

    * ``gradstar`` / ``gradstar view``: ``gradstar.DDP(model, pg, bucket_cap_mb=...)`` without
      and with ``gradient_as_bucket_view=True``, against a ``gradstar coordinator``
      subprocess on 127.0.0.1 (data path ``--path``, default ``stream``: every byte on the
      gRPC stream, so no shared-memory segment counts in a rank's resident memory);
    * ``gloo`` / ``gloo view``: torch's DDP over gloo, without and with the option;
    * ``local``: the bare model, no communication (the floor: parameters, gradients, data;
      run once, with ``set_to_none=False``).

    Each configuration runs once with ``optimizer.zero_grad(set_to_none=False)`` (the gradients
    stay allocated: what the option is for) and, with ``--set-to-none``, once more with torch's
    default ``set_to_none=True`` (autograd allocates new gradients every step; they are copied
    into the buckets and freed as each bucket launches, so part of the saving goes).

    Every rank runs ``--warmup`` steps, resets its peak resident memory (``5`` written to
    /proc/self/clear_refs), then runs ``--iters`` timed steps and reads its peak (VmHWM). The
    table shows rank 0's median step time and its peak resident memory during the timed steps
    (with ``--rounds R`` every configuration runs R times, interleaved: the time is that of the
    round with the lowest median, on a shared machine the least disturbed one, and the peak the
    median over the rounds),
    each also as a ratio to ``gradstar`` with the same zero_grad in the same run; and, for
    gradstar, the bytes held by gradients and buckets after the last step (distinct storages:
    with views the gradients are the buckets). Ranks start from different seeds; the run fails
    if the ranks of a configuration end with different parameters.

How to reproduce
    .venv/bin/python benchmarks/ddp_memory.py                     # 2 ranks, 3+10 steps
    .venv/bin/python benchmarks/ddp_memory.py --set-to-none --iters 20 --json /tmp/mem.json
    .venv/bin/python benchmarks/ddp_memory.py --rounds 3 --iters 20      # a noisy machine
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    PATHS,
    MiB,
    finish,
    format_table,
    free_port,
    loadavg,
    median,
    run_configs,
    run_ranks,
    shm_report,
)
from ddp_step import COLLECTIVE_TIMEOUT, SAMPLE_EVERY, _check_ranks_agree, _data, _model, run_on_hub


def _peak_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))


def _train(model, step_model, barrier, rank: int, batch: int, warmup: int, iters: int,
           set_to_none: bool) -> dict:
    import time

    import torch

    x, y = _data(rank, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + iters):
        if i == warmup:
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.mse_loss(step_model(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"times": times, "peak_mb": _peak_kib() / 1024, "sample": flat[::SAMPLE_EVERY].tolist()}


def _held_mb(tensors) -> float:
    """MB of the distinct storages behind ``tensors`` (None skipped)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}
    return sum(storages.values()) / MiB


def gradstar_rank(rank: int, world_size: int, address: str, job: str, batch: int, warmup: int,
                  iters: int, bucket_cap_mb: float, as_view: bool, set_to_none: bool) -> dict:
    import torch

    import gradstar

    torch.set_num_threads(1)
    pg = gradstar.init_process_group(coordinator=address, job=job, world_size=world_size,
                                     rank=rank, timeout=COLLECTIVE_TIMEOUT)
    try:
        model = _model(seed=rank)
        ddp = gradstar.DDP(model, pg, bucket_cap_mb=bucket_cap_mb,
                           gradient_as_bucket_view=as_view)
        result = _train(model, ddp, pg.barrier, rank, batch, warmup, iters, set_to_none)
        result["held_mb"] = _held_mb([*(p.grad for p in model.parameters()),
                                      *ddp.reducer.flats])
        result["shards"] = len(pg.shards)
        result |= shm_report(pg)
        pg.barrier()
    finally:
        pg.close()
    return result


def gloo_rank(rank: int, world_size: int, init_method: str, batch: int, warmup: int, iters: int,
              bucket_cap_mb: float, as_view: bool, set_to_none: bool) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        model = _model(seed=rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                                        gradient_as_bucket_view=as_view)
        result = _train(model, ddp, dist.barrier, rank, batch, warmup, iters, set_to_none)
        dist.barrier()
        del ddp  # joins gloo's threads while the interpreter lives
    finally:
        dist.destroy_process_group()
    return result


def local_rank(rank: int, world_size: int, batch: int, warmup: int, iters: int,
               set_to_none: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    model = _model(seed=0)
    return _train(model, model, lambda: None, rank, batch, warmup, iters, set_to_none)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DDP gradient_as_bucket_view: memory and time.")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--path", choices=PATHS, default="stream",
                        help="gradstar's data path (default stream: no shared memory in RSS)")
    parser.add_argument("--set-to-none", action="store_true",
                        help="also run every configuration with zero_grad(set_to_none=True)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every configuration this many times, interleaved; each "
                             "reports its round with the lowest median step time")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds allowed per configuration")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    print(f"gradstar DDP gradient_as_bucket_view benchmark: torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {args.ranks} ranks x batch {args.batch}, bucket_cap_mb "
          f"{args.bucket_cap_mb:g}, {args.warmup}+{args.iters} steps, path {args.path}, load "
          f"average {loadavg()}", flush=True)
    common = (args.batch, args.warmup, args.iters)
    configs = [("local", lambda: run_ranks(local_rank, args.ranks, (*common, False),
                                           timeout=args.timeout, label="local"))]
    for set_to_none in (False, True) if args.set_to_none else (False,):
        suffix = " (set_to_none)" if set_to_none else ""
        for view in (False, True):
            name = f"{'gloo view' if view else 'gloo'}{suffix}"
            configs.append((name, lambda v=view, s=set_to_none, n=name: run_ranks(
                gloo_rank, args.ranks, (f"tcp://127.0.0.1:{free_port()}", *common,
                                        args.bucket_cap_mb, v, s),
                timeout=args.timeout, label=n)))
            name = f"{'gradstar view' if view else 'gradstar'}{suffix}"
            configs.append((name, lambda v=view, s=set_to_none, n=name: run_on_hub(
                gradstar_rank, args.ranks, (*common, args.bucket_cap_mb, v, s), shards=0,
                path=args.path, timeout=args.timeout, label=n)))
    rounds: dict[str, list] = {}
    failures = []
    for _ in range(args.rounds):  # rounds interleave the configurations: load hits them alike
        got, failed = run_configs(configs, _check_ranks_agree)
        failures += failed
        for name, results in got.items():
            rounds.setdefault(name, []).append(results)
    runs = {name: None if None in got else min(got, key=lambda r: median(r[0]["times"]))
            for name, got in rounds.items()}
    peaks = {name: median([r[0]["peak_mb"] for r in got])
             for name, got in rounds.items() if None not in got}
    rows, summary = [], {}
    for name, results in runs.items():
        if results is None:
            rows.append([name, "FAILED", "-", "-", "-", "-"])
            continue
        suffix = " (set_to_none)" if name.endswith("(set_to_none)") else ""
        base = runs.get(f"gradstar{suffix}")
        ms, peak = median(results[0]["times"]) * 1e3, peaks[name]
        base_ms = median(base[0]["times"]) * 1e3 if base else None
        base_peak = peaks.get(f"gradstar{suffix}")
        held = results[0].get("held_mb")
        rows.append([name, f"{ms:.1f}", f"{ms / base_ms:.2f}" if base_ms else "-",
                     f"{peak:.0f}", f"{peak / base_peak:.2f}" if base_peak else "-",
                     "-" if held is None else f"{held:.0f}"])
        summary[name] = {"median_ms": ms, "peak_rss_mb": peak, "held_mb": held,
                         "rank0_peak_rss_mb_by_round": [r[0]["peak_mb"] for r in rounds[name]],
                         "rank0_median_ms_by_round": [median(r[0]["times"]) * 1e3
                                                      for r in rounds[name]]}
    print()
    print(format_table(["configuration", "ms/step", "time vs gradstar", "peak RSS MB",
                        "RSS vs gradstar", "grads+buckets MB"], rows))
    print(f"\nrank 0's median over {args.iters} timed steps (best of {args.rounds} rounds) and "
          "its peak resident memory during them (median of the rounds); ratios against "
          "gradstar with the same zero_grad, in this run; grads+buckets: distinct storages "
          f"after the last step; load average at end {loadavg()}")
    return finish(args, "ddp_memory", summary, failures)


if __name__ == "__main__":
    raise SystemExit(main())

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
import itertools
import math
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BenchmarkError,
    DriverSync,
    MiB,
    add_paths_argument,
    add_run_arguments,
    check_path,
    format_table,
    free_port,
    loadavg,
    median,
    path_env,
    run_configs,
    run_ranks,
    shm_report,
    write_json,
)
from allreduce import COLLECTIVE_TIMEOUT, default_timeout, schedule
from ddp_step import check_shards, coordinator, run_on_hub

APIS = ("gloo", "torch", "sdk")  # torch.distributed gloo; backend "gradstar"; gradstar's SDK
DDP_TIMEOUT = 600.0
SAMPLE_EVERY = 997  # every 997th parameter goes into a rank's report, for error messages


# -- in the rank processes -----------------------------------------------------------------------


def rank_device(kind: str, rank: int):
    """The torch device rank ``rank`` computes on: the CPU, or ``cuda:{rank % GPUs}`` (made the
    current device), so ranks share a GPU when there are more ranks than GPUs."""
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("this rank sees no CUDA device")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def synchronize(device) -> None:
    """Wait for everything queued on ``device`` (a no-op on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RankGroup:
    """One rank's side of a configuration: ``api`` (gloo, torch: backend "gradstar", sdk:
    ``gradstar.init_process_group``) joined at ``where`` (gloo: an init_method; gradstar: the
    coordinator's address, with ``job``). ``all_reduce(x)`` returns the sum (x itself for
    torch.distributed, which reduces in place)."""

    def __init__(self, api: str, where: str, job: str | None, rank: int,
                 world_size: int) -> None:
        import datetime

        import torch.distributed as dist

        self.api = api
        self._dist = dist
        if api == "sdk":
            import gradstar

            self.pg = gradstar.init_process_group(coordinator=where, job=job,
                                                  world_size=world_size, rank=rank,
                                                  timeout=COLLECTIVE_TIMEOUT)
            return
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT)
        if api == "gloo":
            dist.init_process_group("gloo", init_method=where, rank=rank,
                                    world_size=world_size, timeout=timeout)
        else:
            import gradstar  # registers backend "gradstar"

            dist.init_process_group("gradstar", init_method=f"gradstar://{where}?job={job}",
                                    rank=rank, world_size=world_size, timeout=timeout)
        self.pg = None

    def barrier(self) -> None:
        if self.pg is not None:
            self.pg.barrier()
        else:
            self._dist.barrier()

    def all_reduce(self, x):
        if self.pg is not None:
            return self.pg.all_reduce(x, op="sum")
        self._dist.all_reduce(x, op=self._dist.ReduceOp.SUM)
        return x

    def path_report(self) -> dict:
        """Which data path gradstar's collectives took (:func:`shm_report`); {} for gloo."""
        if self.api == "gloo":
            return {}
        if self.pg is not None:
            return shm_report(self.pg)
        return shm_report(self._dist.distributed_c10d._get_default_group().gradstar_group)

    def close(self) -> None:
        if self.pg is not None:
            self.pg.close()
        else:
            self._dist.destroy_process_group()


def _check_sum(out, device, world_size: int, elements: int, what: str) -> None:
    import torch

    if out.device != device or out.dtype != torch.float32 or tuple(out.shape) != (elements,):
        raise AssertionError(f"{what}: wrong result: {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}, expected float32 ({elements},) on {device}")
    expected = world_size * (world_size + 1) / 2  # exact in float32
    wrong = out != expected
    count = int(wrong.sum().item())
    if count:
        i = int(wrong.nonzero()[0].item())
        raise AssertionError(f"{what}: WRONG RESULT: {count} of {elements} elements differ "
                             f"from {expected:g}; first at index {i}: {out[i].item()!r}")


def allreduce_rank(rank: int, world_size: int, api: str, device_kind: str, where: str,
                   job: str | None, elements: int, warmup: int, iters: int, sync) -> dict:
    import time

    import torch

    device = rank_device(device_kind, rank)
    t_join = time.perf_counter()
    group = RankGroup(api, where, job, rank, world_size)
    join_s = time.perf_counter() - t_join
    try:
        base = torch.full((elements,), float(rank + 1), dtype=torch.float32, device=device)
        x = base.clone()
        in_place = api != "sdk"

        def one_call():
            if in_place:
                x.copy_(base)  # untimed: the last call left the sum in x
            synchronize(device)
            group.barrier()
            t0 = time.perf_counter()
            out = group.all_reduce(x)
            synchronize(device)
            return out, time.perf_counter() - t0

        for i in range(warmup):
            out, _ = one_call()
            if i == 0:
                _check_sum(out, device, world_size, elements, f"{api} rank {rank} warmup result")
        if sync is not None:
            sync.reach(0)  # the driver samples the hub's CPU while every rank waits here
        times, out = [], None
        cpu0 = time.process_time()
        for i in range(iters):
            out, t = one_call()
            times.append(t)
            if i == 0:
                _check_sum(out, device, world_size, elements, f"{api} rank {rank} first result")
        cpu_s = time.process_time() - cpu0
        if sync is not None:
            sync.reach(1)  # ... and here
        _check_sum(out, device, world_size, elements, f"{api} rank {rank} last result")
        report = {"times": times, "join_s": join_s, "cpu_s": cpu_s, "device": str(device),
                  **group.path_report()}
        if group.pg is not None:
            report["shards"] = len(group.pg.shards)
        group.barrier()  # nobody leaves while a peer is still in its last collective
    finally:
        group.close()
    return report


def mlp_widths(mparams: float) -> list[int]:
    """Widths ``[h/4, h, h, h/4]`` of an MLP with about ``mparams`` million parameters
    (1.5 h^2 weights), h a multiple of 64: 25 -> [1024, 4096, 4096, 1024] (25.2M)."""
    hidden = max(64, round(math.sqrt(mparams * 1e6 / 1.5) / 64) * 64)
    return [hidden // 4, hidden, hidden, hidden // 4]


def parameter_count(widths: list[int]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(widths))


def _mlp(widths: list[int], seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _batch(widths: list[int], rank: int, rows: int, device):
    import torch

    g = torch.Generator().manual_seed(12345)
    x = torch.randn(rows * 64, widths[0], generator=g)
    y = torch.randn(rows * 64, widths[-1], generator=g)
    part = slice(rank * rows, (rank + 1) * rows)
    return x[part].to(device), y[part].to(device)


def ddp_rank(rank: int, world_size: int, where: str | None, job: str | None, api: str,
             device_kind: str, widths: list[int], rows: int, warmup: int, steps: int,
             bucket_cap_mb: float, lr: float, save_as: str | None) -> dict:
    """``api``: local (no communication), gloo / torch (torch's DDP over backend gloo /
    gradstar) or sdk (gradstar.DDP). Returns the step times and a digest of the final
    parameters; rank 0 saves them to ``save_as`` (a .npy path) when given."""
    import hashlib
    import time

    import numpy as np
    import torch

    torch.set_num_threads(1)
    device = rank_device(device_kind, rank)
    group = None if api == "local" else RankGroup(api, where, job, rank, world_size)
    try:
        model = _mlp(widths, seed=0 if api == "local" else rank).to(device)
        initial = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
                   if rank == 0 else None)
        if api == "local":
            step_model = model
        elif api == "sdk":
            import gradstar

            step_model = gradstar.DDP(model, group.pg, bucket_cap_mb=bucket_cap_mb)
        else:
            device_ids = [device.index] if device.type == "cuda" else None
            step_model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
        x, y = _batch(widths, rank, rows, device)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        times = []
        for i in range(warmup + steps):
            synchronize(device)
            if group is not None:
                group.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(step_model(x), y)
            loss.backward()
            opt.step()
            synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        host = flat.cpu().numpy()
        report = {"times": times, "params": int(flat.numel()), "device": str(device),
                  "digest": hashlib.sha256(host.tobytes()).hexdigest(),
                  "sample": host[::SAMPLE_EVERY].tolist()}
        if rank == 0:
            report["moved"] = float((flat - initial).abs().max().item())
            if save_as is not None:
                np.save(save_as, host)
        if group is not None:
            report |= group.path_report()
            if group.pg is not None:
                report["shards"] = len(group.pg.shards)
            group.barrier()
    finally:
        if group is not None:
            group.close()
    return report


# -- driver: part 1 ------------------------------------------------------------------------------


def _per_gb(seconds: float | None, gb_moved: float) -> float | None:
    return None if seconds is None or not gb_moved else seconds / gb_moved


def _allreduce_summary(results: list[dict], nbytes: int, iters: int) -> dict:
    times = results[0]["times"]
    med = median(times)
    gb_moved = nbytes * len(results) * iters / 1e9
    ranks_cpu = sum(r["cpu_s"] for r in results)
    return {
        "median_ms": med * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
        "rank0_times_ms": [round(t * 1e3, 3) for t in times],
        "median_ms_by_rank": [round(median(r["times"]) * 1e3, 3) for r in results],
        "algbw_gbps": nbytes / med / 1e9, "join_s_max": max(r["join_s"] for r in results),
        "gb_moved": gb_moved, "ranks_cpu_s": round(ranks_cpu, 4),
        "ranks_cpu_s_per_gb": _per_gb(ranks_cpu, gb_moved),
        "devices": [r["device"] for r in results], "error": None,
    }


def _hub_cpu(samples: dict, gb_moved: float) -> dict:
    """Hub CPU over the timed loop from the samples at sync points 0 and 1."""
    if 0 not in samples or 1 not in samples or None in (samples[0][1], samples[1][1]):
        return {"hub_cpu_s": None, "hub_cpu_s_per_gb": None, "hub_cores": None}
    (t0, a), (t1, b) = samples[0], samples[1]
    hub = b["total_s"] - a["total_s"]
    return {"hub_cpu_s": round(hub, 4), "hub_cpu_s_per_gb": _per_gb(hub, gb_moved),
            "hub_cores": hub / (t1 - t0) if t1 > t0 else None,
            "shard_pids_changed": a["shard_pids"] != b["shard_pids"]}


def run_allreduce_gloo(ranks: int, device: str, elements: int, warmup: int, iters: int,
                       timeout: float, label: str) -> dict:
    results = run_ranks(allreduce_rank, ranks,
                        ("gloo", device, f"tcp://127.0.0.1:{free_port()}", None, elements,
                         warmup, iters, None),
                        timeout=timeout, label=label)
    return _allreduce_summary(results, elements * 4, iters)


def run_allreduce_gradstar(api: str, path: str, shards: int, ranks: int, device: str,
                           elements: int, warmup: int, iters: int, timeout: float,
                           label: str) -> dict:
    from gradstar.transport.shm import POOL_KEEP_BYTES

    env = path_env(path)
    coord = coordinator(shards, env)
    try:
        coord.start()
        samples: dict[int, tuple[float, dict | None]] = {}
        mappings: list[int | None] = []

        def sample(point: int) -> None:
            samples[point] = (time.monotonic(), coord.cpu_sample())
            if point == 1:  # every rank is alive and holds its segments
                mappings.append(coord.shm_mappings())

        job = f"bench-gpu-{api}-n{ranks}-e{elements}-{uuid.uuid4().hex[:8]}"
        with DriverSync(ranks, 2, sample, timeout=timeout) as sync:
            results = run_ranks(allreduce_rank, ranks,
                                (api, device, coord.address, job, elements, warmup, iters,
                                 sync.handle),
                                timeout=timeout, label=label, env=env)
        if not coord.alive():
            raise BenchmarkError(f"[{label}] the coordinator exited during the run (code "
                                 f"{coord.proc.returncode})")
        check_shards(results, shards, label)
        # A segment above the pool's keep limit is closed after each collective and the hub
        # drops its mapping: the count then proves nothing (the ranks' reports still do).
        hub_mappings = mappings[0] if mappings and elements * 4 <= POOL_KEEP_BYTES else None
        check_path(results, path, label, hub_mappings)
        summary = _allreduce_summary(results, elements * 4, iters)
        summary |= _hub_cpu(samples, summary["gb_moved"])
        summary |= {"path": path, "shards": shards, "sync_errors": sync.errors}
        if sync.errors:
            print(f"  note: [{label}] hub CPU not sampled: {'; '.join(sync.errors)}",
                  file=sys.stderr)
        return summary
    except BenchmarkError as error:
        tail = coord.log_tail() if coord.proc is not None else "(not started)"
        raise BenchmarkError(f"{error}\n--- coordinator log tail ---\n{tail}") from None
    finally:
        coord.stop()


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


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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
                cell += f" ({_fmt(r['ratio'], '.2f')})"
            line.append(cell)
            name = config["name"] if config["api"] == "gloo" else f"gradstar {config['name']}"
            if r is None or r["error"]:
                detail.append([row["ranks"], f"{row['size_mb']:g}", name, "FAILED"] + ["-"] * 6)
                continue
            hub, ranks_cpu = r.get("hub_cpu_s_per_gb"), r.get("ranks_cpu_s_per_gb")
            total = ranks_cpu if config["api"] == "gloo" else (
                None if hub is None or ranks_cpu is None else hub + ranks_cpu)
            gradstar = config["api"] != "gloo"
            detail.append([row["ranks"], f"{row['size_mb']:g}", name, f"{r['median_ms']:.2f}",
                           _fmt(r["ratio"], ".2f"), _fmt(r["algbw_gbps"], ".3f"),
                           _fmt(hub, ".3f") if gradstar else "-", _fmt(ranks_cpu, ".3f"),
                           _fmt(total, ".3f"),
                           _fmt(r.get("hub_cores"), ".2f") if gradstar else "-"])
        summary.append(line)
    headers = ["ranks", "size MB"] + [
        "gloo ms" if c["api"] == "gloo" else f"gradstar {c['name']} ms (ratio)" for c in configs]
    return (format_table(headers, summary),
            format_table(["ranks", "size MB", "backend", "ms", "ratio", "GB/s/rank",
                          "hub CPU s/GB", "ranks CPU s/GB", "total CPU s/GB", "hub cores"],
                         detail))


# -- driver: part 2 ------------------------------------------------------------------------------


class ParameterCheck:
    """``run_configs``' check of a DDP configuration: its ranks end with identical parameters
    (digests), and a gradstar configuration's equal gloo's (run first) within ``atol + rtol *
    |gloo's|``. Keeps the figures for the table in ``found``."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol = atol
        self.rtol = rtol
        self.reference = None  # gloo's rank 0 parameters
        self.found: dict[str, dict] = {}

    def __call__(self, results: list[dict], name: str) -> None:
        first = results[0]
        for rank, r in enumerate(results[1:], start=1):
            if r["digest"] != first["digest"]:
                worst = max(abs(a - b) for a, b in zip(first["sample"], r["sample"], strict=True))
                raise BenchmarkError(f"[ddp {name}] rank {rank}'s parameters differ from rank "
                                     f"0's (max abs diff in a sample {worst:g}): the replicas "
                                     "diverged")
        params = self.load(first)
        if name == "gloo":
            self.reference = params
            return
        found = self.found[name] = self.compare(params)
        if found["over_tolerance"]:
            j = found["worst_over_index"]
            raise BenchmarkError(
                f"[ddp {name}] parameters differ from gloo's beyond float32 rounding: "
                f"{found['over_tolerance']} of {params.size} exceed atol {self.atol:g} + rtol "
                f"{self.rtol:g} x |gloo|; worst at index {j}: {float(params[j])!r} vs gloo "
                f"{float(self.reference[j])!r}; max abs diff {found['max_abs_diff']:.3g} "
                f"(median step {median(first['times']) * 1e3:.1f} ms)")

    @staticmethod
    def load(rank0: dict):
        """Rank 0's saved final parameters (the file is removed)."""
        import numpy as np

        params = np.load(rank0["saved"])
        Path(rank0["saved"]).unlink(missing_ok=True)
        return params

    def compare(self, params) -> dict:
        """How ``params`` differ from gloo's: max |diff|, how many exceed the tolerance."""
        import numpy as np

        if self.reference is None:
            return {"max_abs_diff": None, "over_tolerance": None, "within_tolerance": None}
        ref = self.reference.astype(np.float64)
        diff = np.abs(params.astype(np.float64) - ref)
        excess = diff - (self.atol + self.rtol * np.abs(ref))
        i, j = int(np.argmax(diff)), int(np.argmax(excess))
        over = int(np.count_nonzero(excess > 0))
        return {"max_abs_diff": float(diff[i]), "worst_index": i, "over_tolerance": over,
                "worst_over_index": j if over else None, "within_tolerance": not over}


def run_part_ddp(args, failures: list) -> list[dict]:
    rows = []
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(prefix="gradstar-bench-gpu-") as folder:
            rows += run_ddp_configs(args, ranks, Path(folder), failures)
    return rows


def run_ddp_configs(args, ranks: int, folder: Path, failures: list) -> list[dict]:
    """Part 2 for one world size: local, gloo, then the gradstar configurations; rank 0 of
    each saves its final parameters under ``folder`` for :class:`ParameterCheck`."""
    widths = mlp_widths(args.model_mparams)
    timeout = args.timeout or DDP_TIMEOUT
    common = (args.device, widths, args.batch, args.warmup_steps, args.steps,
              args.bucket_cap_mb, args.lr)
    check = ParameterCheck(args.atol, args.rtol)

    def save_as(name: str) -> str:
        return str(folder / (name.replace(" ", "-").replace(".", "-") + ".npy"))

    def saved(results: list[dict], name: str) -> list[dict]:
        results[0]["saved"] = save_as(name)
        return results

    def local_run():
        return run_ranks(ddp_rank, ranks, (None, None, "local", *common, save_as("local")),
                         timeout=timeout, label=f"ddp local ranks={ranks}")

    def gloo_run():
        return saved(run_ranks(ddp_rank, ranks, (f"tcp://127.0.0.1:{free_port()}", None,
                                                 "gloo", *common, save_as("gloo")),
                               timeout=timeout, label=f"ddp gloo ranks={ranks}"), "gloo")

    def hub_run(api: str, path: str, name: str):
        return lambda: saved(run_on_hub(ddp_rank, ranks, (api, *common, save_as(name)),
                                        shards=args.shards, path=path, timeout=timeout,
                                        label=f"ddp {name} ranks={ranks}"), name)

    configs = [("local", local_run)]
    if "gloo" in args.backends:
        configs.append(("gloo", gloo_run))
    for api, title in (("torch", "gradstar torch"), ("sdk", "gradstar.DDP")):
        if api in args.backends:
            configs += [(f"{title} {path}", hub_run(api, path, f"{title} {path}"))
                        for path in args.paths]
    print(f"  DDP step, {ranks} ranks:", file=sys.stderr, flush=True)
    runs, failed = run_configs(configs, check)
    if runs.get("local"):
        # No communication, so local's parameters must differ from gloo's: how much says
        # whether the tolerance could catch a gradient that was not averaged.
        check.found["local"] = check.compare(check.load(saved(runs["local"], "local")[0]))
    failures += [(f"ddp {name} ranks={ranks}", error) for name, error in failed]
    gloo = runs.get("gloo")
    gloo_ms = median(gloo[0]["times"]) * 1e3 if gloo else None
    rows = []
    for name, results in runs.items():
        row = {"ranks": ranks, "backend": name, "error": dict(failed).get(name)}
        if results is not None:
            ms = median(results[0]["times"]) * 1e3
            row |= {"median_ms": ms, "ratio": ms / gloo_ms if gloo_ms else None,
                    "rank0_times_ms": [round(t * 1e3, 3) for t in results[0]["times"]],
                    "median_ms_by_rank": [round(median(r["times"]) * 1e3, 3) for r in results],
                    "params": results[0]["params"], "devices": [r["device"] for r in results],
                    "moved": results[0].get("moved")}
        rows.append(row | check.found.get(name, {}))
    return rows


def ddp_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        diff = _fmt(r.get("max_abs_diff"), ".1e")
        over = r.get("over_tolerance")
        if r["backend"] == "local":
            verdict = "-" if over is None else f"n/a, {over} over"
        else:
            verdict = "-" if over is None else ("yes" if not over else f"NO, {over} over")
        if r["error"]:
            lines.append([r["ranks"], r["backend"], "FAILED", "-", diff, verdict])
            continue
        lines.append([r["ranks"], r["backend"], f"{r['median_ms']:.1f}", _fmt(r["ratio"], ".2f"),
                      diff, verdict])
    return format_table(["ranks", "backend", "ms/step", "ratio vs gloo", "max |p - p_gloo|",
                         "within tolerance"], lines)


# -- main ----------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import numpy
    import torch

    import gradstar

    env = {"python": platform.python_version(), "numpy": numpy.__version__,
           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "gradstar": gradstar.__version__, "cpus": os.cpu_count(),
           "machine": platform.machine(), "system": platform.system(), "device": device,
           "command": shlex.join([sys.executable, *sys.argv]),
           "loadavg_at_start": loadavg()}
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
              f"(gloo moved them by up to {_fmt(moved, '.1e')}); local = the same steps "
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

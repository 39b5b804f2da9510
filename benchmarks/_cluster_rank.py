"""One rank of benchmarks/cluster.py (``cluster.py --rank-spec``, run inside a host's namespace):
join, warm up, time the loop, report JSON lines.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from _cluster_model import DDP_BATCH


def ddp_step(wrap: Callable, rank: int) -> tuple[Callable, Callable]:
    """``benchmarks/ddp_step.py``'s model, data and SGD step, its gradients reduced by the
    DDP wrapper ``wrap(model, optimizer)`` returns: (one training step, a sample of the
    parameters once every rank applied every step)."""
    import torch
    from ddp_step import SAMPLE_EVERY, _data, _model

    torch.set_num_threads(1)  # every rank shares the machine's cores with the others
    model = _model(seed=rank)  # different seeds: DDP's first broadcast must align them
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step_model = wrap(model, opt)
    x, y = _data(rank, DDP_BATCH)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(step_model(x), y).backward()
        opt.step()

    def sample() -> list[float]:
        if hasattr(step_model, "synchronize"):  # gradstar.DDP: a sync mode's steps applied
            step_model.synchronize()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return flat[::SAMPLE_EVERY].tolist()

    return step, sample


def sync_mode(spec: dict):
    """The gradstar ranks' sync mode: Synchronous, or Quorum of every host but one that never
    waits for the rest (``benchmarks/sync_modes.py``'s)."""
    import gradstar

    if spec.get("sync_mode") == "quorum":
        return gradstar.Quorum(min_ranks=spec["world_size"] - spec["ranks_per_host"],
                               timeout=0.0)
    return gradstar.Synchronous()


def rank_main(spec: dict) -> int:
    """One rank: join, warm up, report the timed loop. Rank 0 prints ``{"phase": ...}`` lines
    and waits for a line on stdin at each; every rank ends with a ``{"result": ...}`` line."""
    import numpy as np

    rank, n, iters = spec["rank"], spec["world_size"], spec["iters"]
    numel = spec["nbytes"] // 4
    want = n * (n + 1) / 2
    # Compressed rows are exact to the format's rounding (these inputs are constant per rank).
    lossy = spec.get("wire") is not None or spec.get("bf16_hook", False)
    if spec["backend"] == "gloo":
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=spec["store"], rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=spec["timeout"]))
        saved = torch.full((numel,), float(rank + 1), dtype=torch.float32)
        x = saved.clone()

        def all_reduce():
            if spec.get("bf16_hook"):  # torch's bf16_compress_hook: divide, cast, sum, cast back
                t = (saved / n).to(torch.bfloat16)
                dist.all_reduce(t)
                return t.to(torch.float32).numpy() * n
            x.copy_(saved)  # gloo reduces in place
            dist.all_reduce(x)
            return x.numpy()

        barrier, close, shards = dist.barrier, dist.destroy_process_group, None
        def wrap(model, opt):
            return torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=spec["bucket_cap_mb"])
    else:
        import gradstar

        options = {"chunk_bytes": spec["chunk_bytes"]} if spec["chunk_bytes"] else {}
        pg = gradstar.init_process_group(rank=rank, timeout=spec["timeout"], join_timeout=120,
                                         **options)
        if len(pg.shards) != spec["shards"]:
            raise SystemExit(f"rank {rank}: striped over {pg.shards}, expected "
                             f"{spec['shards']} shards")
        saved = np.full(numel, rank + 1, dtype=np.float32)
        x = saved.copy()

        def all_reduce():
            x[:] = saved  # in place, as gloo's (a fresh result would cost page faults each call)
            return pg.all_reduce(x, out=x, wire=spec.get("wire"))

        barrier, close, shards = pg.barrier, pg.close, pg.shards

        def wrap(model, opt):
            mode = sync_mode(spec)  # the optimizer applies a ledger mode's steps
            return gradstar.DDP(model, pg, bucket_cap_mb=spec["bucket_cap_mb"], sync_mode=mode,
                                optimizer=opt if mode.on_ledger else None)

    if spec["workload"] == "ddp":
        all_reduce, final = ddp_step(wrap, rank)
    elif spec["workload"] == "barrier":
        all_reduce, final = barrier, None
    else:
        final = None

    def check(result) -> None:
        if final is not None or spec["workload"] == "barrier":
            return  # a DDP step: the ranks' final parameters are compared by the driver
        if lossy:
            if not (np.abs(result - want) <= want * 2.0**-6).all():
                raise SystemExit(f"rank {rank}: wrong all_reduce result (want {want} to the "
                                 "format's rounding)")
            return
        if not (result[0] == want and result[-1] == want and (result == want).all()):
            raise SystemExit(f"rank {rank}: wrong all_reduce result (want {want})")

    def phase(name: str) -> None:
        barrier()
        if rank == 0:
            print(json.dumps({"phase": name}), flush=True)
            if not sys.stdin.readline():
                raise SystemExit("rank 0: the benchmark went away")
        barrier()

    for _ in range(spec["warmup"]):
        check(all_reduce())
    phase("start")
    times = []
    cpu = time.process_time()
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        result = all_reduce()
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu
    check(result)
    phase("end")
    print(json.dumps({"result": {"rank": rank, "times": times, "cpu_s": cpu,
                                 "shards": shards, "sample": final and final()}}), flush=True)
    close()
    return 0

"""What runs in the rank processes of ``gpu.py``: the rank's device, its group (gloo, backend
"gradstar" or gradstar's SDK), a timed all_reduce loop and a timed DDP step."""

from __future__ import annotations

import itertools
import math

from _collective_runs import COLLECTIVE_TIMEOUT
from _paths import shm_report

SAMPLE_EVERY = 997  # every 997th parameter goes into a rank's report, for error messages


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


__all__ = ["RankGroup", "allreduce_rank", "ddp_rank", "mlp_widths", "parameter_count",
           "rank_device", "synchronize"]

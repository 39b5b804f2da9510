"""A DDP rank for tests: ``python ddp_script.py`` (settings from GRADSTAR_* env vars).

Runs every scenario of :data:`SCENARIOS` in turn on one process group, each on a fresh model
seeded by the rank (so only the construction broadcast can make the replicas agree), and prints
one JSON line per scenario: the final parameters and what the scenario observed.

The models, data and training steps are defined here once and imported by ``test_ddp.py``,
which trains the single-process reference with the same code on the whole batch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradstar
from gradstar.client import device
from gradstar.errors import ConfigurationError, GradstarError

try:
    from .scenarios import run_scenarios
except ImportError:  # run as a script
    from scenarios import run_scenarios

SCRIPT = Path(__file__)
IN, HIDDEN, OUT = 6, 16, 3
BATCH = 16  # per step, over all ranks: each of 4 ranks trains on a quarter
STEPS = 5
# Compressed training runs longer: rounding without error feedback builds up over the steps.
WIRE_STEPS = 30
# A few hundred bytes: the MLP's six tensors land in several buckets.
SMALL_BUCKET_MB = 800 / (1 << 20)
# Which ranks use BranchNet's branch at each step (step 2: none, so its grads stay None).
BRANCH_USERS = [{0, 1, 2, 3}, {0, 1}, set(), {3}, {0, 1, 2, 3}]


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


class BranchNet(nn.Module):
    """An MLP with an extra branch that the caller switches on or off per forward."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
        self.branch = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        out = self.trunk(x)
        return out + self.branch(x) if use_branch else out


def make_bn_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + micro)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1)


def loss_of(model, step: int, rank: int, world: int, micro: int = 0) -> torch.Tensor:
    x, y = batch(step, micro)
    return nn.functional.mse_loss(model(shard(x, rank, world)), shard(y, rank, world))


def train_plain(model, opt, rank: int, world: int, *, micro_steps: int = 1, no_sync=None,
                steps: int = STEPS):
    """``steps`` optimizer steps; with ``world=1`` this is the single-process reference.

    ``micro_steps > 1`` accumulates gradients over micro-batches before each step; the
    backward passes of all but the last run inside ``no_sync()`` when it is given."""
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            context = no_sync() if (no_sync is not None and not last) else _nothing()
            with context:
                loss_of(model, step, rank, world, micro).backward()
        opt.step()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def branch_loss(model, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = batch(step)
    out = model(shard(x, rank, world), use_branch=rank in BRANCH_USERS[step])
    return nn.functional.mse_loss(out, shard(y, rank, world))


def branch_reference(seed: int = 0) -> nn.Module:
    """One process, whole batch: the loss is the mean of the four quarters' losses, each with
    or without the branch as on that rank."""
    model = BranchNet(seed)
    opt = optimizer("adam", model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(branch_loss(model, step, r, 4) for r in range(4)) / 4
        loss.backward()
        opt.step()
    return model


def params_of(module: nn.Module) -> dict[str, list]:
    return {name: p.detach().double().reshape(-1).tolist()
            for name, p in module.named_parameters()}


# -- scenarios (every rank runs them in this order) --------------------------------------------


def sgd(pg) -> dict:
    """SGD over several small buckets; reports the last step's timeline (overlap evidence)."""
    ddp = gradstar.DDP(make_mlp(pg.rank), pg, bucket_cap_mb=SMALL_BUCKET_MB)
    train_plain(ddp, optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size)
    t = ddp.last_step_timeline
    return {"params": params_of(ddp.module), "buckets": len(ddp.bucket_plan),
            "state_dict_keys": list(ddp.state_dict()),
            "timeline": {"hooks": [at for _, at in t.hooks],
                         "launches": [[x.bucket, x.at, x.during] for x in t.launches],
                         "backward_end": t.backward_end, "finished": t.finished}}


def adam(pg) -> dict:
    ddp = gradstar.DDP(make_mlp(pg.rank), pg)
    train_plain(ddp, optimizer("adam", ddp.parameters()), pg.rank, pg.world_size)
    return {"params": params_of(ddp.module), "buckets": len(ddp.bucket_plan)}


def no_sync(pg) -> dict:
    ddp = gradstar.DDP(make_mlp(pg.rank), pg, bucket_cap_mb=SMALL_BUCKET_MB)
    train_plain(ddp, optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size, micro_steps=2,
                no_sync=ddp.no_sync)
    return {"params": params_of(ddp.module)}


def one_call(pg) -> dict:
    """``sgd`` through ``create_distributed_data_parallel``: it joins a job of its own (the
    GRADSTAR_* variables, the job renamed) and wraps the model."""
    ddp = gradstar.create_distributed_data_parallel(
        make_mlp(pg.rank), job=os.environ["GRADSTAR_JOB"] + "-one-call",
        pg_options={"timeout": 30, "join_timeout": 60}, bucket_cap_mb=SMALL_BUCKET_MB)
    try:
        train_plain(ddp, optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size)
        joined = [ddp.process_group.rank, ddp.process_group.world_size]
        ddp.process_group.barrier()  # nobody closes while a peer is in its last collective
    finally:
        ddp.process_group.close()
    return {"params": params_of(ddp.module), "buckets": len(ddp.bucket_plan), "joined": joined}


def sync_by_hand(pg) -> dict:
    """Every micro-step inside no_sync(), then sync_gradients() before the optimizer step."""
    ddp = gradstar.DDP(make_mlp(pg.rank), pg, bucket_cap_mb=SMALL_BUCKET_MB)
    opt = optimizer("sgd", ddp.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        with ddp.no_sync():
            for micro in range(2):
                loss_of(ddp, step, pg.rank, pg.world_size, micro).backward()
        ddp.sync_gradients()
        opt.step()
    return {"params": params_of(ddp.module)}


def unused(pg, wire: str | None = None) -> dict:
    ddp = gradstar.DDP(BranchNet(pg.rank), pg, find_unused_parameters=True,
                       bucket_cap_mb=SMALL_BUCKET_MB, wire=wire)
    opt = optimizer("adam", ddp.parameters())
    none_when_unused_everywhere = None
    for step in range(STEPS):
        opt.zero_grad()
        branch_loss(ddp, step, pg.rank, pg.world_size).backward()
        if not BRANCH_USERS[step]:
            none_when_unused_everywhere = all(p.grad is None
                                              for p in ddp.module.branch.parameters())
        opt.step()
    return {"params": params_of(ddp.module),
            "branch_grad_none_when_unused_everywhere": none_when_unused_everywhere}


def unused_error(pg) -> dict:
    """find_unused_parameters off; step 0: rank 0 skips the branch. Then a normal step."""
    ddp = gradstar.DDP(BranchNet(pg.rank), pg)
    opt = optimizer("sgd", ddp.parameters())
    report = {"error": None}
    for step, users in enumerate([{1, 2, 3}, {0, 1, 2, 3}]):
        opt.zero_grad()
        x, y = batch(step)
        out = ddp(shard(x, pg.rank, pg.world_size), use_branch=pg.rank in users)
        loss = nn.functional.mse_loss(out, shard(y, pg.rank, pg.world_size))
        started = time.monotonic()
        try:
            loss.backward()
        except ConfigurationError as error:
            report.update(error=type(error).__name__, message=str(error),
                          seconds=time.monotonic() - started)
        opt.step()
    report["params"] = params_of(ddp.module)
    return report


def bf16(pg) -> dict:
    ddp = gradstar.DDP(make_mlp(pg.rank), pg, bucket_cap_mb=SMALL_BUCKET_MB,
                       gradient_compression="bf16")
    train_plain(ddp, optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size)
    return {"params": params_of(ddp.module),
            "bucket_dtypes": sorted({str(d) for d in ddp.bucket_dtypes})}


def wire_training(pg, wire: str, error_feedback: bool) -> dict:
    """WIRE_STEPS of SGD with every bucket in ``wire``; reports the last residuals' sizes."""
    ddp = gradstar.DDP(make_mlp(pg.rank), pg, bucket_cap_mb=SMALL_BUCKET_MB, wire=wire,
                       error_feedback=error_feedback)
    train_plain(ddp, optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size,
                steps=WIRE_STEPS)
    residuals = ddp.error_feedback_residuals
    return {"params": params_of(ddp.module), "bucket_dtypes": sorted(
                {str(d) for d in ddp.bucket_dtypes}),
            "residuals": [None if r is None else [str(r.dtype), r.numel()] for r in residuals],
            "bucket_numels": [b.numel for b in ddp.bucket_plan]}


def int8_ef(pg) -> dict:
    return wire_training(pg, "int8", True)


def int8_no_ef(pg) -> dict:
    return wire_training(pg, "int8", False)


def int4_ef(pg) -> dict:
    return wire_training(pg, "int4", True)


def int4_no_ef(pg) -> dict:
    return wire_training(pg, "int4", False)


def int8_unused(pg) -> dict:
    """``unused`` (flags, a branch no rank uses at step 2) with int8 buckets and feedback."""
    return unused(pg, wire="int8")


def wire_mismatch(pg) -> dict:
    """Rank 0 sends int8, the others bf16: every rank gets the named mismatch, none hangs."""
    ddp = gradstar.DDP(make_mlp(pg.rank), pg, wire="int8" if pg.rank == 0 else "bf16")
    started = time.monotonic()
    try:
        loss_of(ddp, 0, pg.rank, pg.world_size).backward()
    except GradstarError as error:
        return {"error": type(error).__name__, "message": str(error),
                "seconds": time.monotonic() - started}
    return {"error": None}


def staged(pg) -> dict:
    """``sgd`` (with the used-parameter flags) with the CPU declared a staged device: every
    bucket, broadcast and mean takes the path of a CUDA tensor (a host copy made when the
    collective is issued, the result a new tensor copied back), the part of DDP on a GPU that
    runs on this machine's CPU."""
    saved = device.STAGED_DEVICES
    device.STAGED_DEVICES = ("cuda", "cpu")
    try:
        ddp = gradstar.DDP(make_mlp(pg.rank), pg, bucket_cap_mb=SMALL_BUCKET_MB,
                           find_unused_parameters=True)
        train_plain(ddp, optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size)
        return {"params": params_of(ddp.module), "buckets": len(ddp.bucket_plan),
                "staged": all(device.is_staged(p) for p in ddp.parameters())}
    finally:
        device.STAGED_DEVICES = saved


def staged_int8(pg) -> dict:
    """``staged`` with int8 buckets and error feedback: the flags' own all_reduce and every
    bucket take the path of CUDA tensors (host copies, results copied back)."""
    saved = device.STAGED_DEVICES
    device.STAGED_DEVICES = ("cuda", "cpu")
    try:
        ddp = gradstar.DDP(make_mlp(pg.rank), pg, bucket_cap_mb=SMALL_BUCKET_MB,
                           find_unused_parameters=True, wire="int8")
        train_plain(ddp, optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size,
                    steps=WIRE_STEPS)
        return {"params": params_of(ddp.module),
                "staged": all(device.is_staged(p) for p in ddp.parameters())}
    finally:
        device.STAGED_DEVICES = saved


def buffers(pg) -> dict:
    """BatchNorm buffers: rank 0's are broadcast at construction and before each forward."""
    model = make_bn_mlp(pg.rank)
    model[1].running_mean.fill_(float(pg.rank))
    ddp = gradstar.DDP(model, pg)
    after_init = model[1].running_mean.tolist()
    opt = optimizer("sgd", ddp.parameters())
    for step in range(2):
        opt.zero_grad()
        loss_of(ddp, step, pg.rank, pg.world_size).backward()
        opt.step()
    ddp.eval()
    with torch.no_grad():
        ddp(batch(9)[0])  # syncs the buffers first (the previous forward was a training one)
    return {"after_init": after_init, "mean": model[1].running_mean.tolist(),
            "tracked": int(model[1].num_batches_tracked), "training": ddp.module.training}


SCENARIOS = {"sgd": sgd, "one_call": one_call, "adam": adam, "no_sync": no_sync,
             "sync_by_hand": sync_by_hand, "unused": unused, "unused_error": unused_error,
             "bf16": bf16, "staged": staged,
             "buffers": buffers, "int8_ef": int8_ef, "int8_no_ef": int8_no_ef,
             "int4_ef": int4_ef, "int4_no_ef": int4_no_ef, "int8_unused": int8_unused,
             "staged_int8": staged_int8, "wire_mismatch": wire_mismatch}


def main() -> int:
    return run_scenarios(SCENARIOS, sys.argv[1:] or list(SCENARIOS))


if __name__ == "__main__":
    raise SystemExit(main())

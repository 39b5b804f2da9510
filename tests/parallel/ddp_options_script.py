"""A DDP rank for the tests of DDP's options: ``python ddp_options_script.py`` (GRADSTAR_* env).

Every scenario of :data:`SCENARIOS` runs in turn on one process group, each on a fresh model
seeded by the rank, and prints one JSON line: the final parameters and what it observed.
``test_ddp_options.py`` trains the single-process references with the same code (the models,
data and steps of ``ddp_script.py``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradstar
from gradstar.client import device
from gradstar.errors import BucketCapMismatchError, ConfigurationError

try:
    from . import ddp_script as base
    from .scenarios import run_scenarios
except ImportError:  # run as a script
    import ddp_script as base
    from scenarios import run_scenarios

SCRIPT = Path(__file__)
STEPS = 7
SMALL = base.SMALL_BUCKET_MB
# static_graph: these ranks use BranchNet's branch at every step; the others never do.
STATIC_USERS = {0, 1}
# bucket_cap_mb assigned on every rank before these steps (the plan changes after them).
CAP_CHANGES = {2: 1.0, 4: 200 / (1 << 20)}


def train(ddp, opt, rank: int, world: int, *, set_to_none: bool = True, steps: int = STEPS,
          loss_of=base.loss_of, before_step=None) -> list[dict]:
    """``steps`` optimizer steps; returns what each step saw (buckets, launch places)."""
    seen = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(ddp, step, rank, world).backward()
        opt.step()
        t = getattr(ddp, "last_step_timeline", None)
        seen.append({} if t is None else {
            "buckets": len(t.launches), "in_backward": t.launched_during_backward,
            "during": [x.during for x in t.launches],
            "first_launch_after_backward": t.launches[0].at >= t.backward_end})
    return seen


def static_loss(model, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = base.batch(step)
    out = model(base.shard(x, rank, world), use_branch=rank in STATIC_USERS)
    return nn.functional.mse_loss(out, base.shard(y, rank, world))


def grads_are_views(ddp) -> bool:
    """Every gradient lies in its bucket's flat tensor (the memory of gradient_as_bucket_view)."""
    return all(p.grad is not None and p.grad.data_ptr() == v.data_ptr()
               for p, v in zip(ddp._params, ddp.reducer.views, strict=True))


# -- scenarios ---------------------------------------------------------------------------------


def view_keep(pg) -> dict:
    """gradient_as_bucket_view, zero_grad(set_to_none=False): autograd writes into the buckets."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL,
                       gradient_as_bucket_view=True)
    train(ddp, base.optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size,
          set_to_none=False)
    return {"params": base.params_of(ddp.module), "views": grads_are_views(ddp),
            "buckets": len(ddp.bucket_plan)}


def view_none(pg) -> dict:
    """gradient_as_bucket_view with zero_grad(set_to_none=True), Adam: each step's fresh
    gradients are copied in and replaced by the views."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL,
                       gradient_as_bucket_view=True)
    train(ddp, base.optimizer("adam", ddp.parameters()), pg.rank, pg.world_size)
    return {"params": base.params_of(ddp.module), "views": grads_are_views(ddp)}


def view_no_sync(pg) -> dict:
    """gradient_as_bucket_view: two micro-steps, the first inside no_sync()."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL,
                       gradient_as_bucket_view=True)
    base.train_plain(ddp, base.optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size,
                     micro_steps=2, no_sync=ddp.no_sync)
    return {"params": base.params_of(ddp.module), "views": grads_are_views(ddp)}


def view_unused(pg) -> dict:
    """gradient_as_bucket_view with find_unused_parameters (BranchNet, Adam)."""
    ddp = gradstar.DDP(base.BranchNet(pg.rank), pg, find_unused_parameters=True,
                       bucket_cap_mb=SMALL, gradient_as_bucket_view=True)
    opt = base.optimizer("adam", ddp.parameters())
    none_when_unused = None
    for step in range(base.STEPS):
        opt.zero_grad()
        base.branch_loss(ddp, step, pg.rank, pg.world_size).backward()
        if not base.BRANCH_USERS[step]:
            none_when_unused = all(p.grad is None for p in ddp.module.branch.parameters())
        opt.step()
    return {"params": base.params_of(ddp.module), "none_when_unused": none_when_unused}


def view_int8(pg) -> dict:
    """gradient_as_bucket_view with int8 buckets and error feedback."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL, wire="int8",
                       gradient_as_bucket_view=True)
    train(ddp, base.optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size,
          steps=base.WIRE_STEPS, set_to_none=False)
    return {"params": base.params_of(ddp.module), "views": grads_are_views(ddp)}


def view_staged(pg) -> dict:
    """``view_keep`` with the CPU declared a staged device: each bucket's means come back as a
    new tensor (as a CUDA bucket's do) and are copied into the bucket the gradients view."""
    saved = device.STAGED_DEVICES
    device.STAGED_DEVICES = ("cuda", "cpu")
    try:
        ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL,
                           gradient_as_bucket_view=True, find_unused_parameters=True)
        train(ddp, base.optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size,
              set_to_none=False)
        return {"params": base.params_of(ddp.module), "views": grads_are_views(ddp),
                "staged": all(device.is_staged(p) for p in ddp.parameters())}
    finally:
        device.STAGED_DEVICES = saved


def static(pg, static_graph: bool = True) -> dict:
    """BranchNet whose branch only ranks 0 and 1 use, at every step."""
    ddp = gradstar.DDP(base.BranchNet(pg.rank), pg, bucket_cap_mb=SMALL,
                       find_unused_parameters=not static_graph, static_graph=static_graph)
    seen = train(ddp, base.optimizer("adam", ddp.parameters()), pg.rank, pg.world_size,
                 loss_of=static_loss)
    return {"params": base.params_of(ddp.module), "steps": seen}


def unused_found(pg) -> dict:
    """``static`` without static_graph (find_unused_parameters=True): the comparison."""
    return static(pg, static_graph=False)


def static_unused_everywhere(pg) -> dict:
    """static_graph=True alone, a branch no rank uses: its gradients stay None (no error)."""
    ddp = gradstar.DDP(base.BranchNet(pg.rank), pg, static_graph=True)
    train(ddp, base.optimizer("adam", ddp.parameters()), pg.rank, pg.world_size,
          loss_of=lambda m, s, r, w: nn.functional.mse_loss(
              m(base.shard(base.batch(s)[0], r, w), use_branch=False),
              base.shard(base.batch(s)[1], r, w)))
    return {"params": base.params_of(ddp.module),
            "branch_none": all(p.grad is None for p in ddp.module.branch.parameters())}


def static_changed(pg) -> dict:
    """static_graph=True, then the branch's users change at step 1: {0, 1} -> {1, 2}."""
    ddp = gradstar.DDP(base.BranchNet(pg.rank), pg, static_graph=True)
    opt = base.optimizer("sgd", ddp.parameters())
    report = {"error": None}
    for step, users in enumerate([{0, 1}, {1, 2}]):
        opt.zero_grad()
        x, y = base.batch(step)
        out = ddp(base.shard(x, pg.rank, pg.world_size), use_branch=pg.rank in users)
        started = time.monotonic()
        try:
            nn.functional.mse_loss(out, base.shard(y, pg.rank, pg.world_size)).backward()
        except ConfigurationError as error:
            report.update(error=type(error).__name__, message=str(error), step=step,
                          seconds=time.monotonic() - started)
    return report


def delayed(pg) -> dict:
    """delay_all_reduce=True: every bucket launches when backward ends."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL, delay_all_reduce=True)
    seen = train(ddp, base.optimizer("sgd", ddp.parameters()), pg.rank, pg.world_size)
    return {"params": base.params_of(ddp.module), "steps": seen}


def cap_change(pg, as_view: bool = False) -> dict:
    """bucket_cap_mb assigned on every rank before steps 2 and 4 (Adam)."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL,
                       gradient_as_bucket_view=as_view)

    def change(step: int) -> None:
        if step in CAP_CHANGES:
            ddp.bucket_cap_mb = CAP_CHANGES[step]

    seen = train(ddp, base.optimizer("adam", ddp.parameters()), pg.rank, pg.world_size,
                 before_step=change, set_to_none=not as_view)
    return {"params": base.params_of(ddp.module), "steps": seen,
            "views": grads_are_views(ddp) if as_view else None,
            "bucket_cap_mb": ddp.bucket_cap_mb}


def cap_change_views(pg) -> dict:
    return cap_change(pg, as_view=True)


def cap_mismatch(pg) -> dict:
    """Only rank 0 assigns bucket_cap_mb (before step 1): every rank gets the named error at
    that step, keeps its buckets, and training goes on (Adam, STEPS steps)."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL)
    opt = base.optimizer("adam", ddp.parameters())
    report = {"errors": []}
    for step in range(STEPS):
        if step == 1 and pg.rank == 0:
            ddp.bucket_cap_mb = 1.0
        opt.zero_grad()
        started = time.monotonic()
        try:
            base.loss_of(ddp, step, pg.rank, pg.world_size).backward()
        except BucketCapMismatchError as error:
            report["errors"].append({"step": step, "message": str(error),
                                     "seconds": time.monotonic() - started})
        opt.step()
    return {**report, "params": base.params_of(ddp.module), "buckets": len(ddp.bucket_plan),
            "bucket_cap_mb": ddp.bucket_cap_mb}


def cap_values_differ(pg) -> dict:
    """Every rank assigns bucket_cap_mb before step 1, rank 0 another value: the values are
    compared at step 2, where every rank gets the named error."""
    ddp = gradstar.DDP(base.make_mlp(pg.rank), pg, bucket_cap_mb=SMALL)
    opt = base.optimizer("sgd", ddp.parameters())
    errors = []
    for step in range(4):
        if step == 1:
            ddp.bucket_cap_mb = 2.0 if pg.rank == 0 else 1.0
        opt.zero_grad()
        try:
            base.loss_of(ddp, step, pg.rank, pg.world_size).backward()
        except BucketCapMismatchError as error:
            errors.append({"step": step, "message": str(error)})
        opt.step()
    return {"errors": errors, "params": base.params_of(ddp.module),
            "buckets": len(ddp.bucket_plan), "bucket_cap_mb": ddp.bucket_cap_mb}


def broadcast_src(pg) -> dict:
    """Each rank moves its parameters and buffers apart, then broadcast_parameters(src=2)."""
    model = base.make_bn_mlp(pg.rank)
    ddp = gradstar.DDP(model, pg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(pg.rank))
        model[1].running_mean.fill_(float(pg.rank))
    report = {}
    try:
        ddp.broadcast_parameters(src=pg.world_size)
    except ConfigurationError as error:
        report["bad_src"] = str(error)
    ddp.broadcast_parameters(src=2)
    return {**report, "params": base.params_of(model),
            "running_mean": model[1].running_mean.tolist()}


SCENARIOS = {"view_keep": view_keep, "view_none": view_none, "view_no_sync": view_no_sync,
             "view_unused": view_unused, "view_int8": view_int8, "view_staged": view_staged,
             "static": static,
             "unused_found": unused_found, "static_unused_everywhere": static_unused_everywhere,
             "static_changed": static_changed, "delayed": delayed, "cap_change": cap_change,
             "cap_change_views": cap_change_views, "cap_mismatch": cap_mismatch,
             "cap_values_differ": cap_values_differ,
             "broadcast_src": broadcast_src}


def main() -> int:
    return run_scenarios(SCENARIOS, sys.argv[1:] or list(SCENARIOS))


if __name__ == "__main__":
    raise SystemExit(main())

"""A rank of the wrapper tests on a staged device: ``python wrappers_script.py OUT_DIR
[--device D] [--stage-cpu] [scenario ...]`` (settings from GRADSTAR_* env vars; every rank uses
device D, ``cuda:0`` by default, so two ranks share one GPU).

For tests/cuda/test_wrappers_cuda.py (``--device cuda:0``) and
tests/parallel/test_wrappers_staged.py (``--device cpu --stage-cpu``: ``--stage-cpu`` sets
``gradstar.client.device.STAGED_DEVICES`` before the process group is created, so that CPU
tensors are staged through host copies exactly as CUDA tensors are).

Runs the named scenarios of :data:`SCENARIOS` (default: all) in turn on one process group, each
on fresh models seeded by the rank (so only the construction broadcast can make the ranks
agree), and prints one JSON line per scenario: the final parameters (as host lists), the
devices the wrapper left its tensors on, whether D's tensors are staged and how many staged
host copies the scenario made, and what else the scenario observed. Checkpoint files go to
OUT_DIR.

The models and data are those of ``tests/parallel``; the training loops, which move each batch
to the device, are defined here once and imported by ``test_wrappers_cuda.py``, which trains
the single-process references on the same device with the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from pathlib import Path

import torch
from torch import nn

import gradstar
from gradstar.client import convert
from gradstar.client import device as staging
from gradstar.errors import GradstarError

if not __package__:  # run as a file, the way the tests start ranks: find the `tests` package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.parallel import ddp_script, fsdp_script, local_sgd_script, pipeline_script

SCRIPT = Path(__file__)
STEPS = 4
# Which ranks of two use BranchNet's branch at each step (step 2: none, so its grads stay None).
BRANCH_USERS = [{0, 1}, {0}, set(), {1}]
# Pipeline batches: rows per step, none divisible by the micro-batch count.
PIPELINE_ROWS = [18, 13, 19, 14]
MICROBATCHES = 4
DILOCO = {"sync_every": 2, "outer_optimizer": "nesterov", "outer_lr": 0.7,
          "outer_momentum": 0.9}


def listed(named) -> dict[str, list]:
    """Host lists of ``(name, tensor)`` pairs, in float64 (JSON keeps every float32 exactly)."""
    return {name: t.detach().double().cpu().reshape(-1).tolist() for name, t in named}


def devices(tensors) -> list[str]:
    """The distinct devices of ``tensors`` (Nones skipped), sorted."""
    return sorted({str(t.device) for t in tensors if t is not None})


def mse(model, x: torch.Tensor, y: torch.Tensor, device) -> torch.Tensor:
    """The mean squared error of ``model`` on a host batch moved to ``device``."""
    return nn.functional.mse_loss(model(x.to(device)), y.to(device))


# -- training loops (``world=1``: the single-process reference on the whole batch) ----------------


def train_mlp(model, opt, rank: int, world: int, device, steps: int = STEPS) -> None:
    """ddp_script's MLP on this rank's rows of ddp_script's batches."""
    for step in range(steps):
        x, y = ddp_script.batch(step)
        opt.zero_grad()
        mse(model, x.chunk(world)[rank], y.chunk(world)[rank], device).backward()
        opt.step()


def branch_loss(model, step: int, rank: int, world: int, device) -> torch.Tensor:
    x, y = ddp_script.batch(step)
    out = model(x.chunk(world)[rank].to(device), use_branch=rank in BRANCH_USERS[step])
    return nn.functional.mse_loss(out, y.chunk(world)[rank].to(device))


def branch_reference(device, world: int = 2) -> nn.Module:
    """One process, whole batch: the mean of the ranks' losses, each with or without the branch
    as on that rank."""
    model = ddp_script.BranchNet(0).to(device)
    opt = ddp_script.optimizer("adam", model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(branch_loss(model, step, r, world, device) for r in range(world)) / world
        loss.backward()
        opt.step()
    return model


def train_fsdp_model(model, opt, rank: int, world: int, device, steps: int = STEPS) -> None:
    """fsdp_script's models on this rank's rows of fsdp_script's batches."""
    for step in range(steps):
        x, y = fsdp_script.batch(step)
        opt.zero_grad()
        mse(model, x.chunk(world)[rank], y.chunk(world)[rank], device).backward()
        opt.step()


def pipeline_model(seed: int = 0) -> nn.Sequential:
    """pipeline_script's data shapes in two stages; stage r is ``pipeline_model()[r]``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(pipeline_script.IN, pipeline_script.HIDDEN), nn.Tanh()),
        nn.Sequential(nn.Linear(pipeline_script.HIDDEN, pipeline_script.HIDDEN), nn.Tanh(),
                      nn.Linear(pipeline_script.HIDDEN, pipeline_script.OUT)))


def pipeline_reference(device) -> tuple[nn.Sequential, list[float]]:
    """The unsplit model, the whole batch each step: what every stage must equal."""
    model = pipeline_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=pipeline_script.LR)
    losses = []
    for step, rows in enumerate(PIPELINE_ROWS):
        x, y = pipeline_script.batch(step, rows)
        opt.zero_grad()
        loss = mse(model, x, y, device)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def local_step(model, opt, step: int, rank: int, world: int, device) -> None:
    """local_sgd_script's step, on this rank's rows moved to ``device``."""
    x, y = local_sgd_script.batch(step)
    opt.zero_grad()
    mse(model, x.chunk(world)[rank], y.chunk(world)[rank], device).backward()
    opt.step()


def local_sgd_reference(device) -> nn.Module:
    """Whole-batch SGD from rank 0's init: what LocalSGD synchronising every step must equal."""
    model = local_sgd_script.make_model(100).to(device)
    opt = local_sgd_script.make_optimizer(model, "sgd")
    for step in range(STEPS):
        local_step(model, opt, step, 0, 1, device)
    return model


def flat_params(model) -> torch.Tensor:
    """``model``'s parameters as one flat float32 tensor on their device (a new tensor)."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def diloco_reference(device, world: int = 2) -> nn.Module:
    """DiLoCo (:data:`DILOCO`) by hand in one process: ``world`` models from rank 0's init, each
    with inner SGD on its rank's rows, then a Nesterov step of the global parameters on the mean
    pseudo-gradient every ``sync_every`` steps. Returns rank 0's model, which holds the global
    parameters after the last round (:data:`STEPS` ends one)."""
    assert STEPS % DILOCO["sync_every"] == 0
    models = [local_sgd_script.make_model(100).to(device) for _ in range(world)]
    opts = [local_sgd_script.make_optimizer(m, "sgd") for m in models]
    lr, mu = DILOCO["outer_lr"], DILOCO["outer_momentum"]
    global_params = flat_params(models[0])
    momentum = torch.zeros_like(global_params)
    for step in range(STEPS):
        for rank, (model, opt) in enumerate(zip(models, opts, strict=True)):
            local_step(model, opt, step, rank, world, device)
        if (step + 1) % DILOCO["sync_every"] == 0:
            delta = torch.stack([global_params - flat_params(m) for m in models]).mean(0)
            momentum = mu * momentum + delta
            global_params = global_params - lr * (delta + mu * momentum)
            with torch.no_grad():
                for model in models:  # a copy each: the ranks' inner steps stay their own
                    offset = 0
                    for p in model.parameters():
                        p.copy_(global_params[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
    return models[0]


class StagedCopies:
    """Counts the staged host copies of inputs that gradstar makes (a wrapper around
    ``gradstar.client.convert.to_host_array``, the one place that makes them)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._copy = convert.to_host_array
        convert.to_host_array = self._counted

    def _counted(self, t):
        with self._lock:
            self.count += 1
        return self._copy(t)

    def take(self) -> int:
        """The copies counted since the last call."""
        with self._lock:
            count, self.count = self.count, 0
        return count


@contextlib.contextmanager
def plain_cpu_path():
    """CPU tensors on gradstar's ordinary CPU path for a while, even under ``--stage-cpu``."""
    saved = staging.STAGED_DEVICES
    staging.STAGED_DEVICES = tuple(kind for kind in saved if kind != "cpu")
    try:
        yield
    finally:
        staging.STAGED_DEVICES = saved


# -- scenarios (every rank runs them in the order given) -----------------------------------------


def ddp(pg, device, out: Path) -> dict:
    """SGD over several small buckets."""
    model = ddp_script.make_mlp(pg.rank).to(device)
    wrapped = gradstar.DDP(model, pg, bucket_cap_mb=ddp_script.SMALL_BUCKET_MB)
    train_mlp(wrapped, ddp_script.optimizer("sgd", wrapped.parameters()), pg.rank,
              pg.world_size, device)
    launches = wrapped.last_step_timeline.launches
    return {"params": listed(model.named_parameters()), "buckets": len(wrapped.bucket_plan),
            "device": str(wrapped.device),
            "devices": devices([*model.parameters(), *(p.grad for p in model.parameters())]),
            "launched_during_backward": sum(x.during == "backward" for x in launches)}


def ddp_unused(pg, device, out: Path) -> dict:
    """find_unused_parameters: the flags travel in the last bucket, on the device too."""
    model = ddp_script.BranchNet(pg.rank).to(device)
    wrapped = gradstar.DDP(model, pg, find_unused_parameters=True,
                           bucket_cap_mb=ddp_script.SMALL_BUCKET_MB)
    opt = ddp_script.optimizer("adam", wrapped.parameters())
    none_when_unused_everywhere = None
    for step in range(STEPS):
        opt.zero_grad()
        branch_loss(wrapped, step, pg.rank, pg.world_size, device).backward()
        if not BRANCH_USERS[step]:
            none_when_unused_everywhere = all(p.grad is None for p in model.branch.parameters())
        opt.step()
    return {"params": listed(model.named_parameters()),
            "branch_grad_none_when_unused_everywhere": none_when_unused_everywhere}


def ddp_bf16(pg, device, out: Path) -> dict:
    model = ddp_script.make_mlp(pg.rank).to(device)
    wrapped = gradstar.DDP(model, pg, bucket_cap_mb=ddp_script.SMALL_BUCKET_MB,
                           gradient_compression="bf16")
    train_mlp(wrapped, ddp_script.optimizer("sgd", wrapped.parameters()), pg.rank,
              pg.world_size, device)
    return {"params": listed(model.named_parameters()),
            "bucket_dtypes": sorted({str(d) for d in wrapped.bucket_dtypes}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()})}


def ddp_int8(pg, device, out: Path) -> dict:
    """int8 buckets with error feedback and the unused-parameter flags (which then travel in
    their own all_reduce): residuals live on the device, encoding runs on host copies."""
    model = ddp_script.make_mlp(pg.rank).to(device)
    wrapped = gradstar.DDP(model, pg, bucket_cap_mb=ddp_script.SMALL_BUCKET_MB, wire="int8",
                           find_unused_parameters=True)
    train_mlp(wrapped, ddp_script.optimizer("sgd", wrapped.parameters()), pg.rank,
              pg.world_size, device)
    return {"params": listed(model.named_parameters()),
            "residual_devices": sorted({str(r.device) for r in wrapped.error_feedback_residuals}),
            "grad_devices": devices(p.grad for p in model.parameters())}


def ddp_buffers(pg, device, out: Path) -> dict:
    """BatchNorm buffers (float and int64) broadcast from rank 0, at construction and in
    forward."""
    model = ddp_script.make_bn_mlp(pg.rank).to(device)
    model[1].running_mean.fill_(float(pg.rank))
    wrapped = gradstar.DDP(model, pg)
    after_init = model[1].running_mean.tolist()
    opt = ddp_script.optimizer("sgd", wrapped.parameters())
    train_mlp(wrapped, opt, pg.rank, pg.world_size, device, steps=2)
    wrapped.eval()
    with torch.no_grad():
        wrapped(ddp_script.batch(9)[0].to(device))
    return {"after_init": after_init, "mean": model[1].running_mean.tolist(),
            "tracked": int(model[1].num_batches_tracked),
            "devices": devices([*model.parameters(), *model.buffers()])}


def fsdp_report(wrapped) -> dict:
    shards = list(wrapped.parameters())
    return {"device": str(wrapped.device),
            "devices": devices([*shards, *(p.grad for p in shards)]),
            "placeholders": devices(u.placeholder for u in wrapped.units),
            "units": [[u.name, u.layout.numel, u.layout.padded_numel] for u in wrapped.units]}


def fsdp(pg, device, out: Path) -> dict:
    """Adam on the MLP whose root unit is padded; the full state dict from every rank."""
    wrapped = gradstar.FSDP(fsdp_script.MLP(pg.rank).to(device), pg)
    train_fsdp_model(wrapped, fsdp_script.optimizer("adam", wrapped.parameters()), pg.rank,
                     pg.world_size, device)
    full = wrapped.full_state_dict(rank0_only=False)
    return {"state_dict": listed(full.items()), "state_dict_devices": devices(full.values()),
            **fsdp_report(wrapped)}


def fsdp_nested(pg, device, out: Path) -> dict:
    """Nested units, a tied weight, a frozen unit and a buffer."""
    wrapped = gradstar.FSDP(fsdp_script.NestedNet(pg.rank).to(device), pg,
                            auto_wrap_policy=fsdp_script.NESTED_POLICY)
    train_fsdp_model(wrapped, fsdp_script.optimizer("adam", wrapped.parameters()), pg.rank,
                     pg.world_size, device)
    full = wrapped.full_state_dict(rank0_only=False)
    return {"state_dict": listed(full.items()), "state_dict_devices": devices(full.values()),
            **fsdp_report(wrapped)}


def fsdp_mixed(pg, device, out: Path) -> dict:
    """bf16 gathers and reductions; shards and optimizer in float32."""
    wrapped = gradstar.FSDP(fsdp_script.MLP(pg.rank).to(device), pg, mixed_precision="bf16")
    train_fsdp_model(wrapped, fsdp_script.optimizer("momentum", wrapped.parameters()), pg.rank,
                     pg.world_size, device)
    full = wrapped.full_state_dict(rank0_only=False)
    return {"state_dict": listed(full.items()),
            "collective_dtypes": sorted({c.dtype for c in wrapped.last_collectives}),
            **fsdp_report(wrapped)}


def fsdp_checkpoint(pg, device, out: Path) -> dict:
    """Full and sharded state dicts: saved from a trained FSDP, loaded into fresh ones (the
    full one from host memory), which then compute exactly what the trained one does."""
    wrapped = gradstar.FSDP(fsdp_script.MLP(pg.rank).to(device), pg)
    train_fsdp_model(wrapped, fsdp_script.optimizer("sgd", wrapped.parameters()), pg.rank,
                     pg.world_size, device)
    probe = fsdp_script.probe().to(device)
    with torch.no_grad():
        trained_out = wrapped(probe)
    full = wrapped.full_state_dict()
    report = {"full_devices": devices(full.values())}
    if pg.rank == 0:
        torch.save(full, out / "full.pt")
    fresh = gradstar.FSDP(fsdp_script.MLP(100 + pg.rank).to(device), pg)
    fresh.load_full_state_dict({k: v.cpu() for k, v in full.items()} if pg.rank == 0 else None)
    again = fresh.full_state_dict()
    with torch.no_grad():
        report["full_reloaded_out_equal"] = torch.equal(fresh(probe), trained_out)
    report["full_round_trip_equal"] = list(again) == list(full) and all(
        torch.equal(again[k], full[k]) for k in full)

    sharded = wrapped.sharded_state_dict()
    report["sharded_devices"] = devices([*(e["values"] for e in sharded["params"].values()),
                                         *sharded["buffers"].values()])
    torch.save(sharded, out / f"sharded-{pg.rank}.pt")
    other = gradstar.FSDP(fsdp_script.MLP(200 + pg.rank).to(device), pg)
    other.load_sharded_state_dict(torch.load(out / f"sharded-{pg.rank}.pt", weights_only=True))
    with torch.no_grad():
        report["sharded_reloaded_out_equal"] = torch.equal(other(probe), trained_out)
    report["shard_devices_after_loads"] = devices([*fresh.parameters(), *other.parameters()])
    return report


def pipeline(pg, device, out: Path, schedule: str) -> dict:
    stage = pipeline_model()[pg.rank].to(device)
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=MICROBATCHES, schedule=schedule)
    opt = torch.optim.SGD(stage.parameters(), lr=pipeline_script.LR)
    losses, loss_devices = [], set()
    for step, rows in enumerate(PIPELINE_ROWS):
        x, y = pipeline_script.batch(step, rows)
        opt.zero_grad()
        loss = pipe.step(inputs=x.to(device) if pipe.is_first else None,
                         targets=y.to(device) if pipe.is_last else None,
                         loss_fn=nn.functional.mse_loss)
        if loss is not None:
            loss_devices.add(str(loss.device))
            losses.append(loss.item())
        opt.step()
    x, _ = pipeline_script.batch(99, 10)
    with torch.no_grad():
        inference = pipe.forward(x.to(device) if pipe.is_first else None)
    return {"params": listed(stage.named_parameters()), "losses": losses,
            "device": str(pipe.device), "loss_devices": sorted(loss_devices),
            "devices": devices([*stage.parameters(), *(p.grad for p in stage.parameters())]),
            "inference": None if inference is None else inference.tolist(),
            "inference_device": None if inference is None else str(inference.device)}


def local_sgd(pg, device, out: Path) -> dict:
    """Plain LocalSGD synchronising every step: whole-batch SGD."""
    model = local_sgd_script.make_model(100 + pg.rank).to(device)
    averaging = gradstar.LocalSGD(model, pg, 1, model_name="average")
    opt = local_sgd_script.make_optimizer(model, "sgd")
    for step in range(STEPS):
        local_step(model, opt, step, pg.rank, pg.world_size, device)
        averaging.step()
    held = averaging.global_parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return {"params": listed(model.named_parameters()), "rounds": averaging.rounds,
            "device": str(averaging.device), "devices": devices(model.parameters()),
            "global_is_host_copy_of_params": bool(torch.equal(torch.from_numpy(held), flat))}


def diloco(pg, device, out: Path) -> dict:
    """DiLoCo (Nesterov outer steps) on ``device`` and the same run on the host's CPU, side by
    side, each with its own global model on the hub. The host run takes the ordinary CPU path
    even under ``--stage-cpu``."""
    finals = {}
    for run, where, path in (("device", device, contextlib.nullcontext()),
                             ("host", torch.device("cpu"), plain_cpu_path())):
        with path:
            model = local_sgd_script.make_model(100 + pg.rank).to(where)
            rounds = gradstar.LocalSGD(model, pg, model_name=f"diloco-{run}", **DILOCO)
            opt = local_sgd_script.make_optimizer(model, "sgd")
            for step in range(STEPS):
                local_step(model, opt, step, pg.rank, pg.world_size, where)
                rounds.step()
            finals[run] = {"params": listed(model.named_parameters()),
                           "devices": devices(model.parameters()), "rounds": rounds.rounds,
                           "staged": staging.is_staged(next(model.parameters()))}
    return {"runs": finals}


SCENARIOS = {
    "ddp": ddp, "ddp_unused": ddp_unused, "ddp_bf16": ddp_bf16, "ddp_int8": ddp_int8,
    "ddp_buffers": ddp_buffers,
    "fsdp": fsdp, "fsdp_nested": fsdp_nested, "fsdp_mixed": fsdp_mixed,
    "fsdp_checkpoint": fsdp_checkpoint,
    "pipeline_gpipe": lambda pg, device, out: pipeline(pg, device, out, "gpipe"),
    "pipeline_1f1b": lambda pg, device, out: pipeline(pg, device, out, "1f1b"),
    "local_sgd": local_sgd, "diloco": diloco,
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--stage-cpu", action="store_true",
                        help="stage CPU tensors through host copies as CUDA tensors are")
    parser.add_argument("scenarios", nargs="*", help="default: every scenario, in order")
    args = parser.parse_intermixed_args()  # scenarios may follow the options
    unknown = [name for name in args.scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    if args.stage_cpu:  # before the process group exists: everything it moves is staged
        staging.STAGED_DEVICES = ("cuda", "cpu")
    copies = StagedCopies()
    device = torch.device(args.device)
    torch.set_num_threads(1)  # the ranks share the host's cores with the hub and the test
    with gradstar.init_process_group(timeout=60, join_timeout=60) as pg:
        for name in args.scenarios or list(SCENARIOS):
            copies.take()
            try:
                result = SCENARIOS[name](pg, device, args.out)
            except GradstarError as error:
                result = {"fatal": type(error).__name__, "message": str(error)}
            # Whether the device's tensors are staged, and how many staged copies were made.
            staged = {"staged": staging.is_staged(torch.empty(0, device=device)),
                      "staged_copies": copies.take()}
            print(json.dumps({"scenario": name, "rank": pg.rank, **staged, **result}),
                  flush=True)
            if "fatal" in result:
                return 3
        pg.barrier()  # nobody leaves while a peer is still in its last collective
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

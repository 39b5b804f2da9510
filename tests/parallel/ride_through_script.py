"""A rank of tests/parallel/test_ride_through_ddp.py: ``python ride_through_script.py STEPS
PAUSE [fsdp|diloco|pipeline]`` (settings from GRADSTAR_* env vars) trains a small MLP with
Synchronous gradstar.DDP (or gradstar.FSDP; or DiLoCo, gradstar.LocalSGD with an outer
optimizer; or, one stage a rank, pipeline_script's model in a gradstar.Pipeline) for STEPS
optimizer steps, printing ``step N`` after each
(PAUSE seconds apart), then one JSON line: its final parameters, how long each ride through
a coordinator restart lasted and (DDP, FSDP) the hub shards its generation striped over at
the start and at the end. ``python ride_through_script.py reference STEPS WORLD`` trains the
same model in one process on every rank's batches (what WORLD ranks must end with) and prints
its parameters."""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

import gradstar


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def parameters(module: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in module.parameters()]


def reference(steps: int, world: int) -> None:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        xs, ys = zip(*(batch(r, step) for r in range(world)), strict=True)
        opt.zero_grad()
        # Every rank's loss is a mean over a batch of the same size: DDP's averaged gradient
        # is the gradient of the mean over all of them.
        nn.functional.mse_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    print(json.dumps({"params": parameters(net)}))


def main() -> None:
    if sys.argv[1] == "reference":
        reference(int(sys.argv[2]), int(sys.argv[3]))
        return
    steps, pause = int(sys.argv[1]), float(sys.argv[2])
    sharded = sys.argv[3:4] == ["fsdp"]
    if sys.argv[3:4] == ["pipeline"]:
        pipeline(steps, pause)
        return
    if sys.argv[3:4] == ["diloco"]:
        diloco(steps, pause)
        return
    with gradstar.init_process_group(timeout=60) as pg:
        shards = list(pg.shards)  # the hub shards the generation first stripes over
        net = model()
        if sharded:  # every parameter gathered and its gradient reduce-scattered, unit by unit
            wrapped = gradstar.FSDP(net, pg)
        else:  # small buckets: several all_reduce calls in flight in every backward
            wrapped = gradstar.DDP(net, pg, bucket_cap_mb=0.005, broadcast_buffers=False)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        for step in range(steps):
            x, y = batch(pg.rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
            print(f"step {step}", flush=True)
            time.sleep(pause)
        if sharded:
            full = wrapped.full_state_dict(rank0_only=False)
            # In the unwrapped model's order (FSDP holds flat shards in their place).
            params = [full[name].flatten().tolist() for name, _ in model().named_parameters()]
        else:
            params = parameters(net)
        print(json.dumps({"params": params, "reconnects": pg.reconnects,
                          "shards": [shards, list(pg.shards)]}), flush=True)


def diloco(steps: int, pause: float) -> None:
    """DiLoCo: gradstar.LocalSGD with an outer Nesterov step every 2 inner steps, each rank on
    its own batches; its final parameters (the last round's global model)."""
    with gradstar.init_process_group(timeout=60) as pg:
        net = model()
        outer = gradstar.LocalSGD(net, pg, sync_every=2, outer_optimizer="nesterov",
                                  outer_lr=0.7, outer_momentum=0.9)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(steps):
            x, y = batch(pg.rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            outer.step()
            print(f"step {step}", flush=True)
            time.sleep(pause)
        print(json.dumps({"params": parameters(net), "reconnects": pg.reconnects}), flush=True)


def pipeline(steps: int, pause: float) -> None:
    """Rank r trains stage r of pipeline_script's model in a gradstar.Pipeline (1F1B), on
    batches of 32 rows; its final parameters as pipeline_script reports them."""
    from pipeline_script import batch as stage_batch
    from pipeline_script import make_model, params_of

    with gradstar.init_process_group(timeout=60) as pg:
        stage = make_model()[pg.rank]
        pipe = gradstar.Pipeline(stage, pg, num_microbatches=8, schedule="1f1b")
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        for step in range(steps):
            x, y = stage_batch(step, 32)
            opt.zero_grad()
            pipe.step(inputs=x if pipe.is_first else None, targets=y if pipe.is_last else None,
                      loss_fn=nn.functional.mse_loss)
            opt.step()
            print(f"step {step}", flush=True)
            time.sleep(pause)
        # The steps ride peer streams only, which the coordinator's restart leaves alone, so they
        # may all be done before it is back; a barrier needs the coordinator.
        pg.barrier()
        print(json.dumps({"params": params_of(stage), "reconnects": pg.reconnects}), flush=True)


if __name__ == "__main__":
    main()

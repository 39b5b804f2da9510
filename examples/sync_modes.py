"""A step that does not wait for the slowest rank: ``gradstar.DDP`` with the Quorum sync mode.
The last rank is slow (it sleeps before every backward); each step closes with the first three
ranks' gradients, the slow rank's late ones are dropped, and it keeps up by applying the steps
the others made. Every rank ends with the same parameters.

    gradstar launch --nproc 4 examples/sync_modes.py

Compare the ``sha256`` of the lines the ranks print; ``dropped`` counts the slow rank's late
gradients.
"""

import hashlib
import time

import torch
from torch import nn

import gradstar

STEPS, BATCH, LR = 40, 64, 0.05

# The data: y = sum(x) plus noise, generated from a fixed seed so every rank has the same set.
g = torch.Generator().manual_seed(0)
X = torch.randn(1024, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g)


def full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(X), Y).item()


with gradstar.init_process_group() as pg:  # coordinator, job and rank from `gradstar launch`
    torch.manual_seed(pg.rank)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    # A step closes with every live rank, or with the first world_size - 1 of them once 20 ms
    # passed since its first gradient; opt.step() then applies the hub's aggregates in order.
    ddp = gradstar.DDP(model, pg, sync_mode=gradstar.Quorum(min_ranks=pg.world_size - 1,
                                                            timeout=0.02), optimizer=opt)
    slow = pg.rank == pg.world_size - 1
    before = full_loss(model)

    for step in range(STEPS):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(X)
        x, y = X[rows][pg.rank::pg.world_size], Y[rows][pg.rank::pg.world_size]
        opt.zero_grad()
        if slow:
            time.sleep(0.05)  # a slow GPU, a noisy neighbour
        nn.functional.mse_loss(ddp(x), y).backward()  # the gradient goes to the hub
        opt.step()  # applies every step the hub closed since, in the hub's order

    ddp.synchronize()  # every rank: all gradients aggregated and applied
    after = full_loss(model)
    stats = ddp.sync_stats()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    print(f"sync_modes: rank {pg.rank} of {pg.world_size}: loss {before:.4f} -> {after:.4f}; "
          f"{stats.steps_applied} steps applied, {stats.dropped} of {stats.contributions} "
          f"gradients dropped; parameters sha256 {digest}", flush=True)

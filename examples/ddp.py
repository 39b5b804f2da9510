"""Data parallelism with ``gradstar.DDP``: every rank trains on its slice of each batch, and
backward leaves the mean gradient over all ranks in ``.grad``.

    gradstar launch --nproc 2 examples/ddp.py

Every rank ends with the same parameters: compare the ``sha256`` of the lines the ranks print.
"""

import hashlib

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
    torch.manual_seed(pg.rank)  # different initial weights per rank, on purpose: DDP
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    model = gradstar.DDP(model, pg, bucket_cap_mb=25)  # ...broadcasts rank 0's to the others
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    before = full_loss(model)

    for step in range(STEPS):
        # Batch `step` of the data set; this rank takes every world_size-th row of it.
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(X)
        x, y = X[rows][pg.rank::pg.world_size], Y[rows][pg.rank::pg.world_size]
        opt.zero_grad()
        # Gradient accumulation over two micro-batches: inside no_sync() backward only
        # accumulates locally; the next backward outside it all-reduces the sum of both.
        half = len(x) // 2
        with model.no_sync():
            (nn.functional.mse_loss(model(x[:half]), y[:half]) / 2).backward()
        (nn.functional.mse_loss(model(x[half:]), y[half:]) / 2).backward()
        opt.step()  # .grad is the same on every rank, so the parameters stay the same

    after = full_loss(model)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    print(f"ddp: rank {pg.rank} of {pg.world_size}: loss {before:.4f} -> {after:.4f} after "
          f"{STEPS} steps; parameters sha256 {digest}", flush=True)

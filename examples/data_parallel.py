"""Data parallelism inside a process with ``gradstar.DataParallel``, and across processes with
its ``process_group``: each process (one per host) splits its part of every batch over its
local devices, and backward leaves the mean gradient over all processes in ``.grad``.

    gradstar launch --nproc 2 examples/data_parallel.py

Each process drives every GPU it sees, or two CPU replicas on a machine without one (which
shows the machinery, not a speed-up). Every process ends with the same parameters: compare the
``sha256`` of the lines they print.
"""

import hashlib

import torch
from torch import nn

import gradstar

STEPS, BATCH, LR = 40, 64, 0.05

g = torch.Generator().manual_seed(0)
X = torch.randn(1024, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g)

devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or ["cpu", "cpu"]

with gradstar.init_process_group() as pg:  # coordinator, job and rank from `gradstar launch`
    torch.manual_seed(pg.rank)  # different initial weights per process: rank 0's win
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(devices[0])
    model = gradstar.DataParallel(net, device_ids=devices, process_group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # steps the primary replica, `net`
    with torch.no_grad():
        before = nn.functional.mse_loss(model(X), Y.to(devices[0])).item()

    for step in range(STEPS):
        # Batch `step`; this process takes every world_size-th row, its replicas split those.
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(X)
        x, y = X[rows][pg.rank::pg.world_size], Y[rows][pg.rank::pg.world_size]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y.to(devices[0]))  # outputs on devices[0]
        loss.backward()  # replicas' gradients summed into net, then averaged over processes
        opt.step()

    with torch.no_grad():
        after = nn.functional.mse_loss(model(X), Y.to(devices[0])).item()
    params = torch.cat([p.detach().cpu().reshape(-1) for p in net.parameters()])
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    print(f"data_parallel: rank {pg.rank} of {pg.world_size}: {len(devices)} replicas; loss "
          f"{before:.4f} -> {after:.4f} after {STEPS} steps; parameters sha256 {digest}",
          flush=True)

"""An ordinary torch.distributed script on gradstar's coordinator: backend "gradstar" and torch's
own DistributedDataParallel.

    gradstar launch --nproc 2 examples/torch_backend.py
    torchrun --standalone --nproc-per-node 2 examples/torch_backend.py

To name a running coordinator instead: ``init_method="gradstar://HOST:PORT?job=NAME"`` with
``rank=`` and ``world_size=``.
"""

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import gradstar  # noqa: F401  (registers backend "gradstar" with torch.distributed)

STEPS, BATCH, LR = 40, 64, 0.05

g = torch.Generator().manual_seed(0)
X = torch.randn(1024, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g)


def full_loss(module: nn.Module) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(module(X), Y).item()


# Under `gradstar launch`, "gradstar://" reads the coordinator, job, rank and world size from the
# GRADSTAR_* variables. Under torchrun, torch's default env:// gives rank and world size, and
# rank 0 starts a coordinator for the job (no coordinator is named anywhere).
init_method = "gradstar://" if "GRADSTAR_COORDINATOR" in os.environ else None
dist.init_process_group(backend="gradstar", init_method=init_method)
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(rank)  # different initial weights; torch's DDP broadcasts rank 0's
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=LR)
before = full_loss(model.module)  # the wrapped model, evaluated locally
for step in range(STEPS):
    rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(X)
    x, y = X[rows][rank::world], Y[rows][rank::world]
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # torch's DDP all-reduces the gradient buckets through gradstar
    opt.step()

# Plain collectives work as with any backend: the mean of the ranks' last losses, and every
# rank's value gathered into one tensor.
mean_loss = loss.detach().clone()
dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
gathered = torch.empty(world)
dist.all_gather_single(gathered, torch.tensor([float(rank)]))

params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
# One write per line: under torchrun the ranks share one stdout, and print() writes a line and
# its newline separately when Python runs unbuffered, so two ranks' lines could run together.
sys.stdout.write(f"torch_backend: rank {rank} of {world}: loss {before:.4f} -> "
                 f"{full_loss(model.module):.4f} after {STEPS} steps (last batch, mean over "
                 f"ranks {mean_loss.item():.4f}); all_gather_single {gathered.tolist()}; "
                 f"parameters sha256 {digest}\n")
sys.stdout.flush()
dist.destroy_process_group()  # leaves the job

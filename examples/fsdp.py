"""Sharded data parallelism with ``gradstar.FSDP``: each rank keeps 1/world_size of the
parameters, gradients and optimizer state, and gathers a unit's parameters only while it runs.

    gradstar launch --nproc 2 examples/fsdp.py

At the end ``full_state_dict()`` gathers an ordinary state_dict on rank 0, which loads into the
plain (unwrapped) model and gives the same loss as the sharded one.
"""

import torch
from torch import nn

import gradstar

STEPS, BATCH, LR = 25, 64, 0.02

g = torch.Generator().manual_seed(0)
X = torch.randn(1024, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g)


class Block(nn.Module):
    """A residual MLP block; each Block is one FSDP unit (gathered and freed as a whole)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), Block(32), Block(32), nn.Linear(32, 1))


def full_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(X), Y).item()


with gradstar.init_process_group() as pg:
    model = make_model()
    total = sum(p.numel() for p in model.parameters())
    # Units: each Block, plus the root for the two Linear layers left over. Add
    # mixed_precision="bf16" to gather parameters and reduce gradients in bfloat16.
    fsdp = gradstar.FSDP(model, pg, auto_wrap_policy=[Block])
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)  # only this rank's shards
    held = sum(p.numel() for p in fsdp.parameters())
    before = full_loss(fsdp)  # a forward is collective: every rank runs each one

    for step in range(STEPS):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(X)
        x, y = X[rows][pg.rank::pg.world_size], Y[rows][pg.rank::pg.world_size]
        opt.zero_grad()
        nn.functional.mse_loss(fsdp(x), y).backward()  # shard .grad = mean over ranks
        opt.step()

    after = full_loss(fsdp)
    state = fsdp.full_state_dict()  # every rank calls it; rank 0 gets the dict, others {}
    print(f"fsdp: rank {pg.rank} of {pg.world_size}: holds {held} of {total} parameters; "
          f"loss {before:.4f} -> {after:.4f} after {STEPS} steps", flush=True)
    if pg.rank == 0:
        plain = make_model()
        plain.load_state_dict(state)
        print(f"fsdp: full_state_dict loaded into the plain model: loss {full_loss(plain):.4f}",
              flush=True)

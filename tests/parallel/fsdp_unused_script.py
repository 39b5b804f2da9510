"""An FSDP rank whose backward skips a unit on some ranks: ``python fsdp_unused_script.py``
(settings from GRADSTAR_* env vars).

Each scenario of :data:`SCENARIOS` trains a fresh :class:`BranchNet` seeded by the rank (only
the construction broadcast can make the ranks agree) with ``find_unused_parameters=True`` and
prints one JSON line: the full state dict and what the scenario saw. The model, data and loop
are defined here once and imported by ``test_fsdp_unused.py``, which trains the single-process
reference on the whole batch with the same code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import gradstar

try:
    from .scenarios import run_scenarios
except ImportError:  # run as a script
    from scenarios import run_scenarios

SCRIPT = Path(__file__)
WORLD = 2
IN, HIDDEN, OUT = 5, 9, 3
BATCH = 8  # per step, over both ranks
# Which ranks' loss takes the branch at each step; at step 2 none does, so no rank reaches
# the branch's unit and its gradient stays None.
BRANCH_USERS = [{0, 1}, {0}, set(), {1}, {0, 1}, {1}]
STEPS = len(BRANCH_USERS)


class BranchNet(nn.Module):
    """Units (each child with parameters): ``trunk``, ``head``, ``frozen`` (no gradient of its
    own, but its weight is needed for the branch's input gradient), ``branch``; the root unit
    holds ``scale`` and ``never``, which no forward uses (zeros inside a reached unit)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.frozen = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.branch = nn.Linear(HIDDEN, OUT)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(OUT))
        self.never = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))
        out = self.head(hidden) * self.scale
        # The branch runs on every rank (its forward gathers it); only some ranks' loss uses it.
        side = self.branch(torch.tanh(self.frozen(hidden)))
        return out + side if use_branch else out


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + micro)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def loss_of(model, step: int, rank: int, world: int, micro: int = 0) -> torch.Tensor:
    x, y = batch(step, micro)
    users = BRANCH_USERS[(step + micro) % STEPS]
    out = model(x.chunk(world)[rank], use_branch=rank in users)
    return nn.functional.mse_loss(out, y.chunk(world)[rank])


def optimizer(params):
    # Adam: a zero gradient still moves a parameter by its momentum, a None one does not, so
    # the results tell zeros from None.
    return torch.optim.Adam(params, lr=0.01)


def full_state(fsdp) -> dict[str, list]:
    return {k: v.double().reshape(-1).tolist()
            for k, v in fsdp.full_state_dict(rank0_only=False).items()}


# -- scenarios ---------------------------------------------------------------------------------


def adam(pg) -> dict:
    """One backward per step; reports which steps left the branch's shard gradient None."""
    fsdp = gradstar.FSDP(BranchNet(pg.rank), pg, find_unused_parameters=True)
    opt = optimizer(fsdp.parameters())
    branch = next(u for u in fsdp.units if u.name == "branch").shard
    branch_none = []
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(fsdp, step, pg.rank, pg.world_size).backward()
        if branch.grad is None:
            branch_none.append(step)
        opt.step()
    return {"params": full_state(fsdp), "branch_grad_none_at": branch_none}


def sync_by_hand(pg) -> dict:
    """Two micro-batches per step inside no_sync() (the branch taken by other ranks in each),
    then sync_gradients()."""
    fsdp = gradstar.FSDP(BranchNet(pg.rank), pg, find_unused_parameters=True)
    opt = optimizer(fsdp.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        with fsdp.no_sync():
            for micro in range(2):
                loss_of(fsdp, step, pg.rank, pg.world_size, micro).backward()
        fsdp.sync_gradients()
        opt.step()
    return {"params": full_state(fsdp)}


SCENARIOS = {"adam": adam, "sync_by_hand": sync_by_hand}


def main() -> int:
    torch.set_num_threads(1)  # the ranks share the machine's cores with the hub
    return run_scenarios(SCENARIOS, list(SCENARIOS))


if __name__ == "__main__":
    raise SystemExit(main())

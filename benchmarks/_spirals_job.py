"""The job ``elastic.py`` and ``elastic_torchft.py`` train, whatever runs it: a small MLP on two
interleaved spirals, Adam, batches drawn from (step, rank); torch alone, so that importing it
costs a rank nothing of the framework it is measured under.
"""

from __future__ import annotations

import json
import math
import time

import torch
from torch import nn

BATCH = 32
#: A replica's batch: it trains alone between rounds, so it takes the batch a DDP step of 4
#: ranks takes (with 32, this model stalls on the spirals' plateau in some runs, replicated or
#: not: measured in one process, DiLoCo's rounds by hand).
REPLICA_BATCH = 128


def spirals(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.rand(n, generator=generator) * 3 * math.pi
    label = torch.randint(0, 2, (n,), generator=generator)
    r = t / (3 * math.pi)
    angle = t + label * math.pi
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1)
    return x + 0.02 * torch.randn(n, 2, generator=generator), label


def emit(record: dict) -> None:
    """One JSON line, with this process's CPU seconds so far (``cpu``: since its start, what
    its join costs whatever else the machine runs)."""
    print(json.dumps({**record, "cpu": round(time.process_time(), 3)}), flush=True)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.03)


def accuracy(model: nn.Module) -> float:
    x, y = spirals(4000, torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()

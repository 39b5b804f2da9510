"""A DataParallel process for tests: ``python data_parallel_script.py DEVICE,DEVICE,...``
(settings from GRADSTAR_* env vars): each process drives one replica per listed device.

Runs every scenario of :data:`SCENARIOS` on one process group, each on a fresh model seeded by
the rank (so only the construction broadcast can make the processes agree), and prints one
JSON line per scenario with the final parameters. The model, data and loop are defined here
once and imported by ``test_data_parallel.py`` (and ``tests/cuda``), which trains the
single-process reference on the whole batch with the same code.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from torch import nn

import gradstar

try:
    from .scenarios import run_scenarios
except ImportError:  # run as a script
    from scenarios import run_scenarios

SCRIPT = Path(__file__)
IN, HIDDEN, OUT = 6, 16, 3
# Rows per step over every process; each of 2 processes takes 7, which its 2 replicas split
# 4 and 3 (uneven on purpose).
BATCH = 14
STEPS = 5


class Net(nn.Module):
    """An MLP whose forward takes a dict and returns a tuple, with a buffer it reads."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                                  nn.Tanh())
        self.head = nn.Linear(HIDDEN, OUT)
        self.register_buffer("shift", torch.full((OUT,), 0.01 * seed))

    def forward(self, batch: dict, scale: float = 1.0):
        hidden = self.body(batch["x"])
        return self.head(hidden) * scale + self.shift, hidden


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + micro)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1)


def loss_of(model, step: int, rank: int, world: int, device, micro: int = 0) -> torch.Tensor:
    x, y = batch(step, micro)
    out, _ = model({"x": x.chunk(world)[rank].to(device)}, scale=0.5)
    return nn.functional.mse_loss(out, y.chunk(world)[rank].to(out.device))


def train(model, opt, rank: int, world: int, device, *, micro_steps: int = 1,
          no_sync=None) -> None:
    """STEPS optimizer steps; ``world=1`` on a plain module is the single-process reference.
    With ``micro_steps`` > 1 the gradients of the micro-batches' losses are summed, all but
    the last backward inside ``no_sync()`` when it is given."""
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            with no_sync() if no_sync is not None and not last else _nothing():
                loss_of(model, step, rank, world, device, micro).backward()
        opt.step()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def params_of(module: nn.Module) -> dict[str, list]:
    return {name: p.detach().double().reshape(-1).tolist()
            for name, p in module.named_parameters()}


# -- scenarios ---------------------------------------------------------------------------------


def run(pg, devices: list[str], kind: str, micro_steps: int = 1, by_hand: bool = False) -> dict:
    module = Net(pg.rank).to(devices[0])
    model = gradstar.DataParallel(module, device_ids=devices, process_group=pg)
    opt = optimizer(kind, model.parameters())
    if by_hand:  # every backward inside no_sync(), then sync_gradients() before each step
        for step in range(STEPS):
            opt.zero_grad()
            with model.no_sync():
                for micro in range(micro_steps):
                    loss_of(model, step, pg.rank, pg.world_size, devices[0], micro).backward()
            model.sync_gradients()
            opt.step()
    else:
        train(model, opt, pg.rank, pg.world_size, devices[0], micro_steps=micro_steps,
              no_sync=model.no_sync)
    return {"params": params_of(module), "shift": module.shift.tolist(),
            "devices": sorted({str(p.device) for p in module.parameters()}),
            "replicas": len(model.device_ids)}


def per_device(pg, devices: list[str]) -> dict:
    """``sgd`` through ``forward_parallel``: the process splits its part of the batch itself,
    one input per device, and the loss over the outputs is the mean over its part."""
    module = Net(pg.rank).to(devices[0])
    model = gradstar.DataParallel(module, device_ids=devices, process_group=pg)
    opt = optimizer("sgd", model.parameters())
    for step in range(STEPS):
        x, y = (t.chunk(pg.world_size)[pg.rank] for t in batch(step))
        opt.zero_grad()
        outputs = model.forward_parallel([({"x": part},) for part in x.tensor_split(
            len(devices))], [{"scale": 0.5}] * len(devices))
        out = torch.cat([o.to(devices[0]) for o, _ in outputs])
        nn.functional.mse_loss(out, y.to(devices[0])).backward()
        opt.step()
    return {"params": params_of(module), "shift": module.shift.tolist(),
            "devices": sorted({str(p.device) for p in module.parameters()}),
            "replicas": len(model.device_ids), "outputs": len(outputs)}


SCENARIOS = {
    "sgd": lambda pg, devices: run(pg, devices, "sgd"),
    "per_device": per_device,
    "adam": lambda pg, devices: run(pg, devices, "adam"),
    "no_sync": lambda pg, devices: run(pg, devices, "sgd", micro_steps=2),
    "sync_by_hand": lambda pg, devices: run(pg, devices, "sgd", micro_steps=2, by_hand=True),
}


def main() -> int:
    devices = sys.argv[1].split(",")
    torch.set_num_threads(1)  # the processes share the machine's cores with the hub
    return run_scenarios({name: functools.partial(scenario, devices=devices)
                          for name, scenario in SCENARIOS.items()}, list(SCENARIOS))


if __name__ == "__main__":
    raise SystemExit(main())

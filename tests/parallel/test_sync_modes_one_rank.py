"""DDP in a sync mode on one rank, on a real coordinator in this process: an LR scheduler made
before ``gradstar.DDP(optimizer=..., sync_mode=...)`` (the order ``benchmarks/sync_modes.py``
uses) makes torch warn nothing and still applies; ``sync_gradients()`` after a synchronising
backward sends no second contribution."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import gradstar

from .conftest import on_thread

STEPS, LR, GAMMA = 4, 0.1, 0.5


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(step: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(step))


def train(model, opt, sched, forward) -> None:
    for step in range(STEPS):
        opt.zero_grad()
        forward(batch(step)).square().sum().backward()
        opt.step()
        sched.step()


async def test_a_scheduler_made_before_a_sync_mode_warns_nothing_and_still_applies(solo):
    def body(pg):
        plain = mlp()
        plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
        train(plain, plain_opt, torch.optim.lr_scheduler.StepLR(plain_opt, 1, GAMMA), plain)

        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, GAMMA)  # before DDP takes opt.step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = gradstar.DDP(model, pg, sync_mode=gradstar.Quorum(min_ranks=1), optimizer=opt)
            train(model, opt, sched, ddp)
            ddp.synchronize()
        assert [str(w.message) for w in caught if "optimizer.step()" in str(w.message)] == []
        assert opt.param_groups[0]["lr"] == LR * GAMMA ** STEPS
        assert ddp.sync_stats().steps_applied == STEPS
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a, b)

    await on_thread(body, solo)


async def test_sync_gradients_after_a_backward_contributes_nothing_more(solo):
    def body(pg):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        ddp = gradstar.DDP(model, pg, sync_mode=gradstar.Quorum(min_ranks=1), optimizer=opt)
        for step in range(2):
            opt.zero_grad()
            ddp(batch(step)).square().sum().backward()
            ddp.sync_gradients()  # the backward already contributed: nothing to send
            opt.step()
        ddp.synchronize()
        stats = ddp.sync_stats()
        assert (stats.contributions, stats.steps_applied) == (2, 2)

    await on_thread(body, solo)

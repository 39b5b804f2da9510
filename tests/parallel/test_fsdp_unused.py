"""FSDP with ``find_unused_parameters=True``, 2 real rank processes whose backward skips a unit
on some ranks, proved against one process on the whole batch where a parameter a rank's loss
does not reach contributes zeros (and one no rank reaches keeps ``grad=None``).

One run of ``fsdp_unused_script.py`` (2 ranks, a real coordinator) plays every scenario.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from . import fsdp_unused_script as script
from .conftest import reports_by_scenario, run_world

# float32 training: the hub sums the ranks in arrival order, so results agree to rounding.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    reports = asyncio.run(run_world(script.SCRIPT, script.WORLD, "fsdp-unused", timeout=100))
    return reports_by_scenario(reports, script.SCENARIOS, script.WORLD)


def reference(micro_steps: int) -> torch.nn.Module:
    """One process, whole batch: the loss is the mean of the ranks' losses, each with or
    without the branch as on that rank. A parameter without a gradient gets zeros, as FSDP's
    flat shards give it, unless it is the branch's at a step where no rank used it: that one
    stays None, as find_unused_parameters leaves it."""
    model = script.BranchNet(0)  # rank 0's init: what the construction broadcast hands out
    opt = script.optimizer(model.parameters())
    for step in range(script.STEPS):
        opt.zero_grad()
        for micro in range(micro_steps):
            loss = sum(script.loss_of(model, step, r, script.WORLD, micro)
                       for r in range(script.WORLD)) / script.WORLD
            loss.backward()
        for name, p in model.named_parameters():
            if p.requires_grad and p.grad is None and not name.startswith("branch."):
                p.grad = torch.zeros_like(p)
        opt.step()
    return model


def assert_params_match(reports: list[dict], model: torch.nn.Module) -> None:
    want = {k: v.double().reshape(-1).tolist() for k, v in model.state_dict().items()}
    for report in reports:
        assert sorted(report["params"]) == sorted(want)
        for name, values in want.items():
            np.testing.assert_allclose(report["params"][name], values, rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {report['rank']}, {name}")


def test_the_branch_is_skipped_on_some_ranks_and_used_by_none_at_one_step():
    # Otherwise the test below would not prove what it claims.
    assert any(0 < len(users) < script.WORLD for users in script.BRANCH_USERS)
    assert set() in script.BRANCH_USERS


def test_a_unit_skipped_on_some_ranks_matches_one_process_with_zeros(runs):
    assert_params_match(runs["adam"], reference(micro_steps=1))
    # Detection: the branch's gradient stayed None exactly where no rank's loss used it.
    unused = [step for step, users in enumerate(script.BRANCH_USERS) if not users]
    assert all(r["branch_grad_none_at"] == unused for r in runs["adam"])


def test_no_sync_micro_batches_skipping_it_then_sync_gradients_match_one_process(runs):
    assert_params_match(runs["sync_by_hand"], reference(micro_steps=2))

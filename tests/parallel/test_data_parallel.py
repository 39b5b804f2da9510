"""DataParallel with a process group: 2 real processes x 2 CPU replicas, proved against one
process training the plain module on the whole batch.

One run of ``data_parallel_script.py`` (2 processes, a real coordinator) plays every scenario;
each test checks one against a reference trained here on the whole batch with the same code.
The processes start from different inits and buffers (seeded by rank), so agreeing with the
reference also proves the construction broadcast.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from . import data_parallel_script as script
from .conftest import reports_by_scenario, run_world

WORLD = 2
# float32: replicas' gradients are summed by autograd and the processes' means by the hub, in
# another order than the whole batch's, so results agree to rounding.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    reports = asyncio.run(run_world(script.SCRIPT, WORLD, "dp", "cpu,cpu", timeout=100))
    return reports_by_scenario(reports, script.SCENARIOS, WORLD)


def reference(kind: str, micro_steps: int = 1) -> torch.nn.Module:
    model = script.Net(0)  # rank 0's init: what the construction broadcast hands out
    script.train(model, script.optimizer(kind, model.parameters()), 0, 1, "cpu",
                 micro_steps=micro_steps)
    return model


def assert_params_match(reports: list[dict], model: torch.nn.Module) -> None:
    want = script.params_of(model)
    for report in reports:
        assert report["replicas"] == 2 and report["devices"] == ["cpu"]
        assert list(report["params"]) == list(want)
        for name, values in want.items():
            np.testing.assert_allclose(report["params"][name], values, rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {report['rank']}, {name}")


def test_processes_start_from_different_inits():
    a, b = script.params_of(script.Net(0)), script.params_of(script.Net(1))
    assert all(a[k] != b[k] for k in a)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_two_processes_of_two_replicas_match_one_process_on_the_whole_batch(runs, kind):
    assert_params_match(runs[kind], reference(kind))
    # rank 0's buffer, broadcast at construction and before each forward
    assert all(r["shift"] == [0.0] * script.OUT for r in runs[kind])


def test_forward_parallel_over_a_process_group_matches_one_process(runs):
    # One input per replica in, one output per replica out; backward still averages over
    # processes (DDP's hooks armed by forward_parallel as by forward).
    assert all(r["outputs"] == 2 for r in runs["per_device"])
    assert_params_match(runs["per_device"], reference("sgd"))


def test_no_sync_accumulation_matches_one_process(runs):
    assert_params_match(runs["no_sync"], reference("sgd", micro_steps=2))


def test_sync_gradients_after_no_sync_backwards_matches_one_process(runs):
    assert_params_match(runs["sync_by_hand"], reference("sgd", micro_steps=2))

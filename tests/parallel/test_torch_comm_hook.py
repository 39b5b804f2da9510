"""gradstar's compressed-gradients communication hook on torch's DDP over backend "gradstar".

Real rank processes of ``torch_backend_script.py`` (an ordinary torch.distributed program) on a
coordinator started here; the float32 reference is one process trained here on the whole batch.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator

from . import torch_backend_script as script
from .test_torch_backend import run_ranks

WORLD = 2
SCENARIOS = ("ddp_wire_hook", "ddp_wire_hook_no_ef", "ddp_wire_hook_mismatch")
# Documented bound (docs/wire-formats.md, "Training with a format"): 30 SGD steps (lr 0.1) of
# this MLP with int8 buckets and error feedback stay this close to float32 training.
INT8_EF_BOUND = 2e-3
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    async def play():
        hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
        await hub.start()
        try:
            return await run_ranks(WORLD, lambda rank: [
                "ranks", "--backend", "gradstar", "--init-method",
                f"gradstar://{hub.address}?job=hook&timeout=60", "--rank", str(rank),
                "--world-size", str(WORLD), *SCENARIOS], timeout=200)
        finally:
            await hub.stop(grace=0)

    reports = asyncio.run(play())
    return {name: [reports[rank][name] for rank in range(WORLD)] for name in SCENARIOS}


def drift(reports: list[dict]) -> float:
    """Largest |parameter - float32 single-process training| over ranks and parameters."""
    model = script.make_mlp(0)  # rank 0's init, which DDP broadcasts
    script.train(model, 0, 1, script.WIRE_STEPS)
    want = script.params_of(model)
    return max(float(np.max(np.abs(np.subtract(r["params"][k], v))))
               for r in reports for k, v in want.items())


def test_int8_hook_with_error_feedback_trains_within_the_bound_of_float32(runs):
    reports = runs["ddp_wire_hook"]
    assert all(r["params"] == reports[0]["params"] for r in reports)  # identical replicas
    assert 0 < drift(reports) < INT8_EF_BOUND
    # One float32 residual per bucket (torch's rebuilt buckets: they cover every parameter).
    numel = sum(len(v) for v in reports[0]["params"].values())
    assert all(sum(r["residuals"]) == numel for r in reports)


def test_without_error_feedback_the_hook_drifts_further(runs):
    assert all(r["residuals"] == [] for r in runs["ddp_wire_hook_no_ef"])
    assert drift(runs["ddp_wire_hook"]) < drift(runs["ddp_wire_hook_no_ef"])


def test_ranks_hooking_different_formats_get_a_named_mismatch(runs):
    for r in runs["ddp_wire_hook_mismatch"]:
        assert r["error"] is not None, r
        assert "wire='int8'" in r["message"] and "wire='bf16'" in r["message"], r["message"]

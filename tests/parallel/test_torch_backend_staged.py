"""The torch.distributed backend's path for CUDA tensors, proved on the CPU.

``tests/cuda/torch_backend_cuda_script.py --device cpu --stage-cpu`` sets
``gradstar.client.device.STAGED_DEVICES`` so that CPU tensors take the path of CUDA tensors:
each collective copies its inputs to host buffers when it is called and hands back new tensors,
copied back to the device, which the backend writes into torch's tensors in place. Two ranks run
the CUDA test's scenarios (every collective and point-to-point call against a reference, DDP and
FSDP2 against one process) and must pass the same checks; what needs a GPU (streams, futures
bound to CUDA devices) is left to tests/cuda/test_torch_backend_cuda.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.cuda.test_torch_backend_cuda import (
    BF16_ATOL,
    BF16_RTOL,
    WORLD,
    assert_checks_pass,
    assert_trained_like_one_process,
    run_script,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reports() -> list[dict[str, dict]]:
    return asyncio.run(run_script(WORLD, "staged", "--device", "cpu", "--stage-cpu"))


def test_every_collective_on_staged_tensors_gives_the_reference(reports):
    assert all(report["collectives"]["staged"] for report in reports)
    for scenario in ("collectives", "streams", "p2p"):
        assert_checks_pass(reports, scenario, "cpu")
    assert reports[0]["collectives"]["checks"]["all_reduce_sparse"]["layout"] == (
        "torch.sparse_coo")


@pytest.mark.parametrize("scenario", ["ddp", "fsdp2"])
def test_training_on_staged_tensors_matches_one_process(reports, scenario):
    assert_trained_like_one_process(reports, scenario)


def test_ddp_with_a_compression_hook_on_staged_tensors_matches_one_process(reports):
    assert_trained_like_one_process(reports, "ddp_bf16_hook", BF16_RTOL, BF16_ATOL)

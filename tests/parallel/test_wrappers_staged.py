"""gradstar's training wrappers on the path of CUDA tensors, proved on the CPU.

``tests/cuda/wrappers_script.py --device cpu --stage-cpu`` sets
``gradstar.client.device.STAGED_DEVICES`` in every rank before its process group exists, so that
CPU tensors take the path of CUDA tensors: each collective and send copies its inputs to host
buffers when it is called and hands back new tensors copied back to the device. One 2-rank run
plays every scenario of the CUDA wrapper tests (DDP with unused parameters, bf16 compression and
buffers; FSDP with its state dicts; a 2-stage Pipeline under both schedules; LocalSGD; DiLoCo
staged next to DiLoCo on the ordinary CPU path), and each must pass the same checks, against
references trained here in one process on the CPU, as on a GPU. The in-process checks that need
no GPU run here too, with the staging set in this process. What needs a real GPU (a module
spread over the CPU and a GPU) is left to tests/cuda/test_wrappers_cuda.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from gradstar.client import convert
from gradstar.client import device as staging
from tests.cuda.test_wrappers_cuda import (
    check_all_reduce_coalesced,
    check_ddp,
    check_ddp_bf16,
    check_ddp_buckets_and_gradients,
    check_ddp_buffers,
    check_ddp_int8,
    check_ddp_unused,
    check_diloco,
    check_fsdp,
    check_fsdp_checkpoint,
    check_fsdp_mixed,
    check_fsdp_nested,
    check_local_sgd,
    check_pipeline,
    check_staged,
    run_wrappers,
)

from .conftest import on_thread

CPU = torch.device("cpu")
# One run of every scenario takes about 10 s on 2 cores; the references a few seconds more.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("wrappers-staged")


@pytest.fixture(scope="module")
def runs(out_dir) -> dict[str, list[dict]]:
    return asyncio.run(run_wrappers(out_dir, "wrappers-staged", CPU, "--stage-cpu",
                                    timeout=200))


def test_every_rank_staged_the_cpu_tensors_of_every_scenario(runs):
    check_staged(runs)


def test_ddp_over_several_buckets_matches_one_process(runs):
    check_ddp(runs, CPU)


def test_ddp_unused_parameters_match_one_process(runs):
    check_ddp_unused(runs, CPU)


def test_ddp_bf16_compression_is_within_bf16_tolerance(runs):
    check_ddp_bf16(runs, CPU)


def test_ddp_int8_with_error_feedback_is_within_tolerance(runs):
    check_ddp_int8(runs, CPU)


def test_ddp_broadcasts_buffers_from_rank_0(runs):
    check_ddp_buffers(runs, CPU)


def test_fsdp_matches_one_process(runs):
    check_fsdp(runs, CPU)


def test_fsdp_nested_units_tied_weight_frozen_unit_and_buffer(runs):
    check_fsdp_nested(runs, CPU)


def test_fsdp_mixed_precision_is_within_bf16_tolerance(runs):
    check_fsdp_mixed(runs, CPU)


def test_fsdp_state_dicts_round_trip(runs, out_dir):
    check_fsdp_checkpoint(runs, out_dir, CPU)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipeline_matches_the_unsplit_model(runs, schedule):
    check_pipeline(runs, schedule, CPU)


def test_local_sgd_every_step_equals_whole_batch_sgd(runs):
    check_local_sgd(runs, CPU)


def test_staged_diloco_equals_diloco_on_the_cpu_path_and_by_hand(runs):
    check_diloco(runs, CPU)


# -- in this process ---------------------------------------------------------------------------


@pytest.fixture
def staged_copies(monkeypatch) -> list[torch.device]:
    """CPU tensors staged in this process for one test; the devices of the staged host copies
    made, in order."""
    monkeypatch.setattr(staging, "STAGED_DEVICES", ("cuda", "cpu"))
    copies, copy = [], convert.to_host_array

    def counted(t):
        copies.append(t.device)
        return copy(t)

    monkeypatch.setattr(convert, "to_host_array", counted)
    return copies


async def test_ddp_buckets_and_gradients_on_staged_tensors_match_plain_autograd(solo,
                                                                                staged_copies):
    await on_thread(check_ddp_buckets_and_gradients, solo, CPU)
    assert staged_copies and set(staged_copies) == {CPU}


async def test_all_reduce_coalesced_of_staged_tensors_returns_them_on_the_cpu(coordinator,
                                                                             staged_copies):
    await check_all_reduce_coalesced(coordinator.address, "coalesced-staged", CPU)
    assert staged_copies and set(staged_copies) == {CPU}

"""torch.distributed over backend "gradstar" on CUDA tensors (issue #14).

Two ranks of ``torch_backend_cuda_script.py``, both on cuda:0, run every collective and
point-to-point call of the backend on CUDA tensors and check each result (its values, dtype and
device) against a reference every rank computes without communicating; then torch's DDP with
``device_ids=[0]`` (also with torch's bf16 compression hook, whose ``.then()`` callback runs on a
stream of its own) and FSDP2 ``fully_shard`` on a CUDA mesh train for several steps and must
match the same model trained by one process on the whole batch, within float32 tolerance. The
``streams`` scenario issues collectives on a side stream behind a busy kernel and reads the
results on another stream.

tests/parallel/test_torch_backend_staged.py runs the same script and checks on this machine's
CPU, with CPU tensors staged through host copies as CUDA tensors are.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.parallel.conftest import run_world

from . import torch_backend_cuda_script as script
from .conftest import needs_cuda

WORLD = 2
# float32 training of a few steps: the ranks' gradients are summed on the hub, not in one
# process's order, so the parameters agree to rounding.
RTOL, ATOL = 1e-5, 1e-6
# bf16 compression rounds every gradient to 8 bits of mantissa; a 0.1-lr step moves a
# parameter by about 1e-2 at most, so its rounding stays well below these.
BF16_RTOL, BF16_ATOL = 1e-2, 2e-3
pytestmark = [needs_cuda, pytest.mark.timeout(300)]


async def run_script(world: int, job: str, *args: str,
                     timeout: float = 240) -> list[dict[str, dict]]:
    """``world`` ranks of the script against a fresh hub; {scenario: report} for each rank.

    Raises:
        AssertionError: a rank exited non-zero, hung, or reported a fatal error.
    """
    ranks = await run_world(script.SCRIPT, world, job, *args, timeout=timeout)
    reports = []
    for rank, lines in enumerate(ranks):
        assert all(line["rank"] == rank and "fatal" not in line for line in lines), lines
        reports.append({line["scenario"]: line for line in lines})
    return reports


def assert_checks_pass(reports: list[dict[str, dict]], scenario: str, device: str) -> None:
    """Every check of ``scenario`` on every rank has the reference's values and dtype, on
    ``device`` (a result handed back in place stays where its tensor is)."""
    for rank, report in enumerate(reports):
        checks = report[scenario]["checks"]
        assert checks, f"rank {rank} ran no checks in {scenario}"
        wrong = {name: check for name, check in checks.items()
                 if check["got"] != check["want"] or check["device"] != device
                 or check["dtypes"][0] != check["dtypes"][1]}
        assert not wrong, f"rank {rank}, {scenario}: {wrong}"


def assert_trained_like_one_process(reports: list[dict[str, dict]], scenario: str,
                                    rtol: float = RTOL, atol: float = ATOL) -> None:
    for rank, report in enumerate(reports):
        got, want = report[scenario]["params"], report[scenario]["reference"]
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol,
                                       err_msg=f"{scenario}, rank {rank}: {name}")
        # Every replica (and every FSDP2 rank's gathered view) is the same model.
        assert got == reports[0][scenario]["params"]


@pytest.fixture(scope="module")
def reports() -> list[dict[str, dict]]:
    return asyncio.run(run_script(WORLD, "cuda", "--device", "cuda"))


def test_every_collective_on_cuda_tensors_gives_the_reference_on_the_device(reports):
    assert_checks_pass(reports, "collectives", "cuda:0")
    assert all(report["collectives"]["staged"] for report in reports)
    sparse = reports[0]["collectives"]["checks"]["all_reduce_sparse"]
    assert sparse["layout"] == "torch.sparse_coo"
    assert "reduce_on_root" in reports[0]["collectives"]["checks"]


def test_collectives_keep_torch_s_stream_order(reports):
    assert_checks_pass(reports, "streams", "cuda:0")
    assert "recv_behind_busy_stream" in reports[1]["streams"]["checks"]


def test_send_and_recv_move_cuda_tensors(reports):
    assert_checks_pass(reports, "p2p", "cuda:0")
    assert "pair_int8" in reports[1]["p2p"]["checks"]


def test_ddp_with_device_ids_trains_like_one_process(reports):
    assert_trained_like_one_process(reports, "ddp")
    assert all(report["ddp"]["devices"] == ["cuda:0"] for report in reports)


def test_ddp_with_a_compression_hook_trains_like_one_process(reports):
    assert_trained_like_one_process(reports, "ddp_bf16_hook", BF16_RTOL, BF16_ATOL)


def test_fsdp2_on_a_cuda_mesh_trains_like_one_process(reports):
    assert_trained_like_one_process(reports, "fsdp2")
    for report in reports:
        assert report["fsdp2"]["devices"] == ["cuda:0"]
        assert report["fsdp2"]["local_shapes"]["2.weight"] == [script.HIDDEN // WORLD,
                                                               script.HIDDEN]

"""gradstar's training wrappers on CUDA models, proved against single-process training on the
same device.

One launch of ``wrappers_script.py`` (2 rank processes sharing cuda:0, a real coordinator)
plays every scenario: DDP, FSDP (with full and sharded state dicts), a 2-stage Pipeline under
both schedules, LocalSGD and DiLoCo, each over several optimizer steps. Each test below checks
one of them against a reference trained here, in this process, on the whole batch on the same
device with the same code, and checks that the wrapper left every tensor on the device and that
its traffic was staged through host copies. The ranks start from different random inits (seeded
by rank), so agreeing with the reference also proves the construction broadcast. The in-process
tests at the end check what needs no second rank: a module spread over two devices is refused,
DDP's buckets and gradients stay on the device, and all_reduce_coalesced returns CUDA tensors
where it was given them.

The checks are the module-level ``check_*`` functions, which take the device and the run's
reports: tests/parallel/test_wrappers_staged.py runs the same script and checks on this
machine's CPU, with CPU tensors staged through host copies as CUDA tensors are. What needs a
real GPU (a module spread over the CPU and a GPU) stays here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradstar
from gradstar.client.fsdp import full_state_dict_from_shards
from gradstar.errors import ConfigurationError
from tests.integration.conftest import close_all, join_all
from tests.parallel import ddp_script, fsdp_script, pipeline_script
from tests.parallel.conftest import on_thread, reports_by_scenario, run_world

from . import wrappers_script as script
from .conftest import needs_cuda

pytestmark = needs_cuda

DEVICE = torch.device("cuda", 0)
WORLD = 2
# float32 training of a few steps: the hub sums ranks in arrival order, and cuBLAS may pick
# other kernels (other summation orders) for a rank's rows than for the whole batch, so results
# agree to rounding, not bit for bit.
RTOL, ATOL = 1e-4, 1e-5
# bf16 keeps 8 bits of mantissa: a few steps of lr 0.1 stay within ~1e-3 of float32 training.
BF16_RTOL, BF16_ATOL = 1e-2, 2e-3

Runs = dict[str, list[dict]]


async def run_wrappers(out_dir: Path, job: str, device: torch.device, *args: str,
                       timeout: float = 100) -> Runs:
    """{scenario: [report of rank 0, rank 1]} from one 2-rank run of every scenario on
    ``device`` (``args``: more options of the script, such as ``--stage-cpu``)."""
    reports = await run_world(script.SCRIPT, WORLD, job, str(out_dir), "--device", str(device),
                              *args, timeout=timeout)
    return reports_by_scenario(reports, script.SCENARIOS, WORLD)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("wrappers-cuda")


@pytest.fixture(scope="module")
def runs(out_dir) -> Runs:
    return asyncio.run(run_wrappers(out_dir, "wrappers-cuda", DEVICE))


def named_lists(module: nn.Module) -> dict[str, list]:
    return script.listed(module.named_parameters())


def assert_close(got: dict[str, list], want: dict[str, list], where: str, rtol=RTOL, atol=ATOL):
    """``got`` has ``want``'s keys in ``want``'s order, and values within tolerance."""
    assert list(got) == list(want), where
    for name, values in want.items():
        np.testing.assert_allclose(got[name], values, rtol=rtol, atol=atol,
                                   err_msg=f"{where}, {name}")


def on_device(device: torch.device, *found: list[str]) -> bool:
    return all(devices == [str(device)] for devices in found)


def check_staged(runs: Runs) -> None:
    """Every scenario, on every rank, had the device's tensors staged and made staged host
    copies."""
    for name, reports in runs.items():
        for report in reports:
            assert report["staged"] and report["staged_copies"] > 0, (
                f"{name}, rank {report['rank']}: staged {report['staged']}, "
                f"{report['staged_copies']} staged copies")


def test_every_scenario_stages_its_tensors_through_host_copies(runs):
    check_staged(runs)


# -- DDP ---------------------------------------------------------------------------------------


def mlp_reference(kind: str, device: torch.device) -> nn.Module:
    model = ddp_script.make_mlp(0).to(device)  # rank 0's init: what construction hands out
    script.train_mlp(model, ddp_script.optimizer(kind, model.parameters()), 0, 1, device)
    return model


def check_ddp(runs: Runs, device: torch.device) -> None:
    want = named_lists(mlp_reference("sgd", device))
    for report in runs["ddp"]:
        assert report["device"] == str(device) and on_device(device, report["devices"])
        assert report["buckets"] >= 3 and report["launched_during_backward"] >= 1
        assert_close(report["params"], want, f"rank {report['rank']}")


def check_ddp_unused(runs: Runs, device: torch.device) -> None:
    want = named_lists(script.branch_reference(device))
    for report in runs["ddp_unused"]:
        assert report["branch_grad_none_when_unused_everywhere"]
        assert_close(report["params"], want, f"rank {report['rank']}")


def check_ddp_bf16(runs: Runs, device: torch.device) -> None:
    reports = runs["ddp_bf16"]
    want = named_lists(mlp_reference("sgd", device))
    for report in reports:
        assert report["bucket_dtypes"] == ["torch.bfloat16"]
        assert report["grad_dtypes"] == ["torch.float32"]
        assert_close(report["params"], want, f"rank {report['rank']}", BF16_RTOL, BF16_ATOL)
    assert reports[0]["params"] == reports[1]["params"]  # the very same means everywhere


def check_ddp_int8(runs: Runs, device: torch.device) -> None:
    reports = runs["ddp_int8"]
    want = named_lists(mlp_reference("sgd", device))
    for report in reports:
        assert report["residual_devices"] == [str(device)]
        assert report["grad_devices"] == [str(device)]
        # int8 rounds each gradient by up to amax/254 of its block: within bf16's tolerance.
        assert_close(report["params"], want, f"rank {report['rank']}", BF16_RTOL, BF16_ATOL)
    assert reports[0]["params"] == reports[1]["params"]


def check_ddp_buffers(runs: Runs, device: torch.device) -> None:
    reports = runs["ddp_buffers"]
    assert all(r["after_init"] == [0.0] * ddp_script.HIDDEN for r in reports)
    assert reports[0]["mean"] == reports[1]["mean"]
    assert all(r["tracked"] == 2 and on_device(device, r["devices"]) for r in reports)


def test_ddp_over_several_buckets_matches_one_process_and_stays_on_the_device(runs):
    check_ddp(runs, DEVICE)


def test_ddp_unused_parameters_on_the_device_match_one_process(runs):
    check_ddp_unused(runs, DEVICE)


def test_ddp_bf16_compression_on_the_device_is_within_bf16_tolerance(runs):
    check_ddp_bf16(runs, DEVICE)


def test_ddp_int8_with_error_feedback_on_the_device_is_within_tolerance(runs):
    check_ddp_int8(runs, DEVICE)


def test_ddp_broadcasts_cuda_buffers_from_rank_0(runs):
    check_ddp_buffers(runs, DEVICE)


# -- FSDP --------------------------------------------------------------------------------------


def fsdp_reference(model: nn.Module, kind: str, device: torch.device) -> dict[str, list]:
    """The state dict, as lists, of ``model`` trained on the whole batch on ``device``."""
    model = model.to(device)
    script.train_fsdp_model(model, fsdp_script.optimizer(kind, model.parameters()), 0, 1,
                            device)
    return script.listed(model.state_dict().items())


def assert_fsdp_on_device(report: dict, device: torch.device) -> None:
    assert report["device"] == str(device)
    assert on_device(device, report["devices"], report["placeholders"])


def check_fsdp(runs: Runs, device: torch.device) -> None:
    want = fsdp_reference(fsdp_script.MLP(0), "adam", device)
    for report in runs["fsdp"]:
        assert_fsdp_on_device(report, device)
        assert on_device(device, report["state_dict_devices"])
        assert report["units"][0] == ["", 3, 4]  # the root unit is padded across 2 ranks
        assert_close(report["state_dict"], want, f"rank {report['rank']}")


def check_fsdp_nested(runs: Runs, device: torch.device) -> None:
    want = fsdp_reference(fsdp_script.NestedNet(0), "adam", device)
    for report in runs["fsdp_nested"]:
        assert_fsdp_on_device(report, device)
        assert on_device(device, report["state_dict_devices"])
        assert_close(report["state_dict"], want, f"rank {report['rank']}")


def check_fsdp_mixed(runs: Runs, device: torch.device) -> None:
    want = fsdp_reference(fsdp_script.MLP(0), "momentum", device)
    for report in runs["fsdp_mixed"]:
        assert_fsdp_on_device(report, device)
        assert report["collective_dtypes"] == ["bfloat16"]
        assert_close(report["state_dict"], want, f"rank {report['rank']}", BF16_RTOL, BF16_ATOL)


def check_fsdp_checkpoint(runs: Runs, out_dir: Path, device: torch.device) -> None:
    first, *others = runs["fsdp_checkpoint"]
    assert on_device(device, first["full_devices"]) and all(
        r["full_devices"] == [] for r in others)
    for report in runs["fsdp_checkpoint"]:
        # A full state dict loaded from host memory, and a sharded one, into fresh FSDPs:
        # both compute exactly what the trained one does, and their shards are on the device.
        assert report["full_reloaded_out_equal"] and report["full_round_trip_equal"]
        assert report["sharded_reloaded_out_equal"]
        assert on_device(device, report["sharded_devices"], report["shard_devices_after_loads"])
    saved = torch.load(out_dir / "full.pt", weights_only=True)
    assert {str(v.device) for v in saved.values()} == {str(device)}
    assert_close(script.listed(saved.items()), fsdp_reference(fsdp_script.MLP(0), "sgd", device),
                 "full.pt")
    merged = full_state_dict_from_shards(
        [torch.load(out_dir / f"sharded-{rank}.pt", weights_only=True) for rank in (1, 0)])
    assert list(merged) == list(saved)
    for key, value in saved.items():
        assert merged[key].device == value.device and torch.equal(merged[key], value), key


def test_fsdp_matches_one_process_and_keeps_shards_grads_and_state_on_the_device(runs):
    check_fsdp(runs, DEVICE)


def test_fsdp_nested_units_tied_weight_frozen_unit_and_buffer_on_the_device(runs):
    check_fsdp_nested(runs, DEVICE)


def test_fsdp_mixed_precision_on_the_device_is_within_bf16_tolerance(runs):
    check_fsdp_mixed(runs, DEVICE)


def test_fsdp_state_dicts_round_trip_on_the_device(runs, out_dir):
    check_fsdp_checkpoint(runs, out_dir, DEVICE)


# -- Pipeline ----------------------------------------------------------------------------------


def check_pipeline(runs: Runs, schedule: str, device: torch.device) -> None:
    reference, losses = script.pipeline_reference(device)
    reports = runs[f"pipeline_{schedule}"]
    for report in reports:
        assert report["device"] == str(device) and on_device(device, report["devices"])
        assert_close(report["params"], named_lists(reference[report["rank"]]),
                     f"stage {report['rank']}")
    first, last = reports
    assert first["losses"] == [] and first["loss_devices"] == []
    assert on_device(device, last["loss_devices"])
    np.testing.assert_allclose(last["losses"], losses, rtol=RTOL, atol=ATOL)
    x, _ = pipeline_script.batch(99, 10)
    with torch.no_grad():
        want = reference(x.to(device)).cpu().numpy()
    assert first["inference"] is None and last["inference_device"] == str(device)
    np.testing.assert_allclose(last["inference"], want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipeline_on_the_device_matches_the_unsplit_model(runs, schedule):
    check_pipeline(runs, schedule, DEVICE)


# -- LocalSGD and DiLoCo -----------------------------------------------------------------------


def check_local_sgd(runs: Runs, device: torch.device) -> None:
    want = named_lists(script.local_sgd_reference(device))
    for report in runs["local_sgd"]:
        assert report["rounds"] == script.STEPS
        assert report["device"] == str(device) and on_device(device, report["devices"])
        assert report["global_is_host_copy_of_params"]
        assert_close(report["params"], want, f"rank {report['rank']}")


def check_diloco(runs: Runs, device: torch.device) -> None:
    reports = runs["diloco"]
    want = named_lists(script.diloco_reference(torch.device("cpu")))  # by hand, on the host
    for report in reports:
        on_gpu, on_cpu = report["runs"]["device"], report["runs"]["host"]
        where = f"rank {report['rank']}"
        assert on_device(device, on_gpu["devices"]) and on_cpu["devices"] == ["cpu"]
        # The device's run was staged, the host's took the ordinary CPU path.
        assert on_gpu["staged"] and not on_cpu["staged"]
        assert on_gpu["rounds"] == on_cpu["rounds"] == script.STEPS // script.DILOCO[
            "sync_every"]
        assert_close(on_gpu["params"], on_cpu["params"], where)
        assert_close(on_cpu["params"], want, f"{where}, on the host")
        assert_close(on_gpu["params"], want, f"{where}, on the device")
    # Every rank ends a round with the very same global parameters.
    assert reports[0]["runs"]["device"]["params"] == reports[1]["runs"]["device"]["params"]


def test_local_sgd_every_step_on_the_device_equals_whole_batch_sgd(runs):
    check_local_sgd(runs, DEVICE)


def test_diloco_on_the_device_equals_diloco_on_the_cpu_and_by_hand(runs):
    check_diloco(runs, DEVICE)


# -- in this process ---------------------------------------------------------------------------


@pytest.fixture
async def solo(coordinator):
    """A blocking process group of world_size 1, joined on a worker thread."""
    pg = await asyncio.to_thread(gradstar.init_process_group, coordinator=coordinator.address,
                                 job="solo-cuda", world_size=1, rank=0, timeout=20,
                                 join_timeout=20)
    yield pg
    await asyncio.wait_for(asyncio.to_thread(pg.close), 20)


def spread_mlp() -> nn.Module:
    """An MLP whose first layer is on the CPU and whose last is on the GPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[2].to(DEVICE)
    return model


@pytest.mark.parametrize(("name", "wrap"), [
    ("DistributedDataParallel", lambda module, pg: gradstar.DDP(module, pg)),
    ("FullyShardedDataParallel", lambda module, pg: gradstar.FSDP(module, pg)),
    ("Pipeline", lambda module, pg: gradstar.Pipeline(module, pg, num_microbatches=2)),
    ("LocalSGD", lambda module, pg: gradstar.LocalSGD(module, pg, 1)),
])
async def test_a_module_spread_over_the_cpu_and_a_gpu_is_refused_naming_both(solo, name, wrap):
    def body(pg):
        with pytest.raises(ConfigurationError) as raised:
            wrap(spread_mlp(), pg)
        assert str(raised.value) == (
            f"{name} needs all of a module's parameters and buffers on one device; parameter "
            f"0.weight is on cpu, parameter 2.weight on {DEVICE}: move the whole module with "
            ".to(device) first")

    await on_thread(body, solo)


def check_ddp_buckets_and_gradients(pg, device: torch.device) -> None:
    """DDP's flat buckets and the gradients it writes are on ``device`` and equal plain
    autograd's (run in a thread: the process group is blocking)."""
    model, plain = ddp_script.make_mlp(0).to(device), ddp_script.make_mlp(0).to(device)
    ddp = gradstar.DDP(model, pg, bucket_cap_mb=ddp_script.SMALL_BUCKET_MB)
    assert ddp.device == device
    assert {flat.device for flat in ddp.reducer.flats} == {device}
    x = torch.randn(6, ddp_script.IN, device=device)
    ddp(x).square().sum().backward()
    plain(x).square().sum().backward()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        assert got.grad.device == device
        torch.testing.assert_close(got.grad, want.grad)
    assert ddp.last_step_timeline.launched_during_backward >= 1


async def test_ddp_buckets_and_gradients_stay_on_the_device_and_match_plain_autograd(solo):
    await on_thread(check_ddp_buckets_and_gradients, solo, DEVICE)


def check_ddp_views_and_input_move(pg, device: torch.device) -> None:
    """gradient_as_bucket_view on the device, the input given on the CPU nested in a dict: the
    forward moves it, the gradients are views of the device buckets and equal autograd's."""
    plain = ddp_script.make_mlp(0).to(device)
    ddp = gradstar.DDP(_Net(ddp_script.make_mlp(0).to(device)), pg,
                       gradient_as_bucket_view=True, bucket_cap_mb=ddp_script.SMALL_BUCKET_MB)
    x = torch.randn(6, ddp_script.IN)
    ddp({"x": [x]}).square().sum().backward()
    plain(x.to(device)).square().sum().backward()
    for got, view, want in zip(ddp.parameters(), ddp.reducer.views, plain.parameters(),
                               strict=True):
        assert got.grad.device == device and got.grad.data_ptr() == view.data_ptr()
        torch.testing.assert_close(got.grad, want.grad)


class _Net(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(batch["x"][0])


async def test_ddp_bucket_views_and_inputs_moved_to_the_device(solo):
    await on_thread(check_ddp_views_and_input_move, solo, DEVICE)


def coalesced_inputs(rank: int, device: torch.device) -> list[torch.Tensor]:
    """Tensors on ``device`` of every reducible dtype and of awkward shapes (0-d, empty)."""
    g = torch.Generator().manual_seed(rank)
    return [t.to(device) for t in (
        torch.randn(7, 5, generator=g),
        torch.randn(3, generator=g, dtype=torch.float64),
        torch.tensor(2.0 + rank, dtype=torch.float16),
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
        torch.arange(4) * (rank + 1),
        torch.empty(0, 3),
    )]


async def check_all_reduce_coalesced(address: str, job: str, device: torch.device) -> None:
    """Two async ranks in this process: all_reduce_coalesced of tensors on ``device`` gives
    tensors on ``device`` of their dtypes and shapes, holding the sums."""
    groups = await join_all(address, 2, job=job)
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(
            g.all_reduce_coalesced(coalesced_inputs(g.rank, device), op="sum",
                                   bucket_cap_mb=100 / (1 << 20))
            for g in groups)), 30)
    finally:
        await close_all(groups)
    for out in outs:
        for got, a, b in zip(out, coalesced_inputs(0, device), coalesced_inputs(1, device),
                             strict=True):
            assert got.device == device and got.dtype == a.dtype and got.shape == a.shape
            # Half-precision sums are taken in float32 on the hub and rounded once.
            want = (a.double() + b.double()).to(a.dtype) if a.dtype.is_floating_point else a + b
            assert torch.equal(got, want), (got, want)


async def test_all_reduce_coalesced_returns_cuda_tensors_on_their_device(coordinator):
    await check_all_reduce_coalesced(coordinator.address, "coalesced-cuda", DEVICE)

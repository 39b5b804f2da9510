"""LocalSGD and DiLoCo with real rank processes, proved against single-process references."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from torch import nn

import gradstar
from gradstar.errors import ConfigurationError
from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc
from gradstar.wire.formats import roundtrip
from tests.integration.conftest import (  # noqa: F401
    finish,
    rank_env,
    spawn_coordinator,
    start_coordinator,
)

from . import local_sgd_script as script
from .conftest import on_thread

SCRIPT = Path(script.__file__)


async def spawn(address: str, job: str, world: int, *args: str, ranks=None):
    return [
        await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), *args, env=rank_env(address, job, world, r),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        for r in (range(world) if ranks is None else ranks)
    ]


async def run_ranks(address: str, job: str, world: int, *args: str, timeout=120):
    for code, out, err in [await finish(p, timeout) for p in await spawn(address, job, world,
                                                                          *args)]:
        assert code == 0, out + err[-3000:]


def reference_training(steps: int, world: int, inner: str) -> np.ndarray:
    """One process, whole batches, starting from rank 0's init: what H=1 LocalSGD must equal."""
    model = script.make_model(100)
    opt = script.make_optimizer(model, inner)
    for step in range(steps):
        x, y = script.batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return script.flat(model)


async def test_local_sgd_every_step_equals_whole_batch_sgd(start_coordinator, tmp_path):  # noqa: F811
    coordinator = await start_coordinator()
    await run_ranks(coordinator.address, "lsgd", 4, "train", str(tmp_path), "--sync-every", "1",
                    "--steps", "5")
    want = reference_training(5, 4, "sgd")
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        job = await admin_pb2_grpc.AdminStub(channel).GetJob(
            admin_pb2.GetJobRequest(job="lsgd"), timeout=5)
    assert [(m.name, m.rounds, m.parameters) for m in job.models] == [("global", 5, want.size)]
    start = script.flat(script.make_model(100))
    for r in range(4):
        # Ranks began from different inits; construction gave every rank rank 0's.
        np.testing.assert_array_equal(np.load(tmp_path / f"start{r}.npy"), start)
        np.testing.assert_allclose(np.load(tmp_path / f"final{r}.npy"), want,
                                   rtol=1e-5, atol=1e-6)


def diloco_reference(world: int, sync_every: int, steps: int, lr: float, mu: float,
                     wire: str | None = None):
    """DiLoCo by hand: inner SGD per rank, then a Nesterov step on the mean pseudo-gradient
    (each rank's pseudo-gradient rounded through ``wire`` first, if given)."""
    global_params = script.flat(script.make_model(100))
    momentum = np.zeros_like(global_params)
    models = [script.make_model(100) for _ in range(world)]
    opts = [script.make_optimizer(m, "sgd") for m in models]
    for step in range(steps):
        for r in range(world):
            script.local_step(models[r], opts[r], step, r, world)
        if (step + 1) % sync_every == 0:
            sent = [global_params - script.flat(m) for m in models]
            if wire is not None:
                sent = [roundtrip(wire, d) for d in sent]
            delta = np.mean(sent, axis=0)
            momentum = mu * momentum + delta
            global_params = global_params - lr * (delta + mu * momentum)
            for m in models:
                offset = 0
                with torch.no_grad():
                    for p in m.parameters():
                        n = p.numel()
                        p.copy_(torch.from_numpy(global_params[offset:offset + n]).view_as(p))
                        offset += n
    return global_params


async def test_diloco_rounds_match_a_hand_computed_nesterov_outer_step(start_coordinator,  # noqa: F811
                                                                       tmp_path):
    coordinator = await start_coordinator()
    await run_ranks(coordinator.address, "diloco", 2, "train", str(tmp_path), "--sync-every",
                    "3", "--steps", "6", "--outer", "nesterov", "--outer-lr", "0.7",
                    "--outer-momentum", "0.9")
    want = diloco_reference(2, 3, 6, 0.7, 0.9)
    finals = [np.load(tmp_path / f"final{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(finals[0], finals[1])  # identical on every rank
    np.testing.assert_allclose(finals[0], want, rtol=1e-5, atol=1e-6)
    # The outer step really happened (not plain averaging, which gives other parameters).
    plain = diloco_reference(2, 3, 6, 1.0, 0.0)
    assert not np.allclose(finals[0], plain, rtol=1e-4)


async def test_diloco_with_encoded_pseudo_gradients_matches_the_rounded_reference(
        start_coordinator, tmp_path):  # noqa: F811
    coordinator = await start_coordinator()
    await run_ranks(coordinator.address, "diloco-int8", 2, "train", str(tmp_path),
                    "--sync-every", "3", "--steps", "6", "--outer", "nesterov", "--outer-lr",
                    "0.7", "--outer-momentum", "0.9", "--wire", "int8")
    finals = [np.load(tmp_path / f"final{r}.npy") for r in range(2)]
    np.testing.assert_array_equal(finals[0], finals[1])  # identical on every rank
    want = diloco_reference(2, 3, 6, 0.7, 0.9, wire="int8")
    np.testing.assert_allclose(finals[0], want, rtol=1e-5, atol=1e-6)
    # The pseudo-gradients really were encoded: float32 ones give other parameters.
    exact = diloco_reference(2, 3, 6, 0.7, 0.9)
    assert not np.allclose(finals[0], exact, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(finals[0], exact, rtol=0, atol=1e-2)  # but not far from them


def test_local_sgd_refuses_a_wire_format_without_an_outer_optimizer():
    with pytest.raises(ConfigurationError, match="plain LocalSGD averages parameters"):
        gradstar.LocalSGD(nn.Linear(2, 2), object.__new__(gradstar.ProcessGroup), 2,
                          wire="int8")


async def test_restarted_rank_resumes_from_the_global_model(start_coordinator, tmp_path):  # noqa: F811
    coordinator = await start_coordinator(heartbeat_timeout=5.0)
    first = await spawn(coordinator.address, "elastic", 2, "resilient", str(tmp_path),
                        "--rounds", "100", "--after-resume", "3")
    victim = first[1]
    try:
        # Let both ranks complete two rounds, then kill rank 1.
        while True:
            line = await asyncio.wait_for(victim.stdout.readline(), 60)
            assert line, "rank 1 exited early"
            if json.loads(line).get("round") == 2:
                break
        victim.kill()
        await victim.wait()
        restarted = (await spawn(coordinator.address, "elastic", 2, "resilient",
                                 str(tmp_path), "--after-resume", "3", "--fresh-seed", "999",
                                 ranks=[1]))[0]
        results = [await finish(first[0], 120), await finish(restarted, 120)]
    finally:
        for p in first:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    for code, out, err in results:
        assert code == 0, out + err[-3000:]
    events = [json.loads(line) for line in results[0][1].splitlines()]
    lost_at = next(i for i, e in enumerate(events) if "lost" in e)
    assert events[lost_at]["lost"] == "RankLostError", events[lost_at]
    # The last round rank 0 completed before the loss is the global model both resume from.
    last = max(e["round"] for e in events[:lost_at])
    assert last >= 2
    global_model = np.load(tmp_path / f"round{last}_rank0.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "resumed1.npy"), global_model)
    np.testing.assert_array_equal(np.load(tmp_path / "resumed0.npy"), global_model)
    assert not np.array_equal(global_model, script.flat(script.make_model(999)))
    np.testing.assert_array_equal(np.load(tmp_path / "final0.npy"),
                                  np.load(tmp_path / "final1.npy"))


async def test_one_rank_rounds_keep_the_parameters_and_report_them_on_the_host(solo):
    def body(pg):
        model = script.make_model(3)
        before = script.flat(model)
        lsgd = gradstar.LocalSGD(model, pg, 2, model_name="solo")
        assert lsgd.device == torch.device("cpu")
        assert [lsgd.step(), lsgd.step()] == [False, True]
        np.testing.assert_array_equal(script.flat(model), before)
        held = lsgd.global_parameters
        assert isinstance(held, np.ndarray) and held.dtype == np.float32
        np.testing.assert_array_equal(held, before)
        held[:] = 0  # a copy: the next round starts from the real global parameters
        lsgd.sync()
        np.testing.assert_array_equal(lsgd.global_parameters, before)

    await on_thread(body, solo)


async def test_a_module_on_another_device_is_refused_naming_the_device(solo):
    def body(pg):
        with pytest.raises(ConfigurationError) as raised:
            gradstar.LocalSGD(script.make_model(0).to("meta"), pg, 1)
        assert str(raised.value) == ("LocalSGD runs on the CPU or a CUDA device; parameter "
                                     "0.weight is on meta: move the module to one of them first")
        with pytest.raises(ConfigurationError, match=r"LocalSGD wraps a torch\.nn\.Module, got "
                                                     r"list"):
            gradstar.LocalSGD([torch.zeros(3)], pg, 1)

    await on_thread(body, solo)


async def coordinator_process(state_dir: Path):
    return await spawn_coordinator("--state-dir", str(state_dir))


@pytest.mark.timeout(180)
async def test_coordinator_restart_keeps_every_completed_round(tmp_path):
    state = tmp_path / "state"
    proc, address = await coordinator_process(state)
    try:
        await run_ranks(address, "durable", 2, "train", str(tmp_path / "a"), "--steps", "3")
    finally:
        proc.kill()  # no graceful shutdown: what was persisted must be enough
        await proc.wait()
    trained = np.load(tmp_path / "a" / "final0.npy")
    proc, address = await coordinator_process(state)
    try:
        # New ranks from other inits join the same job: they must start from the saved model.
        await run_ranks(address, "durable", 2, "train", str(tmp_path / "b"), "--steps", "0")
    finally:
        proc.terminate()
        await proc.wait()
    for r in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / "b" / f"start{r}.npy"), trained)

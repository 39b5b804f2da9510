"""Pipeline parallelism with 4 real stage processes, proved against single-process training.

One launch of ``pipeline_script.py`` (4 ranks, a real coordinator, activations and gradients
over the ranks' own peer streams) plays every scenario; each test below checks one of them
against the unsplit model trained here, in this process, on the whole batch. The same launch
then trains on until the middle stage 2 is killed mid-step, and every other stage must get a
named error quickly.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np
import pytest
import torch

import gradstar
from gradstar import errors
from gradstar.client.pipeline.schedules import peak_live, schedule_actions
from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator, EmbeddedCoordinator

from . import pipeline_script as script
from .conftest import finish, kill_all, rank_env

S = script.STAGES
# float32: the micro-batches' gradients are summed in another order than the whole batch's.
RTOL, ATOL = 1e-5, 1e-6


VICTIM = 2


async def run_then_kill_stage(victim: int, timeout: float = 100) -> dict:
    """One launch of 4 stage processes against a coordinator on 127.0.0.1:0: every scenario,
    then ``until_killed``, during which stage ``victim`` is SIGKILLed after two steps.

    Returns {"lines": [stage 0's JSON lines, ...], "killed_at": time.time() of the kill}.
    """
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
    await hub.start()
    procs = []
    try:
        for rank in range(S):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(script.SCRIPT), *script.SCENARIOS, "until_killed",
                env=rank_env(hub.address, "pipeline", S, rank),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        # Every stage's lines as they come; the kill once every stage finished two steps (the
        # victim's two steps alone leave the others still finishing their second).
        lines: list[list[dict]] = [[] for _ in procs]

        async def two_steps(rank: int) -> None:
            while sum("progress" in line for line in lines[rank]) < 2:
                line = await procs[rank].stdout.readline()
                if not line:
                    _, err = await procs[rank].communicate()
                    raise AssertionError(f"stage {rank} ended early:\n{lines[rank][-3:]}\n"
                                         f"{err.decode()[-3000:]}")
                if line.startswith(b"{"):
                    lines[rank].append(json.loads(line))

        async with asyncio.timeout(timeout):
            await asyncio.gather(*(two_steps(rank) for rank in range(S)))
        await asyncio.sleep(0.1)  # into the third step
        procs[victim].kill()
        killed_at = time.time()
        await procs[victim].wait()
        for rank, proc in enumerate(procs):
            if rank == victim:
                continue
            code, out, err = await finish(proc, 60)
            assert code == 0, f"stage {rank} exited with {code}:\n{out[-2000:]}\n{err[-3000:]}"
            lines[rank] += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    finally:
        await kill_all(procs)
        await hub.stop(grace=0)
    return {"lines": lines, "killed_at": killed_at}


@pytest.fixture(scope="module")
def world() -> dict:
    return asyncio.run(run_then_kill_stage(VICTIM))


@pytest.fixture(scope="module")
def runs(world) -> dict[str, list[dict]]:
    """{scenario: [report of stage 0, ..., stage 3]} for every scenario but the kill."""
    by_scenario: dict[str, list[dict]] = {}
    for rank, lines in enumerate(world["lines"]):
        for line in lines:
            if "scenario" in line and line["scenario"] in script.SCENARIOS:
                assert line["rank"] == rank
                assert "fatal" not in line, line
                by_scenario.setdefault(line["scenario"], []).append(line)
    assert sorted(by_scenario) == sorted(script.SCENARIOS)
    assert all(len(v) == S for v in by_scenario.values())
    return by_scenario


def assert_matches_reference(reports: list[dict], sizes: list[int]) -> None:
    reference, losses = script.train_reference(sizes)
    for report in reports:
        want = script.params_of(reference[report["rank"]])
        assert sorted(report["params"]) == sorted(want)
        for name, values in want.items():
            np.testing.assert_allclose(report["params"][name], values, rtol=RTOL, atol=ATOL,
                                       err_msg=f"stage {report['rank']}, {name}")
    # The last stage returns the mean loss over the batch; the others return None.
    assert all(r["losses"] == [None] * len(sizes) for r in reports[:-1])
    np.testing.assert_allclose(reports[-1]["losses"], losses, rtol=RTOL, atol=ATOL)


def test_stages_start_from_slices_of_one_model():
    # Otherwise agreeing with the reference would prove less than it seems.
    whole = script.make_model()
    assert [type(m) for m in whole] == [torch.nn.Sequential] * S
    assert script.params_of(whole[1]) != script.params_of(script.make_model(1)[1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_training_matches_the_unsplit_model_in_one_process(runs, schedule):
    assert_matches_reference(runs[schedule], script.EVEN)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_micro_batches_and_changing_batch_sizes_match_exactly(runs, schedule):
    assert all(rows % script.M for rows in script.UNEVEN)
    assert_matches_reference(runs[f"{schedule}_uneven"], script.UNEVEN)


@pytest.mark.parametrize(("name", "sizes"), [("forward_backward", script.EVEN),
                                            ("forward_backward_uneven", script.UNEVEN)])
def test_forward_then_backward_matches_step_and_the_unsplit_model(runs, name, sizes):
    assert_matches_reference(runs[name], sizes)
    # ... and step() itself, on the same batches (1f1b and gpipe alike).
    step = runs["1f1b" if sizes is script.EVEN else "gpipe_uneven"]
    for mine, theirs in zip(runs[name], step, strict=True):
        for key, values in theirs["params"].items():
            np.testing.assert_allclose(mine["params"][key], values, rtol=RTOL, atol=ATOL)
    # Every micro-batch is kept from forward to backward (GPipe's order), none after.
    assert all(r["live"] == [[script.M, 0]] * len(sizes) for r in runs[name])


def test_fewer_micro_batches_than_stages_match_too(runs):
    assert_matches_reference(runs["1f1b_few"], script.EVEN)


def test_stages_run_the_schedules_action_lists(runs):
    for schedule in ("gpipe", "1f1b"):
        for r, report in enumerate(runs[schedule]):
            want = schedule_actions(schedule, S, r, script.M)
            assert report["actions"] == [str(a) for a in want]


@pytest.mark.parametrize("suffix", ["", "_uneven"])
def test_1f1b_keeps_at_most_stages_minus_r_micro_batches_alive_and_gpipe_keeps_all(runs, suffix):
    for r in range(S):
        one_f = runs[f"1f1b{suffix}"][r]["max_live"]
        gpipe = runs[f"gpipe{suffix}"][r]["max_live"]
        assert all(n <= S - r for n in one_f), (r, one_f)
        assert one_f == [min(S - r, script.M)] * script.STEPS
        assert gpipe == [script.M] * script.STEPS
    assert [r["max_live"][0] for r in runs["1f1b_few"]] == [2, 2, 2, 1]


def test_1f1b_saves_real_activation_memory(runs):
    # Measured in bytes of tensors held for backward, not counted by the schedule: with equal
    # micro-batches each one holds the same bytes, so the peaks are in the ratio of the counts.
    for r in range(S):
        one_f = runs["1f1b"][r]["peak_bytes"]
        gpipe = runs["gpipe"][r]["peak_bytes"]
        assert all(b > 0 for b in gpipe)
        live = peak_live(schedule_actions("1f1b", S, r, script.M))
        assert [b * script.M for b in one_f] == [b * live for b in gpipe], (r, one_f, gpipe)


def test_inference_forward_returns_the_whole_models_output_on_the_last_stage(runs):
    reports = runs["inference"]
    x, _ = script.batch(99, 10)
    with torch.no_grad():
        want = script.make_model()(x)
    assert [r["out"] for r in reports[:-1]] == [None] * (S - 1)
    np.testing.assert_allclose(reports[-1]["out"], want.numpy(), rtol=RTOL, atol=ATOL)
    assert not any(r["grads_kept"] for r in reports)


def test_send_recv_between_processes_round_trips_types_shapes_and_dtypes(runs):
    for report in runs["send_recv"]:
        assert all(report["checks"].values()), report


def test_killing_a_middle_stage_mid_step_fails_every_other_stage_within_5s(world):
    for rank, lines in enumerate(world["lines"]):
        if rank == VICTIM:
            continue
        report = lines[-1]
        assert report["scenario"] == "until_killed", report
        assert report["steps"] >= 2, report  # it was mid-training, not starting up
        assert report["error"] == "RankLostError", report
        assert report["lost_rank"] == VICTIM, report
        assert f"rank {VICTIM}" in report["message"]
        assert report["failed_at"] - world["killed_at"] < 5.0, report


def test_arguments_for_the_wrong_stage_are_refused_before_anything_is_sent(runs):
    reports = runs["misuse"]
    first, middle, last = reports[0]["messages"], reports[1]["messages"], reports[-1]["messages"]
    assert first[0] == "stage 0 is the first stage: pass inputs= a tensor, got NoneType"
    assert first[1] == ("stage 0 is not the last stage (stage 3 is): only the last stage takes "
                        "targets, pass targets=None")
    assert middle[0] == "stage 1 is not the first stage: its inputs come from stage 0, " \
                        "pass inputs=None"
    assert last[1] == "stage 3 is the last stage: pass targets= a tensor, got NoneType"
    for messages in (first, last):
        assert messages[3].startswith("a batch of 7 rows cannot be split into 8 micro-batches")
    assert [len(r["messages"]) for r in reports] == [4, 3, 3, 4]
    # The refused calls sent nothing and numbered nothing: the next step ran normally.
    x, y = script.batch(0, 32)
    with torch.no_grad():
        want = torch.nn.functional.mse_loss(script.make_model()(x), y).item()
    assert reports[-1]["loss"] == pytest.approx(want, rel=RTOL)


# -- one stage, in this process -------------------------------------------------------------------


@pytest.fixture(scope="module")
def solo():
    """A blocking process group of world_size 1 (a one-stage pipeline needs no peer)."""
    with EmbeddedCoordinator() as hub, gradstar.init_process_group(
            coordinator=hub.address, job="solo", world_size=1, rank=0, timeout=20) as pg:
        yield pg


def test_a_single_stage_pipeline_is_plain_training_and_inference(solo):
    model, reference = script.make_model(), script.make_model()
    pipe = gradstar.Pipeline(model, solo, num_microbatches=3, schedule="1f1b")
    x, y = script.batch(0, 10)
    loss = pipe.step(inputs=x, targets=y, loss_fn=torch.nn.functional.mse_loss)
    want = torch.nn.functional.mse_loss(reference(x), y)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=RTOL)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert pipe.max_live_activations == 1 and pipe.live_activations == 0
    with torch.no_grad():
        out = pipe.forward(x)
    torch.testing.assert_close(out, reference(x), rtol=RTOL, atol=ATOL)
    assert not out.requires_grad
    with pytest.raises(errors.ConfigurationError, match="backward\\(\\) needs a forward\\(\\) "
                                                        "run with grad enabled"):
        pipe.backward(torch.zeros_like(out))


def test_a_single_stage_forward_and_backward_is_plain_training(solo):
    model, reference = script.make_model(), script.make_model()
    pipe = gradstar.Pipeline(model, solo, num_microbatches=3)
    x, y = script.batch(0, 10)
    out = pipe.forward(x)
    assert out.requires_grad and out.grad_fn is None  # a leaf: the loss's graph ends here
    assert pipe.live_activations == 3
    loss = torch.nn.functional.mse_loss(out, y)
    (grad,) = torch.autograd.grad(loss, out)
    with pytest.raises(errors.ConfigurationError, match=r"grad_outputs has shape \(9, 3\), "
                                                        r"forward\(\) returned \(10, 3\)"):
        pipe.backward(grad[:9])
    with pytest.raises(errors.ConfigurationError, match="stage 0 is the last stage: pass "
                                                        "grad_outputs="):
        pipe.backward()
    pipe.backward(grad)  # the refused calls kept the forward's micro-batches
    torch.nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert pipe.live_activations == 0
    with pytest.raises(errors.ConfigurationError, match="backward\\(\\) needs a forward"):
        pipe.backward(grad)
    # A forward that is never backwarded is dropped by the next call.
    pipe.forward(x)
    pipe.step(inputs=x, targets=y, loss_fn=torch.nn.functional.mse_loss)
    assert pipe.live_activations == 0


def test_a_batch_smaller_than_the_micro_batch_count_is_a_configuration_error(solo):
    pipe = gradstar.Pipeline(script.make_model(), solo, num_microbatches=4)
    x, y = script.batch(0, 3)
    with pytest.raises(errors.ConfigurationError, match="a batch of 3 rows cannot be split "
                                                        "into 4 micro-batches"):
        pipe.step(inputs=x, targets=y, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(errors.ConfigurationError, match="cannot be split"):
        pipe.forward(x)


def test_the_last_stage_needs_a_loss_function_and_a_stage_returns_one_tensor(solo):
    x, y = script.batch(0, 8)
    pipe = gradstar.Pipeline(script.make_model(), solo, num_microbatches=2)
    with pytest.raises(errors.ConfigurationError, match="pass loss_fn="):
        pipe.step(inputs=x, targets=y)
    with pytest.raises(errors.ConfigurationError, match="batch dimension"):
        pipe.forward(torch.tensor(1.0))

    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(errors.ConfigurationError, match="returns one tensor"):
        gradstar.Pipeline(Pair(), solo, num_microbatches=2).forward(x)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_microbatches": 0}, "positive int"),
    ({"num_microbatches": True}, "positive int"),
    ({"num_microbatches": 2, "schedule": "interleaved"}, "unknown pipeline schedule"),
])
def test_invalid_pipeline_settings_are_refused(solo, kwargs, match):
    with pytest.raises(errors.ConfigurationError, match=match):
        gradstar.Pipeline(script.make_model(), solo, **kwargs)


def test_a_stage_on_another_device_is_refused_naming_the_device(solo):
    with pytest.raises(errors.ConfigurationError) as raised:
        gradstar.Pipeline(script.make_model().to("meta"), solo, num_microbatches=2)
    assert str(raised.value) == ("Pipeline runs on the CPU or a CUDA device; parameter 0.0.weight "
                                 "is on meta: move the module to one of them first")
    with pytest.raises(errors.ConfigurationError, match=r"Pipeline wraps a torch\.nn\.Module, "
                                                        r"got function"):
        gradstar.Pipeline(lambda x: x, solo, num_microbatches=2)


def test_a_pipeline_needs_the_blocking_process_group():
    with pytest.raises(errors.ConfigurationError, match="needs the blocking ProcessGroup"):
        gradstar.Pipeline(script.make_model(), object(), num_microbatches=2)

"""FullyShardedDataParallel with 4 and 2 real rank processes, proved against one process.

One launch of ``fsdp_script.py`` (4 processes and a real coordinator) plays every scenario,
first as a 4-rank job, then ranks 0 and 1 as a 2-rank job; each test below checks one scenario
against a reference trained here, in this process, on the whole batch with the same code. The
ranks start from different random inits (seeded by rank), so agreeing with the reference also
proves the construction broadcast.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gradstar.client.fsdp.state_dict import full_state_dict_from_shards

from . import fsdp_script as script
from .conftest import run_world

# float32 training: the hub sums ranks in arrival order and each rank's rows in another order
# than the whole batch, so results agree to rounding, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6
SCENARIOS = {  # world size: scenarios, played in this order
    4: ["sgd", "adam", "no_prefetch", "mixed", "wire_int8", "nested", "checkpoint", "sharded",
        "staged", "memory", "sync_by_hand", "no_sync", "sync_after_backward", "into_inner"],
    2: ["sgd", "adam", "nested", "plan_mismatch", "diverged", "rank_death"],
}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def runs(out_dir) -> dict[tuple[int, str], list[dict]]:
    """{(world size, scenario): [report of rank 0, ...]} from one launch."""
    groups = [f"{world}:{','.join(names)}" for world, names in SCENARIOS.items()]
    reports = asyncio.run(run_world(script.SCRIPT, 4, "fsdp", str(out_dir), *groups,
                                    timeout=150))
    found: dict[tuple[int, str], list[dict]] = {}
    for rank, lines in enumerate(reports):
        for line in lines:
            assert line["rank"] == rank
            assert "fatal" not in line, line
            found.setdefault((line["world"], line["scenario"]), []).append(line)
    assert sorted(found) == sorted((w, name) for w, names in SCENARIOS.items() for name in names)
    assert all(len(found[key]) == key[0] for key in found)
    return found


def reference(model: torch.nn.Module, kind: str, **train) -> torch.nn.Module:
    script.train(model, script.optimizer(kind, model.parameters()), 0, 1, **train)
    return model


def assert_state_dicts_match(reports: list[dict], want: dict, rtol=RTOL, atol=ATOL):
    """Every rank's full_state_dict equals ``want``: the same keys in the same order, values."""
    expected = script.listed(want)
    for report in reports:
        got = report["state_dict"]
        assert list(got) == list(expected)
        for key, values in expected.items():
            np.testing.assert_allclose(got[key], values, rtol=rtol, atol=atol,
                                       err_msg=f"rank {report['rank']}, {key}")


def test_ranks_start_from_different_inits():
    # Otherwise the equivalence tests would not prove the construction broadcast.
    a, b = script.MLP(0).state_dict(), script.MLP(1).state_dict()
    assert all(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_training_matches_one_process_on_the_whole_batch(runs, world, kind):
    assert_state_dicts_match(runs[world, kind], reference(script.MLP(0), kind).state_dict())


def test_unit_sizes_do_not_divide_by_the_world_size_and_are_padded(runs):
    units = runs[4, "sgd"][0]["units"]
    assert [name for name, _, _ in units] == ["", "fc1", "fc2", "fc3", "fc4"]  # root: scale
    assert all(numel % 4 for _, numel, _ in units)
    assert all(padded % 4 == 0 and 0 < padded - numel < 4 for _, numel, padded in units)
    assert all(numel % 2 == 0 for _, numel, _ in units[1:])  # with 2 ranks only the root pads
    assert runs[2, "sgd"][0]["units"][0] == ["", 3, 4]


def test_parameters_and_optimizer_state_are_sharded(runs):
    units = runs[4, "adam"][0]["units"]
    for report in runs[4, "adam"]:
        # Each rank holds a quarter of every padded unit, and Adam two states per element.
        assert report["shard_numels"] == [padded // 4 for _, _, padded in units]
        assert report["optimizer_state_numel"] == 2 * sum(report["shard_numels"])


def test_each_unit_is_gathered_around_its_forward_and_reduced_once_per_backward(runs):
    for report in runs[4, "sgd"]:
        calls = [tuple(c) for c in report["collectives"]]  # the last step's, in issue order
        forward = [c for c in calls if c[2].startswith("forward")]
        # The root first (it encloses the others), then each unit with the next prefetched.
        assert forward == [("all_gather", 0, "forward", "float32")] + [
            ("all_gather", u, "forward prefetch", "float32") for u in (1, 2, 3, 4)]
        assert sorted(u for op, u, _, _ in calls if op == "reduce_scatter") == [0, 1, 2, 3, 4]
        # Backward gathers what it needs again: not fc1 (unit 1), whose input needs no
        # gradient, so autograd saved no weight of it.
        again = [u for op, u, during, _ in calls
                 if op == "all_gather" and during.startswith("backward")]
        assert sorted(again) == [0, 2, 3, 4]
        assert any(during == "backward prefetch" for _, _, during, _ in calls)
        # Freed after forward and after backward: never more than the root and two units.
        assert report["peak_gathered_numel"] == 4 + 132 + 240


def test_without_prefetch_one_unit_at_a_time_and_the_same_result(runs):
    assert_state_dicts_match(runs[4, "no_prefetch"],
                             reference(script.MLP(0), "adam").state_dict())
    for report in runs[4, "no_prefetch"]:
        assert not any("prefetch" in during for _, _, during, _ in report["collectives"])
        assert report["peak_gathered_numel"] == 4 + 240  # the root and the largest unit


def test_mixed_precision_is_within_bf16_tolerance_of_float32(runs):
    reports = runs[4, "mixed"]
    for report in reports:
        assert {dtype for *_, dtype in report["collectives"]} == {"bfloat16"}
        assert report["shard_dtypes"] == ["torch.float32"]
        assert report["optimizer_dtypes"] == ["torch.float32"]
    exact = reference(script.MLP(0), "momentum").state_dict()
    # bf16 keeps 8 bits of mantissa: parameters and gradients are off by up to ~0.4% per
    # step; after 5 momentum steps of lr 0.1 the parameters stay within ~1e-3 of float32.
    assert_state_dicts_match(reports, exact, rtol=1e-2, atol=2e-3)
    # ... and the bf16 rounding was real: float32 training lands elsewhere.
    got = reports[0]["state_dict"]
    assert any(not np.allclose(got[k], script.listed(exact)[k], rtol=1e-6, atol=1e-7)
               for k in exact)
    assert all(r["state_dict"] == got for r in reports)


def test_int8_reduce_scatter_is_within_the_int8_bound_of_float32(runs):
    reports = runs[4, "wire_int8"]
    assert all(r["wire"] == "int8" for r in reports)
    exact = reference(script.MLP(0), "momentum").state_dict()
    # An int8 round trip is off by up to amax/254 of a block of 64 (on the way in and once on
    # the way back); after 5 momentum steps of lr 0.1 the parameters stay within ~2e-3.
    assert_state_dicts_match(reports, exact, rtol=1e-2, atol=3e-3)
    got = reports[0]["state_dict"]
    assert any(not np.allclose(got[k], script.listed(exact)[k], rtol=1e-6, atol=1e-7)
               for k in exact)  # the format was really used
    assert all(r["state_dict"] == got for r in reports)


@pytest.mark.parametrize("world", [2, 4])
def test_nested_units_tied_weight_frozen_unit_and_buffer_match_one_process(runs, world):
    reports = runs[world, "nested"]
    assert [name for name, _, _ in reports[0]["units"]] == [
        "", "embed", "frozen", "blocks.0", "blocks.0.inner", "blocks.1", "blocks.1.inner",
        "head", "out"]
    # The tied weight sits in the root, the common enclosing unit of head and out.
    assert reports[0]["units"][0][1] == 7 * 7
    want = reference(script.NestedNet(0), "adam").state_dict()
    assert want["offset"].eq(0).all()  # rank 0's buffer: the construction broadcast
    assert_state_dicts_match(reports, want)
    frozen = script.NestedNet(0).frozen.state_dict()
    assert script.listed(frozen)["weight"] == reports[0]["state_dict"]["frozen.weight"]


def test_the_staged_path_of_cuda_tensors_matches_one_process_on_cpu(runs):
    # The CPU declared a staged device: shards, gathers, reductions and broadcasts travel as a
    # CUDA tensor's would, and neither training nor a checkpoint's round trip may notice.
    reports = runs[4, "staged"]
    assert all(r["staged"] and r["reloaded_outputs_equal"] for r in reports)
    assert_state_dicts_match(reports, reference(script.NestedNet(0), "adam").state_dict())


def test_full_checkpoint_loads_into_a_plain_model_and_back(runs, out_dir):
    reports = runs[4, "checkpoint"]
    first = reports[0]
    assert all(r["rank0_only_elsewhere_empty"] for r in reports)
    # The plain model loaded from FSDP's checkpoint computes exactly what FSDP computes, and
    # so does a fresh FSDP (another init) after load_full_state_dict.
    assert first["plain_out"] == first["fsdp_out"]
    assert all(r["fsdp_out"] == first["fsdp_out"] == r["reloaded_out"] for r in reports)
    assert first["reloaded_state_equal"]
    saved = torch.load(out_dir / "full.pt", weights_only=True)
    want = reference(script.MLP(0), "sgd").state_dict()
    assert list(saved) == list(want)
    for key in want:
        torch.testing.assert_close(saved[key], want[key], rtol=RTOL, atol=ATOL)
    # Training resumes from the loaded state as a plain model would from the file.
    plain = script.MLP(99)
    plain.load_state_dict(saved)
    assert_state_dicts_match([{"rank": r["rank"], "state_dict": r["after_reload_step"]}
                              for r in reports],
                             reference(plain, "sgd", steps=1).state_dict())


def test_a_bad_checkpoint_is_refused_on_every_rank(runs):
    first, *others = runs[4, "checkpoint"]
    assert first["bad_checkpoint"] == (
        "load_full_state_dict: the state dict does not fit the wrapped module: missing keys "
        "['fc2.bias']; fc1.weight has shape (2, 2), the module's is (9, 5). Nothing was loaded")
    assert all(r["bad_checkpoint"] == (
        "load_full_state_dict: rank 0 found 2 problem(s) in the state dict it was given (its "
        "error lists them). Nothing was loaded") for r in others)


def test_sharded_checkpoints_merge_into_the_full_state_and_load_back(runs, out_dir):
    shards = [torch.load(out_dir / f"sharded-{rank}.pt", weights_only=True)
              for rank in (2, 0, 3, 1)]
    merged = full_state_dict_from_shards(shards)
    want = reference(script.NestedNet(0), "adam").state_dict()
    assert list(merged) == list(want)  # tied aliases included, in state_dict order
    for key in want:
        torch.testing.assert_close(merged[key], want[key], rtol=RTOL, atol=ATOL)
    # Each rank's file holds about a quarter of the parameters.
    total = sum(math.prod(e["shape"]) for e in shards[0]["params"].values())
    for shard in shards:
        held = sum(e["values"].numel() for e in shard["params"].values())
        assert held <= total / 4 + 4 * len(shard["params"])
    for report in runs[4, "sharded"]:
        assert report["reloaded_outputs_equal"]
        assert report["wrong_rank"].startswith(
            f"this sharded state dict was saved by rank {(report['rank'] + 1) % 4} of 4; rank "
            f"{report['rank']} of 4 needs its own")


def test_per_rank_storage_is_a_quarter_of_the_unsharded_model(runs):
    """Bytes of parameter, gradient and optimizer storage held between steps, counted the
    same way for one unsharded process (here) and for each of 4 FSDP ranks."""
    model = script.memory_model(0)
    opt = script.optimizer("adam", model.parameters())
    width = script.MEMORY_WIDTH
    script.train(model, opt, 0, 1, steps=2, width=width, out=width)
    unsharded = script.storage_bytes(script.held_tensors(model, opt))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert unsharded > 4 * model_bytes  # parameters, gradients and Adam's two states
    for report in runs[4, "memory"]:
        largest = max(numel for _, numel, _ in report["units"])
        assert largest * 4 < 0.1 * model_bytes
        assert report["held_bytes"] <= 0.3 * unsharded
        # Nothing else in the rank process holds tensors between steps (no gathered copy).
        assert report["live_bytes"] <= 0.3 * unsharded
        # Gathered at once: the running unit and the prefetched one.
        assert report["peak_gathered_numel"] <= 2 * max(p for _, _, p in report["units"])


def test_different_plans_are_refused_on_every_rank(runs):
    for report in runs[2, "plan_mismatch"]:
        structure, precision, wire = report["errors"]
        assert structure.startswith("rank 1's FSDP sharding plan differs from rank 0's (5 units "
                                    "of 506 parameter elements against 5 units of 479)")
        assert precision.startswith("rank 1's FSDP sharding plan differs from rank 0's (as many "
                                    "units and elements, but other parameter names")
        assert "same auto_wrap_policy and mixed_precision" in precision
        assert wire.startswith("rank 1's FSDP sharding plan differs from rank 0's (as many "
                               "units and elements, but other parameter names")
        assert wire.endswith("and mixed_precision, and the same wire")


def test_ranks_that_diverge_get_a_mismatch_error_not_a_hang(runs):
    for report in runs[2, "diverged"]:
        assert report["error"]["type"] == "CollectiveMismatchError"
        message = report["error"]["message"]
        assert "all_gather" in message and "broadcast" in message and "rank 0" in message


def test_a_lost_rank_is_named_by_the_survivor_not_a_hang(runs):
    survivor, dead = runs[2, "rank_death"]
    assert dead == {"scenario": "rank_death", "world": 2, "rank": 1, "died": True}
    assert survivor["error"] == "RankLostError"
    assert survivor["lost"] == 1
    assert survivor["message"].startswith("rank 1 of job 'fsdp-2' was lost")


# -- driving FSDP by hand: no_sync, sync_gradients, into_inner ---------------------------------


def micro_reference(kind: str) -> dict:
    model = script.MLP(0)
    script.train_micro(model, script.optimizer(kind, model.parameters()), 0, 1)
    return model.state_dict()


UNITS = [0, 1, 2, 3, 4]


def test_sync_gradients_after_no_sync_backwards_matches_one_process(runs):
    reports = runs[4, "sync_by_hand"]
    assert_state_dicts_match(reports, micro_reference("adam"))
    # The backwards inside no_sync() reduced nothing; sync_gradients() reduced every unit once,
    # and its second call found nothing left.
    for report in reports:
        assert report["reductions"] == [[[u, "sync_gradients"] for u in UNITS]] * script.STEPS


def test_a_synchronising_backward_after_no_sync_reduces_the_kept_gradients_with_its_own(runs):
    reports = runs[4, "no_sync"]
    assert_state_dicts_match(reports, micro_reference("adam"))
    for report in reports:
        for step in report["reductions"]:
            assert sorted(u for u, _ in step) == UNITS and {d for _, d in step} == {"backward"}


def test_sync_gradients_after_a_synchronising_backward_is_a_no_op(runs):
    reports = runs[4, "sync_after_backward"]
    assert_state_dicts_match(reports, reference(script.MLP(0), "sgd").state_dict())
    for report in reports:
        assert not any(during == "sync_gradients" for _, _, during, _ in report["collectives"])


def test_into_inner_gives_the_plain_module_back_with_its_full_trained_parameters(runs):
    plain = script.NestedNet(0)
    want = reference(script.NestedNet(0), "adam").state_dict()
    for report in runs[4, "into_inner"]:
        assert report["plain_parameters"] and report["tied"] and report["frozen"] == [False] * 2
        assert report["names"] == [name for name, _ in plain.named_parameters()]
        assert_state_dicts_match([report], want)
        np.testing.assert_allclose(report["plain_out"], report["fsdp_out"], rtol=1e-6, atol=1e-7)
        assert report["forward_after"] == (
            "FSDP.forward() after into_inner(): the module was taken back; use the module "
            "into_inner() returned")
    # The plain module trains on as the reference does.
    trained = reference(script.NestedNet(0), "adam")
    script.train(trained, script.optimizer("sgd", trained.parameters()), 0, 1, steps=1)
    assert_state_dicts_match([{"rank": r["rank"], "state_dict": r["after_plain_step"]}
                              for r in runs[4, "into_inner"]], trained.state_dict())

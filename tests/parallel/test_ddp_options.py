"""DDP's torch options with 4 real rank processes, proved against single-process training:
gradient_as_bucket_view, static_graph, delay_all_reduce, bucket_cap_mb assigned during training
(and on some ranks only), broadcast_parameters(src).

One run of ``ddp_options_script.py`` (4 ranks, a real coordinator) plays every scenario; each
test checks one against a reference trained here on the whole batch with the same code.
"""

from __future__ import annotations

import asyncio

import pytest
from torch import nn

from . import ddp_options_script as script
from . import ddp_script as base
from .conftest import reports_by_scenario, run_world
from .test_ddp import INT8_EF_BOUND, assert_params_match, drift, reference_mlp

WORLD = 4


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """{scenario: [report of rank 0, ..., rank 3]} from one 4-rank run of every scenario."""
    reports = asyncio.run(run_world(script.SCRIPT, WORLD, "ddp-options", timeout=110))
    return reports_by_scenario(reports, script.SCENARIOS, WORLD)


def reference(kind: str, steps: int = script.STEPS) -> nn.Module:
    model = base.make_mlp(0)
    base.train_plain(model, base.optimizer(kind, model.parameters()), 0, 1, steps=steps)
    return model


def static_reference() -> nn.Module:
    """One process, whole batch: the mean of the quarters' losses, ranks 0 and 1 with the
    branch."""
    model = base.BranchNet(0)
    opt = base.optimizer("adam", model.parameters())
    for step in range(script.STEPS):
        opt.zero_grad()
        (sum(script.static_loss(model, step, r, WORLD) for r in range(WORLD)) / WORLD).backward()
        opt.step()
    return model


# -- gradient_as_bucket_view -------------------------------------------------------------------


def test_bucket_views_with_zero_grad_keeping_tensors_match_one_process(runs):
    reports = runs["view_keep"]
    assert all(r["views"] and r["buckets"] >= 3 for r in reports)
    assert_params_match(reports, reference("sgd"))


def test_bucket_views_with_zero_grad_set_to_none_match_one_process(runs):
    # Each step autograd allocates new gradients; they are copied in and replaced by views.
    reports = runs["view_none"]
    assert all(r["views"] for r in reports)
    assert_params_match(reports, reference("adam"))


def test_bucket_views_accumulate_over_no_sync_steps(runs):
    reports = runs["view_no_sync"]
    assert all(r["views"] for r in reports)
    assert_params_match(reports, reference_mlp("sgd", micro_steps=2))


def test_bucket_views_with_unused_parameters_keep_none_where_nobody_has_one(runs):
    reports = runs["view_unused"]
    assert all(r["none_when_unused"] for r in reports)
    assert_params_match(reports, base.branch_reference())


def test_bucket_views_with_int8_and_error_feedback_stay_within_the_bound(runs):
    reports = runs["view_int8"]
    assert all(r["views"] for r in reports)
    assert all(r["params"] == reports[0]["params"] for r in reports)  # identical replicas
    wire_reference = reference("sgd", steps=base.WIRE_STEPS)
    assert 0 < drift(reports, wire_reference) < INT8_EF_BOUND


def test_bucket_views_on_the_staged_path_of_cuda_tensors_match_one_process(runs):
    reports = runs["view_staged"]
    assert all(r["views"] and r["staged"] for r in reports)
    assert_params_match(reports, reference("sgd"))


# -- static_graph ------------------------------------------------------------------------------


def test_static_graph_matches_one_process(runs):
    assert_params_match(runs["static"], static_reference())
    assert_params_match(runs["unused_found"], static_reference())


def test_static_graph_launches_unused_parameters_buckets_during_backward(runs):
    # Bucket 0 holds the branch (reverse registration order). Ranks 2 and 3 never use it: found
    # at the end of backward it holds every bucket back; with static_graph it is ready from the
    # second step on, so buckets launch from the gradient hooks again.
    for rank in (2, 3):
        found = runs["unused_found"][rank]["steps"]
        static = runs["static"][rank]["steps"]
        assert all(s["in_backward"] == 0 for s in found), found
        assert static[0]["in_backward"] == 0  # the first step learns
        assert all(s["in_backward"] >= 1 for s in static[1:]), static


def test_static_graph_keeps_none_for_a_parameter_no_rank_uses(runs):
    reports = runs["static_unused_everywhere"]
    assert all(r["branch_none"] for r in reports)
    want = base.params_of(base.BranchNet(0))
    for r in reports:  # Adam never touched the branch: None gradients are skipped
        assert r["params"]["branch.weight"] == want["branch.weight"]


def test_a_static_graph_that_changes_is_a_named_error_on_the_ranks_that_changed(runs):
    by_rank = runs["static_changed"]
    for rank in (0, 2):  # rank 0 stopped using the branch, rank 2 started
        r = by_rank[rank]
        assert r["error"] == "ConfigurationError" and r["step"] == 1, r
        assert r["message"].startswith(
            f"static_graph=True, but the parameters rank {rank} used in this backward pass "
            "differ from its first step's: branch.weight, branch.bias."), r["message"]
        assert r["seconds"] < 20  # answered by the step itself, not a timeout
    assert by_rank[1]["error"] is None and by_rank[3]["error"] is None


# -- delay_all_reduce --------------------------------------------------------------------------


def test_delay_all_reduce_launches_every_bucket_after_backward_and_matches(runs):
    reports = runs["delayed"]
    assert_params_match(reports, reference("sgd"))
    for r in reports:
        for step in r["steps"]:
            assert step["buckets"] >= 3 and step["in_backward"] == 0
            assert set(step["during"]) == {"end of backward"}
            assert step["first_launch_after_backward"]


# -- bucket_cap_mb after construction ----------------------------------------------------------


@pytest.mark.parametrize("scenario", ["cap_change", "cap_change_views"])
def test_bucket_cap_changes_mid_training_rebuild_the_plan_and_match_one_process(runs, scenario):
    reports = runs[scenario]
    want = reference("adam")
    assert_params_match(reports, want)
    for r in reports:
        buckets = [s["buckets"] for s in r["steps"]]
        # The buckets each step launched: assigned before steps 2 and 4; every rank's "I
        # assigned one" travels with those steps, the values with the next, which rebuilds the
        # buckets when it completes.
        small, one, tiny = buckets[0], buckets[4], buckets[6]
        assert small >= 3 and one == 1 and tiny > small, buckets
        assert buckets == [small, small, small, small, one, one, tiny], buckets
        assert r["bucket_cap_mb"] == script.CAP_CHANGES[4]
        assert r["views"] in (None, True)


def test_a_bucket_cap_changed_on_one_rank_is_a_named_error_on_every_rank(runs):
    reports = runs["cap_mismatch"]
    for r in reports:
        (error,) = r["errors"]
        assert error["step"] == 1
        mine = "assigned 1 MB" if r["rank"] == 0 else "kept 0.000762939 MB"
        assert error["message"] == (
            "some ranks assigned bucket_cap_mb before this step and others did not (rank "
            f"{r['rank']} {mine}); every rank keeps its buckets of 0.000762939 MB. Assign the "
            "same bucket_cap_mb on every rank between the same two steps")
        assert error["seconds"] < 20
        # Refused everywhere: the plan and the value stay what they were.
        assert r["buckets"] == reports[0]["buckets"] >= 3
        assert r["bucket_cap_mb"] == base.SMALL_BUCKET_MB
    # The step's means were written, so training went on in step with one process.
    assert_params_match(reports, reference("adam"))


def test_bucket_caps_assigned_to_different_values_are_a_named_error_on_every_rank(runs):
    reports = runs["cap_values_differ"]
    for r in reports:
        (error,) = r["errors"]
        assert error["step"] == 2  # the values are compared at the step after the assignment
        assert error["message"] == (
            "the ranks asked for different bucket caps at this step: from 1 to 2 MB (rank "
            f"{r['rank']}: {2 if r['rank'] == 0 else 1} MB); every rank keeps its buckets of "
            "0.000762939 MB. Assign the same bucket_cap_mb on every rank between the same two "
            "steps")
        assert r["buckets"] == reports[0]["buckets"] >= 3
        assert r["bucket_cap_mb"] == base.SMALL_BUCKET_MB
        assert r["params"] == reports[0]["params"]  # the replicas stayed identical


# -- broadcast_parameters(src) -----------------------------------------------------------------


def test_broadcast_parameters_from_any_rank_overwrites_parameters_and_buffers(runs):
    reports = runs["broadcast_src"]
    for r in reports:
        assert r["bad_src"] == "broadcast_parameters(src=4): src must be a rank, 0 to 3"
        assert r["running_mean"] == [2.0] * base.HIDDEN
        for name, values in r["params"].items():
            # Rank 0's init (construction), plus 2.0 added by rank 2 before the broadcast.
            assert values == reports[0]["params"][name]
    # Rank r added r to rank 0's init (handed out by the construction): rank 2's values won.
    init = base.params_of(base.make_bn_mlp(0))
    for name, values in reports[0]["params"].items():
        assert values == pytest.approx([v + 2.0 for v in init[name]], abs=1e-6)

"""PyTorch's own distributed test suite over backend "gradstar", next to gloo: a fast subset of
``scripts/torch_suite.py`` (``make torch-suite`` runs all of it), and the runner's own parts.

The subset is one test from each family that exercises something different in the backend:
reductions and their profiler events, broadcast, coalesced gathers, reduce, point-to-point (by
rank, from any rank, with profiling), a new_group's 1 s timeout, DDP, the backend's name and the
group's own monitored_barrier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import torch_suite

SUBSET = [
    "test_all_reduce_sum",
    "test_broadcast",
    "test_all_gather_coalesced_simple",
    "test_reduce_sum",
    "test_send_recv_autograd_profiler",
    "test_send_recv_any_source",
    "test_barrier_timeout_full_group",
    "test_accumulate_gradients_no_sync",
    "test_get_backend",
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_sparse_all_reduce_sum",
]
pytestmark = pytest.mark.timeout(400)


def test_gradstar_passes_every_test_of_the_subset_that_gloo_passes(tmp_path):
    out = tmp_path / "results.json"
    run = subprocess.run(
        [sys.executable, torch_suite.__file__, "--world-sizes", "2", "--json", str(out),
         "--test-timeout", "60", "--timeout", "300", "--tests", *SUBSET],
        capture_output=True, text=True, timeout=360)
    results = json.loads(out.read_text())["2"]
    # Every test of the subset runs on the CPU under gloo: a skip would hide gradstar's result.
    assert {t: r["status"] for t, r in results["gloo"].items()} == dict.fromkeys(
        SUBSET, "pass"), run.stdout + run.stderr[-3000:]
    failed = {t: r["error"] for t, r in results["gradstar"].items() if r["status"] != "pass"}
    assert not failed, run.stdout
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    n = len(SUBSET)
    assert f"| **all** | {n} | {n}/{n} | {n}/{n} |  |" in run.stdout


# -- the runner's parts (no processes) ---------------------------------------------------------


@pytest.mark.parametrize(("test", "family"), [
    ("test_all_reduce_sum_async", "all_reduce"),
    ("test_all_reduce_coalesced_max", "all_reduce_coalesced"),
    ("test_reduce_sum", "reduce"),
    ("test_reduce_scatter_tensor_cuda", "reduce_scatter_tensor"),
    ("test_monitored_barrier_gloo_subgroup", "monitored_barrier"),
    ("test_barrier_timeout_global", "barrier_timeout"),
    ("test_barrier", "barrier"),
    ("test_ddp_comm_hook_logging", "ddp"),
    ("test_Backend_enum_class", "Backend"),
])
def test_tests_are_grouped_by_family(test, family):
    assert torch_suite.family(test) == family


def test_a_failure_is_reported_by_its_first_ranks_exception_line():
    message = (
        "RuntimeError: Process 0 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    g()\n"
        "gradstar.errors.CollectiveTimeoutError: [Rank 0] Timed out after 1 s: barrier\n"
        "\nProcess 1 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\nValueError: something else\n")
    assert torch_suite.first_error_line(message) == (
        "gradstar.errors.CollectiveTimeoutError: [Rank 0] Timed out after 1 s: barrier")
    assert torch_suite.first_error_line(
        "Traceback (most recent call last):\nAssertionError: Scalars are not equal!\n\n"
        "Expected 1 but got 0.\nAbsolute difference: 1\n") == (
        "AssertionError: Scalars are not equal!")
    assert torch_suite.first_error_line("Process 0 terminated or timed out after 60 s") == (
        "Process 0 terminated or timed out after 60 s")


def test_the_stand_in_is_gradstar_to_torch_and_gloo_to_the_suites_branches():
    backend = torch_suite.GlooStandIn("gradstar")
    assert backend == "gradstar" and backend == "gloo" and backend != "nccl"
    assert not backend != "gloo"
    assert backend.lower() == "gradstar" and backend.upper() == "GRADSTAR"


REFUSED = "ValueError: monitored_barrier is only implemented for GLOO backend."


def test_the_report_lists_what_gloo_passes_and_gradstar_fails(capsys):
    results = {2: {
        "gloo": {"test_a": {"status": "pass", "error": "", "seconds": 1},
                 "test_monitored_barrier_gloo": {"status": "pass", "error": "", "seconds": 1},
                 "test_b": {"status": "skip", "error": "needs CUDA", "seconds": 0}},
        "gradstar": {"test_a": {"status": "fail", "error": "ValueError: no", "seconds": 1},
                     "test_monitored_barrier_gloo": {"status": "fail", "error": REFUSED,
                                                     "seconds": 1},
                     "test_b": {"status": "skip", "error": "needs CUDA", "seconds": 0}}}}
    assert torch_suite.report(results, ["gloo", "gradstar"]) == 1  # test_a is unexplained
    out = capsys.readouterr().out
    assert "| a | 1 | 1/1 | 0/1 |  |" in out
    assert "| b | 1 | skipped | skipped |  |" in out
    assert "- 2 ranks: test_a: ValueError: no" in out
    assert f"- 2 ranks: test_monitored_barrier_gloo [gloo-only]: {REFUSED}" in out
    del results[2]["gloo"]["test_a"], results[2]["gradstar"]["test_a"]
    assert torch_suite.report(results, ["gloo", "gradstar"]) == 0  # only gloo-only failures
    # A monitored_barrier test failing for another reason than torch's refusal counts.
    results[2]["gradstar"]["test_monitored_barrier_gloo"]["error"] = "AssertionError: no"
    assert torch_suite.report(results, ["gloo", "gradstar"]) == 1

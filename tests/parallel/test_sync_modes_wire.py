"""gradstar.DDP in sync modes with a compressed wire format (error feedback on), 4 real rank
processes and a real coordinator: replicas end bitwise identical and equal a one-process replay
of the hub's record where each contribution is ``roundtrip(fmt, g + residual)`` and each
aggregate ``roundtrip(fmt, weighted mean)``; a contribution the hub drops leaves the rank's
residual as it was before it (the drop rule), and each rank's residual is the replay's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from . import sync_modes_script as script
from .test_sync_modes import WORLD, assert_identical_and_replayed, record, run_modes


def assert_residuals(reports: dict[int, dict], replayed: dict) -> None:
    """Each rank's residual after its last contribution is the replay's (of its accepted ones
    only: the dropped ones left it as it was)."""
    for rank, report in reports.items():
        last = report["contributions"][-1]["residual"]
        np.testing.assert_allclose(last, replayed[rank].numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=f"rank {rank}'s residual")


@pytest.fixture(scope="module")
def quorum_int8() -> dict[int, dict]:
    # Rank 3 is slow: its gradients arrive after the other three closed their steps.
    return asyncio.run(run_modes("quorum", "--min-ranks", "3", "--timeout", "0.02",
                                 "--delays", "0,0,0,0.3", "--steps", "10", "--wire", "int8"))


def test_quorum_int8_replicas_identical_and_equal_the_rounded_replay(quorum_int8):
    replayed = assert_identical_and_replayed(quorum_int8, wire="int8")
    assert_residuals(quorum_int8, replayed)
    assert all(s == 0 for step in record(quorum_int8) for s in step["staleness"])


def test_a_dropped_contribution_leaves_the_residual_as_it_was_before_it(quorum_int8):
    slow = quorum_int8[3]["contributions"]
    dropped = [i for i, c in enumerate(slow) if c["step"] is None]
    assert dropped, "the slow rank's gradients were all taken: nothing was dropped"
    for i in dropped:
        before = slow[i - 1]["residual"] if i else None
        assert slow[i]["residual"] == before, f"contribution {i} changed the residual"
    taken = [i for i, c in enumerate(slow) if c["step"] is not None]
    assert taken and slow[taken[0]]["residual"] is not None  # an accepted one sets it
    assert any(max(map(abs, slow[i]["residual"])) > 0 for i in taken)


def test_asynchronous_bf16_weighted_contributions_equal_the_rounded_replay():
    # The push rule (timeout 0): a step closes without waiting for the slower ranks, whose
    # gradients are then carried into later steps, late (by default they would be waited for).
    reports = asyncio.run(run_modes("async", "--delays", "0,0.01,0.02,0.05", "--timeout", "0",
                                    "--weights", "1,2,3,0.5", "--steps", "8", "--wire", "bf16"))
    replayed = assert_identical_and_replayed(reports, wire="bf16")
    assert_residuals(reports, replayed)
    weights = {r: w for s in record(reports)
               for r, w in zip(s["ranks"], s["weights"], strict=True)}
    assert weights == {0: 1.0, 1: 2.0, 2: 3.0, 3: 0.5}
    assert sum(len(s["ranks"]) for s in record(reports)) == WORLD * 8  # none dropped
    # Some gradients were taken late (carried): their residuals counted as sent.
    assert any(s > 0 for step in record(reports) for s in step["staleness"])


def test_asynchronous_int8_replicas_identical_and_equal_the_rounded_replay():
    reports = asyncio.run(run_modes("async", "--delays", "0,0.02,0.01,0.04", "--steps", "8",
                                    "--wire", "int8"))
    replayed = assert_identical_and_replayed(reports, wire="int8")
    assert_residuals(reports, replayed)
    float32 = script.params_of(script.replay(
        {r: reports[r]["contributions"] for r in reports}, record(reports)))
    assert any(not np.array_equal(reports[0]["params"][k], v) for k, v in float32.items()), (
        "the int8 run trained exactly as float32 would: nothing was rounded")


def test_a_restarted_rank_joins_with_a_zero_residual_and_ends_identical(tmp_path):
    # As test_sync_modes' restart, in int8: the new process starts from the hub's snapshot
    # and a zero residual (the replay resets its rank's residual where its iterations restart).
    reports = asyncio.run(run_modes("quorum", "--min-ranks", "3", "--timeout", "0.0",
                                    "--delays", "0.3,0.3,0.3,0.3", "--steps", "30",
                                    "--wire", "int8",  # before --stop-*: the restart keeps it
                                    "--await-replacement", str(tmp_path / "joined"),
                                    "--stop-rank", "3", "--stop-at", "3", "--stop-how", "kill",
                                    stopped=3, restart=True, timeout=150))
    assert reports[3]["replacement"]
    replayed = assert_identical_and_replayed(reports, wire="int8")
    assert_residuals(reports, replayed)
    second_life = reports[3]["contributions"][3:]
    assert second_life[0]["iteration"] == 0 and second_life[0]["base"] > 3

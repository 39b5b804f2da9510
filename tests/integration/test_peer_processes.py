"""all_to_all, receives from any source and receives from a rank that finished, in real rank
processes (rank_script.py) against a real coordinator on 127.0.0.1:0."""

from __future__ import annotations

import json

from gradstar.client import session

from .conftest import finish, spawn_ranks


async def reports(scenario: str, address: str, world: int, job: str) -> list[dict]:
    procs = await spawn_ranks(scenario, address, world, job)
    results = [await finish(p, 120) for p in procs]
    out = []
    for code, stdout, stderr in results:
        assert code == 0, f"rank failed: {stdout}\n{stderr[-3000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(out, key=lambda report: report["rank"])


async def test_uneven_all_to_all_and_mismatched_splits_in_four_processes(coordinator):
    ranks = await reports("uneven_all_to_all", coordinator.address, 4, "a2a-procs")
    for report in ranks:
        assert all(report["checks"].values()), report
    mismatches = {tuple(report["mismatch"]) for report in ranks}
    assert len(mismatches) == 1, mismatches  # the same named error on every rank
    ((name, message),) = mismatches
    assert name == "CollectiveMismatchError"
    assert "rank 0 sends" in message and "but rank 3 expects" in message


async def test_rank_zero_receives_from_three_senders_at_once_in_each_senders_order(
        coordinator):
    report = (await reports("any_source", coordinator.address, 4, "any-procs"))[0]
    assert report["senders_named"]
    assert report["order"] == {str(src): list(range(25)) for src in (1, 2, 3)}
    assert report["others"] == [100, 200, 300]


async def test_receives_from_ranks_that_finished_end_without_waiting_for_the_timeout(
        coordinator):
    report = (await reports("finished_sender", coordinator.address, 3, "finished-procs"))[0]
    assert report["first"] == [0, 1, 2] and report["second"] == [0, 1, 2, 3]
    for name, rank in [("waiting", 1), ("after", 1), ("silent", 2), ("any", 1), ("send", 1)]:
        error, message, named, seconds = report[name]
        assert error == "RankFinishedError", (name, report[name])
        assert named == rank, (name, report[name])
        assert "finished (closed its process group)" in message, (name, message)
        # The goodbye or the hub's notice, not a timeout (60 s) or a guess (VERDICT_GRACE).
        assert seconds < session.VERDICT_GRACE, (name, report[name])
    assert "every other rank of job 'finished-procs' (1, 2) finished" in report["any"][1]

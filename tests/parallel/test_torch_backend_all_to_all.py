"""torch.distributed's all_to_all, all_to_all_single and recv from any source over backend
"gradstar", against the same calls over "gloo": four ranks of ``torch_backend_script.py``
(scenarios ``all_to_all`` and ``recv_any``) per backend, both at once; and on gradstar only,
split sizes that disagree between ranks (gloo aborts the process group on those)."""

from __future__ import annotations

import asyncio

import pytest

from .test_torch_backend import both_backends

WORLD = 4
SCENARIOS = ("all_to_all", "recv_any")
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, dict]]]:
    """{backend: [rank 0's {scenario: report}, ...]}."""
    rendezvous = tmp_path_factory.mktemp("gloo-rendezvous") / "a2a"

    gradstar_reports, gloo_reports = asyncio.run(both_backends(
        WORLD, rendezvous, "a2a", (*SCENARIOS, "all_to_all_errors"), SCENARIOS, 180))
    return {"gradstar": gradstar_reports, "gloo": gloo_reports}


def test_all_to_all_matches_gloo_on_every_rank(runs):
    for rank in range(WORLD):
        got, want = runs["gradstar"][rank]["all_to_all"], runs["gloo"][rank]["all_to_all"]
        assert got == want, {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
    report = runs["gradstar"][1]["all_to_all"]
    # Rank 1 gets (2s + 1) % 3 rows from rank s: 1, 0, 2 and 1 rows from ranks 0..3.
    assert [row[0] // 100 for row in report["single_uneven"]] == [0, 2, 2, 3]
    assert report["list"] == [[[10.0 * src + 1] * 2] * 2 for src in range(WORLD)]


def test_recv_from_any_source_names_each_sender_and_keeps_its_order(runs):
    for backend in ("gradstar", "gloo"):
        report = runs[backend][0]["recv_any"]
        assert report["senders_named"], backend
        assert report["by_sender"] == {str(src): [0.0, 1.0, 2.0] for src in range(1, WORLD)}
        assert report["tagged"] == [[src, [float(src), 9.0]] for src in range(1, WORLD)]


def test_split_sizes_that_disagree_fail_every_rank_with_one_named_error(runs):
    reports = [runs["gradstar"][rank]["all_to_all_errors"] for rank in range(WORLD)]
    # torch prefixes "[Rank N] " to the message; the rest is the same on every rank.
    seen = {(r["mismatch"][0], r["mismatch"][1].removeprefix(f"[Rank {rank}] "))
            for rank, r in enumerate(reports)}
    assert len(seen) == 1, reports
    ((name, message),) = seen
    assert name == "CollectiveMismatchError"
    assert (f"rank 0 sends 1 rows to rank {WORLD - 1} (its input_split_sizes[{WORLD - 1}] = 1) "
            f"but rank {WORLD - 1} expects 2 from rank 0") in message
    assert all(r["after"] == [float(src) for src in range(WORLD)] for r in reports)

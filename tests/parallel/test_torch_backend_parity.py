"""Calls from PyTorch's own distributed tests that gloo passes, over backend "gradstar" and the
same calls over "gloo": all_gather_coalesced, the bitwise reduce ops, and the messages of what
gradstar refuses (sparse MAX, BAND on floats) or times out; sparse SUM as gloo does it.

Three ranks per backend, both at once, in ``torch_backend_script.py``'s ``parity`` and
``parity_errors`` scenarios; three ranks, two inputs, so that all_gather_coalesced's lists by
rank cannot pass for lists by input.
"""

from __future__ import annotations

import asyncio

import pytest

from .test_torch_backend import both_backends

WORLD = 3
pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, dict]]]:
    """{backend: [rank 0's {scenario: report}, ...]}."""
    rendezvous = tmp_path_factory.mktemp("gloo-rendezvous") / "parity"

    gradstar_reports, gloo_reports = asyncio.run(both_backends(
        WORLD, rendezvous, "parity", ("parity", "parity_errors"), ("parity",), 120))
    return {"gradstar": gradstar_reports, "gloo": gloo_reports}


def test_all_gather_coalesced_and_bitwise_ops_match_gloo(runs):
    for rank in range(WORLD):
        got, want = runs["gradstar"][rank]["parity"], runs["gloo"][rank]["parity"]
        assert got == want, {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
    report = runs["gradstar"][0]["parity"]
    assert report["sparse_sum"][0] is True and report["sparse_sum"][1][0][0] == sum(range(WORLD))
    # Lists by rank, each holding that rank's inputs in order.
    assert report["all_gather_coalesced"][2] == [[[2.0, 2.0], [2.0, 2.0]], [20.0, 21.0, 22.0]]
    assert report["all_reduce_BXOR_torch.bool"] == ["torch.bool", [True, True, True, False]]
    assert runs["gradstar"][WORLD - 1]["parity"]["reduce_BOR_on_root"] == [7, 3]


def test_refusals_and_timeouts_name_what_went_wrong(runs):
    for rank in range(WORLD):
        report = runs["gradstar"][rank]["parity_errors"]
        assert report["band_float"] == [
            "ConfigurationError",
            "ReduceOp.BAND reduces integer and bool tensors, not torch.float32 tensors"]
        name, message = report["sparse"]
        assert name == "ConfigurationError"
        assert "sparse all_reduce supports SUM only (as gloo does), got MAX" in message
        name, message = report["timeout"]
        assert name == "CollectiveTimeoutError", report["timeout"]
        # Errors through torch's Works name the rank first, as torch's own backends' do.
        assert message.startswith(f"[Rank {rank}] Timed out after 1 s: "), message
        assert report["after"] == [float(sum(range(WORLD)))] * 2

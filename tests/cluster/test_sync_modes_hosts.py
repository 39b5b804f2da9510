"""Sync modes across hosts (issue 32): an emulated cluster of two hosts with two ranks each, every
host with its node-local shard (the default topology), one host slowed before every backward.
DDP in Quorum (every host but one closes a step), in float32 and in int8 with error feedback,
beside the job's all_reduces through the shards: the slowed host's late gradients are dropped,
every rank ends bitwise identical, equal to a one-process replay of the hub's record, and the
collectives still sum right. Needs root and iproute2 (CI runs as root); elsewhere it fails
saying why."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.cluster.jobs import hosts_network, job_on_hosts, wait_reports
from tests.parallel import sync_modes_script as script

pytestmark = pytest.mark.timeout(300)
STEPS, DELAY, PER_HOST = 10, 0.3, 2


@pytest.mark.parametrize("wire", [None, "int8"], ids=["float32", "int8"])
def test_quorum_across_hosts_with_node_shards(tmp_path, wire):
    names = ["host0", "host1"]
    out = tmp_path / "out"
    out.mkdir()
    world = PER_HOST * len(names)
    argv = [sys.executable, "-m", "tests.cluster.sync_modes_rank", str(out), str(STEPS),
            *([wire] if wire else [])]
    with hosts_network(names) as network:
        with job_on_hosts(network, tmp_path, PER_HOST, argv,
                          env_for={"host1": {"STRAGGLER_DELAY": str(DELAY)}}) as (procs, _):
            reports = {r["rank"]: r for r in wait_reports(out, "result", world, procs, 240)}
    total = sum(range(1, world + 1))
    for report in reports.values():
        assert report["sums"] == [total] * 4, report["sums"]
    first = reports[0]
    for rank, report in reports.items():
        assert report["params"] == first["params"], f"rank {rank} differs"
    steps = script.full_record({rank: r["steps"] for rank, r in reports.items()})
    slow = [r for r in reports.values() if r["host"] == "host1"]
    assert len(slow) == PER_HOST and all(r["dropped"] > 0 for r in slow), (
        "the slowed host's gradients were never dropped: the Quorum did not close without it")
    contributions = {rank: r["contributions"] for rank, r in reports.items()}
    replayed = script.params_of(script.replay(contributions, steps, wire=wire))
    for name, values in replayed.items():
        np.testing.assert_allclose(first["params"][name], values, rtol=1e-6, atol=1e-7,
                                   err_msg=name)

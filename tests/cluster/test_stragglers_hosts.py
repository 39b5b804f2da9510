"""Naming the straggler across hosts (issue 33): an emulated cluster, every host with its
node-local shard (the default), the ranks of one host slowed by a fixed delay before every
all_reduce. With one rank per host the collectives stripe over the node shards (the shard of
stripe 0 measures, the coordinator merges its report); with two per host they run in two
levels (a host stage and a leaders' stage, folded into the job's view). Either way every rank's
``pg.straggler_stats()`` names the slowed host's ranks first, with at least about the delay as
lag, the others well below it, and flags as the flagging rule says.
Needs root and iproute2 (CI runs as root); elsewhere it fails saying why."""

from __future__ import annotations

import sys

import pytest

from tests.cluster.jobs import hosts_network, job_on_hosts, wait_reports
from tests.integration.test_stragglers import as_rows, check_slow_first

pytestmark = pytest.mark.timeout(300)
ROUNDS, DELAY = 20, 0.2


@pytest.mark.parametrize("per_host", [1, 2], ids=["3x1", "3x2"])
def test_the_slowed_hosts_ranks_are_named(tmp_path, per_host):
    names = ["host0", "host1", "host2"]
    out = tmp_path / "out"
    out.mkdir()
    world = per_host * len(names)
    argv = [sys.executable, "-m", "tests.cluster.straggler_rank", str(out), str(ROUNDS)]
    with hosts_network(names) as network:
        with job_on_hosts(network, tmp_path, per_host, argv,
                          env_for={"host2": {"STRAGGLER_DELAY": str(DELAY)}}) as (procs, _):
            reports = wait_reports(out, "stats", world, procs, 200)
    slow = sorted(r["rank"] for r in reports if r["host"] == "host2")
    assert len(slow) == per_host
    for report in reports:
        ranks = report["stats"]["ranks"]
        # The slowed host's ranks first, at least about the delay late, the others well below
        # them, flags as the flagging rule says (a quiet run flags the slowed host's ranks
        # alone), whatever the load: see check_slow_first.
        check_slow_first(as_rows(ranks), slow, world, 0.6 * DELAY)

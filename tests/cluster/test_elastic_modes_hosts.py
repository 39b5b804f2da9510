"""Sync-mode jobs that grow and shrink across hosts of the emulated cluster: 3 hosts, one rank
each (``GRADSTAR_MAX_WORLD_SIZE`` 4), DDP in Quorum, BoundedStaleness and Asynchronous. A fourth
process joins on host 1 while the job trains (elastic, no rank: it starts from the hub's
snapshot), then host 2's rank leaves for good (closes its group). No process restarts; every
rank that stays ends bitwise identical, equal to one process replaying the hub's record of
which contribution joined which step, the newcomer's contributions among them.

Needs root and iproute2; elsewhere it fails saying why.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cluster.jobs import REPO, hosts_network, job_on_hosts, wait_reports
from tests.cluster.test_resize_hosts import wait_running
from tests.parallel.test_sync_modes import assert_identical_and_replayed, record
from tests.runtime.conftest import clean_env

HOSTS = ["host0", "host1", "host2"]
STEPS, LEAVER, LEAVE_AT = 24, 2, 12
MODES = {"quorum": ["--min-ranks", "2", "--timeout", "0.02"],
         "bounded": ["--max-staleness", "2"], "async": []}
pytestmark = pytest.mark.timeout(420)


def reports_by_rank(found: list[dict]) -> dict[int, dict]:
    """Each process's report as ``run_modes`` gives it: its final line (parameters and steps),
    or ``{"left": i}`` for the leaver, with the contributions it printed."""
    reports = {}
    for report in found:
        assert report["code"] == 0, f"{report['name']} failed: {report['lines'][-3:]}"
        lines = report["lines"]
        rank = lines[-1]["rank"]
        reports[rank] = dict(lines[-1])
        reports[rank]["contributions"] = [line["contribution"] for line in lines
                                          if "contribution" in line]
    return reports


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_sync_mode_job_grows_and_shrinks_across_hosts(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    ready = tmp_path / "joined"
    script = [mode, *MODES[mode], "--steps", str(STEPS), "--delays", "0.2,0.2,0.2,0.2",
              "--await-replacement", str(ready), "--leave-rank", str(LEAVER),
              "--leave-at", str(LEAVE_AT)]
    limits = {"GRADSTAR_MAX_WORLD_SIZE": "4", "GRADSTAR_ELASTIC": "1"}
    argv = [sys.executable, "-m", "tests.cluster.modes_rank", str(out)]
    with hosts_network(HOSTS) as network, job_on_hosts(
            network, tmp_path, 1, [*argv, "host", "--", *script],
            {h: dict(limits) for h in HOSTS}) as (procs, hub):
        wait_running(network, hub)  # a join before the job formed would take a first place
        procs.append(subprocess.Popen(
            network.argv("host1", [*argv, "joiner", "--", *script]), cwd=REPO,
            start_new_session=True,
            env=clean_env(GRADSTAR_TOKEN_FILE=str(hub.token), PYTHONPATH=str(REPO),
                          GRADSTAR_COORDINATOR=hub.address, GRADSTAR_JOB=hub.job,
                          GRADSTAR_WORLD_SIZE="3", **limits),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        reports = reports_by_rank(wait_reports(out, "modes", 4, procs, 300))
    assert sorted(reports) == [0, 1, 2, 3]
    assert reports[LEAVER].get("left") == LEAVE_AT and "params" not in reports[LEAVER]
    assert reports[3]["replacement"] and not reports[0]["replacement"]
    assert_identical_and_replayed(reports)
    # What the ranks read of the job's size: the ledger's live ranks, the newcomer in, the
    # leaver out (pg.world_size stays the size each joined with).
    assert all(reports[r]["live"] == [0, 1, 3] for r in (0, 1, 3)), [
        reports[r]["live"] for r in (0, 1, 3)]
    steps = record(reports)
    joined = [c for c in reports[3]["contributions"] if c["step"] is not None]
    assert joined and joined[0]["base"] > 0, "the newcomer did not start from the hub's state"
    with_newcomer = [s["step"] for s in steps if 3 in s["ranks"]]
    with_leaver = [s["step"] for s in steps if LEAVER in s["ranks"]]
    assert with_newcomer, "no step took the newcomer's gradient"
    assert len(with_leaver) <= LEAVE_AT
    # After it left, the job went on: later steps were made without it, the newcomer in some.
    assert [s for s in with_newcomer if s > max(with_leaver)], (steps, with_leaver)

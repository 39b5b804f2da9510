"""A Synchronous DDP job that grows and shrinks across hosts of the emulated cluster: 3 hosts,
one rank each (max 4, min 2), a fourth rank joins on host 1 (whose node-local shard then
combines two ranks first), then host 2's rank leaves for good. No process restarts; the ranks
that stay end bitwise equal and equal to one process replaying the run, as on one host
(``tests/parallel/test_resize.py``, whose checks this reuses).

Needs root and iproute2; elsewhere it fails saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.cluster.jobs import REPO, hosts_network, job_on_hosts, wait_reports
from tests.parallel.test_resize import assert_replayed, steps_run
from tests.runtime.conftest import clean_env

HOSTS = ["host0", "host1", "host2"]
pytestmark = pytest.mark.timeout(420)


def wait_running(network, hub, timeout: float = 180) -> None:
    """Until ``gradstar admin jobs`` on host 0 says the job's first generation runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(network.argv("host0", [
            sys.executable, "-m", "gradstar", "admin", "jobs", "--json", "--coordinator",
            hub.address]), cwd=REPO, capture_output=True, timeout=60,
            env=clean_env(GRADSTAR_TOKEN_FILE=str(hub.token), PYTHONPATH=str(REPO)))
        if listed.returncode == 0 and any(
                j["job"] == hub.job and j["state"] == "running"
                for j in json.loads(listed.stdout)):
            return
        time.sleep(0.5)
    pytest.fail(f"job {hub.job!r} did not start within {timeout:g} s", pytrace=False)


def test_a_synchronous_job_grows_and_shrinks_across_hosts(tmp_path):
    limits = {"GRADSTAR_MAX_WORLD_SIZE": "4", "GRADSTAR_MIN_WORLD_SIZE": "2",
              "GRADSTAR_TIMEOUT": "120"}
    argv = [sys.executable, "-m", "tests.cluster.resize_rank", str(tmp_path)]
    env_for = {h: dict(limits) for h in HOSTS}
    env_for["host2"]["RESIZE_LEAVER"] = "1"
    with hosts_network(HOSTS) as network, job_on_hosts(network, tmp_path, 1, argv,
                                                       env_for) as (procs, hub):
        wait_running(network, hub)  # a join before the job formed would take a first place
        joiner = subprocess.Popen(
            network.argv("host1", [*argv, "3", "--joiner"]), cwd=REPO, start_new_session=True,
            env=clean_env(GRADSTAR_TOKEN_FILE=str(hub.token), PYTHONPATH=str(REPO),
                          GRADSTAR_COORDINATOR=hub.address, GRADSTAR_JOB=hub.job,
                          GRADSTAR_WORLD_SIZE="3", GRADSTAR_ELASTIC="1", **limits),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(joiner)
        reports = {r["ident"]: r for r in wait_reports(tmp_path, "resize", 4, procs, 300)}
    lines = [reports[ident]["lines"] for ident in range(4)]
    assert all(reports[ident]["code"] == 0 for ident in range(4))
    grown, shrunk = [line for line in lines[0] if "resize" in line]
    assert (grown["world"], shrunk["world"], grown["newcomers"]) == (4, 3, [3])
    assert any(line.get("left_at") == shrunk["resize"] for line in lines[2])
    steps = steps_run(lines)
    assert {len(steps[s]) for s in range(grown["resize"], shrunk["resize"])} == {4}
    assert_replayed([next(line for line in lines[i] if "params" in line) for i in (0, 1, 3)],
                    steps)

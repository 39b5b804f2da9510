"""DiLoCo in a job that grows and shrinks across hosts of the emulated cluster, as on one host
(``tests/parallel/test_local_sgd_resize.py``, whose script, checks and replay this reuses): 3
hosts, one rank each (max 4, min 2); a fourth process joins on host 1 while the first ranks
wait before their step ``WAIT_AT`` (until the coordinator lists it as joining at a boundary),
then host 1's first rank leaves for good. Nobody restarts. The ranks that stay end bitwise
equal to each other and equal to one process replaying each round over the processes that
took part in it; a replay without the newcomer ends elsewhere.

Needs root and iproute2; elsewhere it fails saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.cluster.jobs import REPO, hosts_network, job_on_hosts
from tests.cluster.test_resize_hosts import wait_running
from tests.parallel import local_sgd_script as script
from tests.parallel.test_local_sgd_resize import LEAVER, STEPS, SYNC_EVERY, WAIT_AT, assert_resized
from tests.runtime.conftest import clean_env

HOSTS = ["host0", "host1", "host2"]
pytestmark = pytest.mark.timeout(420)


def admin_jobs(network, hub) -> list[dict]:
    listed = subprocess.run(network.argv("host0", [
        sys.executable, "-m", "gradstar", "admin", "jobs", "--json", "--coordinator",
        hub.address]), cwd=REPO, capture_output=True, timeout=60,
        env=clean_env(GRADSTAR_TOKEN_FILE=str(hub.token), PYTHONPATH=str(REPO)))
    return json.loads(listed.stdout) if listed.returncode == 0 else []


def until(what: str, timeout: float, check) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:g} s", pytrace=False)
        time.sleep(0.3)


def test_diloco_grows_and_shrinks_across_hosts(tmp_path):
    go = tmp_path / "go"
    limits = {"GRADSTAR_MAX_WORLD_SIZE": "4", "GRADSTAR_MIN_WORLD_SIZE": "2"}
    common = ["elastic", str(tmp_path), "--sync-every", str(SYNC_EVERY), "--steps", str(STEPS),
              "--wait-at", str(WAIT_AT), "--go", str(go), "--leaver", str(LEAVER)]
    argv = [sys.executable, str(script.__file__), *common]
    env_for = {h: dict(limits) for h in HOSTS}
    outs = {}
    with hosts_network(HOSTS) as network, job_on_hosts(
            network, tmp_path, 1, [sys.executable, "-m", "tests.cluster.local_sgd_rank",
                                   *common], env_for) as (procs, hub):
        wait_running(network, hub)
        until("the first ranks did not reach their step WAIT_AT", 180,
              lambda: all((tmp_path / f"waiting{r}").exists() for r in range(3)))
        joiner = subprocess.Popen(
            network.argv("host1", [*argv, "--ident", "3"]), cwd=REPO, start_new_session=True,
            env=clean_env(GRADSTAR_TOKEN_FILE=str(hub.token), PYTHONPATH=str(REPO),
                          GRADSTAR_COORDINATOR=hub.address, GRADSTAR_JOB=hub.job,
                          GRADSTAR_WORLD_SIZE="3", GRADSTAR_ELASTIC="1", **limits),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(joiner)
        until("the joiner did not wait for a boundary", 180, lambda: any(
            j["job"] == hub.job and j["joining_at_boundary"] for j in admin_jobs(network, hub)))
        go.touch()
        out, err = joiner.communicate(timeout=300)
        assert joiner.returncode == 0, err[-3000:]
        outs[3] = out
        until("the first ranks did not finish", 300,
              lambda: all((tmp_path / f"lines{r}.jsonl").exists() for r in range(3)))
    for ident in range(3):
        outs[ident] = (tmp_path / f"lines{ident}.jsonl").read_text()
    lines = {i: [json.loads(line) for line in out.splitlines() if line.startswith("{")]
             for i, out in outs.items()}
    assert_resized(lines, tmp_path)

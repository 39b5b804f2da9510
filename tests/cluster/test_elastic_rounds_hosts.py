"""A Streaming DiLoCo job that grows and shrinks across hosts of the emulated cluster: three
replicas, one per host, a fourth that starts on host 1 while they train (from the hub's global
model and round count), then host 2's replica leaves for good (``StreamingDiLoCo.leave``). The
rounds wait ten minutes for an expected replica, far past the test's bound, so a round that
waited for the leaver, or missed the newcomer, would fail it. No process restarts; the
replicas that stay end with the same global model and rounds, the newcomer in every fragment's
last round and the leaver counted as left, not missed.

Needs root and iproute2; elsewhere it fails saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from tests.cluster.jobs import REPO, coordinator_on_hosts, hosts_network
from tests.integration.test_streaming_diloco import SCRIPT

HOSTS = ["host0", "host1", "host2"]
SDL = dict(h=4, p=2, tau=1, alpha=0.5, min_replicas=2, round_timeout=600, steps=80,
           sleep=0.1)
pytestmark = pytest.mark.timeout(420)


class Lines:
    """A process's output lines, read on a thread, waited for by prefix."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := next((line for line in self.lines if line.startswith(prefix)), None):
                return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no line {prefix!r} within {timeout:g} s:\n" + "\n".join(self.lines[-40:]),
                    pytrace=False)


def test_a_streaming_diloco_job_grows_and_shrinks_across_hosts(tmp_path):
    gate, leave = tmp_path / "grow", tmp_path / "leave"
    with hosts_network(HOSTS) as network, coordinator_on_hosts(network, tmp_path) as (
            _, hub, start):

        def replica(index: int, host: str, **extra: str) -> Lines:
            env = {f"SDL_{k.upper()}": str(v) for k, v in SDL.items()}
            return Lines(start(host, [sys.executable, str(SCRIPT), str(tmp_path / "r{index}.json")],
                               GRADSTAR_COORDINATOR=hub.address, GRADSTAR_JOB=hub.job,
                               SDL_INDEX=str(index), SDL_REPLICA=f"r{index}", **env, **extra))

        first = [replica(i, host) for i, host in enumerate(HOSTS[:2])]
        leaver = replica(2, "host2", SDL_LEAVE_WHEN=str(leave))
        newcomer = replica(3, "host1", SDL_WAIT_FOR=str(gate))
        first[0].wait_for("step 12", 180)
        gate.touch()
        joined = newcomer.wait_for("joined", 120)
        newcomer.wait_for("step", 120)  # it trains: its first contribution is under way
        leave.touch()
        for lines in (*first, leaver, newcomer):
            assert lines.proc.wait(240) == 0, "\n".join(lines.lines[-40:])
        listed = subprocess.run(network.argv("host0", [
            sys.executable, "-m", "gradstar", "admin", "rounds", "--job", hub.job, "--json",
            "--coordinator", hub.address]), cwd=REPO, capture_output=True, timeout=60,
            env={"GRADSTAR_TOKEN_FILE": str(hub.token), "PYTHONPATH": str(REPO),
                 "PATH": "/usr/bin:/bin"})
    assert listed.returncode == 0, listed.stderr
    rounds = json.loads(listed.stdout)
    results = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(4)]
    stay = [results[i] for i in (0, 1, 3)]
    assert results[2]["left"] and not any(r["left"] for r in stay)
    assert stay[0]["rounds"] == stay[1]["rounds"] == stay[2]["rounds"] == [20, 20]
    assert stay[0]["global"] == stay[1]["global"] == stay[2]["global"]
    # It took up the schedule where the rounds were (not step 0), from the hub's model.
    assert int(joined.split()[1]) >= 8, joined
    by_name = {r["replica"]: r for r in rounds["replicas"]}
    assert by_name["r2"]["missed"] == 0 and by_name["r2"]["contributed"] >= 2  # left
    assert by_name["r3"]["joins"] == 1 and by_name["r3"]["contributed"] >= 2
    assert all(f["last_participants"] == ["r0", "r1", "r3"] for f in rounds["fragments"])

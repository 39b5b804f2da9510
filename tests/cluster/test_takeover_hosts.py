"""A standby coordinator takes over on an emulated cluster (issue 50): etcd and two
``gradstar coordinator --ha`` processes on one host, a Synchronous DDP job of two ranks on each
of two other hosts, given both coordinators' addresses. The leader is killed (SIGKILL) mid-
training; the standby takes over, the ranks ride through across hosts, and every rank ends with
the same parameters as one process trained on all their batches (``ride_through_script``'s
reference). Needs root and iproute2 (CI runs as root); elsewhere it fails saying why."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks._etcd import MISSING
from tests.cluster.jobs import REPO, hosts_network, starter

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "tests" / "parallel" / "ride_through_script.py"
HOSTS, PER_HOST = ["ctl", "host0", "host1"], 2
STEPS, PAUSE, KILL_AFTER = 16, 0.3, 4
#: Fixed ports are safe: each host is a fresh namespace.
ETCD, PORTS = 2379, (29401, 29402)


def read_until(proc: subprocess.Popen, start: str, seconds: float = 60) -> str:
    """The first line of ``proc``'s output that starts with ``start`` (bounded by the test's
    timeout; fails if the process exits first)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        assert line, f"{proc.args[-8:]} exited before it printed {start!r}"
        if line.startswith(start):
            return line
    raise AssertionError(f"no {start!r} within {seconds:g} s")


def test_a_standby_takes_over_on_another_host_and_ddp_trains_on_exactly(tmp_path):
    etcd = shutil.which("etcd")
    assert etcd, MISSING
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe() + "\n")
    world = PER_HOST * (len(HOSTS) - 1)
    procs: list[subprocess.Popen] = []
    with hosts_network(HOSTS) as network:
        ctl = network.addresses["ctl"]
        start = starter(network, token, procs)

        def coordinator(port: int) -> subprocess.Popen:
            return start("ctl", [sys.executable, "-m", "gradstar", "coordinator", "--host",
                                 "0.0.0.0", "--port", str(port), "--shards", "0",
                                 "--ha", f"etcd://127.0.0.1:{ETCD}", "--ha-ttl", "2",
                                 "--ha-advertise", f"{ctl}:{port}",
                                 "--state-dir", str(tmp_path / "state")])

        try:
            start("ctl", [etcd, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls",
                          f"http://127.0.0.1:{ETCD}", "--advertise-client-urls",
                          f"http://127.0.0.1:{ETCD}"])
            hubs = []
            for port in PORTS:  # etcd takes a moment: a coordinator that found none retries
                for _ in range(20):
                    hub = coordinator(port)
                    line = hub.stdout.readline().decode()
                    while line and not line.startswith(("gradstar coordinator listening on ",
                                                        "gradstar coordinator standby on ")):
                        line = hub.stdout.readline().decode()
                    if line:
                        break
                    hub.wait(10)
                    time.sleep(0.5)
                assert line, "no coordinator could start on the first host"
                hubs.append((hub, "listening" in line))
            assert [leads for _, leads in hubs] == [True, False]
            addresses = ",".join(f"{ctl}:{port}" for port in PORTS)
            ranks = []
            for r in range(world):
                host = HOSTS[1 + r // PER_HOST]
                ranks.append(start(host, [sys.executable, str(SCRIPT), str(STEPS), str(PAUSE)],
                                   GRADSTAR_COORDINATOR=addresses, GRADSTAR_JOB="takeover",
                                   GRADSTAR_WORLD_SIZE=str(world), GRADSTAR_RANK=str(r),
                                   GRADSTAR_RECONNECT_TIMEOUT="60"))
            for _ in range(KILL_AFTER):
                read_until(ranks[0], "step ", 120)
            os.killpg(hubs[0][0].pid, signal.SIGKILL)
            read_until(hubs[1][0], "gradstar coordinator listening on ", 30)
            outputs = []
            for proc in ranks:
                out, _ = proc.communicate(timeout=180)
                assert proc.returncode == 0, out.decode()[-3000:]
                outputs.append(out.decode())
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    finals = [json.loads(next(line for line in reversed(out.splitlines())
                              if line.startswith("{"))) for out in outputs]
    for rank, (final, out) in enumerate(zip(finals, outputs, strict=True)):
        assert len(final["reconnects"]) == 1, (rank, final["reconnects"])
        assert out.count("rejoined the coordinator at") == 1, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert final["params"] == finals[0]["params"], f"rank {rank} differs"
    ended_as_the_reference(finals[0]["params"], STEPS, world)


def ended_as_the_reference(params: list[list[float]], steps: int, world: int) -> None:
    """``params`` (a rank's final ones) are, within float32 rounding, those of one process
    trained on ``world`` ranks' batches for ``steps`` steps (``ride_through_script``'s
    reference)."""
    reference = subprocess.run([sys.executable, str(SCRIPT), "reference", str(steps),
                                str(world)], capture_output=True, text=True, timeout=120,
                               check=True)
    expected = json.loads(reference.stdout.splitlines()[-1])["params"]
    for got, want in zip(params, expected, strict=True):
        np.testing.assert_allclose(np.array(got, np.float32), np.array(want, np.float32),
                                   rtol=1e-5, atol=1e-6)

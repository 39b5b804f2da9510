"""torchrun across two hosts (network namespaces on a bridge, :mod:`tests.runtime.netns`), as a
user runs it: ``--nnodes 2 --master-addr HOST0``, ``init_process_group("gradstar")`` and nothing
else set. Rank 0's hub must advertise an address host 1 reaches (not a host name host 1
resolves to itself), each host's local rank 0 starts a node-local shard, and the trained
parameters equal gloo's on the same two hosts (``GLOO_SOCKET_IFNAME=eth0``, as gloo needs).

Needs root and iproute2 (CI runs as root); elsewhere it fails saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cluster.jobs import hosts_network

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "tools" / "torchrun_script.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
HOSTS = ["host0", "host1"]
NPROC = 2
#: torch's store on host 0: a fixed port is safe here, each host is a fresh network namespace.
PORT = 29531
pytestmark = pytest.mark.timeout(420)


def _env(backend: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADSTAR_", "MASTER_", "TORCHELASTIC_", "GLOO_"))}
    env["PYTHONPATH"] = str(REPO)
    if backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # what gloo needs across hosts
    return env


def _run_on_hosts(network, out: Path, backend: str) -> list[subprocess.CompletedProcess]:
    master = network.addresses["host0"]
    procs = []
    for node, host in enumerate(HOSTS):
        command = [str(TORCHRUN), "--nnodes=2", f"--node-rank={node}",
                   f"--nproc-per-node={NPROC}", f"--master-addr={master}",
                   f"--master-port={PORT}", str(SCRIPT), backend, str(out)]
        procs.append(subprocess.Popen(network.argv(host, command), env=_env(backend),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=REPO))
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=180)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return done


def test_torchrun_across_two_hosts_trains_like_gloo(tmp_path):
    with hosts_network(HOSTS) as network:
        for backend in ("gradstar", "gloo"):
            runs = _run_on_hosts(network, tmp_path, backend)
            for node, run in enumerate(runs):
                assert run.returncode == 0, f"{backend} on host{node}: {run.stderr[-3000:]}"
    world = 2 * NPROC
    ours = [json.loads((tmp_path / f"gradstar-rank{r}.json").read_text()) for r in range(world)]
    theirs = [json.loads((tmp_path / f"gloo-rank{r}.json").read_text()) for r in range(world)]
    for mine, gloo in zip(ours, theirs, strict=True):
        for a, b in zip(mine["params"], gloo["params"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The hub is advertised at host 0's address on the bridge, and the job striped over one
    # node-local shard per host, each advertised at its own host's address.
    assert ours[0]["coordinator"].split(":")[0] == network.addresses["host0"]
    shards = ours[0]["shards"]
    assert sorted(a.split(":")[0] for a in shards) == sorted(network.addresses.values())
    assert all(r["shards"] == shards for r in ours)

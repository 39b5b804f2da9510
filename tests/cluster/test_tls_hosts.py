"""A TLS job across hosts gets its node-local shards too.

A node-local shard serves the ranks of other hosts, so over TLS it needs a server certificate
for its host: ``gradstar worker --shard-tls-cert/--shard-tls-key`` (env
``GRADSTAR_SHARD_TLS_CERT``/``_KEY``) give it one, and the shard verifies the coordinator with
the agent's CA. Without them a TLS job's bytes all crossed the coordinator's link. Here: 2 hosts
(network namespaces), a coordinator with TLS and a job token on host 0, ``gradstar worker``
with TLS on each host; every rank's collectives are exact and stripe over one shard per host,
each advertised at its own host's address and reached over TLS (a plaintext shard could not be
reached by a TLS rank at all). The rank program is :mod:`tests.cluster.rank`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.certs import make_pki
from tests.runtime.conftest import clean_env
from tests.runtime.netns import service_network

REPO = Path(__file__).resolve().parents[2]
CHUNK = 2 << 20
pytestmark = pytest.mark.timeout(240)


def test_a_tls_job_across_hosts_runs_on_tls_node_local_shards(tmp_path):
    names = ["host0", "host1"]
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe() + "\n")
    out = tmp_path / "out"
    out.mkdir()
    procs: list[subprocess.Popen] = []

    def start(host: str, argv: list[str], **env: str) -> subprocess.Popen:
        proc = subprocess.Popen(network.argv(host, argv), cwd=REPO, start_new_session=True,
                                env=clean_env(GRADSTAR_TOKEN_FILE=str(token),
                                              PYTHONPATH=str(REPO), **env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    with service_network(names) as network:
        if network.kind != "netns":
            pytest.skip(f"needs network namespaces as hosts: {network.reason}")
        pki = make_pki(tmp_path, ips=tuple(network.addresses.values()))
        try:
            hub = start("host0", [sys.executable, "-m", "gradstar", "coordinator", "--host",
                                  "0.0.0.0", "--port", "0", "--shards", "0", "--tls-cert",
                                  str(pki["server"]), "--tls-key", str(pki["server_key"])])
            line = b""
            while b"listening on" not in line:  # bounded by the test's timeout
                line = hub.stdout.readline()
                assert line, "the coordinator exited before it listened"
            coordinator = f"{network.addresses['host0']}:{int(line.rsplit(b':', 1)[1])}"
            job = f"tls-{secrets.token_hex(3)}"
            workers = [start(host, [
                sys.executable, "-m", "gradstar", "worker", "--coordinator", coordinator,
                "--job", job, "--nproc", "1", "--world-size", str(len(names)),
                "--shard-tls-cert", str(pki["server"]), "--shard-tls-key",
                str(pki["server_key"]), "--", sys.executable, "-m", "tests.cluster.rank",
                str(out), str(len(names) * 3 * CHUNK), "2"],
                CLUSTER_HOST=host, CLUSTER_REJOIN_WORLD="0", GRADSTAR_TLS_CA=str(pki["ca"]))
                for host in names]

            deadline = time.monotonic() + 120
            while len(found := sorted(out.glob("exact-*.json"))) < len(names):
                if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                    logs = b"".join(w.stdout.read1(1 << 16) for w in workers
                                    if w.poll() is not None).decode(errors="replace")
                    pytest.fail(f"{len(found)} of {len(names)} ranks were exact in time; "
                                f"exited workers said:\n{logs[-4000:]}")
                time.sleep(0.1)
            exact = [json.loads(p.read_text()) for p in found]
            shards = exact[0]["shards"]
            assert sorted(a.rsplit(":", 1)[0] for a in shards) == sorted(
                network.addresses.values()), "not one node-local shard per host"
            assert all(r["shards"] == shards for r in exact)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

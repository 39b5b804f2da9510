"""A TLS job across hosts gets its node-local shards too.

A node-local shard serves the ranks of other hosts, so over TLS it needs a server certificate
for its host: ``gradstar worker --shard-tls-cert/--shard-tls-key`` (env
``GRADSTAR_SHARD_TLS_CERT``/``_KEY``) give it one, and the shard verifies the coordinator with
the agent's CA. Without them a TLS job's bytes all crossed the coordinator's link. Here: 2 hosts
(network namespaces), a coordinator with TLS and a job token on host 0, ``gradstar worker``
with TLS on each host; every rank's collectives are exact and stripe over one shard per host,
each advertised at its own host's address and reached over TLS (a plaintext shard could not be
reached by a TLS rank at all). The rank program is :mod:`tests.cluster.rank`. Once more with
host 1 behind NAT (nftables drops new inbound TCP): its shard is reached by NAT traversal, and
TLS runs end to end through the punched connection, checked against host 1's certificate.
"""

from __future__ import annotations

import sys

import pytest

from benchmarks.emulated_cluster import ClusterUnavailable
from tests.cluster.jobs import hosts_network, job_on_hosts, wait_reports
from tests.integration.certs import make_pki

CHUNK = 2 << 20
pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("behind_nat", [False, True], ids=["reachable", "host1-behind-nat"])
def test_a_tls_job_across_hosts_runs_on_tls_node_local_shards(tmp_path, behind_nat):
    names = ["host0", "host1"]
    out = tmp_path / "out"
    out.mkdir()
    with hosts_network(names) as network:
        if behind_nat:
            try:
                network.cluster.block_inbound("host1")
            except ClusterUnavailable as error:
                pytest.fail(str(error), pytrace=False)
        pki = make_pki(tmp_path, ips=tuple(network.addresses.values()))
        rank = [sys.executable, "-m", "tests.cluster.rank", str(out),
                str(len(names) * 3 * CHUNK), "2"]
        tls = {host: {"GRADSTAR_TLS_CA": str(pki["ca"]), "CLUSTER_REJOIN_WORLD": "0"}
               for host in names}
        with job_on_hosts(network, tmp_path, 1, rank, env_for=tls,
                          coordinator_args=["--tls-cert", str(pki["server"]), "--tls-key",
                                            str(pki["server_key"])],
                          worker_args=["--shard-tls-cert", str(pki["server"]),
                                       "--shard-tls-key", str(pki["server_key"])]) as (procs, _):
            exact = wait_reports(out, "exact", len(names), procs, 120)
        shards = exact[0]["shards"]
        assert sorted(a.rsplit(":", 1)[0] for a in shards) == sorted(
            network.addresses.values()), "not one node-local shard per host"
        assert all(r["shards"] == shards for r in exact)

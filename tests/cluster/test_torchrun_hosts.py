"""torchrun across two hosts (network namespaces on a bridge, :mod:`tests.runtime.netns`), as a
user runs it: ``--nnodes 2 --master-addr HOST0``, ``init_process_group("gradstar")`` and nothing
else set. Rank 0's hub must advertise an address host 1 reaches (not a host name host 1
resolves to itself), each host's local rank 0 starts a node-local shard, and the trained
parameters equal gloo's on the same two hosts (``GLOO_SOCKET_IFNAME=eth0``, as gloo needs) —
also with the two hosts 100 ms apart (delay lines, ``rtt=100``): a far link changes no
result.

Needs root and iproute2 (CI runs as root); elsewhere it fails saying why.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.cluster.jobs import hosts_network, torchrun_on_hosts

HOSTS = ["host0", "host1"]
NPROC = 2
pytestmark = pytest.mark.timeout(420)


@pytest.mark.parametrize("rtt", [None, 100], ids=["near", "100ms"])
def test_torchrun_across_two_hosts_trains_like_gloo(tmp_path, rtt):
    with hosts_network(HOSTS, rtt=rtt) as network:
        for backend in ("gradstar", "gloo"):
            runs = torchrun_on_hosts(network, tmp_path, backend, HOSTS, NPROC)
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

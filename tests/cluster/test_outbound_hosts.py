"""Hosts that can only dial out (behind NAT, a firewall that lets connections out only), as
nftables rules in their namespaces make them: new inbound TCP on ``eth0`` is dropped, replies
to what the host dialed pass. The coordinator's host takes connections; the others do not.

torchrun with ``backend="gradstar"`` and nothing set trains like gloo does on the same hosts
with nothing blocked: the coordinator probes each node-local shard as it registers, finds the
outbound-only ones, and stripes the job's collectives over every host's shard all the same:
ranks on the other hosts reach an outbound-only one through NAT traversal (TCP hole punching
arranged by the coordinator, gradstar.transport.traversal). With ``GRADSTAR_NAT_TRAVERSAL=0``
the stripes go to the shards every host can dial only. A send to a rank on an outbound-only
host from another host goes through the coordinator's relay (both dial it); sends to a
reachable rank stay direct.

Needs root, iproute2 and nftables (``make test`` installs it); elsewhere it fails saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.emulated_cluster import ClusterUnavailable
from tests.cluster.jobs import hosts_network, job_on_hosts, torchrun_on_hosts, wait_reports

HOSTS = ["host0", "host1", "host2"]
pytestmark = pytest.mark.timeout(420)

def block_inbound(network, host: str) -> None:
    """Make ``host`` outbound-only; the test fails, saying why, where that cannot be done."""
    try:
        network.cluster.block_inbound(host)
    except ClusterUnavailable as error:
        pytest.fail(str(error), pytrace=False)


def connects(network, src: str, dst: str) -> bool:
    """Whether a TCP connection from ``src`` to a listener on ``dst`` opens within 2 s."""
    listener = subprocess.Popen(network.argv(dst, [
        sys.executable, "-c", "import socket,sys,time; s=socket.create_server(('0.0.0.0', "
        "29999)); print('up', flush=True); time.sleep(30)"]), stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        probe = subprocess.run(network.argv(src, [
            sys.executable, "-c", f"import socket; socket.create_connection(("
            f"'{network.addresses[dst]}', 29999), timeout=2)"]), capture_output=True, timeout=30)
        return probe.returncode == 0
    finally:
        listener.kill()
        listener.wait(10)


def test_outbound_only_hosts_train_through_torchrun_and_name_what_they_cannot_take(tmp_path):
    with hosts_network(HOSTS) as network:
        gloo = tmp_path / "gloo"
        gloo.mkdir()
        for node, run in enumerate(torchrun_on_hosts(network, gloo, "gloo", HOSTS, 1)):
            assert run.returncode == 0, f"gloo on host{node}: {run.stderr[-3000:]}"
        for host in HOSTS[1:]:
            block_inbound(network, host)
        assert connects(network, "host1", "host0") and not connects(network, "host0", "host1")
        assert not connects(network, "host2", "host1")  # gloo's full mesh cannot form now
        ours = tmp_path / "gradstar"
        ours.mkdir()
        for node, run in enumerate(torchrun_on_hosts(network, ours, "gradstar", HOSTS, 1)):
            assert run.returncode == 0, f"gradstar on host{node}: {run.stderr[-3000:]}"
        reports = [json.loads((ours / f"gradstar-rank{r}.json").read_text()) for r in range(3)]
        for rank, report in enumerate(reports):
            theirs = json.loads((gloo / f"gloo-rank{rank}.json").read_text())
            for a, b in zip(report["params"], theirs["params"], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # The job striped over every host's node-local shard, the outbound-only ones punched
        # through to from the other hosts.
        assert sorted(s.split(":")[0] for s in reports[0]["shards"]) == sorted(
            network.addresses[h] for h in HOSTS)

        # Point to point, through gradstar worker (a node-local shard on every host): streams
        # to the outbound-only rank 1 punched through to it (NAT traversal); with traversal
        # off, relayed by the coordinator, and the stripes on host 0's shard alone, the one
        # every host can dial; without node-local shards (none to be probed), the
        # coordinator's probe of each rank's peer server finds the outbound-only ones.
        for traversal, shard, stripes, to_nat in (("1", "1", HOSTS, "punched"),
                                                  ("0", "1", HOSTS[:1], "relayed"),
                                                  ("1", "0", [], "punched")):
            out = tmp_path / f"p2p-{traversal}-{shard}"
            out.mkdir()
            env = {"GRADSTAR_NAT_TRAVERSAL": traversal, "GRADSTAR_NODE_SHARD": shard}
            with job_on_hosts(network, out, 1, [sys.executable, "-m",
                                                "tests.cluster.outbound_rank", str(out)],
                              env_for={h: dict(env) for h in HOSTS}) as (procs, _):
                got = {r["rank"]: r for r in wait_reports(out, "outbound", 3, procs, 180)}
            assert all(r["exact"] for r in got.values())
            assert sorted(s.split(":")[0] for s in got[0]["shards"]) == sorted(
                network.addresses[h] for h in stripes), traversal
            assert got[0]["received"] == [7.0] * 8  # outbound-only rank 1 -> reachable rank 0
            # To the outbound-only rank 1: from reachable rank 0 and outbound-only rank 2.
            assert got[1]["from_0"] == (np.arange(300_000, dtype=np.float32) % 97).tolist()
            assert got[1]["from_2"] == [2.0] * 5
            assert got[1]["routes"] == {"0": "direct"}
            assert got[0]["routes"] == got[2]["routes"] == {"1": to_nat}, traversal


def test_every_wrapper_trains_across_outbound_only_hosts_as_across_reachable_ones(tmp_path):
    """DDP, FSDP, a Pipeline with a stage on each host (activation and gradient streams between
    them) and Streaming DiLoCo, on 3 hosts: once with every host reachable, once with hosts 1
    and 2 outbound-only. Every wrapper ends with the same parameters both times (float32 sums
    met in another order: close, not bitwise), and both jobs striped over every host's shard
    (the second one punching through to the outbound-only ones)."""
    argv = [sys.executable, "-m", "tests.cluster.wrappers_rank"]
    with hosts_network(HOSTS) as network:
        runs = {}
        for name in ("reachable", "outbound"):
            if name == "outbound":
                for host in HOSTS[1:]:
                    block_inbound(network, host)
            out = tmp_path / name
            out.mkdir()
            with job_on_hosts(network, out, 1, [*argv, str(out)]) as (procs, _):
                runs[name] = {r["rank"]: r for r in wait_reports(out, "wrappers", 3, procs, 300)}
    for rank in range(3):
        for wrapper in ("ddp", "fsdp", "pipeline", "streaming_diloco"):
            np.testing.assert_allclose(runs["outbound"][rank][wrapper],
                                       runs["reachable"][rank][wrapper], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{wrapper} on rank {rank}")
        # Data parallel replicas agree with each other too.
        np.testing.assert_array_equal(runs["outbound"][rank]["ddp"], runs["outbound"][0]["ddp"])
    for name in ("reachable", "outbound"):
        assert sorted(s.split(":")[0] for s in runs[name][0]["shards"]) == sorted(
            network.addresses[h] for h in HOSTS), name

"""A job across hosts of an emulated cluster, started as a user starts one: a coordinator on
host 0 and ``gradstar worker`` on every host (each runs its ranks and, by default, its
node-local shard). Hosts are network namespaces on a bridge (:mod:`tests.runtime.netns`).

- every collective equals numpy's result (int64 bit-identical), striped over one shard per
  host, each advertised at its own host's address, a 36 MiB all_reduce among them (its chunks
  across hosts over 512 KiB, the last one short);
- the bytes over each host's link per all_reduce of S bytes stay within 1.1 x 2(H-1)/H·S each
  way, what a ring moves, however many ranks the host runs (the local stripe goes over shared
  memory; several ranks on a host combine there first, :mod:`gradstar.client.hierarchy`);
- the last host's link goes down mid-collective: every rank on the other hosts gets a named
  error (a lost shard or a lost rank, naming it) within :data:`NAMED_WITHIN` seconds, the
  coordinator keeps serving, and the ranks left form the job again (``JOB/again``) on the hosts
  left, exactly;
- before that, the same host's link is silent for :data:`SILENT_FOR` seconds (every packet
  dropped both ways, as a burst of losses on a far path) and comes back: nobody is named lost
  and the all_reduces go on (a live host whose packets TCP must send again is slow, not gone);
- all of it also with every two hosts 100 ms apart (delay lines, ``rtt=100``): far links
  change neither the results nor the bound on naming a lost host.

The rank program is :mod:`tests.cluster.rank`. Needs root and iproute2 (CI runs as root);
elsewhere it fails saying why.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.cluster.jobs import hosts_network, job_on_hosts, wait_reports

CHUNK = 2 << 20  # the default chunk: a multiple of it per shard keeps the stripes even
#: Seconds from a host's link going down to a named error on every other host: keepalive's
#: 1 s pings with a 2 s timeout, plus room for a loaded machine and a 100 ms round trip.
NAMED_WITHIN = 8.0
#: A silence a live host must survive. TCP sends a packet lost in it again a tail-loss probe
#: and then a retransmission timeout (200 ms plus the round trip) later, doubling: at 100 ms
#: about 0.35, 0.65, 1.25 and 2.45 s after it first went (on a LAN 0.2, 0.4, 0.8, 1.6, 3.2 s).
#: Inside the 4 s keepalive timeout (gradstar.transport.channels.KEEPALIVE_TIMEOUT_MS, which
#: gRPC also makes the socket's TCP_USER_TIMEOUT) every packet gets through; inside the 2 s one
#: it had, a ping sent in the first 0.55 s of the silence (at 100 ms) was the connection's end.
SILENT_FOR = 1.8
#: nftables rules that drop every packet on a host's link, both ways (the link stays up).
SILENCE = """table inet gradstar_silence {
    chain input { type filter hook input priority 0; policy accept; iifname "eth0" drop; }
    chain output { type filter hook output priority 0; policy accept; oifname "eth0" drop; }
}
"""
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("hosts", "per_host", "rtt"), [(3, 1, None), (2, 2, None), (3, 1, 100)],
                         ids=["3x1", "2x2", "3x1-100ms"])
def test_a_job_across_hosts_is_exact_within_link_bytes_and_survives_a_host(
        tmp_path, hosts, per_host, rtt):
    names = [f"host{h}" for h in range(hosts)]
    out = tmp_path / "out"
    out.mkdir()
    world, dead = hosts * per_host, names[-1]
    nbytes, iters = hosts * 3 * CHUNK, 3
    rank_argv = [sys.executable, "-m", "tests.cluster.rank", str(out), str(nbytes), str(iters)]
    rejoin = {h: {"CLUSTER_REJOIN_WORLD": "0" if h == dead else str(world - per_host)}
              for h in names}

    with hosts_network(names, rtt=rtt) as network:
        with job_on_hosts(network, tmp_path, per_host, rank_argv, rejoin) as (procs, hub):
            exact = wait_reports(out, "exact", world, procs, 120)
            shards = exact[0]["shards"]
            assert sorted(a.rsplit(":", 1)[0] for a in shards) == sorted(
                network.addresses.values()), "not one node-local shard per host"
            assert all(r["shards"] == shards for r in exact)

            # Every rank reads its host's counters; the ranks of one host read the same ones.
            measured = {r["host"]: r for r in wait_reports(out, "bytes", world, procs, 120)}
            bound = 1.1 * 2 * (hosts - 1) / hosts * nbytes * iters
            for host, r in sorted(measured.items()):
                print(f"{host}: rx {r['rx'] / bound * 1.1:.3f}, tx {r['tx'] / bound * 1.1:.3f} "
                      f"x 2(H-1)/H·S")
                assert r["rx"] <= bound and r["tx"] <= bound, (
                    f"{host} moved rx {r['rx']} / tx {r['tx']} bytes over its link for {iters} "
                    f"all_reduces of {nbytes} by {per_host} rank(s): over 1.1 x 2(H-1)/H·S "
                    f"({bound:.0f})")

            time.sleep(0.5)  # every rank is inside its all_reduce loop
            silence(network.namespaces[dead], SILENT_FOR)
            time.sleep(NAMED_WITHIN)  # a host taken for lost would be named by now
            named = sorted((out).glob("failure-*.json"))
            assert not named, (f"a link silent for {SILENT_FOR} s (rtt {rtt} ms) had a live host "
                               f"named lost: {[p.read_text() for p in named]}")
            assert all(p.poll() is None for p in procs), "a process exited during the silence"

            subprocess.run(["ip", "-n", network.namespaces[dead], "link", "set", "eth0", "down"],
                           check=True, timeout=20)
            down_at = time.time()
            survivors = [r["rank"] for r in exact if r["host"] != dead]
            failures = [f for f in wait_reports(out, "failure", 0, procs, 90, survivors)
                        if f["host"] != dead]
            assert sorted(f["rank"] for f in failures) == sorted(survivors)
            for f in failures:
                assert f["error"] in ("ShardLostError", "RankLostError"), f
                print(f"rank {f['rank']} on {f['host']}: {f['error']} "
                      f"{f['at'] - down_at:.2f} s after the link went down")
                assert f["at"] - down_at <= NAMED_WITHIN, (
                    f"rank {f['rank']} named the lost host {f['at'] - down_at:.1f} s after its "
                    f"link went down (rtt {rtt} ms), over {NAMED_WITHIN} s")
            assert hub.poll() is None, "the coordinator exited"

            again = wait_reports(out, "again", world - per_host, procs, 120)
            assert {r["world"] for r in again} == {world - per_host}
            left = sorted(network.addresses[h] for h in names if h != dead)
            assert sorted(a.rsplit(":", 1)[0] for a in again[0]["shards"]) == left


def silence(namespace: str, seconds: float) -> None:
    """Drop every packet on ``namespace``'s link for ``seconds``, then let them through again."""
    def nft(*argv: str, **kwargs) -> None:
        subprocess.run(["ip", "netns", "exec", namespace, "nft", *argv], check=True,
                       timeout=20, text=True, **kwargs)
    nft("-f", "-", input=SILENCE)
    try:
        time.sleep(seconds)
    finally:
        nft("delete", "table", "inet", "gradstar_silence")

"""The emulated cluster itself: hosts reach each other by name, each link is shaped both ways
by a token bucket at the configured rate, and the link counters account for what crossed; its
hosts' sockets run the congestion control asked for even where the machine's allowed list lacks
it, and the list is as it was after building (and after a failed build).

Nothing here is timed: the shaping is proved by the qdiscs installed on both ends of a link,
and the counters by the bytes of a real TCP transfer between two hosts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.emulated_cluster import (
    ClusterUnavailable,
    EmulatedCluster,
    allowing_congestion_control,
    congestion,
    rate_bytes_per_second,
)

ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"

PAYLOAD = 4 << 20
#: TCP/IP and Ethernet headers on ~64 KiB GSO segments of 1448-byte MSS: under 5 %.
OVERHEAD = 0.05

# Receives PAYLOAD bytes on a port it prints, then prints how many it got.
RECEIVER = """
import socket
with socket.create_server(("0.0.0.0", 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    got = 0
    while chunk := conn.recv(1 << 20):
        got += len(chunk)
    print(got, flush=True)
"""
# The congestion control of a connected socket and of the socket it was accepted on.
SOCKET_CC = """
import socket
with socket.create_server(("127.0.0.1", 0)) as server:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    print(*(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode()
            for s in (client, accepted)))
"""
SENDER = f"""
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    conn.sendall(bytes({PAYLOAD}))
"""


def test_rate_notation():
    assert rate_bytes_per_second("200mbit") == 25e6
    assert rate_bytes_per_second("1gbit") == 125e6
    assert rate_bytes_per_second("25mbps") == 25e6


def test_a_transfer_between_two_hosts_is_counted_on_both_shaped_links(cluster):
    net = cluster(["node0", "node1"], rate="200mbit")
    for host in ("node0", "node1"):
        shown = net.qdiscs(host)
        for side in ("upload", "download"):
            assert "tbf" in shown[side] and "rate 200Mbit" in shown[side], (host, side, shown)
    receiver = net.popen("node1", [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE,
                         text=True)
    port = int(receiver.stdout.readline())
    before = net.link_bytes()
    # By name: the host's /etc/hosts resolves the other host.
    sent = net.run("node0", [sys.executable, "-c", SENDER, "node1", str(port)], timeout=60)
    assert sent.returncode == 0, sent.stderr
    assert int(receiver.stdout.readline()) == PAYLOAD
    assert receiver.wait(timeout=10) == 0
    after = net.link_bytes()
    grew = {host: after[host] - before[host] for host in after}
    assert PAYLOAD <= grew["node0"].tx <= PAYLOAD * (1 + OVERHEAD), grew
    assert PAYLOAD <= grew["node1"].rx <= PAYLOAD * (1 + OVERHEAD), grew
    # The other direction carried only acknowledgements.
    assert grew["node1"].tx < PAYLOAD * OVERHEAD and grew["node0"].rx < PAYLOAD * OVERHEAD, grew


def test_a_host_whose_link_is_down_cannot_be_reached(cluster):
    net = cluster(["node0", "node1"], rate="200mbit")
    ping = [sys.executable, "-c", "import socket, sys; socket.create_connection("
            "(sys.argv[1], 9), timeout=2)", "node1"]
    # Up: node1 answers (a refusal: nothing listens on port 9), fast.
    assert "ConnectionRefusedError" in net.run("node0", ping).stderr
    net.link_down("node1")
    assert "timed out" in net.run("node0", ping).stderr
    net.link_up("node1")
    assert "ConnectionRefusedError" in net.run("node0", ping).stderr


def test_closing_removes_namespaces_and_processes(cluster):
    net = cluster(["node0"], rate=None)
    sleeper = net.popen("node0", ["sleep", "600"])
    namespaces = [h.namespace for h in net.hosts.values()] + [net.bridge]
    net.close()
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed


def _allowed() -> str:
    with open(ALLOWED, encoding="ascii") as file:
        return file.read()


def test_hosts_run_cubic_and_the_allowed_list_is_left_as_found(cluster):
    before = _allowed()
    net = cluster(["node0"], rate=None, congestion_control="cubic")
    assert _allowed() == before  # widened only while the hosts' default was set
    ran = net.run("node0", [sys.executable, "-c", SOCKET_CC])
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["cubic", "cubic"]


def test_sysctls_are_set_in_every_host_and_a_tag_names_the_namespaces(cluster, monkeypatch):
    monkeypatch.setenv("GRADSTAR_CLUSTER_TAG", "tst")
    net = cluster(["node0", "node1"], rate=None, sysctls={
        "net.ipv4.tcp_slow_start_after_idle": "0", "net.ipv4.tcp_wmem": "4096 16384 67108864"})
    for host in ("node0", "node1"):
        assert net.hosts[host].namespace.startswith("gs-tst-")
        ran = net.run(host, ["cat", "/proc/sys/net/ipv4/tcp_slow_start_after_idle",
                             "/proc/sys/net/ipv4/tcp_wmem"])
        assert ran.stdout.split() == ["0", "4096", "16384", "67108864"], ran.stderr
    monkeypatch.setenv("GRADSTAR_CLUSTER_TAG", "Not-Ok")
    with pytest.raises(ValueError, match="GRADSTAR_CLUSTER_TAG must be 1-4 lowercase"):
        EmulatedCluster(["node0"])


def test_the_allowed_list_is_widened_in_the_block_and_restored_when_it_raises(
        tmp_path, monkeypatch):
    allowed = tmp_path / "allowed"  # the machine's list is never widened for this test
    allowed.write_text("reno bbr\n")
    monkeypatch.setattr(congestion, "_ALLOWED", allowed)
    monkeypatch.setattr(congestion, "_ALLOWED_LOCK", tmp_path / "lock")
    with pytest.raises(RuntimeError, match="boom"), allowing_congestion_control("cubic"):
        assert allowed.read_text() == "reno bbr cubic\n"
        raise RuntimeError("boom")
    assert allowed.read_text() == "reno bbr\n"
    with allowing_congestion_control("bbr"):  # already allowed: left alone
        assert allowed.read_text() == "reno bbr\n"


def test_a_congestion_control_the_kernel_lacks_fails_the_build_saying_so():
    before = _allowed()
    with pytest.raises(ClusterUnavailable, match="does not offer TCP congestion control "
                                                 "'nosuchcc'"):
        EmulatedCluster(["node0"], rate=None, congestion_control="nosuchcc").build()
    assert _allowed() == before

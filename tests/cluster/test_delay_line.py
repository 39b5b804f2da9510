"""Far links: the emulated cluster's delay line (:mod:`benchmarks.emulated_cluster.delay_line`).

- A TCP handshake (one round trip; this machine has no ``ping``) between two hosts takes the
  configured round trip: ``rtt=50`` puts two hosts 50 ms apart, a per-host map adds the two
  hosts' round trips to the core, and hosts without a line are under 5 ms apart.
- TCP runs through the line end to end, so a flow whose socket buffers are fixed (autotuning
  off) carries about its window per round trip, while the same flow between two near hosts is
  far faster; the line drops nothing on the way.
- A gradstar all_reduce across two far hosts is bit-identical to numpy's sum.
- The convention itself (no cluster): ``rtt=MS`` gives each line MS/4 each way, a map MS/2,
  and a bad round trip fails before anything is built.

These are ratios of the emulated network's own behaviour (what the harness promises), not
timings of the product.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from benchmarks.emulated_cluster import EmulatedCluster, one_way_delays, parse_rtt

pytestmark = pytest.mark.timeout(120)

# Accepts connections on a port it prints, and closes each at once.
ACCEPTOR = """
import socket
with socket.create_server(("0.0.0.0", 0)) as server:
    print(server.getsockname()[1], flush=True)
    while True:
        server.accept()[0].close()
"""
# Times COUNT TCP handshakes to HOST:PORT (each one round trip) and prints them in seconds.
HANDSHAKES = """
import socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socket.create_connection((host, port), timeout=10).close()  # ARP resolved before the count
for _ in range(count):
    t0 = time.perf_counter()
    socket.create_connection((host, port), timeout=10).close()
    print(time.perf_counter() - t0)
"""
WINDOW = 256 << 10
PAYLOAD, SKIP = 6 << 20, 1 << 20
# Receives on a port it prints, its receive buffer fixed at WINDOW before listening (so
# autotuning is off), and prints the rate in bytes per second after the first SKIP bytes (slow
# start), up to the end of the stream.
RECEIVER = f"""
import socket, time
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, {WINDOW})
server.bind(("0.0.0.0", 0))
server.listen()
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
got, t0 = 0, None
while chunk := conn.recv(1 << 20):
    got += len(chunk)
    if t0 is None and got >= {SKIP}:
        t0, at = time.perf_counter(), got
print((got - at) / (time.perf_counter() - t0), got, flush=True)
"""
# Sends PAYLOAD from a send buffer fixed large enough that the receiver's window alone limits
# the flow, and prints that window as the kernel last saw it (struct tcp_info's tcpi_snd_wnd,
# at byte 228 since Linux 6.2; its fields are only ever appended).
SENDER = f"""
import socket, struct, sys
conn = socket.socket()
conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, {4 * WINDOW})
conn.connect((sys.argv[1], int(sys.argv[2])))
conn.sendall(bytes({PAYLOAD}))
print(struct.unpack_from("I", conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232), 228)[0])
conn.close()
"""
N = (4 << 20) // 4 + 3  # float32 elements: several chunks, the last one short
RANK = f"""
import sys
import numpy as np
import gradstar
rank = int(sys.argv[1])
xs = [np.random.default_rng(seed).standard_normal({N}).astype(np.float32) for seed in (1, 2)]
with gradstar.init_process_group(coordinator=sys.argv[2], job="far", world_size=2,
                                 rank=rank) as pg:
    got = pg.all_reduce(xs[rank].copy(), op="sum")
print("exact" if np.array_equal(got, xs[0] + xs[1]) else f"differs: {{got[:4]}}", flush=True)
"""


def _started(proc: subprocess.Popen) -> str:
    """The first line ``proc`` prints (its port), or a failure quoting what it said."""
    line = proc.stdout.readline()
    if not line:
        pytest.fail(f"it exited before it printed a port: {proc.stderr.read()}")
    return line.strip()


def round_trip_ms(net, client: str, server: str, count: int = 7) -> float:
    """The median of ``count`` TCP handshakes from ``client`` to ``server``, in ms."""
    acceptor = net.popen(server, [sys.executable, "-c", ACCEPTOR], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    port = _started(acceptor)
    ran = net.run(client, [sys.executable, "-c", HANDSHAKES, server, port, str(count)],
                  timeout=30)
    assert ran.returncode == 0, ran.stderr
    net.stop_processes([acceptor])
    return statistics.median(float(s) for s in ran.stdout.split()) * 1e3


def window_limited_rate(net, client: str, server: str) -> tuple[float, int]:
    """Bytes per second of one TCP flow from ``client`` to ``server`` whose buffers are fixed,
    and the receive window it was given (bytes)."""
    receiver = net.popen(server, [sys.executable, "-c", RECEIVER], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    port = _started(receiver)
    sent = net.run(client, [sys.executable, "-c", SENDER, server, port], timeout=40)
    assert sent.returncode == 0, sent.stderr
    out, err = receiver.communicate(timeout=20)
    rate, got = out.split()
    assert int(got) == PAYLOAD, err
    return float(rate), int(sent.stdout)


def test_two_hosts_are_the_configured_round_trip_apart(cluster):
    far = cluster(["node0", "node1"], rate="200mbit", rtt=50)
    measured = round_trip_ms(far, "node0", "node1")
    print(f"rtt=50: {measured:.2f} ms")
    assert 48 <= measured <= 55, f"rtt=50 measured {measured:.2f} ms"


def test_a_map_gives_each_host_its_round_trip_to_the_core(cluster):
    regions = cluster(["near0", "near1", "far0"], rate="200mbit",
                      rtt={"near0": 10, "far0": 40})  # near1 is left out: 0, no line
    assert regions.delay_line_cpu().keys() == {"near0", "far0"}
    for a, b, want in (("near0", "far0", 50), ("near0", "near1", 10), ("near1", "far0", 40)):
        measured = round_trip_ms(regions, a, b)
        print(f"{a} - {b}: {measured:.2f} ms (configured {want})")
        assert want - 2 <= measured <= want + 5, f"{a} - {b}: {measured:.2f} ms, not {want}"


def test_a_tcp_window_carries_its_size_per_round_trip_and_the_line_drops_nothing(cluster):
    # far0 is 100 ms from near0, far1 50 ms; near0 and near1 have no line.
    net = cluster(["far0", "far1", "near0", "near1"], rate=None,
                  rtt={"far0": 100, "far1": 50})
    near_ms = round_trip_ms(net, "near0", "near1")
    assert near_ms < 5, f"two hosts without a line are {near_ms:.2f} ms apart"
    rates, windows = {}, {}
    for client, rtt_s in (("far0", 0.100), ("far1", 0.050), ("near1", near_ms / 1e3)):
        rates[client], windows[client] = window_limited_rate(net, client, "near0")
        print(f"{client} -> near0 at {rtt_s * 1e3:.2f} ms: {rates[client] / 1e6:.2f} MB/s, "
              f"window {windows[client]} B (buffers {WINDOW} B): window/RTT "
              f"{windows[client] / rtt_s / 1e6:.2f} MB/s")
    predicted = windows["far0"] / 0.100
    assert 0.5 * predicted <= rates["far0"] <= 1.3 * predicted, (
        f"{rates['far0'] / 1e6:.2f} MB/s over 100 ms, window/RTT predicts "
        f"{predicted / 1e6:.2f} MB/s")
    halved = rates["far1"] / rates["far0"] * windows["far0"] / windows["far1"]
    assert 1.5 <= halved <= 2.5, f"half the round trip gave {halved:.2f} x the rate, not 2"
    assert rates["near1"] > 10 * rates["far0"], rates
    for host, stats in net.delay_line_stats().items():
        assert stats.upload.bytes >= PAYLOAD, stats
        assert stats.upload.lost == 0 and stats.download.lost == 0, (host, stats)
    assert net.delay_line_stats()["far0"].delay_s == pytest.approx(0.05)
    # Its CPU is the benchmarks' to report (/proc counts in 10 ms ticks: a few here).
    print(f"delay lines' CPU: {net.delay_line_cpu()} s")


def test_an_all_reduce_between_far_hosts_is_exact(cluster):
    far = cluster(["node0", "node1"], rate="200mbit", rtt=50)
    env = {"PATH": "/usr/bin:/bin", "GRADSTAR_TOKEN": "far-token", "PYTHONUNBUFFERED": "1"}
    hub = far.popen("node0", [sys.executable, "-m", "gradstar", "coordinator", "--host",
                              "0.0.0.0", "--port", "0", "--shards", "0"], env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = ""
    while "listening on" not in line:  # bounded by the test's timeout
        line = hub.stdout.readline()
        assert line, "the coordinator exited before it listened"
    address = f"{far.address('node0')}:{int(line.rsplit(':', 1)[1])}"
    ranks = [far.popen(host, [sys.executable, "-c", RANK, str(rank), address], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, host in enumerate(["node0", "node1"])]
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=90)
        assert out.strip() == "exact", f"rank {rank}: {out} {err[-2000:]}"


def test_the_round_trip_convention():
    assert one_way_delays(["a", "b"], 50) == {"a": 0.0125, "b": 0.0125}
    assert one_way_delays(["a", "b", "c"], {"a": 10, "c": 40}) == {
        "a": 0.005, "b": 0.0, "c": 0.02}
    assert one_way_delays(["a"], None) == {"a": 0.0}
    assert parse_rtt(["50"]) == 50.0
    assert parse_rtt(["a=10", "c=40"]) == {"a": 10.0, "c": 40.0}
    for words in (["a=1", "2"], [], ["a=b=1"]):
        with pytest.raises(ValueError, match="--rtt takes MS or HOST=MS"):
            parse_rtt(words)
    with pytest.raises(ValueError, match="rtt names hosts the cluster does not have"):
        EmulatedCluster(["a"], rtt={"z": 5})
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="round trips must be finite"):
            EmulatedCluster(["a"], rtt=bad)
    # Nothing at 0: no host gets a line unless it is forced.
    assert all(h.line_namespace is None for h in EmulatedCluster(["a", "b"], rtt=0).hosts.values())
    assert all(h.line_namespace for h in EmulatedCluster(
        ["a", "b"], rtt=0, force_delay_line=True).hosts.values())

"""The rank's straggler log line (gradstar.client.stragglers.StragglerLog) on a fake clock:
past the threshold only, once per window, naming the ranks and hosts, counting what it left out."""

from __future__ import annotations

import logging

from gradstar.client.stragglers import StragglerLog, peer_hosts
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.proto.v1 import rendezvous_pb2 as rpb


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def late(*pairs) -> list[pb.LateRank]:
    return [pb.LateRank(rank=r, lag_seconds=s) for r, s in pairs]


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gradstar.client.stragglers"]


def test_one_line_per_window_naming_ranks_and_hosts(caplog):
    caplog.set_level(logging.WARNING, logger="gradstar.client.stragglers")
    clock = Clock()
    log = StragglerLog("job 'j'", {3: "node-c", 5: "node-e"}, threshold=0.5, window=60,
                       clock=clock)
    log.saw(1, late((3, 0.2)))  # under the threshold: nothing
    assert lines(caplog) == []
    log.saw(2, late((3, 0.8), (5, 0.6), (4, 0.1)))
    (first,) = lines(caplog)
    assert first.startswith("collective seq 2 of job 'j' waited for rank 3 (host node-c) "
                            "0.8 s late; rank 5 (host node-e) 0.6 s late; next such line in "
                            "60 s")
    assert "rank 4" not in first
    for seq in range(3, 10):  # within the window: counted, not logged
        clock.now += 5
        log.saw(seq, late((3, 0.9)))
    assert len(lines(caplog)) == 1 and log.quiet == 7
    clock.now = 100.0 + 60
    log.saw(10, late((7, 1.5)))
    second = lines(caplog)[1]
    assert "seq 10" in second and "rank 7 (host ?) 1.5 s late" in second
    assert "(7 more collectives waited over 0.5 s since the last such line)" in second
    assert log.quiet == 0


def test_a_zero_threshold_logs_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="gradstar.client.stragglers")
    log = StragglerLog("job 'j'", {}, threshold=0, window=0)
    log.saw(1, late((1, 30.0)))
    assert lines(caplog) == []


def test_hosts_come_from_the_peer_table():
    peers = [rpb.Peer(rank=0, address="10.0.0.1:5000", host="k0", hostname="node-a"),
             rpb.Peer(rank=1, address="10.0.0.2:5000", host="k1"),
             rpb.Peer(rank=2, host="k2")]
    assert peer_hosts(peers) == {0: "node-a", 1: "10.0.0.2", 2: "k2"}

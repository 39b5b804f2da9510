"""The rules a rank follows on far links, without sockets: how many connections a round trip
needs (:mod:`gradstar.client.collective.connections`), which connection a collective takes
(:class:`gradstar.client.collective.targets.Target`), and how a large all_reduce is cut into
parts (:mod:`gradstar.client.process_group.parts`)."""

from __future__ import annotations

import itertools

import pytest

from gradstar.client.collective import connections
from gradstar.client.collective.targets import Target
from gradstar.client.process_group.parts import MAX_PARTS, PART_BYTES, SPLIT_BYTES, part_bounds

MIB = 1 << 20


def test_connections_carry_the_fill_rate_at_the_round_trip():
    window = 4 * MIB
    # 125 MB/s x RTT / 4 MiB, rounded up: one on a LAN, six at 200 ms, capped at the most.
    assert connections.connections_for(0.0005, window) == 1
    assert connections.connections_for(0.0, window) == 1
    assert connections.connections_for(0.025, window) == 1
    assert connections.connections_for(0.050, window) == 2
    assert connections.connections_for(0.100, window) == 3
    assert connections.connections_for(0.200, window) == 6
    assert connections.connections_for(10.0, window) == connections.MAX_CONNECTIONS
    # A host whose tcp_wmem allows 64 MiB needs one connection where 4 MiB needed six.
    assert connections.connections_for(0.200, 64 * MIB) == 1


def test_the_send_window_is_read_from_tcp_wmem(tmp_path):
    wmem = tmp_path / "tcp_wmem"
    wmem.write_text("4096\t16384\t67108864\n")
    assert connections.send_window_bytes(wmem) == 64 * MIB
    wmem.write_text("garbage")
    assert connections.send_window_bytes(wmem) == connections.DEFAULT_SEND_WINDOW
    assert connections.send_window_bytes(tmp_path / "missing") == \
        connections.DEFAULT_SEND_WINDOW


class _Call:
    def __init__(self, connection: int) -> None:
        self.connection = connection

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass


def _target(n: int) -> Target:
    calls = [lambda requests, c=c, **kwargs: _Call(c) for c in range(n)]
    return Target(calls[0], "far:1", connections=calls)


def test_collectives_at_once_take_distinct_connections_and_the_warm_ones_again():
    target = _target(6)
    first = [target.open(()) for _ in range(4)]
    assert sorted(s.connection for s in first) == [0, 1, 2, 3]
    assert [s.call.connection for s in first] == [s.connection for s in first]
    for stream in first:
        target.put_back(stream)
    # The next step's four collectives reuse those four streams, never a cold connection.
    second = [target.open(()) for _ in range(4)]
    assert sorted(s.connection for s in second) == [0, 1, 2, 3]
    assert {id(s) for s in second} == {id(s) for s in first}
    # A failed one frees its connection too, and its stream is not kept.
    target.discard(second[0])
    again = target.open(())
    assert again.connection == second[0].connection and again is not second[0]


def test_a_target_of_one_connection_opens_every_stream_on_it():
    calls = []
    target = Target(lambda requests, **kwargs: calls.append(1) or _Call(0), "near:1")
    streams = [target.open(()) for _ in range(3)]
    assert [s.connection for s in streams] == [0, 0, 0] and len(calls) == 3


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_parts_cover_the_tensor_once_in_order(itemsize):
    for nbytes in (SPLIT_BYTES, 64 * MIB, 64 * MIB + 3 * itemsize, 1 << 30):
        size = nbytes // itemsize
        bounds = part_bounds(size, itemsize)
        assert 2 <= len(bounds) <= MAX_PARTS
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        assert all((b - a) * itemsize >= PART_BYTES // 2 for a, b in bounds)
        assert all(a * itemsize % (64 << 10) == 0 for a, _ in bounds)


def test_small_all_reduces_and_split_bytes_zero_are_not_split():
    assert part_bounds((SPLIT_BYTES - 4) // 4, 4) == []
    assert part_bounds((64 * MIB) // 4, 4, split_bytes=0) == []
    assert part_bounds((64 * MIB) // 4, 4, split_bytes=128 * MIB) == []
    assert len(part_bounds((64 * MIB) // 4, 4, split_bytes=16 * MIB)) == 4


def test_far_hosts_are_told_which_tcp_settings_cost_them(tmp_path):
    restart = tmp_path / "tcp_slow_start_after_idle"
    restart.write_text("1\n")
    control = tmp_path / "tcp_congestion_control"
    control.write_text("cubic\n")
    def advice(rtt, window):
        return connections.host_tuning_advice(rtt, window, restart, control)
    assert advice(0.005, 4 * MIB) is None  # a LAN: nothing
    said = advice(0.100, 4 * MIB)
    assert "round trip to the hub is 100 ms" in said
    assert "net.ipv4.tcp_slow_start_after_idle=0" in said
    assert "congctl bbr" in said and "cubic now" in said  # or BBR on the far routes
    assert "net.ipv4.tcp_wmem='4096 16384 67108864'" in said and "336 Mbit/s" in said
    restart.write_text("0\n")
    said = advice(0.100, 4 * MIB)
    assert "slow_start_after_idle" not in said and "bbr" not in said and "tcp_wmem" in said
    assert advice(0.100, 64 * MIB) is None  # tuned already
    # BBR never restarts after idle (Linux skips it for a congestion control with its own
    # control loop), whatever tcp_slow_start_after_idle says.
    restart.write_text("1\n")
    control.write_text("bbr\n")
    assert advice(0.100, 64 * MIB) is None
    control.unlink()  # unreadable: the restart is assumed, as Linux's default
    assert "slow_start_after_idle=0" in advice(0.100, 64 * MIB)


@pytest.mark.parametrize(("world_size", "configured", "auto", "want"), [
    (2, 0, True, 6),     # one far rank: enough windows for 1 Gbit/s at 200 ms
    (4, 0, True, 1),     # four ranks into one hub: one each (more measured slower)
    (2, 0, False, 1),    # a hub shard: one unless configured
    (4, 3, False, 3),    # GRADSTAR_CONNECTIONS sets every target's count
])
async def test_the_data_plane_sizes_connections_by_round_trip_and_world(
        monkeypatch, world_size, configured, auto, want):
    from gradstar.client.collective.data_plane import DataPlane
    from gradstar.config import ClientSettings

    async def two_hundred_ms(channel, metadata, timeout):
        return 0.200

    monkeypatch.setattr(connections, "round_trip", two_hundred_ms)
    monkeypatch.setattr(connections, "send_window_bytes", lambda path=None: 4 * MIB)
    monkeypatch.setattr(connections, "host_tuning_advice", lambda rtt: None)
    plane = DataPlane.__new__(DataPlane)  # no channels: _count needs only the settings
    plane.settings = ClientSettings(connections=configured)
    assert await plane._count(None, (), 5.0, auto, world_size) == want

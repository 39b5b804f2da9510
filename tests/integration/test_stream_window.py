"""The hub's receive window per stream (``stream_window_bytes``) is what its servers tell every
connecting peer, read off the wire: the HTTP/2 SETTINGS frame a real coordinator and a real
shard send first.

The window bounds what gRPC takes in of a stream the hub holds back (its read window), so it
bounds the hub's memory for a late rank (``tests/robustness/test_memory.py``); left to gRPC it
grows with gRPC's bandwidth estimate instead.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

from gradstar.config import CoordinatorSettings, ShardSettings
from gradstar.coordinator.shards import Shard
from gradstar.transport.channels import stream_window_options

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x4, 0x4, 0x5
#: HTTP/2's initial window when a server says nothing of it (RFC 9113, 6.5.2).
HTTP2_DEFAULT_WINDOW = 65_535


async def advertised_settings(port: int) -> dict[int, int]:
    """The HTTP/2 settings of the server on 127.0.0.1:``port`` by identifier: its first frame,
    after a client's preface and empty SETTINGS."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(PREFACE + struct.pack(">I", 0)[1:] + bytes([SETTINGS, 0]) + bytes(4))
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(9), 5)
        length, kind = int.from_bytes(head[:3], "big"), head[3]
        assert kind == SETTINGS, f"the server's first frame is of type {kind}, not SETTINGS"
        body = await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()
    return dict(struct.unpack(">HI", body[i:i + 6]) for i in range(0, length, 6))


async def advertised_window(port: int) -> int:
    """The SETTINGS_INITIAL_WINDOW_SIZE of the server on 127.0.0.1:``port``."""
    return (await advertised_settings(port)).get(INITIAL_WINDOW_SIZE, HTTP2_DEFAULT_WINDOW)


@pytest.mark.parametrize("window", [1 << 20, 16 << 20])
async def test_stream_window_bytes_is_the_window_both_ports_advertise(start_coordinator, window):
    hub = await start_coordinator(stream_window_bytes=window)
    # Both ports carry collectives (the sessions' port for ranks of an earlier version).
    for port in (hub.collective_port, int(hub.address.rsplit(":", 1)[1])):
        settings = await advertised_settings(port)
        assert settings[INITIAL_WINDOW_SIZE] == window
        assert settings[MAX_FRAME_SIZE] == min(window, (1 << 24) - 1)


def test_a_fixed_window_turns_grpcs_probing_off_and_zero_leaves_it_on():
    # gRPC's starting window happens to be 4 MiB too: what bounds it is that probing, which
    # grows the window with gRPC's bandwidth estimate, is off.
    assert CoordinatorSettings().stream_window_bytes == 4 << 20
    assert stream_window_options(4 << 20) == [("grpc.http2.bdp_probe", 0),
                                              ("grpc.http2.lookahead_bytes", 4 << 20),
                                              ("grpc.http2.max_frame_size", 4 << 20)]
    # Frames as large as the window, within what HTTP/2 allows (as gRPC's probing sizes them).
    assert dict(stream_window_options(64 << 20))["grpc.http2.max_frame_size"] == (1 << 24) - 1
    assert dict(stream_window_options(1024))["grpc.http2.max_frame_size"] == 1 << 14
    assert stream_window_options(0) == []


async def test_a_shard_fixes_its_streams_window_too(coordinator):
    shard = Shard(ShardSettings(host="127.0.0.1", port=0, coordinator=coordinator.address,
                                stream_window_bytes=2 << 20))
    await asyncio.wait_for(shard.start(), 20)
    try:
        assert await advertised_window(shard.port) == 2 << 20
    finally:
        await asyncio.wait_for(shard.stop(), 20)


async def test_the_coordinators_own_shards_get_its_window(start_coordinator):
    hub = await start_coordinator(shards=1, stream_window_bytes=3 << 20)
    ports = [int(record.address.rsplit(":", 1)[1]) for record in hub.shards.up]
    assert len(ports) == 1
    assert await advertised_window(ports[0]) == 3 << 20

"""How a striped collective is cut into chunks (client/collective/data_plane.py,
striped_chunk_bytes)."""

from __future__ import annotations

from gradstar.client.collective.data_plane import (
    CHUNKS_PER_STRIPE,
    MIN_STRIPED_CHUNK,
    striped_chunk_bytes,
)

MiB = 1 << 20
CONFIGURED = 2 * MiB


def test_one_target_keeps_the_configured_chunk():
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 1) == CONFIGURED


def test_a_stripe_gets_enough_chunks_up_to_the_configured_size():
    assert striped_chunk_bytes(CONFIGURED, 16 * MiB, 4) == 16 * MiB // (4 * CHUNKS_PER_STRIPE)
    assert striped_chunk_bytes(CONFIGURED, 256 * MiB, 4) == CONFIGURED
    # 64 MiB over 2 hosts' shards: 2 MiB chunks; over 4: 1 MiB; 16 MiB over 4: 256 KiB.
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 2) == 2 * MiB
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 4) == MiB
    assert striped_chunk_bytes(CONFIGURED, 16 * MiB, 4) == 256 << 10


def test_a_configured_size_is_kept_whatever_it_is():
    assert striped_chunk_bytes(16 * MiB, 4 << 30, 8) == 16 * MiB
    assert striped_chunk_bytes(32 << 10, 64 * MiB, 4) == 32 << 10


def test_tiny_collectives_stop_at_the_smallest_chunk():
    assert striped_chunk_bytes(CONFIGURED, MiB, 4) == MIN_STRIPED_CHUNK

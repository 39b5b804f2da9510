"""How a striped collective is cut into chunks (client/collective/data_plane.py,
striped_chunk_bytes)."""

from __future__ import annotations

import pytest

from gradstar.client.collective.data_plane import (
    CHUNKS_PER_STRIPE,
    MAX_CHUNK_ACROSS_HOSTS,
    MIN_STRIPED_CHUNK,
    striped_chunk_bytes,
)

MiB = 1 << 20
CONFIGURED = 2 * MiB


@pytest.mark.parametrize("spans_hosts", [False, True])
def test_one_target_keeps_the_configured_chunk(spans_hosts):
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 1, spans_hosts) == CONFIGURED


def test_within_one_host_a_stripe_gets_enough_chunks_up_to_the_configured_size():
    assert striped_chunk_bytes(CONFIGURED, 16 * MiB, 4) == 16 * MiB // (4 * CHUNKS_PER_STRIPE)
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 4) == MiB
    assert striped_chunk_bytes(CONFIGURED, 256 * MiB, 4) == CONFIGURED  # shm: big chunks


def test_across_hosts_chunks_stay_small_enough_for_a_short_drain():
    assert striped_chunk_bytes(16 * MiB, 64 * MiB, 2, True) == MAX_CHUNK_ACROSS_HOSTS
    assert striped_chunk_bytes(16 * MiB, 4 << 30, 8, True) == MAX_CHUNK_ACROSS_HOSTS
    assert striped_chunk_bytes(16 * MiB, 4 << 30, 8) == 16 * MiB  # within a host: no cap


def test_across_hosts_a_stripe_still_gets_its_chunks():
    # 64 MiB over 2 hosts: 2 MiB chunks; over 4: 1 MiB; 16 MiB over 4: 256 KiB.
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 2, True) == 2 * MiB
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 4, True) == 64 * MiB // (
        4 * CHUNKS_PER_STRIPE) == MiB
    assert striped_chunk_bytes(CONFIGURED, 16 * MiB, 4, True) == 256 << 10


def test_tiny_collectives_stop_at_the_smallest_chunk_and_a_smaller_configured_one_wins():
    assert striped_chunk_bytes(CONFIGURED, MiB, 4, True) == MIN_STRIPED_CHUNK
    assert striped_chunk_bytes(32 << 10, 64 * MiB, 4, True) == 32 << 10

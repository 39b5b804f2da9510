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
from gradstar.config import ClientSettings

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
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 4, True) == MAX_CHUNK_ACROSS_HOSTS
    assert striped_chunk_bytes(CONFIGURED, 4 << 30, 8, True) == MAX_CHUNK_ACROSS_HOSTS
    assert striped_chunk_bytes(CONFIGURED, 16 * MiB, 4, True) == 256 << 10


def test_tiny_collectives_stop_at_the_smallest_chunk_and_a_smaller_configured_one_wins():
    assert striped_chunk_bytes(CONFIGURED, MiB, 4, True) == MIN_STRIPED_CHUNK
    assert striped_chunk_bytes(32 << 10, 64 * MiB, 4, True) == 32 << 10


def test_a_chunk_size_the_user_chose_is_kept_across_hosts():
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 2, True, chosen=True) == CONFIGURED
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 4, True, chosen=True) == MiB  # 16 a stripe
    assert striped_chunk_bytes(CONFIGURED, 64 * MiB, 2, True) == MAX_CHUNK_ACROSS_HOSTS


def test_the_group_knows_whether_the_user_chose_the_chunk_size(monkeypatch):
    # What AsyncProcessGroup reads (settings.model_fields_set): given, or from the environment.
    monkeypatch.delenv("GRADSTAR_CHUNK_BYTES", raising=False)
    assert "chunk_bytes" not in ClientSettings().model_fields_set
    assert "chunk_bytes" in ClientSettings(chunk_bytes=CONFIGURED).model_fields_set
    monkeypatch.setenv("GRADSTAR_CHUNK_BYTES", str(CONFIGURED))
    assert "chunk_bytes" in ClientSettings().model_fields_set
    chosen = ClientSettings().model_copy(update={"job": "j", "world_size": 2})
    assert "chunk_bytes" in chosen.model_fields_set  # as join.py copies it

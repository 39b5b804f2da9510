"""NAT traversal seen from a rank, against a real coordinator: a hub shard that cannot be
punched through to fails the join within its timeout, naming the shard, why the punch failed
and the setting that takes the other road, never a hang (the punch itself across emulated NAT:
tests/cluster/test_outbound_hosts.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gradstar.client.collective.data_plane import DataPlane
from gradstar.config import ClientSettings
from gradstar.errors import CoordinatorUnavailableError
from gradstar.transport.relay import relay_metadata

pytestmark = pytest.mark.timeout(60)


async def test_a_shard_that_cannot_be_punched_through_fails_the_join_by_name(coordinator):
    """The data plane of a made-up member whose one stripe is "behind NAT": the coordinator
    refuses its punch (not a member), so no connection ever reaches the shard."""
    settings = ClientSettings(coordinator=coordinator.address, job="nat")
    collectives = f":{coordinator.collective_port}"
    plane = DataPlane(settings, ["127.0.0.1:9"], collectives, ["127.0.0.1:9"],
                      caller=lambda stripe: relay_metadata("nat", 1, 0, "0" * 32, "punch",
                                                           stripe))
    assert set(plane.routes) == {0}
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailableError) as raised:
        await asyncio.wait_for(plane.connect(3.0), 20)
    assert time.monotonic() - started < 15
    message = str(raised.value)
    assert "hub shard 0" in message and "behind NAT" in message, message
    assert "NAT traversal failed" in message and "no generation" in message, message
    assert "GRADSTAR_NAT_TRAVERSAL=0" in message, message
    await plane.close()

"""Where a rank's collective streams go: the coordinator, or the generation's hub shards.

The coordinator's ``Joined`` answer lists the shards the generation stripes over (empty: the
coordinator carries every collective itself). The rank opens one channel per shard, with the
coordinator channel's TLS settings and token, so each shard's stripe travels on its own TCP
connection. A shard address with no host (``:PORT``, as local shards advertise themselves)
means the host this rank reaches the coordinator at. Parameter-averaging rounds always go to
the coordinator, which keeps the job's global model.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from gradstar.config import ClientSettings
from gradstar.transport.channels import open_channel
from gradstar.wire import COLLECTIVE_METHOD

from .collective_stream import SharedMemoryOffer, Target


def resolve(address: str, coordinator: str) -> str:
    """``address`` with an empty host replaced by the coordinator's host."""
    if not address.startswith(":"):
        return address
    host = coordinator.rsplit(":", 1)[0] if ":" in coordinator else coordinator
    return f"{host}{address}"


class DataPlane:
    """The coordinator's :class:`Target` and one per hub shard of the generation."""

    def __init__(self, settings: ClientSettings, coordinator: grpc.aio.Channel,
                 shards: list[str]) -> None:
        self.coordinator = Target(coordinator.stream_stream(COLLECTIVE_METHOD),
                                  settings.coordinator,
                                  shm=SharedMemoryOffer(settings.shared_memory))
        #: The shards' addresses, in stripe order, as this rank reaches them.
        self.addresses = [resolve(a, settings.coordinator) for a in shards]
        self._channels = [open_channel(settings, address) for address in self.addresses]
        self.shards = [
            Target(channel.stream_stream(COLLECTIVE_METHOD), address,
                   f"hub shard {k} at {address}", SharedMemoryOffer(settings.shared_memory))
            for k, (channel, address) in enumerate(zip(self._channels, self.addresses,
                                                       strict=True))]

    def targets(self, averaging: bool = False) -> list[Target]:
        """Where a collective's stripes go, in stripe order (averaging rounds: the coordinator,
        which keeps the global model)."""
        if averaging or not self.shards:
            return [self.coordinator]
        return self.shards

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.gather(*(c.close() for c in self._channels))

"""Where a rank's collective streams go: the coordinator, or the generation's hub shards.

The coordinator's ``Joined`` answer lists the shards the generation stripes over (empty: the
coordinator carries every collective itself). The rank opens one channel per shard, with the
coordinator channel's TLS settings and token, so each shard's stripe travels on its own TCP
connection. A shard address with no host (``:PORT``, as local shards advertise themselves)
means the host this rank reaches the coordinator at. Parameter-averaging rounds always go to
the coordinator, which keeps the job's global model. Joining waits until every shard is
connected (:meth:`DataPlane.connect`), as it waits for the coordinator, so that a shard this
rank cannot reach fails the join with its cause named (a TLS mismatch within a second or two).
"""

from __future__ import annotations

import asyncio
import contextlib

from gradstar.config import ClientSettings
from gradstar.transport.channels import open_channel
from gradstar.transport.tls_check import wait_connected
from gradstar.wire import COLLECTIVE_METHOD

from .targets import SharedMemoryOffer, Target

#: A collective striped over K targets is cut into at least this many chunks per target, down
#: to MIN_STRIPED_CHUNK bytes: with the default 2 MiB chunk, 1 MiB over 4 shards was one chunk
#: (every byte to shard 0, 13% of the link-bound ideal on the emulated cluster) and 16 MiB two
#: per shard (pipeline fill and drain dominated). Measured with 4 node-local shards at 200
#: Mbit/s (benchmarks/cluster.py --chunk-mb): 64 MiB took 4977 ms in 2 MiB chunks, 4822 in 1 MiB,
#: 4696 in 0.5 MiB; 1 MiB over 4 shards-extra-hosts 320 ms in one chunk, 84 in 64 KiB ones.
CHUNKS_PER_STRIPE = 16
MIN_STRIPED_CHUNK = 64 << 10
#: The same holds across hosts (node-local shards, 64 MiB), where the chunks used to be at most
#: 512 KiB: a shard can send a chunk's result only once every rank's chunk arrived, so the
#: first and last chunks' round trips are the pipeline's fill and drain, while at 5-10 Gbit/s
#: the CPU is the limit and every message costs both ends far more than its bytes (gRPC hands
#: each one between its threads and the event loop: wakeups and context switches were a
#: quarter of a rank's and a shard's CPU under perf). Measured on the emulated cluster (2
#: loaded cores; 3-4 A/B runs against 512 KiB, docs/performance.md): 2 hosts x 1 at 10 Gbit/s,
#: now 2 MiB chunks, through torch.distributed under torchrun (benchmarks/cluster_torch.py)
#: ranks' + shards' CPU-s/GB 1.65 -> 1.38 and 1.76x -> 1.54x gloo; 4 hosts x 1 at 5 Gbit/s,
#: now 1 MiB, the SDK's node-local row 360 -> 300 ms. At 200 Mbit/s, quiet (load < 1), 4 runs
#: each: 4 hosts x 1 4234-4381 ms in 512 KiB chunks, 4250-4470 in 1 MiB (medians 4253 / 4320,
#: +1.6%; gloo 4227-4238); 2 hosts x 1 2813-2818 ms in both; 1 Gbit/s 1.00x gloo. Eight 2 MiB
#: chunks a stripe saved more CPU at 5 Gbit/s (shards 1.12 -> 1.01 CPU-s/GB) but cost 200
#: Mbit/s 5-11% (4 hosts x 1: 4273-4701 ms against gloo's 4230) in a longer fill and drain.


def striped_chunk_bytes(configured: int, nbytes: int, stripes: int) -> int:
    """The chunk size for a collective of ``nbytes`` over ``stripes`` targets: ``configured``,
    or smaller so that each stripe gets CHUNKS_PER_STRIPE chunks (every rank computes the same
    from the same header fields and generation, as the hub checks)."""
    if stripes <= 1:
        return configured
    wanted = -(-nbytes // (stripes * CHUNKS_PER_STRIPE))
    return min(configured, max(MIN_STRIPED_CHUNK, wanted))


def resolve(address: str, coordinator: str) -> str:
    """``address`` with an empty host replaced by the coordinator's host."""
    if not address.startswith(":"):
        return address
    host = coordinator.rsplit(":", 1)[0] if ":" in coordinator else coordinator
    return f"{host}{address}"


class DataPlane:
    """The coordinator's :class:`Target` and one per hub shard of the generation."""

    def __init__(self, settings: ClientSettings, shards: list[str],
                 collectives: str = "") -> None:
        self.settings = settings
        # The coordinator's collectives go on a connection of their own, apart from the
        # session's, to the port it serves them on (``collectives``; empty: its own): a
        # session's keepalive pings must not wait behind MBs of tensors
        # (gradstar.transport.channels, BULK_KEEPALIVE_TIMEOUT_MS).
        self.collectives = resolve(collectives or settings.coordinator, settings.coordinator)
        self._coordinator_channel = open_channel(settings, self.collectives, bulk=True)
        self.coordinator = Target(self._coordinator_channel.stream_stream(COLLECTIVE_METHOD),
                                  self.collectives,
                                  shm=SharedMemoryOffer(settings.shared_memory))
        #: The shards' addresses, in stripe order, as this rank reaches them.
        self.addresses = [resolve(a, settings.coordinator) for a in shards]
        self._channels = [open_channel(settings, address, bulk=True)
                          for address in self.addresses]
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

    async def connect(self, timeout: float) -> None:
        """Wait until this rank is connected to every hub shard and to the coordinator's
        collective port (all at once).

        Raises:
            CoordinatorUnavailableError: a shard or the collective port was not reached within
                ``timeout`` seconds, or its TLS settings do not match this rank's (named at
                once).
        """
        s = self.settings
        ends = list(zip(self._channels, (t.address for t in self.shards),
                        (t.name for t in self.shards), strict=True))
        ends.append((self._coordinator_channel, self.collectives,
                     f"the coordinator's collective port at {self.collectives}"))
        waits = [asyncio.ensure_future(wait_connected(
            channel, address, timeout, s.tls_ca, s.tls_cert, s.tls_key, name=name))
            for channel, address, name in ends]
        try:
            await asyncio.gather(*waits)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def close(self) -> None:
        """End the streams kept open to the coordinator and the shards, then their channels
        (the session's channel is the group's to close)."""
        for target in (self.coordinator, *self.shards):
            target.close()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(c.close() for c in (self._coordinator_channel,
                                                       *self._channels)))

"""Where a rank's Collective streams go (:class:`Target`: the coordinator or a hub shard) and
the streams kept open to it between collectives (:class:`OpenStream`).

Streams outlive collectives: after the hub's ``END`` a stream goes back to its target's idle
streams and the next collective's header follows on it, so a collective costs no call set-up (a
new gRPC call costs the hub far more CPU than a message on an open one: docs/performance.md,
"Figures behind the code"). Collectives issued at once each take a stream of their own, and a
target keeps at most :data:`MAX_IDLE_STREAMS` idle. What a stream carries, and when it ends, is
:mod:`.stream`'s.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

#: Streams kept open per target between collectives: as many as run at once, up to this.
MAX_IDLE_STREAMS = 8


@dataclass
class SharedMemoryOffer:
    """Whether a rank offers a target shared memory: until the target refuses once."""

    enabled: bool = True
    refused: str = ""
    #: Inodes of this process's segments the target attached: offering one of them again is
    #: eager (``ShmSegment.eager``: the chunks go without waiting for the verdict).
    attached: set[int] = field(default_factory=set)


class OpenStream:
    """A Collective stream kept open across collectives, which it carries one at a time.

    The requests are a feed of frame sources (one per collective, from
    :mod:`gradstar.client.collective.stream`), written in turn; a collective that ended cleanly
    (its END marker checked) leaves the stream to the next one, anything else ends the call
    (:meth:`close`).
    """

    def __init__(self, target: Target, metadata) -> None:
        self._sources: asyncio.Queue = asyncio.Queue()
        self.call = target.stream(self._feed(), metadata=metadata)

    async def _feed(self):
        while (source := await self._sources.get()) is not None:
            async for frame in source:
                yield frame

    def send(self, source) -> None:
        """Write ``source``'s frames (an async iterator) after those of earlier collectives."""
        self._sources.put_nowait(source)

    async def read(self):
        return await self.call.read()

    @property
    def usable(self) -> bool:
        """Whether the call is still up (a hub that went away ended it)."""
        return self.call is not None and not self.call.done()

    def close(self) -> None:
        self._sources.put_nowait(None)
        if self.call is not None:
            self.call.cancel()
            # An ended call holds its channel's TCP connection (gRPC's core call references the
            # transport until the call object is freed, the channel closed or not), and a
            # failed collective's traceback keeps this object: a caller that kept the error
            # kept a connection open, and the hub a descriptor, for as long as it held it.
            self.call = None


@dataclass(frozen=True)
class Target:
    """Where a Collective stream goes.

    ``stream`` is ``channel.stream_stream(COLLECTIVE_METHOD)``; ``address`` is named in
    transport errors and ``name`` in protocol errors. ``idle`` holds the streams to it that
    no collective is using (at most :data:`MAX_IDLE_STREAMS`; :meth:`close` ends them).
    """

    stream: grpc.aio.StreamStreamMultiCallable
    address: str
    name: str = "coordinator"
    shm: SharedMemoryOffer = field(default_factory=lambda: SharedMemoryOffer(False))
    idle: list[OpenStream] = field(default_factory=list)

    def open(self, metadata) -> OpenStream:
        """A stream for one collective: an idle one still up, else a new one."""
        while self.idle:
            stream = self.idle.pop()
            if stream.usable:
                return stream
            stream.close()
        return OpenStream(self, metadata)

    def put_back(self, stream: OpenStream) -> None:
        """``stream``'s collective ended cleanly: keep it for the next one."""
        if len(self.idle) < MAX_IDLE_STREAMS and stream.usable:
            self.idle.append(stream)
        else:
            stream.close()

    def close(self) -> None:
        """End the idle streams (the group is closing)."""
        while self.idle:
            self.idle.pop().close()


__all__ = ["MAX_IDLE_STREAMS", "OpenStream", "SharedMemoryOffer", "Target"]

"""Where a rank's Collective streams go (:class:`Target`: the coordinator or a hub shard) and
the streams kept open to it between collectives (:class:`OpenStream`).

Streams outlive collectives: after the hub's ``END`` a stream goes back to its target's idle
streams and the next collective's header follows on it, so a collective costs no call set-up (a
new gRPC call costs the hub far more CPU than a message on an open one: docs/performance.md,
"Figures behind the code"). Collectives issued at once each take a stream of their own, and a
target keeps at most :data:`MAX_IDLE_STREAMS` idle. What a stream carries, and when it ends, is
:mod:`.stream`'s.

A target may be reached over several TCP connections (its ``connections``: one channel each,
opened by :mod:`.data_plane` where the round trip is long, :mod:`.connections`): a collective
takes the connection carrying the fewest collectives now and, of those, the one used last, so
collectives in flight at once (the parts of a split all_reduce, DDP's buckets) spread over
them, each connection's window carrying its share of the bandwidth-delay product, while the
same few connections carry every step. (A connection left idle for longer than a round-trip
timeout starts again from TCP's initial window; rotating over all of them measured a third of
the rate: the part on the coldest connection finished three times later than the others.)
"""

from __future__ import annotations

import asyncio
import itertools
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

    def __init__(self, target: Target, metadata, connection: int = 0) -> None:
        self._sources: asyncio.Queue = asyncio.Queue()
        #: Which of the target's connections carries it.
        self.connection = connection
        opened = target.connections[connection] if target.connections else target.stream
        self.call = opened(self._feed(), metadata=metadata)

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
    ``connections``: the same callable on each of several channels (TCP connections) to the
    target, ``stream``'s first; empty: ``stream`` alone.
    """

    stream: grpc.aio.StreamStreamMultiCallable
    address: str
    name: str = "coordinator"
    shm: SharedMemoryOffer = field(default_factory=lambda: SharedMemoryOffer(False))
    idle: list[OpenStream] = field(default_factory=list)
    connections: list[grpc.aio.StreamStreamMultiCallable] = field(default_factory=list)
    #: Per connection: collectives on it now, and when one last started or ended there.
    _busy: dict[int, int] = field(default_factory=dict)
    _used: dict[int, int] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)

    def open(self, metadata) -> OpenStream:
        """A stream for one collective, on the connection with the fewest collectives now,
        the one used last among those (see the module): an idle one still up there, else a
        new one."""
        connection = min(range(max(1, len(self.connections))),
                         key=lambda c: (self._busy.get(c, 0), -self._used.get(c, -1)))
        self._busy[connection] = self._busy.get(connection, 0) + 1
        self._used[connection] = next(self._clock)
        for stream in [s for s in reversed(self.idle) if s.connection == connection]:
            self.idle.remove(stream)
            if stream.usable:
                return stream
            stream.close()
        return OpenStream(self, metadata, connection)

    def _release(self, stream: OpenStream) -> None:
        self._busy[stream.connection] = max(0, self._busy.get(stream.connection, 0) - 1)
        self._used[stream.connection] = next(self._clock)

    def put_back(self, stream: OpenStream) -> None:
        """``stream``'s collective ended cleanly: keep it for the next one."""
        self._release(stream)
        if len(self.idle) < MAX_IDLE_STREAMS and stream.usable:
            self.idle.append(stream)
        else:
            stream.close()

    def discard(self, stream: OpenStream) -> None:
        """``stream``'s collective failed: end the stream."""
        self._release(stream)
        stream.close()

    def close(self) -> None:
        """End the idle streams (the group is closing)."""
        while self.idle:
            self.idle.pop().close()


__all__ = ["MAX_IDLE_STREAMS", "OpenStream", "SharedMemoryOffer", "Target"]

"""Flow control of one collective on the hub: each rank's side of it (:class:`Participant`: what
it sends, what is queued for it and how much of that gRPC took) and the :class:`ReadWindow`
that reads those counts to decide when the hub may read a rank's next chunk. The collective
itself, which fills the counts, is :class:`.engine.PendingCollective`.

Memory: the hub never holds a whole tensor. It stops reading a stream when the collective's
:class:`ReadWindow` says so, and HTTP/2 flow control then holds the sender back (gRPC itself
buffers up to its flow-control window, 4 MiB or twice its bandwidth-delay estimate, per paused
stream). Per in-flight collective, with ``C`` the chunk size (2 MiB by default), ``W`` =
:data:`READ_AHEAD_CHUNKS` and ``F`` = :data:`FORWARD_AHEAD_CHUNKS`:

* reducing ops (all_reduce, reduce_scatter): inputs at most ``W`` chunks apart, so a few windows
  of pooled accumulators (``~W x C``), plus at most ``W`` queued result chunks per rank;
* forwarding ops (broadcast, all_gather): at most ``F x C`` held in all before the collective is
  matched; afterwards at most ``F x C`` queued per receiving rank (one bytes object shared by
  all the receivers of a frame), plus one chunk per sender being read. On the shared-memory
  path a held or forwarded chunk is a view of its sender's segment: the hub holds no copy.

Measured (``tests/robustness/test_memory.py``, ``benchmarks/broadcast_memory.py``, the hub's
VmRSS less the ranks' segments it maps): a 512 MiB broadcast to 3 ranks, one 5 s late, grows the
hub by 39-54 MiB on the stream path (8 held chunks, then 8 queued, plus one send per receiver
and the root's paused stream, whose window gRPC sizes by its bandwidth-delay estimate; 564 MiB
without the window, 76-89 MiB with 16 chunks held and a malloc arena per gRPC thread, see
``gradstar.allocator.share_malloc_arena``) and by under 1 MiB on the shared-memory path.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from gradstar import ops
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import ChunkLayout, ChunkTracker

#: Placed in a participant's outbox after its END frame: the stream is complete.
CLOSE = None
#: How far (in chunks) a rank's input may run ahead of the slowest rank's input and, for
#: all_reduce, of the slowest rank's output. Held first arrivals, accumulators and queued results
#: are then bounded by a few windows of chunks, whatever the tensor size or skew.
READ_AHEAD_CHUNKS = 16
#: How many forwarded chunks (broadcast, all_gather) may wait in one rank's outbox before the hub
#: stops reading their senders, and how many the hub holds, from all senders, before such a
#: collective matches. Half a window: an all_gather receiver's backlog holds frames of every
#: other sender, so the distinct frames in flight can reach this times the world size. Holding
#: 16 before the match cost 8-10 MiB more for a late rank and gained nothing: the collective
#: ends when the late rank has every chunk, whatever the root sent before it came.
FORWARD_AHEAD_CHUNKS = READ_AHEAD_CHUNKS // 2


class Outbox:
    """A participant's frames for its stream's writer, in order: the four methods of
    :class:`asyncio.Queue` the hub uses, for one reader, without the queue's bookkeeping (its
    getters, putters and task counting: docs/performance.md, "Figures behind the code").
    Unbounded, as the queue was: the read window bounds what is queued."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits in get()

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self):
        """The next item. Raises asyncio.QueueEmpty when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self):
        """The next item, once there is one (a cancelled wait takes nothing)."""
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


@dataclass(eq=False)
class Participant:
    """One rank's side of a collective: what it sends, and the frames queued for it."""

    rank: int
    header: pb.CollectiveHeader
    tracker: ChunkTracker
    #: The input chunk indices the rank may send (its geometry), and how many of them it does
    #: send (fewer when one stripe of them comes to this engine).
    inputs: range
    input_count: int
    output_count: int
    #: The rank's result layout (where output chunk ``i`` goes).
    out_layout: ChunkLayout
    outbox: Outbox = field(default_factory=Outbox)
    #: Result chunks queued for the rank, and their payload bytes.
    queued: int = 0
    queued_bytes: int = 0
    #: Chunk frames handed to gRPC for this rank (the servicer counts them).
    delivered: int = 0
    ended: bool = False
    #: The rank's attached shared-memory segment (:mod:`gradstar.transport.shm`): its input
    #: chunks are read from it, and its result chunks written into it at ``shm_out``.
    shm: memoryview | None = None
    shm_out: int = 0
    #: Bytes of the hub's budget this part holds (:mod:`.budget`), given back at the end.
    charge: int = 0
    #: When its header arrived (``time.monotonic()``): arrival lags are measured from these.
    arrived: float = field(default_factory=time.monotonic)

    def out_region(self, index: int) -> memoryview:
        """Where output chunk ``index`` goes in the rank's segment."""
        offset, length = self.out_layout.span(index)
        start = self.shm_out + offset
        return self.shm[start:start + length]


class Windowed(Protocol):
    """What the read window reads of a collective (:class:`.engine.PendingCollective`)."""

    op: int
    world: int
    finished: bool
    reducer: object | None
    participants: dict[int, Participant]
    layout: ChunkLayout  # of the input chunks

    @property
    def matched(self) -> bool: ...

    @property
    def held_chunks(self) -> int: ...


class ReadWindow:
    """Backpressure of one collective: when it may not read a rank's next chunk, the hub stops
    reading that stream and HTTP/2 flow control holds the rank back.

    Forwarding ops (broadcast, all_gather): before the collective is matched, chunks have no
    outbox to go to and are held, :data:`FORWARD_AHEAD_CHUNKS` of them in all (so at most that
    per sender); afterwards a sender is read only while no other rank has
    :data:`FORWARD_AHEAD_CHUNKS` chunks queued but not yet delivered.
    Reducing ops: a rank is read only while no rank has :data:`READ_AHEAD_CHUNKS` result chunks
    queued but not yet delivered, and while it is less than :data:`READ_AHEAD_CHUNKS` ahead of
    the slowest rank's input (and, for all_reduce, of the slowest rank's delivered output).

    Deliveries wake the waits (:meth:`progressed`), and a rank's outbox drains on its own task
    while its reads wait, so a rank that both sends and receives cannot block itself.

    The window is handed its collective on each call rather than keeping it: a reference back
    would make a cycle, and a finished collective (with its views of the ranks' segments) would
    then live until the cyclic garbage collector ran instead of going when its streams end.
    """

    def __init__(self) -> None:
        # Made by the first wait: most collectives (every small one) never hold a read back.
        self._progress: asyncio.Event | None = None

    def may_read(self, c: Windowed, p: Participant) -> bool:
        """Whether the hub should read ``p``'s next chunk of collective ``c`` now."""
        if c.finished:
            return True
        if c.reducer is not None and c.layout.count < READ_AHEAD_CHUNKS:
            # Fewer chunks than a window: no rank can read, nor have queued, a window ahead
            # (a rank's results are at most the input's chunks), so the checks below all pass.
            return True
        if c.reducer is None:
            if not c.matched:
                return c.held_chunks < FORWARD_AHEAD_CHUNKS
            return not self._backlogged(c, p, FORWARD_AHEAD_CHUNKS)
        if self._backlogged(c, None, READ_AHEAD_CHUNKS):
            return False
        low = min(c.participants[r].tracker.received if r in c.participants else 0
                  for r in range(c.world))
        if c.op == ops.ALL_REDUCE:
            low = min(low, *(q.delivered for q in c.participants.values()))
            if not c.matched:
                low = 0
        return p.tracker.received < low + READ_AHEAD_CHUNKS

    @staticmethod
    def _backlogged(c: Windowed, sender: Participant | None, window: int) -> bool:
        """Whether a rank other than ``sender`` has ``window`` chunks queued, undelivered."""
        return any(q.queued - q.delivered >= window
                   for q in c.participants.values() if q is not sender)

    async def wait(self, c: Windowed, p: Participant) -> None:
        """Hold ``p``'s stream until it may read."""
        while not self.may_read(c, p):
            if self._progress is None:
                self._progress = asyncio.Event()
            self._progress.clear()
            await self._progress.wait()

    def progressed(self) -> None:
        """Something moved (a chunk in, a chunk delivered, the end): re-check the waits."""
        if self._progress is not None:
            self._progress.set()

"""Small collectives from the caller's own thread: the blocking API's fast path.

The blocking :class:`~gradstar.client.process_group.ProcessGroup` runs its asyncio group on a
loop thread, so a collective used to cross threads four times on the rank alone: the caller to
the loop, and on the way back gRPC's I/O thread to its poller thread to the loop to the caller.
For a tensor of a few KB those hops are most of the call (the profile: docs/performance.md,
"Figures behind the code"). A :class:`DirectLane` instead carries a *small* collective
(:meth:`DirectLane.takes`) on a blocking gRPC stream from the caller's thread: the caller writes
the rank's whole side as one message and waits on the stream's own completion queue, so the
answer wakes it directly (:mod:`.caller_stream`: no gRPC thread in between).

What travels is exactly what :mod:`.stream` sends for a small collective on the stream path
(:func:`.outgoing.in_one_message`: header, chunks and end marker in one message) and what
comes back is checked by the same :class:`~.plan.StreamReceiver` — accept, chunks with their
checksums, end marker and its counts — so the hub cannot tell the two apart and every check on
either side is the same. Shared memory is never offered on this path: for a payload of at most
:data:`~gradstar.wire.MAX_BATCHED_CHUNK_BYTES` the segment's offer and copies cost more than the
bytes.

Streams outlive collectives as on the asyncio path (:mod:`.caller_stream`; idle ones are
kept for the next call, any failure ends the stream). Failure, by the same rules as the
asyncio path (:mod:`.failure`: one table and one ending for both roads):

- the hub's verdict (an ``ERROR`` frame: mismatch, timeout, lost rank, ...) is raised as the
  error it names;
- the session failing (a lost rank or hub noticed on the control connection) ends every
  collective in flight on this lane with the session's error: :meth:`DirectLane.watch`, a task
  on the group's loop, cancels their calls at once;
- a transport failure asks the session for a verdict, briefly, then is translated from the
  gRPC status;
- the collective's timeout plus :data:`~.stream.DEADLINE_MARGIN` is a backstop for a hub that
  stopped answering (checked by :meth:`DirectLane.watch` every :data:`WATCH_INTERVAL`, which
  ends the stream with the builtin :class:`TimeoutError` the table names, as the stream road's
  ``asyncio.timeout``);
- a caller interrupted (``KeyboardInterrupt``) before the hub's accept tells the hub it gave
  up, as a cancelled asyncio collective does (:func:`.stream.abandon_collective`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
import numpy as np

from gradstar import ops
from gradstar.errors import ProtocolError
from gradstar.wire import MAX_BATCH_FRAMES, MAX_BATCHED_CHUNK_BYTES, as_byte_view

from ..session import VERDICT_GRACE, Session
from .caller_stream import BlockingStream, open_stream
from .failure import StreamEnding
from .outgoing import in_one_message
from .plan import CollectivePlan, Phase, StreamReceiver
from .stream import DEADLINE_MARGIN
from .targets import MAX_IDLE_STREAMS

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often :meth:`DirectLane.watch` checks the deadlines of the collectives in flight (the
#: session's failure it hears at once).
WATCH_INTERVAL = 1.0


class DirectLane:
    """Blocking streams to one target (the coordinator's collective port) for small
    collectives issued on the caller's thread; see the module docstring.

    ``submit`` runs a coroutine on the group's loop (for the session's verdict and a notice
    that a collective was abandoned); ``abandon(call)`` is that notice's coroutine.
    """

    def __init__(self, channel: grpc.Channel, method: str, address: str, metadata, *,
                 session: Session,
                 submit: Callable[[Coroutine], concurrent.futures.Future],
                 abandon: Callable[[ops.CollectiveCall], Coroutine]) -> None:
        self._channel = channel
        self._method = method
        self.address = address
        self._metadata = metadata
        self._session = session
        self._submit = submit
        self._abandon = abandon
        self._lock = threading.Lock()
        self._idle: list[BlockingStream] = []
        #: Streams carrying a collective now, with that collective's deadline (monotonic).
        self._inflight: dict[BlockingStream, float] = {}
        self._closed = False
        #: Collectives this lane completed (they ran on their caller's thread).
        self.completed = 0

    @staticmethod
    def takes(call: ops.CollectiveCall) -> bool:
        """Whether ``call`` is small enough for this lane: no wire format, no averaging round,
        and the rank's whole side fits one message (:func:`.outgoing.in_one_message`)."""
        g = call.geometry
        if call.encoding is not None or call.header.averaging.rule:
            return False
        if len(g.sends) + 2 > MAX_BATCH_FRAMES:
            return False
        return g.send_bytes <= MAX_BATCHED_CHUNK_BYTES

    def run(self, call: ops.CollectiveCall, send: np.ndarray | None, out: np.ndarray,
            timeout: float) -> np.ndarray:
        """Run ``call`` (which :meth:`takes`) on the caller's thread; return ``out`` holding
        the result.

        Raises:
            What :func:`gradstar.client.collective.stream.run_stream` raises, for the same
            reasons; the session's failure once there is one.
        """
        header = call.header
        what = f"collective seq {header.seq}"
        plan = CollectivePlan.for_call(call, send, out)
        g = call.geometry
        receiver = StreamReceiver(what, "coordinator", g.out_layout,
                                  plan.out_indices(i for r in g.receives for i in r),
                                  as_byte_view(plan.out))
        stream = self._open()
        self._inflight[stream] = time.monotonic() + timeout + DEADLINE_MARGIN
        ending = StreamEnding(
            what, self.address, receiver, verdict=self._verdict,
            end_stream=lambda clean: self._end_stream(stream, clean),
            abandon=lambda: self._notify_abandoned(call), ended_by=lambda: stream.ended_by)
        with ending:
            stream.send(in_one_message(header, plan, g.sends, None))
            while (message := stream.read()) is not None:
                receiver.on_frame(message)
                if receiver.phase is Phase.COMPLETE:
                    stragglers = self._session.stragglers
                    if receiver.end.late and stragglers is not None:
                        stragglers.saw(header.seq, receiver.end.late)
                    self.completed += 1
                    return plan.finish()
            raise ProtocolError(f"{what}: the coordinator closed the stream without an end marker")

    def _open(self) -> BlockingStream:
        with self._lock:
            while self._idle:
                stream = self._idle.pop()
                if stream.usable:
                    return stream
                stream.close()
        return open_stream(self._channel, self._method, self._metadata)

    def _end_stream(self, stream: BlockingStream, clean: bool) -> None:
        """``stream``'s collective ended: out of the watch's sight, then kept for the next one
        if it ended cleanly, else closed."""
        del self._inflight[stream]
        with self._lock:
            if clean and not self._closed and stream.usable and (
                    len(self._idle) < MAX_IDLE_STREAMS):
                self._idle.append(stream)
                return
        stream.close()

    def _verdict(self):
        """The session's verdict on a broken stream (a lost rank or hub), or None."""
        try:
            return self._submit(self._session.verdict()).result(VERDICT_GRACE + 1.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            return self._session.failure

    def _notify_abandoned(self, call: ops.CollectiveCall) -> None:
        """Tell the hub, from the loop, that this rank gave up ``call`` before its accept."""
        try:
            self._submit(self._abandon(call))
        except RuntimeError:  # the loop is closing: the group is going away anyway
            log.debug("collective seq %d: could not tell the hub it was abandoned",
                      call.header.seq)

    async def watch(self) -> None:
        """On the group's loop, until :meth:`close`: end the collectives in flight with the
        session's failure as soon as it comes, and each with a timeout error once its
        deadline passed."""
        while not self._closed:
            try:
                failure = await asyncio.wait_for(self._session.wait_failed(), WATCH_INTERVAL)
            except TimeoutError:
                now = time.monotonic()
                for stream, deadline in list(self._inflight.items()):
                    if deadline <= now and stream.ended_by is None:
                        # The builtin: the failure table names it, as the stream road's.
                        stream.end(TimeoutError("the collective's deadline passed"))
                continue
            for stream in list(self._inflight):
                stream.end(failure)
            return

    def close(self) -> None:
        """End the idle streams and the channel (collectives in flight fail)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for stream in idle:
            stream.close()
        self._channel.close()


@dataclass(frozen=True, eq=False)  # hashed by identity, as asyncio.gather needs
class SettledCall(Generic[T]):
    """A small collective issued (its seq taken) on a thread without an event loop, which the
    blocking API *settles* there: runs to its end on the caller's thread (:meth:`settle`).
    Awaited, or handed to the loop for ``async_op=True`` (:meth:`coroutine`), it runs on the
    loop like any other collective.

    "Settled" is the one word for a collective that ended on the caller's thread: this call,
    :class:`gradstar.client.work.SettledWork` (its Work),
    :meth:`gradstar.client.process_group.ProcessGroup.settled` and, in torch's backend,
    ``GradstarWork.from_settled`` and ``settled=``."""

    lane: DirectLane
    call: ops.CollectiveCall
    send: np.ndarray | None
    out: np.ndarray
    restore: Callable[[np.ndarray], T]
    timeout: float
    #: The collective as a coroutine for the loop (the asyncio path).
    coroutine: Callable[[], Awaitable[T]]

    def settle(self) -> T:
        """Run the collective to its end on this thread; what the caller gets (``restore``'s
        result)."""
        return self.restore(self.lane.run(self.call, self.send, self.out, self.timeout))

    def __await__(self):
        return self.coroutine().__await__()

    def close(self) -> None:
        """Withdrawn before it ran (as a coroutine that never ran is closed): nothing to do."""


__all__ = ["WATCH_INTERVAL", "DirectLane", "SettledCall"]

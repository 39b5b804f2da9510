"""gRPC servicer of the collective service: it translates, nothing more.

The logic lives in :mod:`.engine`; this class turns streams into calls on it and gradstar
errors into gRPC statuses (:mod:`gradstar.transport.status`). Its twin on the rank is
:mod:`gradstar.client.collective.stream` (the I/O of the rank's half of the same stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from gradstar.errors import GradstarError, ProtocolError
from gradstar.proto.v1 import collective_pb2 as cpb
from gradstar.transport.auth import check_job_access
from gradstar.transport.shm import SegmentMapper, ShmRefused, host_id, process_gone
from gradstar.transport.status import abort
from gradstar.wire import (
    COLLECTIVE_SERVICE,
    KIND_CHUNK,
    KIND_END,
    KIND_HEADER,
    KIND_SHM_ATTACH,
    KIND_SHM_CHUNK,
    MAX_BATCH_BYTES,
    MAX_BATCH_FRAMES,
    batchable,
    check_header_size,
    decode_message,
    encode_batch,
    encode_error,
    encode_message,
    frame_kind,
    frames_of,
)

from ..rendezvous.jobs import check_job_name
from .engine import CLOSE, CollectiveEngine, Participant, PendingCollective, without_frames
from .window import Outbox

log = logging.getLogger(__name__)

# "No frame held back" in a stream's writer (CLOSE, the outbox's last item, is None).
_NOTHING = object()


def _take_batch(item, outbox: Outbox) -> tuple[list, object, int]:
    """``item`` and the small frames already queued behind it, to go in one message; the
    first queued item that may not join them (``_NOTHING`` if none was taken); and how many
    of the batch's frames are output chunks (in the frame or in a segment)."""
    batch = [item]  # outbox bytes: CLOSE and errors are the writer's before this
    chunks = 1 if item[0] in _CHUNK_KINDS else 0
    if not batchable(item):
        return batch, _NOTHING, chunks
    size = len(item)
    while len(batch) < MAX_BATCH_FRAMES and not outbox.empty():
        following = outbox.get_nowait()
        if not batchable(following) or size + len(following) > MAX_BATCH_BYTES:
            return batch, following, chunks
        batch.append(following)
        size += len(following)
        if following[0] in _CHUNK_KINDS:
            chunks += 1
    return batch, _NOTHING, chunks


# An output chunk's kinds: in the frame, or in the rank's segment.
_CHUNK_KINDS = frozenset((KIND_CHUNK, KIND_SHM_CHUNK))

# How long a failed collective's call stays open for the client to read the in-band error and
# hang up. Ending a call while the client still writes can make grpc-python report INTERNAL to
# that client instead of our status; a client that read the ERROR frame cancels at once.
FAILURE_LINGER = 2.0


class CollectiveServicer:
    """The raw-frame collective stream (registered with identity serializers)."""

    def __init__(self, engine: CollectiveEngine,
                 admit: Callable[[cpb.CollectiveHeader], Awaitable[None]] | None = None,
                 shared_memory: bool = True):
        self.engine = engine
        #: Awaited with each header before the engine sees it (a hub shard waits there for the
        #: coordinator's word that the header's generation formed, and checks its stripe).
        self.admit = admit
        #: Ranks' shared-memory segments this process has mapped (same-host fast path); None
        #: when the operator turned the fast path off.
        self.segments = SegmentMapper() if shared_memory else None

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            COLLECTIVE_SERVICE,
            {"Stream": grpc.stream_stream_rpc_method_handler(self.Stream)},
        )

    async def Stream(self, request_iterator: AsyncIterator[bytes],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Serve collectives one after another on one stream: a rank keeps its stream to the
        hub open across collectives (one call set-up per stream, not per collective). The
        next header may follow only a collective that ended cleanly (both END markers); a
        failed collective ends the call.

        One collective runs inline here, from its header to the hub's END, rather than in a
        generator of its own, which would cost a tiny collective's hub a generator, its closing
        and a pass-through of every answer for each rank."""
        frames = request_iterator.__aiter__()
        offered: set[int] = set()  # processes whose segments this stream offered
        try:
            while True:
                try:
                    first = await anext(frames)
                except StopAsyncIteration:
                    return
                attach = None  # the attach verdict, when the header offered a segment
                try:
                    # A small collective's header comes with the rest of the rank's side
                    # (chunks or their announcements, end marker) in one message.
                    arrived = frames_of(first)
                    header = self._header(arrived[0])
                    if self.admit is not None:
                        await self.admit(header)
                    shm, attach = self._attach(header)
                    coll, me = self._arrive(header, shm, attach, offered)
                except GradstarError as error:
                    # Kept errors (a failed generation's, an ended collective's) are raised
                    # again for every header that comes for them: each time, drop the frames
                    # they went through.
                    without_frames(error)
                    shm = None  # nor may the abort's traceback keep the segment (see below)
                    if attach is not None:
                        yield attach  # the rank learns a refusal even from a failure
                    yield encode_error(error)
                    await self._linger(asyncio.ensure_future(self._drain(frames)))
                    await abort(context, error)
                # What came with the header is taken now, before any stream's writer runs:
                # once the last rank's whole side is in, every rank's accept, result and end
                # marker are queued together and leave in one message (no reader task at all
                # when its end came too).
                left = self._take_arrived(coll, me, arrived[1:])
                reader = None if left is None else asyncio.create_task(
                    self._read(coll, me, frames, left))
                try:
                    # An eager rank does not wait for the verdict on a segment this hub
                    # attached: it goes with the accept. Any other verdict goes first, at once.
                    eager = shm is not None and header.shm.eager
                    held = _NOTHING if attach is None or eager else attach
                    while True:
                        item = await me.outbox.get() if held is _NOTHING else held
                        held = _NOTHING
                        if item is CLOSE:
                            break
                        if isinstance(item, GradstarError):
                            yield encode_error(item)
                            await self._linger(
                                reader or asyncio.ensure_future(self._drain(frames)))
                            await abort(context, item)
                        batch, held, chunks = _take_batch(item, me.outbox)
                        if eager:
                            eager = False
                            if batchable(item):
                                batch.insert(0, attach)
                            else:
                                yield attach
                        yield batch[0] if len(batch) == 1 else encode_batch(batch)
                        if chunks:
                            me.delivered += chunks
                            coll.progressed()
                finally:
                    if reader is not None:
                        reader.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await reader
                    coll.on_stream_closed(me, "disconnected")
                    # An exception passing through here (the call cancelled or aborted) keeps
                    # this frame in its traceback, and gRPC may keep that exception a while:
                    # the frame must not keep the collective, or the rank's segment, alive
                    # with it.
                    del coll, me, shm, reader
        finally:
            # A rank's stream ends when it exits (or closes its group): let go of its segments
            # now if it let go of them, rather than at the next sweep.
            for pid in offered:
                self.segments.release(pid)

    def sweep_segments(self) -> None:
        """Unmap the segments whose ranks let go of them (the hub runs this on a timer)."""
        if self.segments is not None:
            self.segments.sweep()

    @staticmethod
    def _header(frame: bytes) -> cpb.CollectiveHeader:
        """The header a collective's first frame carries, checked before anything quotes it
        or acts on it: its size, its job's name, and that the call's token opens that job.

        Raises:
            ProtocolError, ConfigurationError: a malformed header or job name.
            JobAccessError: the call's token is another job's own token.
        """
        check_header_size(frame, "a collective stream")
        header = decode_message(frame, KIND_HEADER, cpb.CollectiveHeader)
        # Before anything quotes it: a header may carry a name of up to its own size.
        check_job_name(header.job)
        check_job_access(header.job)
        return header

    def _arrive(self, header: cpb.CollectiveHeader, shm: memoryview | None,
                attach: bytes | None,
                offered: set[int]) -> tuple[PendingCollective, Participant]:
        """Admit ``header``'s rank, with the segment :meth:`_attach` mapped for it (or None)
        and its verdict ``attach``, to its collective: (the collective, the rank's part); adds
        the pid of an attached segment to ``offered``."""
        if shm is not None:
            offered.add(header.shm.pid)
        coll, me = self.engine.arrive(header, shm)
        if shm is None and attach is not None and header.shm.eager and (
                process_gone(header.shm.pid)):
            # The rank wrote its chunks into a segment it expected this hub to hold, then
            # died before the hub could open it: a lost rank (what every other rank must
            # hear, to rejoin), not a protocol error (what its announced chunks would be).
            coll.on_stream_closed(me, "exited before the hub could attach the shared-memory "
                                      "segment holding its chunks")
        return coll, me

    def _attach(self, header: cpb.CollectiveHeader) -> tuple[memoryview | None, bytes | None]:
        """Map the segment ``header`` offers, if any: (its data or None, the attach verdict
        frame to send first, or None when nothing was offered)."""
        if not header.HasField("shm"):
            return None, None
        s = header.shm
        try:
            if self.segments is None:
                raise ShmRefused("shared memory is turned off on this hub (shared_memory)")
            if s.host and s.host != host_id():
                raise ShmRefused("the rank is on another host (or network namespace)")
            data = self.segments.attach(s.pid, s.fd, s.inode, s.size, s.key)
        except ShmRefused as refused:
            log.debug("rank %d's segment not attached: %s", header.rank, refused)
            return None, encode_message(KIND_SHM_ATTACH, cpb.ShmAttach(reason=str(refused)))
        return data, encode_message(KIND_SHM_ATTACH, cpb.ShmAttach(attached=True))

    @staticmethod
    async def _linger(reader: asyncio.Future) -> None:
        """Give the client FAILURE_LINGER seconds to read the ERROR frame and hang up."""
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(reader), FAILURE_LINGER)

    @staticmethod
    async def _drain(frames) -> None:
        # AbortError: the call was already aborted (the refusal went out); nothing to drain.
        with contextlib.suppress(grpc.RpcError, grpc.aio.AbortError, asyncio.CancelledError):
            async for _ in frames:
                pass

    @classmethod
    def _take_arrived(cls, coll: PendingCollective, me: Participant,
                      arrived: list[bytes]) -> list[bytes] | None:
        """Take the frames that came with ``me``'s header while the read window allows; the
        frames left for the reader, or None when the end marker was among those taken (or
        the collective failed on them)."""
        with _failing(coll, me):
            for i, frame in enumerate(arrived):
                if not coll.window.may_read(coll, me):
                    return arrived[i:]
                if cls._take(coll, me, frame):
                    return None
            return []
        return None

    @staticmethod
    def _take(coll: PendingCollective, me: Participant, frame: bytes) -> bool:
        """One frame of ``me``'s input; True for its end marker."""
        kind = frame_kind(frame)
        if kind == KIND_CHUNK:
            coll.on_chunk(me, frame)
        elif kind == KIND_SHM_CHUNK:
            coll.on_shm_chunk(me, frame)
        elif kind == KIND_END:
            coll.on_end(me, frame)
            return True
        else:
            raise ProtocolError(f"rank {me.rank} sent a frame of kind {kind} mid-stream")
        return False

    @classmethod
    async def _read(cls, coll: PendingCollective, me: Participant, frames,
                    arrived: list[bytes]) -> None:
        """Feed ``me``'s frames (first those ``arrived`` with its header) to the collective;
        after it ends, drain until the client stops."""
        with _failing(coll, me):
            for frame in arrived:
                await coll.wait_to_read(me)
                if cls._take(coll, me, frame):
                    return
            async for message in frames:
                if coll.finished:
                    continue
                try:
                    batch = frames_of(message)
                except ProtocolError as error:
                    raise ProtocolError(f"rank {me.rank}: {error}") from None
                for frame in batch:
                    if cls._take(coll, me, frame):
                        return
                    await coll.wait_to_read(me)
            coll.on_stream_closed(me, "closed its stream before its end marker")


class _failing:
    """Whatever goes wrong reading ``me``'s side ends the collective (on every rank).

    A class rather than a generator-based context manager: it is entered for every message a
    rank sends, and a generator costs more than the two calls."""

    __slots__ = ("coll", "me")

    def __init__(self, coll: PendingCollective, me: Participant) -> None:
        self.coll, self.me = coll, me

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        # An error's traceback holds this frame and the reader's, so the collective: the
        # collective keeps a ProtocolError, and grpc's call state the AbortError it raised.
        # Each traceback is dropped, or the collective would outlive its end in a reference
        # cycle until the cyclic collector runs (tests/integration/test_collective_lifetime.py).
        if error is None or not isinstance(error, Exception):
            return False  # nothing went wrong, or a cancellation / exit passing through
        coll, me = self.coll, self.me
        if isinstance(error, ProtocolError):
            coll.fail(error.with_traceback(None))
        elif isinstance(error, (grpc.RpcError, grpc.aio.AbortError)):
            # AbortError: the call was aborted under the reader (the rank's stream ended or
            # this side sent its verdict); either way the rank is gone from the collective.
            error.__traceback__ = None
            coll.on_stream_closed(me, "disconnected")
        else:
            # A bug must cost one collective, never the hub or a silent hang of the other
            # ranks.
            log.error("internal error in collective seq %d", coll.spec.seq,
                      exc_info=(kind, error, traceback))
            coll.fail(GradstarError(
                f"the coordinator hit an internal error in collective seq {coll.spec.seq}: "
                f"{type(error).__name__}: {error}"))
        return True

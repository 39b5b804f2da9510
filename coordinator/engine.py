"""The collective engine: matches collective calls of a generation and moves their chunks.

Protocol of one collective (one stream per rank, see ``collective.proto`` and ``gradstar.wire``):

1. Each rank sends a ``HEADER`` naming (job, generation, group, seq) and what it asks for. The
   first header of a seq opens a :class:`PendingCollective`; every later one is checked against
   it field by field (op, reduce op, dtype, shape, root, chunk size). A disagreement fails the
   collective on every rank with :class:`CollectiveMismatchError` naming both ranks and values.
2. When all ``world_size`` headers have arrived the collective is *matched*: every rank gets an
   ``ACCEPT`` frame.
3. Ranks stream their ``CHUNK`` frames. For all_reduce and reduce_scatter, chunk ``i`` is
   reduced into a pooled accumulator as arrivals come in and, once every rank has sent it, is
   encoded once and the same bytes object is queued for every receiving rank, while later chunks
   are still arriving. Broadcast and all_gather frames are forwarded unchanged (their senders
   already use output chunk indices), so the hub copies nothing for them.
4. Each rank closes its input with an ``END`` frame carrying its chunk and byte counts. Only
   when every rank's input is complete and every output chunk is queued does each rank get its
   ``END``: a client treats its result as valid only after that marker, so a failure at any point
   leaves no rank with a partial result.

Any failure — mismatch, invalid request, corrupt frame, a stream closed before its end marker,
the collective's timeout, or the generation failing because a member was lost — fails the
collective on every rank that arrived, and on every rank that arrives later for the same seq.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import numpy as np

from gradstar.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GradstarError,
    InvalidCollectiveError,
    PayloadTooLargeError,
    ProtocolError,
    RankLostError,
)
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import (
    CHUNK_HEADER_BYTES,
    KIND_ACCEPT,
    KIND_END,
    ChunkLayout,
    ChunkTracker,
    chunk_frame_buffer,
    decode_chunk,
    decode_message,
    dtype_from_wire,
    encode_message,
    seal_chunk_frame,
)

from .averaging import RULE_NAMES, AveragingRound, AveragingStore
from .metrics import CollectiveMetrics
from .reduce import REDUCE_OP_NAMES, BufferPool, ChunkReducer
from .rendezvous import Generation, Rendezvous

OP_NAMES = {
    pb.COLLECTIVE_OP_ALL_REDUCE: "all_reduce",
    pb.COLLECTIVE_OP_BROADCAST: "broadcast",
    pb.COLLECTIVE_OP_ALL_GATHER: "all_gather",
    pb.COLLECTIVE_OP_REDUCE_SCATTER: "reduce_scatter",
    pb.COLLECTIVE_OP_BARRIER: "barrier",
}
_REDUCING = (pb.COLLECTIVE_OP_ALL_REDUCE, pb.COLLECTIVE_OP_REDUCE_SCATTER)

#: Placed in a participant's outbox after its END frame: the stream is complete.
CLOSE = None
#: How far (in chunks) a rank's input may run ahead of the slowest rank's input and, for
#: all_reduce, of the slowest rank's output. Held first arrivals, accumulators and queued
#: results are then bounded by a few windows of chunks, whatever the tensor size or skew.
READ_AHEAD_CHUNKS = 16


def describe(h: pb.CollectiveHeader) -> str:
    """A header as a user would have written the call, for error messages."""
    parts = [f"dtype={dtype_name(h.dtype)}", f"shape={tuple(h.shape)}"]
    if h.op in _REDUCING:
        parts.insert(0, f"op={REDUCE_OP_NAMES.get(h.reduce_op, h.reduce_op)!r}")
    if h.op == pb.COLLECTIVE_OP_BROADCAST:
        parts.append(f"src={h.root}")
    return f"{OP_NAMES.get(h.op, f'op {h.op}')}({', '.join(parts)})"


def dtype_name(wire: int) -> str:
    try:
        return dtype_from_wire(wire).name
    except ProtocolError:
        return f"dtype {wire}"


def _field_values(h: pb.CollectiveHeader) -> list[tuple[str, object]]:
    values: list[tuple[str, object]] = [("op", OP_NAMES.get(h.op, h.op))]
    if h.op in _REDUCING:
        values.append(("reduce op", REDUCE_OP_NAMES.get(h.reduce_op, h.reduce_op)))
    values += [("dtype", dtype_name(h.dtype)), ("shape", tuple(h.shape))]
    if h.op == pb.COLLECTIVE_OP_BROADCAST:
        values.append(("root", h.root))
    values.append(("chunk_bytes", h.chunk_bytes))
    a = h.averaging
    values.append(("averaging", (a.model, RULE_NAMES.get(a.rule, a.rule), a.outer_lr,
                                 a.outer_momentum) if a.rule else None))
    return values


@dataclass(eq=False)
class Participant:
    """One rank's side of a collective: what it sent, and the frames queued for it."""

    rank: int
    header: pb.CollectiveHeader
    tracker: ChunkTracker
    first_input: int
    input_count: int
    output_count: int
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    queued: int = 0
    queued_bytes: int = 0
    #: Chunk frames handed to gRPC for this rank (the servicer counts them).
    delivered: int = 0
    ended: bool = False


class PendingCollective:
    """One collective of one generation, from its first header to its last END frame."""

    def __init__(self, engine: CollectiveEngine, gen: Generation, header: pb.CollectiveHeader):
        self.engine = engine
        self.gen = gen
        self.key = (header.group, header.seq)
        self.spec = header
        self.op = header.op
        self.world = gen.world_size
        self.started = time.monotonic()
        self.participants: dict[int, Participant] = {}
        self.finished = False
        self.ends = 0
        self._slots: dict[int, list] = {}
        self._held: list[tuple[int, int, bytes]] = []
        self._progress = asyncio.Event()
        self._validate(header)
        self.dtype = dtype_from_wire(header.dtype)
        nbytes = math.prod(header.shape) * self.dtype.numpy.itemsize
        self.reducer = (
            ChunkReducer(header.reduce_op, self.dtype, self.world, engine.pool)
            if self.op in _REDUCING else None
        )
        self.round: AveragingRound | None = None
        if header.averaging.rule:
            self.round = engine.averaging.open_round(gen.job.name, header.averaging,
                                                     nbytes // self.dtype.numpy.itemsize)
        cb = header.chunk_bytes
        if self.op == pb.COLLECTIVE_OP_REDUCE_SCATTER:
            self.layout = ChunkLayout(self.world, nbytes // self.world, cb)
        elif self.op == pb.COLLECTIVE_OP_ALL_GATHER:
            self.layout = ChunkLayout(self.world, nbytes, cb)
        elif self.op == pb.COLLECTIVE_OP_BARRIER:
            self.layout = ChunkLayout(1, 0, cb)
        else:
            self.layout = ChunkLayout(1, nbytes, cb)
        timeout = min(header.timeout_seconds or engine.max_timeout, engine.max_timeout)
        self._timer = asyncio.get_running_loop().call_later(timeout, self._on_timeout, timeout)

    # -- arrival -------------------------------------------------------------------------------

    def _validate(self, h: pb.CollectiveHeader) -> None:
        if h.op not in OP_NAMES:
            raise InvalidCollectiveError(f"unknown collective op {h.op}")
        info = dtype_from_wire(h.dtype)
        cb = h.chunk_bytes
        if not 0 < cb <= self.engine.max_chunk_bytes or cb % info.numpy.itemsize:
            raise InvalidCollectiveError(
                f"chunk_bytes {h.chunk_bytes} must be a multiple of the element size "
                f"{info.numpy.itemsize} and at most {self.engine.max_chunk_bytes}"
            )
        nbytes = math.prod(h.shape) * info.numpy.itemsize
        if nbytes > self.engine.max_tensor_bytes:
            raise PayloadTooLargeError(
                f"rank {h.rank} sent a {describe(h)} payload of {nbytes} bytes, over the "
                f"coordinator's limit of {self.engine.max_tensor_bytes} bytes "
                "(coordinator setting max_tensor_bytes)"
            )
        if h.op == pb.COLLECTIVE_OP_BROADCAST and h.root >= self.world:
            raise InvalidCollectiveError(
                f"broadcast src={h.root} is out of range for world_size {self.world}"
            )
        if h.averaging.rule and (h.op != pb.COLLECTIVE_OP_ALL_REDUCE or h.dtype != pb.DTYPE_FLOAT32
                                 or h.reduce_op != pb.REDUCE_OP_MEAN):
            raise InvalidCollectiveError(
                f"an averaging round must be an all_reduce with op='mean' of float32, got "
                f"{describe(h)}"
            )
        if h.op == pb.COLLECTIVE_OP_REDUCE_SCATTER and (not h.shape or h.shape[0] % self.world):
            raise InvalidCollectiveError(
                f"reduce_scatter needs dim 0 divisible by world_size {self.world}, "
                f"got shape {tuple(h.shape)}"
            )

    def arrive(self, h: pb.CollectiveHeader) -> Participant:
        """Admit rank ``h.rank``; raises (after failing the collective) on a mismatch."""
        if h.rank in self.participants:
            raise ProtocolError(f"rank {h.rank} issued collective seq {h.seq} twice")
        self._validate(h)
        first = self.spec
        pairs = zip(_field_values(h), _field_values(first), strict=False)
        differing = "op" if h.op != first.op else next(
            (name for (name, mine), (_, theirs) in pairs if mine != theirs), None)
        if differing is not None:
            raise CollectiveMismatchError(
                    f"ranks disagree on collective seq {h.seq} of job {self.gen.job.name!r} "
                f"(group {h.group!r}): rank {h.rank} called {describe(h)} but rank "
                f"{first.rank} called {describe(first)} ({differing} differs); every rank must "
                "issue the same collectives in the same order",
                rank=h.rank, field=differing,
            )
        p = Participant(h.rank, h, ChunkTracker(self.layout, f"rank {h.rank}"),
                        *self._input_range(h.rank), self._output_count(h.rank))
        self.participants[h.rank] = p
        self.engine.metrics.arrived(self.gen.job.name, h.rank, self.started, self.world,
                                    len(self.participants))
        if len(self.participants) == self.world:
            self._on_matched()
        return p

    def _input_range(self, rank: int) -> tuple[int, int]:
        """(first index, count) of the chunks ``rank`` must send."""
        n = self.layout.count
        if self.op == pb.COLLECTIVE_OP_BROADCAST:
            return 0, n if rank == self.spec.root else 0
        if self.op == pb.COLLECTIVE_OP_ALL_GATHER:
            per = self.layout.per_segment
            return rank * per, per
        return 0, n

    def _output_count(self, rank: int) -> int:
        n, per = self.layout.count, self.layout.per_segment
        if self.op == pb.COLLECTIVE_OP_ALL_REDUCE:
            return n
        if self.op == pb.COLLECTIVE_OP_BROADCAST:
            return 0 if rank == self.spec.root else n
        if self.op == pb.COLLECTIVE_OP_ALL_GATHER:
            return n - per
        if self.op == pb.COLLECTIVE_OP_REDUCE_SCATTER:
            return per
        return 0

    @property
    def matched(self) -> bool:
        return len(self.participants) == self.world

    def may_read(self, p: Participant) -> bool:
        """Whether the hub should read ``p``'s next chunk now (see :data:`READ_AHEAD_CHUNKS`)."""
        if self.finished or self.reducer is None:
            return True
        low = min(self.participants[r].tracker.received if r in self.participants else 0
                  for r in range(self.world))
        if self.op == pb.COLLECTIVE_OP_ALL_REDUCE:
            low = min(low, *(q.delivered for q in self.participants.values()))
            if not self.matched:
                low = 0
        return p.tracker.received < low + READ_AHEAD_CHUNKS

    async def wait_to_read(self, p: Participant) -> None:
        """Hold ``p``'s stream (HTTP/2 flow control then holds the rank) until it may read."""
        while not self.may_read(p):
            self._progress.clear()
            await self._progress.wait()

    def progressed(self) -> None:
        self._progress.set()

    def _on_matched(self) -> None:
        for p in self.participants.values():
            accept = pb.CollectiveAccept(output_chunks=p.output_count)
            p.outbox.put_nowait(encode_message(KIND_ACCEPT, accept))
        held, self._held = self._held, []
        for sender, _index, frame in held:
            self._forward(sender, frame)
        self._maybe_complete()

    # -- data ----------------------------------------------------------------------------------

    def on_chunk(self, p: Participant, frame: bytes) -> None:
        """A chunk frame from ``p``; reduce or forward it. Raises ProtocolError if it is bad."""
        try:
            index, payload = decode_chunk(frame)
        except ProtocolError as error:
            raise ProtocolError(f"rank {p.rank}: {error}") from None
        if not p.first_input <= index < p.first_input + p.input_count:
            raise ProtocolError(
                f"rank {p.rank} sent chunk {index}, outside its range "
                f"{p.first_input}..{p.first_input + p.input_count - 1}"
            )
        p.tracker.admit(index, payload)
        self._progress.set()
        self.gen.job.counters.bytes_in += payload.nbytes
        if self.reducer is None:
            if self.matched:
                self._forward(p.rank, frame)
            else:
                self._held.append((p.rank, index, frame))
            return
        slot = self._slots.pop(index, None)
        if (slot.count if slot is not None else 0) + 1 < self.world:
            self._slots[index] = self.reducer.fold(slot, payload)
            return
        frame, view = chunk_frame_buffer(payload.nbytes)
        self.reducer.finish_into(slot, payload, view[CHUNK_HEADER_BYTES:])
        if self.round is not None:
            values = np.frombuffer(view[CHUNK_HEADER_BYTES:], dtype=np.float32)
            self.round.apply(self.layout.span(index)[0] // 4, values)
        if self.op == pb.COLLECTIVE_OP_ALL_REDUCE:
            targets = self.participants.values()
        else:
            owner = self.layout.segment_of(index)
            index -= owner * self.layout.per_segment
            targets = (self.participants[owner],)
        seal_chunk_frame(frame, view, index)
        for t in targets:
            self._queue(t, frame)
        self._maybe_complete()

    def _forward(self, sender: int, frame: bytes) -> None:
        for t in self.participants.values():
            if t.rank != sender:
                self._queue(t, frame)
        self._maybe_complete()

    def _queue(self, p: Participant, frame: bytes) -> None:
        p.outbox.put_nowait(frame)
        p.queued += 1
        p.queued_bytes += len(frame)
        self.gen.job.counters.bytes_out += len(frame)

    def on_end(self, p: Participant, frame: bytes) -> None:
        """``p``'s end marker; raises ProtocolError if its counts disagree with what arrived."""
        try:
            end = decode_message(frame, KIND_END, pb.CollectiveEnd)
        except ProtocolError as error:
            raise ProtocolError(f"rank {p.rank}: {error}") from None
        p.tracker.finish(end, p.input_count)
        p.ended = True
        self.ends += 1
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.finished or not self.matched or self.ends < self.world:
            return
        if any(p.queued < p.output_count for p in self.participants.values()):
            return
        if self.round is not None:
            try:
                self.round.commit()
            except OSError as error:
                self.fail(GradstarError(
                    f"the coordinator could not save global model {self.spec.averaging.model!r} "
                    f"of job {self.gen.job.name!r}: {error}; the round did not happen"))
                return
        self._finish(None)
        for p in self.participants.values():
            payload = p.queued_bytes - p.queued * CHUNK_HEADER_BYTES
            p.outbox.put_nowait(encode_message(KIND_END, pb.CollectiveEnd(
                chunks=p.queued, bytes=payload)))
            p.outbox.put_nowait(CLOSE)

    # -- failure -------------------------------------------------------------------------------

    def on_stream_closed(self, p: Participant, how: str) -> None:
        if self.finished:
            return
        self.fail(RankLostError(
            f"rank {p.rank} {how} during {describe(self.spec)} seq {self.spec.seq} of job "
            f"{self.gen.job.name!r}; no rank received a result",
            rank=p.rank, generation=self.gen.number,
        ))

    def _on_timeout(self, timeout: float) -> None:
        if self.finished:
            return
        absent = [r for r in range(self.world) if r not in self.participants]
        if absent:
            detail = f"ranks {absent} never arrived"
            missing = absent
        else:
            missing = [p.rank for p in self.participants.values() if not p.ended]
            detail = (f"ranks {missing} did not finish sending" if missing
                      else "results are still being delivered")
        self.fail(CollectiveTimeoutError(
            f"{describe(self.spec)} seq {self.spec.seq} of job {self.gen.job.name!r} "
            f"(group {self.spec.group!r}) timed out after {timeout:g} s: {detail}",
            missing_ranks=missing,
        ))

    def fail(self, error: GradstarError) -> None:
        """End the collective with ``error`` on every rank that arrived or will arrive."""
        if self.finished:
            return
        self._finish(error)
        for p in self.participants.values():
            p.outbox.put_nowait(error)
        self.gen.ended[self.key] = (error, set(self.participants))

    def _finish(self, error: GradstarError | None) -> None:
        self.finished = True
        self._progress.set()
        self._timer.cancel()
        for slot in self._slots.values():
            self.reducer.release(slot)
        self._slots.clear()
        self._held.clear()
        self.gen.collectives.pop(self.key, None)
        counts = self.gen.job.counters.failed if error else self.gen.job.counters.completed
        counts[self.op] = counts.get(self.op, 0) + 1
        self.engine.metrics.finished(self.gen.job.name, OP_NAMES.get(self.op, str(self.op)),
                                     self.started, failed=error is not None)


class CollectiveEngine:
    """Entry point for collective streams: finds or opens the pending collective of a header."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        *,
        max_tensor_bytes: int,
        max_chunk_bytes: int,
        max_timeout: float,
        pool: BufferPool | None = None,
        averaging: AveragingStore | None = None,
        metrics: CollectiveMetrics | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.max_tensor_bytes = max_tensor_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.max_timeout = max_timeout
        self.pool = pool or BufferPool()
        self.averaging = averaging or AveragingStore()
        self.metrics = metrics or CollectiveMetrics()

    def arrive(self, h: pb.CollectiveHeader) -> tuple[PendingCollective, Participant]:
        """Admit a rank's header.

        Raises:
            RankLostError / RendezvousError: the caller's generation failed or is not current.
            GradstarError: the collective failed (mismatch, invalid, timeout); every rank that
                arrived or arrives later for this seq gets the same error.
        """
        gen = self.rendezvous.member(h.job, h.generation, h.rank, h.member_id)
        key = (h.group, h.seq)
        ended = gen.ended.get(key)
        if ended is not None:
            error, seen = ended
            seen.add(h.rank)
            if len(seen) >= gen.world_size:
                del gen.ended[key]
            raise error
        coll = gen.collectives.get(key)
        try:
            if coll is None:
                coll = PendingCollective(self, gen, h)
                gen.collectives[key] = coll
            return coll, coll.arrive(h)
        except GradstarError as error:
            if coll is None:
                # The opening header itself was invalid: later ranks must see the same error.
                gen.ended[key] = (error, {h.rank})
                counts = gen.job.counters.failed
                counts[h.op] = counts.get(h.op, 0) + 1
            else:
                coll.fail(error)
                gen.ended[key][1].add(h.rank)
            raise

    def fail_generation(self, gen: Generation) -> None:
        """Fail every pending collective of ``gen`` with the generation's failure."""
        for coll in list(gen.collectives.values()):
            coll.fail(gen.failure)

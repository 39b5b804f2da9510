"""The collective engine: matches collective calls of a generation and moves their chunks
(no I/O: that is :mod:`.servicer`'s; the rank's twin is :mod:`gradstar.client.collective.plan`).

Protocol of one collective (one stream per rank, which may carry the rank's next collective
after this one's END; see ``collective.proto`` and ``gradstar.wire``):

1. Each rank sends a ``HEADER`` naming (job, generation, group, seq) and what it asks for. The
   first header of a seq opens a :class:`PendingCollective`; every later one is checked against
   it field by field (op, reduce op, dtype, shape, root, chunk size; :mod:`.matching`). A
   disagreement fails the collective on every rank with :class:`CollectiveMismatchError` naming
   both ranks and values. Which chunks each rank sends and receives is the op's geometry
   (:func:`gradstar.ops.geometry`), the same table the ranks read.
2. When all ``world_size`` headers have arrived the collective is *matched*: every rank gets an
   ``ACCEPT`` frame.
3. Ranks stream their ``CHUNK`` frames. For all_reduce and reduce_scatter, chunk ``i`` is
   reduced into a pooled accumulator as arrivals come in (decoded to float32 first when the
   header names a wire format) and, once every rank has sent it, encoded once; the same bytes
   object is queued for every receiving rank while later chunks are still arriving. Broadcast
   and all_gather frames are forwarded unchanged (their senders use output chunk indices).
4. Each rank closes its input with an ``END`` frame carrying its chunk and byte counts. Only
   when every rank's input is complete and every output chunk is queued does each rank get its
   ``END``: a client treats its result as valid only after that marker, so a failure at any point
   leaves no rank with a partial result.

Memory: the hub never holds a whole tensor; how much it holds per collective, and when it stops
reading a rank's stream, is the read window's to say (:mod:`.window`).

Striping: behind a sharded hub each engine (one per shard process) carries one stripe of a
collective, the input chunks ``i % stripes == stripe`` (:func:`gradstar.ops.in_stripe`); its
participants send, and get, only those.

Any failure — mismatch, invalid request, corrupt frame, a stream closed before its end marker,
the collective's timeout, the generation failing because a member was lost, or a member
finishing (closing its group) while the collective needs it — fails the collective on every rank
that arrived, and on every rank that arrives later for the same seq.
"""

from __future__ import annotations

import time

import numpy as np

from gradstar import ops
from gradstar.errors import (
    CollectiveTimeoutError,
    GradstarError,
    ProtocolError,
    RankLostError,
)
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import (
    CHUNK_HEADER_BYTES,
    KIND_END,
    ChunkTracker,
    accept_frame,
    chunk_frame_buffer,
    decode_chunk,
    decode_shared,
    decode_shm_chunk,
    encode_chunk,
    encode_shm_chunk,
    end_frame,
    seal_chunk_frame,
)

from ..metrics import CollectiveMetrics
from ..rendezvous.rendezvous import Generation, Rendezvous
from ..rounds.averaging import AveragingRound, AveragingStore, collective_id
from .budget import CollectiveBudget, participant_charge
from .deadlines import Deadlines
from .matching import Limits, ValidatedCalls, check_agrees, describe
from .reduce import BufferPool, reducer_for
from .window import CLOSE, Participant, ReadWindow


def without_frames(error: GradstarError) -> GradstarError:
    """``error`` with its traceback and context dropped, returned.

    Errors outlive the collectives they end: a failed generation's error and an ended
    collective's error are kept for the ranks that come later. A traceback keeps every frame it
    passed through, with their locals (the collective, views of the ranks' segments), alive as
    long as the error is kept; the error's message and fields are all a rank ever gets.
    """
    error.__traceback__ = None
    error.__context__ = None
    return error


class PendingCollective:
    """One collective of one generation, from its first header to its last END frame."""

    def __init__(self, engine: CollectiveEngine, gen: Generation, call: ops.CollectiveCall):
        header = call.header
        self.engine, self.gen = engine, gen
        self.key = (header.group, header.seq)
        self.spec = header
        self.fields = call.fields  # what a later rank's header must agree with (call_fields)
        self.op = header.op
        self.world = gen.world_size
        self.started = time.monotonic()
        self.participants: dict[int, Participant] = {}
        self.finished = False
        self.ends = 0
        self._slots: dict[int, list] = {}
        self._held: list[tuple[int, int, bytes]] = []
        self.window = ReadWindow()
        self.dtype = call.dtype
        self.nbytes = call.nbytes
        #: Striping over hub shards: this engine carries input chunks i % stripes == stripe.
        self.stripes = max(1, header.stripes)
        self.layout = call.geometry.layout  # of encoded chunks if wire
        self.reducer = reducer_for(call, engine.pool)
        self.round: AveragingRound | None = None
        if header.averaging.rule:
            self.round = engine.averaging.open_round(
                gen.job.name, header.averaging, self.nbytes // self.dtype.numpy.itemsize,
                made_by=collective_id(gen, header.seq))
        timeout = min(header.timeout_seconds or engine.max_timeout, engine.max_timeout)
        self._due = engine.deadlines.add(self, timeout)  # calls expired() unless it ends first

    # -- arrival -------------------------------------------------------------------------------

    def arrive(self, call: ops.CollectiveCall, shm: memoryview | None = None) -> Participant:
        """Admit rank ``call.header.rank`` (validated, :func:`.matching.validate`; with its
        attached segment ``shm``, if any); raises (after failing the collective) on a
        mismatch."""
        h = call.header
        if h.rank in self.participants:
            raise ProtocolError(f"rank {h.rank} issued collective seq {h.seq} twice")
        if h is not self.spec and call.fields != self.fields:  # the first header is the spec
            check_agrees(h, self.spec, self.gen.job.name)
        s = self.spec
        g = call.geometry  # h agrees with self.spec: checked just above
        if shm is not None:
            # Input region at 0, result region at output_offset: both must fit the segment,
            # apart or the same where the op's record allows it (ops.CollectiveCall).
            start = h.shm.output_offset
            if not call.result_fits(start, len(shm)):
                raise ProtocolError(
                    f"rank {h.rank}'s segment of {len(shm)} bytes with its result at {start} "
                    f"cannot hold {self.layout.total_bytes} input and "
                    f"{g.out_layout.total_bytes} result bytes")
        # Charged before anything is allocated for this rank's part.
        charge = participant_charge(self.layout.count)
        self.engine.budget.charge((self.gen, h.rank), charge,
                                  lambda: f"rank {h.rank}'s {describe(s)} seq {s.seq} of job "
                                          f"{self.gen.job.name!r}", self.gen.job.name)
        try:
            inputs = self._stripe((g.sends,))
            outputs = self._stripe(g.receives)
            p = Participant(h.rank, h, ChunkTracker(self.layout, f"rank {h.rank}",
                                                    allowed=inputs),
                            g.sends, len(g.sends) if inputs is None else len(inputs),
                            g.receive_count if outputs is None else len(outputs), g.out_layout,
                            charge=charge)
        except BaseException:
            self.engine.budget.give_back((self.gen, h.rank), charge)
            raise
        if shm is not None:
            p.shm, p.shm_out = shm, start
        self.participants[h.rank] = p
        if len(self.participants) == self.world:
            self._on_matched()
        return p

    def _stripe(self, indices) -> ops.Indices | None:
        """The input indices among ``indices`` this engine's stripe carries (None: all)."""
        if self.stripes <= 1:
            return None
        return ops.stripe_indices(indices, self.spec.stripe, self.stripes)

    @property
    def matched(self) -> bool:
        return len(self.participants) == self.world

    @property
    def held_chunks(self) -> int:
        """Forwarded chunks read before the collective matched, held until it does."""
        return len(self._held)

    def _on_matched(self) -> None:
        self.late = self.engine.metrics.matched(self.gen.job.name, self.spec.stripe, [
            (p.rank, p.arrived) for p in self.participants.values()])  # in arrival order
        for p in self.participants.values():
            p.outbox.put_nowait(accept_frame(p.output_count))
        held, self._held = self._held, []
        for sender, index, payload, frame in held:
            self._forward(sender, index, payload, frame)
        # Senders held back while unmatched may read again (as far as the receivers allow).
        self.window.progressed()
        self._maybe_complete()

    # -- data ----------------------------------------------------------------------------------

    async def wait_to_read(self, p: Participant) -> None:
        """Hold ``p``'s stream until the read window lets the hub read its next chunk."""
        await self.window.wait(self, p)

    def progressed(self) -> None:
        """A chunk was delivered (or something else moved): re-check the held reads."""
        self.window.progressed()

    def on_chunk(self, p: Participant, frame: bytes) -> None:
        """A chunk frame from ``p``; reduce or forward it. Raises ProtocolError if it is bad."""
        try:
            index, payload = decode_chunk(frame)
        except ProtocolError as error:
            raise ProtocolError(f"rank {p.rank}: {error}") from None
        self._take(p, index, payload, frame)

    def on_shm_chunk(self, p: Participant, frame: bytes) -> None:
        """``p`` announced an input chunk in its segment; reduce or forward it."""
        if p.shm is None:
            raise ProtocolError(f"rank {p.rank} sent a shared-memory chunk on a stream whose "
                                "segment the hub did not attach")
        try:
            index = decode_shm_chunk(frame)
            offset, length = self.layout.span(index)
        except ProtocolError as error:
            raise ProtocolError(f"rank {p.rank}: {error}") from None
        self._take(p, index, p.shm[offset:offset + length], None)

    def _take(self, p: Participant, index: int, payload: memoryview,
              frame: bytes | None) -> None:
        """Input chunk ``index`` of ``p`` (``frame``: the chunk frame it came in, if any)."""
        if index not in p.inputs:
            raise ProtocolError(
                f"rank {p.rank} sent chunk {index}, outside its range "
                f"{p.inputs.start}..{p.inputs.stop - 1}"
            )
        p.tracker.admit(index, payload)
        self.window.progressed()
        self.gen.job.counters.bytes_in += payload.nbytes
        if self.reducer is None:
            if self.matched:
                self._forward(p.rank, index, payload, frame)
            else:
                self._held.append((p.rank, index, payload, frame))
            return
        slot = self._slots.pop(index, None)
        if (slot.count if slot is not None else 0) + 1 < self.world:
            self._slots[index] = self.reducer.fold(slot, payload, index)
            return
        routes = ops.routes(self.op, self.layout, index, p.rank, self.world, self.spec.root)
        # Every route of a reduced chunk has the same output index (one result for all ranks).
        out_index = routes[0][1]
        receivers = [self.participants[rank] for rank, _ in routes]
        if all(q.shm is not None for q in receivers):
            # Every receiver shares memory with the hub: reduce straight into the first one's
            # segment, copy from there to the others; no frame at all.
            result, frame = receivers[0].out_region(out_index), None
        else:
            frame, view = chunk_frame_buffer(receivers[0].out_layout.span(out_index)[1])
            result = view[CHUNK_HEADER_BYTES:]
        self.reducer.finish_into(slot, payload, result, index)
        if self.round is not None:
            values = np.frombuffer(result, dtype=np.float32)
            self.round.apply(receivers[0].out_layout.span(out_index)[0] // 4, values)
        if frame is not None:
            seal_chunk_frame(frame, view, out_index)
        for i, q in enumerate(receivers):
            self._deliver(q, out_index, result, frame, placed=frame is None and i == 0)
        self._maybe_complete()

    def _forward(self, sender: int, index: int, payload: memoryview,
                 frame: bytes | None) -> None:
        for rank, out_index in ops.routes(self.op, self.layout, index, sender, self.world):
            q = self.participants[rank]
            if frame is None and q.shm is None:
                frame = encode_chunk(out_index, payload)  # once, shared by every receiver
            self._deliver(q, out_index, payload, frame)
        self._maybe_complete()

    def _deliver(self, q: Participant, index: int, payload: memoryview,
                 frame: bytes | None, placed: bool = False) -> None:
        """Queue output chunk ``index`` for ``q``: through its segment if it has one (the
        payload copied into place unless it was ``placed`` there already), else as ``frame``."""
        if q.shm is not None:
            if not placed:
                q.out_region(index)[:] = payload
            q.outbox.put_nowait(encode_shm_chunk(index))
        else:
            q.outbox.put_nowait(frame)
        q.queued += 1
        q.queued_bytes += payload.nbytes
        self.gen.job.counters.bytes_out += payload.nbytes

    def on_end(self, p: Participant, frame: bytes) -> None:
        """``p``'s end marker; raises ProtocolError if its counts disagree with what arrived."""
        try:
            end = decode_shared(frame, KIND_END, pb.CollectiveEnd)
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
            p.outbox.put_nowait(end_frame(p.queued, p.queued_bytes, self.late))
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

    def expired(self, timeout: float) -> None:
        """Its ``timeout`` passed before it ended (:mod:`.deadlines`): fail it."""
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
            f"Timed out after {timeout:g} s: {describe(self.spec)} seq {self.spec.seq} of job "
            f"{self.gen.job.name!r} (group {self.spec.group!r}): {detail}",
            missing_ranks=missing,
        ))

    def fail(self, error: GradstarError) -> None:
        """End the collective with ``error`` on every rank that arrived or will arrive."""
        if self.finished:
            return
        self._finish(error)
        for p in self.participants.values():
            p.outbox.put_nowait(error)
        self.gen.ended[self.key] = (without_frames(error), set(self.participants))

    def _finish(self, error: GradstarError | None) -> None:
        self.finished = True
        self.window.progressed()
        self.engine.deadlines.remove(self._due, self)
        for slot in self._slots.values():
            self.reducer.release(slot)
        self._slots.clear()
        self._held.clear()
        self.gen.collectives.pop(self.key, None)
        for p in self.participants.values():
            self.engine.budget.give_back((self.gen, p.rank), p.charge)
        self.engine.count(self.gen, self.spec, failed=error is not None)
        self.engine.metrics.finished(self.gen.job.name, ops.op_name(self.op), self.started,
                                     failed=error is not None, error=error)


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
        budget: CollectiveBudget | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.limits = Limits(max_tensor_bytes, max_chunk_bytes)
        self.validated = ValidatedCalls(self.limits)
        #: What pending collectives may hold (:mod:`.budget`); unlimited unless given.
        self.budget = budget or CollectiveBudget(1 << 62, 1 << 62, 1 << 62)
        self.max_timeout = max_timeout
        self.pool = pool or BufferPool()
        self.averaging = averaging or AveragingStore()
        self.metrics = metrics or CollectiveMetrics()
        self.deadlines = Deadlines()  # when pending collectives time out

    @classmethod
    def from_settings(cls, rendezvous: Rendezvous, settings, *,
                      averaging: AveragingStore | None = None,
                      metrics: CollectiveMetrics | None = None) -> CollectiveEngine:
        """The engine a hub process runs: its limits, budget and arrival measurement as
        ``settings`` (a :class:`~gradstar.config.CoordinatorSettings` or
        :class:`~gradstar.config.ShardSettings`: the coordinator's and a hub shard's alike)
        say; ``averaging`` and ``metrics`` as the constructor takes them."""
        s = settings
        engine = cls(
            rendezvous, max_tensor_bytes=s.max_tensor_bytes, max_chunk_bytes=s.max_chunk_bytes,
            max_timeout=s.max_collective_timeout, averaging=averaging, metrics=metrics,
            budget=CollectiveBudget(s.max_collective_state_bytes, s.max_pending_per_member,
                                    s.max_pending_per_job, s.collective_state_job_share))
        engine.metrics.arrivals.enabled = s.measure_arrivals
        return engine

    def arrive(self, h: pb.CollectiveHeader,
               shm: memoryview | None = None) -> tuple[PendingCollective, Participant]:
        """Admit a rank's header (and its attached shared-memory segment, if any).

        Raises:
            RankLostError / RendezvousError: the caller's generation failed or is not current.
            RankFinishedError: a rank of the generation finished (closed its group).
            HubCapacityError: the hub's budget for pending collectives, or a cap on them per
                member or per job, is reached (:mod:`.budget`); the collective fails.
            GradstarError: the collective failed (mismatch, invalid, timeout); every rank that
                arrived or arrives later for this seq gets the same error.
        """
        gen = self.rendezvous.member(h.job, h.generation, h.rank, h.member_id)
        if gen.finished_error is not None:
            raise gen.finished_error
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
            call = self.validated.call(h, gen.world_size)
            if coll is None:
                self.budget.check_open(len(gen.collectives), gen.job.name)
                coll = PendingCollective(self, gen, call)
                gen.collectives[key] = coll
            return coll, coll.arrive(call, shm)
        except GradstarError as error:
            if coll is None:
                # The opening header itself was invalid: later ranks must see the same error.
                gen.ended[key] = (without_frames(error), {h.rank})
                self.count(gen, h, failed=True)
            else:
                coll.fail(error)
                gen.ended[key][1].add(h.rank)
            raise

    @staticmethod
    def count(gen: Generation, h: pb.CollectiveHeader, *, failed: bool) -> None:
        """Count a finished collective for its job; a striped one counts once, by stripe 0."""
        if h.stripe == 0:
            counts = gen.job.counters.failed if failed else gen.job.counters.completed
            counts[h.op] = counts.get(h.op, 0) + 1

    def fail_generation(self, gen: Generation, error: GradstarError | None = None) -> None:
        """Fail every pending collective of ``gen`` with ``error`` (default: the generation's
        failure)."""
        for coll in list(gen.collectives.values()):
            coll.fail(error or gen.failure)

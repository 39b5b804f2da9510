"""gRPC servicer of the Steps service: streams in, :class:`.ledger.StepsTable` calls, streams
out, gradstar errors to statuses. Contribute answers with the aggregates the rank lacks (one
round trip per training step); it, Fetch and Synchronize wait (bounded) for a step or a barrier.
The rank's half is ``gradstar.client.steps.client``.

Who may call: every call names its caller as a member of the job's current generation
(``StepsKey``: generation, rank, member id, as the rendezvous issued them), checked before
anything else; the ledger's world size is the generation's. A caller that is not that member
(of another job, of no job, an old generation, a replaced rank) is refused with
:class:`~gradstar.errors.RendezvousError`, and no ledger is made for it. Uploads (gradients,
snapshots) reserve their declared size in the table's memory account before a byte of them is
allocated."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np

from gradstar.allocator import trim_heap
from gradstar.errors import GradstarError, HubCapacityError, ProtocolError
from gradstar.proto.v1 import steps_pb2 as pb
from gradstar.proto.v1 import steps_pb2_grpc
from gradstar.sync_modes import from_message
from gradstar.transport.auth import check_job_access
from gradstar.transport.channels import PART_BYTES
from gradstar.transport.status import error_status
from gradstar.wire.chunks import split_parts, take_part
from gradstar.wire.formats import WireFormat, decode, format_from_wire

from ..collective.deadlines import Changes, DeadlineTimer
from ..rendezvous.jobs import check_job_name
from .ledger import StepLedger
from .records import ClosedStep
from .resume import ResumeClaim, Resumptions
from .store import SnapshotStore
from .table import StepsTable

log = logging.getLogger(__name__)

#: Longest a Fetch or Synchronize waits before answering "not ready" (the client asks again, so
#: a dead hub or a lost answer is noticed within this).
MAX_WAIT = 10.0
#: A snapshot (parameters, buffers, optimizer state) may be this many times the largest
#: gradient the hub takes; its layout this many characters.
MAX_SNAPSHOT_SCALE = 4
MAX_LAYOUT_CHARS = 1 << 20


class StepsServicer(steps_pb2_grpc.StepsServicer):
    """Contribute, Fetch, Heartbeat and Synchronize over :class:`StepsTable`; closes Quorum
    steps at their deadlines."""

    def __init__(self, table: StepsTable, max_chunk_bytes: int,
                 store: SnapshotStore | None = None, *,
                 members: Callable[[str, int, int, str], object],
                 rebuilt: Callable[[object], bool] = lambda generation: False) -> None:
        """``members(job, generation, rank, member_id)``: the caller's generation (its
        ``world_size`` sizes the ledger), or a raised gradstar error when it is not that
        member (the rendezvous' ``bound_member``); ``rebuilt(generation)``: whether it was
        taken back from its rejoining ranks after a restart (its ledgers resume:
        :mod:`.resume`)."""
        self.table = table
        self.members = members
        self.rebuilt = rebuilt
        self.resumptions = Resumptions()
        # Many ranks lost together settle each ledger once, on the next loop turn.
        table.defer = lambda settle: asyncio.get_running_loop().call_soon(settle)
        self.max_chunk_bytes = max_chunk_bytes
        self.store = store
        self._saving: dict[tuple[str, str], asyncio.Lock] = {}
        self._saved: dict[tuple[str, str], int] = {}
        self._changes = Changes()
        table.on_change = self._changes.wake
        self._deadlines = DeadlineTimer(table, grace=0.001)

    async def Contribute(self, request_iterator: AsyncIterator[pb.ContributionPart],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepsPart]:
        parts = request_iterator.__aiter__()
        async with error_status(context):
            first = await _first(parts)
        caller = first.header.key
        while True:
            for part in await self._contribution(first, parts, context):
                yield part
            if not first.header.streamed:
                return
            # A streamed call: the rank's next contribution follows, or the half-close.
            async with error_status(context):
                first = await _next_header(parts, caller)
            if first is None:
                return

    async def _contribution(self, first: pb.ContributionPart, parts,
                            context: grpc.aio.ServicerContext) -> list[pb.StepsPart]:
        """One contribution whose header is ``first``'s: read, taken, and the answer's parts."""
        h = first.header
        async with error_status(context):
            ledger = self._ledger(h.key, "Contribute")
            mode = from_message(h.mode)
            # Refused before any memory is taken for it.
            ledger.check_header(h.key.rank, mode, h.mode_epoch, h.numel, h.base, h.weight,
                                h.wire, tuple(h.hyper), h.buffer_numel)
            fmt = format_from_wire(h.wire)
            # The received bytes, and the float32 values an encoded gradient decodes to.
            size = 4 * h.numel if fmt is None else fmt.encoded_nbytes(h.numel) + 4 * h.numel
            reservation = self.table.account.reserve(ledger, h.key.rank, "contribution", size)
            try:
                data = await self._read(first, parts, h.numel, fmt, f"rank {h.key.rank}",
                                        h.streamed)
                # BoundedStaleness: a fast rank's next gradient waits while closing the step
                # its previous one is in would leave a live rank too far behind.
                began = asyncio.get_running_loop().time()
                while ledger.must_wait(h.key.rank):
                    await self._wait(lambda: not ledger.must_wait(h.key.rank),
                                     MAX_WAIT)
                reservation.release()  # the step holds it from here (no await in between)
                verdict = ledger.contribute(h.key.rank, mode, h.mode_epoch, h.base, h.weight,
                                            data, h.wire, tuple(h.hyper), h.buffer_numel)
            finally:
                reservation.release()
            self._deadlines.arm()
            contributed = pb.Contributed(
                accepted=verdict.accepted, step=verdict.step, staleness=verdict.staleness,
                steps=ledger.steps, reason=verdict.reason,
                want_snapshot=ledger.wants_snapshot(h.key.rank, self.table.clock()))
        # The contribution is taken: from here on the answer always carries the verdict.
        closed = None
        if h.fetch_limit:
            if verdict.accepted and h.await_step:
                await self._wait(lambda: ledger.steps >= verdict.step, h.wait_seconds)
            with contextlib.suppress(GradstarError):  # the rank's Fetch names it
                closed = ledger.fetch(h.key.rank, h.base, h.fetch_limit)
        contributed.waited_seconds = asyncio.get_running_loop().time() - began
        return _answer(ledger, closed, contributed, joined=h.streamed)

    async def Fetch(self, request: pb.FetchStepsRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepsPart]:
        async with error_status(context):
            ledger = self._ledger(request.key, "Fetch")
            await self._wait(lambda: ledger.steps >= request.min_steps, request.wait_seconds)
            closed = None
            if ledger.steps < request.min_steps:
                ledger.seen(request.key.rank)
            else:
                closed = ledger.fetch(request.key.rank, request.have, request.limit)
        for part in _answer(ledger, closed):
            yield part

    async def Heartbeat(self, request: pb.StepsHeartbeat,
                        context: grpc.aio.ServicerContext) -> pb.StepsState:
        async with error_status(context):
            ledger = self._ledger(request.key, "")
            if self.resumptions.pending(ledger):  # its state waits for Resume
                ledger.seen(request.key.rank)
            else:
                ledger.heartbeat(request.key.rank, request.have, request.leave)
            self._deadlines.arm()
            return _state(ledger)

    async def Synchronize(self, request: pb.SynchronizeRequest,
                          context: grpc.aio.ServicerContext) -> pb.SynchronizeReply:
        async with error_status(context):
            ledger = self._ledger(request.key, "Synchronize")
            rank, barrier = request.key.rank, request.barrier
            next_mode = (from_message(request.next_mode) if request.HasField("next_mode")
                         else None)
            outcome = ledger.synchronize(rank, barrier, next_mode)
            if outcome is None:
                await self._wait(lambda: barrier in ledger.barriers, request.wait_seconds)
                outcome = ledger.synchronize(rank, barrier, next_mode)
            if outcome is None:
                return pb.SynchronizeReply(ready=False)
            return pb.SynchronizeReply(
                ready=True, steps=outcome.steps, mode_epoch=outcome.mode_epoch,
                mode=outcome.mode.message() if outcome.mode is not None else None,
                switch_refused=outcome.refused)

    async def PutSnapshot(self, request_iterator: AsyncIterator[pb.SnapshotPart],
                          context: grpc.aio.ServicerContext) -> pb.StepsState:
        async with error_status(context):
            parts = request_iterator.__aiter__()
            first = await _first(parts, "PutSnapshot")
            h = first.header
            ledger = self._ledger(h.key, "PutSnapshot")
            if h.nbytes > MAX_SNAPSHOT_SCALE * self.table.max_numel * 4 or (
                    len(h.layout) > MAX_LAYOUT_CHARS):
                raise HubCapacityError(
                    f"rank {h.key.rank}'s snapshot of {h.nbytes} bytes (layout "
                    f"{len(h.layout)} characters) is over this coordinator's limits")
            reservation = self.table.account.reserve(ledger, h.key.rank, "snapshot",
                                             h.nbytes + len(h.layout))
            try:
                data = await self._read_snapshot(first, parts, h.nbytes, h.key.rank)
                reservation.release()  # the ledger holds it from here (no await in between)
                ledger.put_snapshot(h.key.rank, h.steps, h.layout, data)
            finally:
                reservation.release()
            await self._save(ledger)
            return _state(ledger)

    async def GetSnapshot(self, request: pb.SnapshotRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SnapshotPart]:
        async with error_status(context):
            ledger = self._ledger(request.key, "GetSnapshot")
            ledger.seen(request.key.rank)
            # A snapshot older than the log's first aggregate cannot be replayed from: the
            # joiner waits for a fresh one (the hub asks a live rank for it meanwhile).
            await self._wait(ledger.joinable, request.wait_seconds)
        snapshot = ledger.snapshot
        if snapshot is None or not ledger.joinable():
            yield pb.SnapshotPart(header=pb.SnapshotHeader(key=request.key))
            return
        yield pb.SnapshotPart(header=pb.SnapshotHeader(
            key=request.key, steps=snapshot.steps, layout=snapshot.layout,
            nbytes=len(snapshot.data), mode_epoch=ledger.mode_epoch,
            barriers=ledger.barrier_done))
        for piece in split_parts(memoryview(snapshot.data), PART_BYTES):
            yield pb.SnapshotPart(data=piece)

    async def Resume(self, request: pb.ResumeRequest,
                     context: grpc.aio.ServicerContext) -> pb.ResumeReply:
        async with error_status(context):
            ledger = self._ledger(request.key, "")
            claim = ResumeClaim(request.key.rank, request.have, request.barriers,
                                request.mode_epoch)
            resumed = self.resumptions.claim(ledger, claim)
            if resumed is None:  # the other ranks have yet to say
                await self._wait(lambda: not self.resumptions.pending(ledger),
                                 request.wait_seconds)
                resumed = self.resumptions.claim(ledger, claim)
            if resumed is None:
                return pb.ResumeReply(ready=False)
            return pb.ResumeReply(ready=True, steps=resumed.steps,
                                  load_snapshot=resumed.load_snapshot,
                                  send_snapshot=resumed.send_snapshot)

    async def _save(self, ledger: StepLedger) -> None:
        """Write the ledger's snapshot to the state directory (if any), off the event loop;
        one write per ledger at a time, and never an older snapshot over a newer one. A failed
        write is logged: the snapshot still serves joiners from memory."""
        if self.store is None:
            return
        key = (ledger.job, ledger.model)
        async with self._saving.setdefault(key, asyncio.Lock()):
            snapshot = ledger.snapshot
            if snapshot is None or self._saved.get(key, -1) >= snapshot.steps:
                return
            try:
                await asyncio.to_thread(self.store.save, ledger.job, ledger.model, snapshot)
            except OSError as error:
                log.error("could not save the snapshot of model %r of job %r: %s",
                          ledger.model, ledger.job, error)
                return
            self._saved[key] = snapshot.steps

    def sweep(self) -> None:
        """Take silent ranks out of the live sets (the coordinator's sweep calls this)."""
        self.table.expire()
        self.table.close_due()
        if self.table.account.should_trim():  # a burst of uploads or steps is over: give it back
            trim_heap()
            self.table.account.trimmed()

    def _ledger(self, key: pb.StepsKey, what: str) -> StepLedger:
        """The ledger ``key`` names, once its caller is bound to a member (see the module
        docstring); nothing is made for a caller that is not one. ``what``: the call, refused
        while the ledger of a rebuilt generation waits for its ranks (empty: taken then)."""
        check_job_name(key.job)
        check_job_name(key.model, "a model name")
        check_job_access(key.job)  # the caller's token opens this job (per-job tokens)
        gen = self.members(key.job, key.generation, key.rank, key.member_id)
        return self.resumptions.ledger(self.table, gen, self.rebuilt(gen), key.job, key.model,
                                       key.rank, what)

    async def _read_snapshot(self, first: pb.SnapshotPart, parts, nbytes: int,
                             rank: int) -> bytearray:
        """A PutSnapshot stream's ``nbytes`` bytes (reserved by the caller).

        Raises:
            ProtocolError: a part too large, or data of another length than announced.
        """
        data = bytearray(nbytes)
        view = memoryview(data)
        filled = take_part(first.data, view, 0, self.max_chunk_bytes, "a Steps")
        async for part in parts:
            filled = take_part(part.data, view, filled, self.max_chunk_bytes, "a Steps")
        if filled != nbytes:
            raise ProtocolError(f"rank {rank} announced a snapshot of {nbytes} bytes but sent "
                                f"{filled}; nothing was kept")
        return data

    async def _read(self, first: pb.ContributionPart, parts, numel: int,
                    fmt: WireFormat | None, who: str, streamed: bool = False) -> np.ndarray:
        """The whole float32 gradient of a Contribute stream: ``numel`` float32 values, or
        ``fmt``'s encoding of them (exactly its encoded size; decoded once, here); read up to
        the half-close, or (``streamed``) exactly that many bytes.

        Raises:
            ProtocolError: a part too large, a second header, or data of the wrong length.
        """
        size = 4 * numel if fmt is None else fmt.encoded_nbytes(numel)
        what = "float32" if fmt is None else fmt.name
        stream = f"{who}'s {what} Contribute"  # names the format in a size error
        out = np.empty(size, dtype=np.uint8)
        view = memoryview(out)
        filled = take_part(first.data, view, 0, self.max_chunk_bytes, stream)
        while not streamed or filled < size:
            part = await anext(parts, None)
            if part is None:
                break
            if part.HasField("header"):
                raise ProtocolError("a Contribute stream carries one header per contribution, "
                                    "before its data")
            filled = take_part(part.data, view, filled, self.max_chunk_bytes, stream)
        if filled != len(view):
            raise ProtocolError(f"{who} announced {numel} {what} values ({size} bytes) but sent "
                                f"{filled} bytes; the stream was cut or malformed and nothing "
                                "was used")
        return out.view("<f4").astype(np.float32, copy=False) if fmt is None else (
            decode(fmt, out, numel))


    async def _wait(self, ready: Callable[[], bool], seconds: float) -> None:
        await self._changes.wait(ready, min(seconds, MAX_WAIT))


async def _next_header(parts, caller: pb.StepsKey) -> pb.ContributionPart | None:
    """The next contribution of a streamed Contribute call (None: the rank half-closed).

    Raises:
        ProtocolError: it is not a streamed contribution's header of the call's caller.
    """
    part = await anext(parts, None)
    if part is None:
        return None
    if not part.HasField("header") or not part.header.streamed or part.header.key != caller:
        raise ProtocolError("each contribution of a streamed Contribute call begins with its "
                            "header, streamed, of the call's first caller")
    return part


async def _first(parts, what: str = "Contribute"):
    try:
        first = await anext(parts)
    except StopAsyncIteration:
        raise ProtocolError(f"a {what} stream ended before its header") from None
    if not first.HasField("header"):
        raise ProtocolError(f"a {what} stream must begin with its header")
    return first


def _answer(ledger: StepLedger, closed: list[ClosedStep] | None,
            contributed: pb.Contributed | None = None, joined: bool = False,
            ) -> list[pb.StepsPart]:
    """A Fetch or Contribute answer: the header (``closed`` None: not ready), then the
    aggregates' bytes in parts; ``joined``: the first part rides in the header's message (a
    streamed Contribute, whose reader counts the bytes the header announces)."""
    if closed is None:
        return [pb.StepsPart(header=pb.StepsHeader(ready=False, steps=ledger.steps,
                                                   contributed=contributed))]
    header = pb.StepsHeader(
        ready=True, steps=ledger.steps, numel=ledger.numel or 0,
        records=[_record(s) for s in closed],
        wire=ledger.wire.wire if ledger.wire is not None else 0, contributed=contributed)
    # The aggregates are never changed once closed: send them as they are (encoded).
    pieces = [piece for step in closed
              for piece in split_parts(memoryview(step.aggregate).cast("B"), PART_BYTES)]
    if joined and pieces:
        return [pb.StepsPart(header=header, data=pieces[0]),
                *(pb.StepsPart(data=piece) for piece in pieces[1:])]
    return [pb.StepsPart(header=header), *(pb.StepsPart(data=piece) for piece in pieces)]


def _state(ledger: StepLedger) -> pb.StepsState:
    snapshot = ledger.snapshot
    return pb.StepsState(steps=ledger.steps, live=sorted(ledger.live()),
                         has_snapshot=snapshot is not None,
                         snapshot_steps=snapshot.steps if snapshot is not None else 0)


def _record(step: ClosedStep) -> pb.StepRecord:
    return pb.StepRecord(step=step.number, ranks=step.ranks, weights=step.weights,
                         staleness=step.staleness, hyper=step.hyper, factors=step.factors)

"""The rank's half of the Collective stream: the I/O. Its twin on the hub is
:mod:`gradstar.coordinator.collective.servicer`; the bookkeeping without sockets is
:mod:`.plan`'s here and :mod:`gradstar.coordinator.collective.engine`'s there.

A collective runs on a bidirectional stream of raw frames (:mod:`gradstar.wire`) between the
rank and its target, which it has to itself while it runs. Seen from the rank:

1. **Header.** The rank writes a ``HEADER`` (``CollectiveHeader``: job, generation, group, seq,
   op, reduce op, dtype, shape, root, chunk size, timeout) and right behind it its ``CHUNK``
   frames and an ``END`` frame with its chunk and byte counts — a small collective's all in one
   message (:mod:`.outgoing`), which the hub answers in one message too. Which chunks it sends
   is the op's geometry (:func:`gradstar.ops.geometry`), which the hub computes from the same
   header.
2. **Accept.** Once every rank's header has arrived and agreed, the hub answers ``ACCEPT``
   with the number of chunks it will send this rank; a number unlike the rank's own geometry
   is a :class:`~gradstar.errors.ProtocolError`. No chunk may come before the accept.
3. **Chunks.** Each result chunk is checked (checksum, index, length; once each; only the
   indices this stream may carry — all_gather never sends a rank its own segment back) and
   copied to its place in the result buffer, by input index, or by output index for
   reduce_scatter (see :mod:`gradstar.ops`).
4. **End.** The hub's ``END`` says how many chunks and bytes it sent; only when they match
   what arrived is the result valid.

Failure: an ``ERROR`` frame, at any point, carries the hub's verdict and is raised as the
exception it names (mismatch, timeout, lost rank, ...). A transport failure first asks the
rank's session, which names a lost rank or hub if that is why, briefly
(:meth:`~gradstar.client.session.Session.verdict`); otherwise it is translated from the gRPC
status. The collective's deadline (its timeout and a margin) is only a backstop: the hub times
a collective out itself. These rules, with the put-back and the abandon below, are
:mod:`.failure`'s, which the direct lane (:mod:`.direct`) shares.

Streams outlive collectives (:class:`OpenStream`): after the hub's ``END`` the stream goes back
to its target's idle streams and the next collective's header follows on it, so a collective
costs no call set-up (:mod:`.targets` says why). Collectives issued at once each take a stream
of their own. ``ERROR`` and every other way a collective can end are final for its stream: the
call is hung up without waiting for its gRPC status, which grpc-python may misreport as INTERNAL
when the server finishes while this side is still writing. Closing the group ends the idle
streams.

Cancellation: a collective cancelled on this rank (its task cancelled, ``asyncio.wait_for``
expiring) fails on every rank. Once the hub holds the rank's header, hanging up does that: the
hub fails a collective whose stream closes before its end marker. Before the hub has it (the
header is written by grpc's own task, so a cancelled caller cannot tell), the hub would not know
this rank is gone, its session being alive, and the other ranks would wait out the timeout; so
a stream cancelled before the hub's accept also sends the hub the header alone on a new stream
(:func:`_abandon`). A collective is issued when it is called, not when it is awaited
(:func:`issue`: the asyncio API returns a running task, as torch's ``async_op`` does), so one
the caller never awaits still runs; and one cancelled before its task ever ran sends the hub its
header alone the same way (:func:`abandon_collective`), so no rank waits out the timeout.

Shared memory: when a rank may share a host with its target, it offers a segment in the header
(:mod:`gradstar.transport.shm`); the hub answers ``SHM_ATTACH`` before anything else. If it
attached the segment, the rank copies each input chunk into the segment and sends a small
``SHM_CHUNK`` frame instead of the chunk, and the hub writes each result chunk into the segment
and announces it the same way; everything else — accept, end marker and its counts, errors,
flow control — is unchanged. If not (another host, user or container), the stream carries
chunks as above, and the rank stops offering that target a segment. A segment the target
attached before is offered *eagerly*: the rank writes its chunks at once, without waiting for the
verdict, which the hub then sends with its accept (one round trip and one message fewer for every
collective after the first); a refusal then fails the collective on every rank.

Shape of this module: it is the I/O that drives the bookkeeping of
:mod:`gradstar.client.collective.plan` (:class:`CollectivePlan`, and :class:`StreamReceiver`,
the state machine of one stream's incoming side, with no I/O) over the streams of
:mod:`gradstar.client.collective.targets` (:class:`Target`, :class:`OpenStream`).
:func:`run_stream` runs ONE stream to ONE :class:`Target` for a given set of chunks to send and
result chunks to admit, writing into a shared result buffer; :func:`run_collective` runs a whole
collective, today as one stream to the hub carrying every chunk. Striping a collective over K
hub shards is K concurrent :func:`run_stream` calls, shard ``k`` taking the chunks of
:func:`gradstar.ops.in_stripe` ``(..., k, K)``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from gradstar import ops
from gradstar.errors import ProtocolError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.transport import shm
from gradstar.wire import KIND_HEADER, as_byte_view, encode_message

from ..session import Session
from .failure import StreamEnding
from .outgoing import frames
from .plan import CollectivePlan, Phase, StreamReceiver
from .targets import MAX_IDLE_STREAMS, OpenStream, SharedMemoryOffer, Target

log = logging.getLogger(__name__)

T = TypeVar("T")

# The hub answers a late collective with its own timeout error; the call's deadline is only a
# backstop for a hub that stopped answering altogether.
DEADLINE_MARGIN = 10.0
#: How long a cancelled collective's notice to the hub (:func:`_abandon`) may take.
ABANDON_TIMEOUT = 5.0
# Notices in flight: the event loop holds tasks only weakly.
_abandoning: set[asyncio.Task] = set()
#: This process's shared-memory segments (one per collective in flight, reused after).
SEGMENTS = shm.SegmentPool()


async def run_stream(target: Target, header: pb.CollectiveHeader, plan: CollectivePlan,
                     sends: Sequence[int], receives: frozenset[int], *, session: Session,
                     metadata, timeout: float, segment: shm.Segment | None = None) -> None:
    """Run one Collective stream to ``target``: send input chunks ``sends`` of ``plan.send``
    and write result chunks ``receives`` (output indices) into ``plan.out`` — through
    ``segment`` if ``header`` offers it and the target attaches it.

    Returns once the stream's END marker proved every chunk of ``receives`` arrived; other
    streams of the same collective may fill other chunks of ``plan.out`` concurrently.

    Raises:
        CollectiveError and subclasses: the hub's verdict (mismatch, timeout, lost rank, ...).
        RankLostError, CoordinatorUnavailableError: the transport failed and the session says
            why, or the target could not be reached.
        ProtocolError: a frame out of place, a bad chunk, or no end marker.
    """
    what = f"collective seq {header.seq}"
    geometry = plan.geometry
    offered = segment is not None and header.HasField("shm")
    shm_out = None
    if offered:
        start = header.shm.output_offset
        shm_out = segment.data[start:start + geometry.out_layout.total_bytes]
    receiver = StreamReceiver(what, target.name, geometry.out_layout, receives,
                              as_byte_view(plan.out), shm_out)
    attached = asyncio.get_running_loop().create_future() if offered else None
    if offered and header.shm.eager:
        attached.set_result(True)  # the target attached this segment before: no round trip
    verdict = not offered  # whether the target's attach verdict has been taken
    stream = target.open(metadata)
    stream.send(frames(header, plan, sends, attached, segment))
    ending = StreamEnding(
        what, target.address, receiver, verdict=session.verdict,
        end_stream=lambda clean: target.put_back(stream) if clean else target.discard(stream),
        abandon=lambda: _notify(_abandon(target, header, metadata)))
    async with ending:
        try:
            # The stream outlives the collective, so its deadline is this collective's own: a
            # backstop for a hub that stopped answering (the hub times the collective out).
            async with asyncio.timeout(timeout + DEADLINE_MARGIN):
                while (frame := await stream.read()) is not grpc.aio.EOF:
                    receiver.on_frame(frame)
                    if not verdict and receiver.attached is not None:
                        verdict = True
                        _take_verdict(target, receiver, attached, segment)
                    if receiver.phase is Phase.COMPLETE:
                        if receiver.end.late and session.stragglers is not None:
                            session.stragglers.saw(header.seq, receiver.end.late)
                        return
        finally:
            if attached is not None and not attached.done():
                attached.set_result(False)  # the frame generator must not wait for ever
            if offered and header.shm.eager and receiver.phase is not Phase.COMPLETE:
                target.shm.attached.clear()  # after a failure, the next offer waits
        # read() raises for a non-OK status, so this is an OK status without an END frame.
        raise ProtocolError(f"{what}: the coordinator closed the stream without an end marker")


def _take_verdict(target: Target, receiver: StreamReceiver, attached: asyncio.Future,
                  segment: shm.Segment) -> None:
    """The target answered this stream's shared-memory offer: note whether it attached."""
    if not attached.done():
        attached.set_result(receiver.attached)
    if receiver.attached:
        target.shm.attached.add(segment.inode)
    else:
        target.shm.enabled, target.shm.refused = False, receiver.refusal
        target.shm.attached.clear()
        log.info("%s refused shared memory (%s); its chunks travel on the stream",
                 target.name, receiver.refusal)


async def _abandon(target: Target, header: pb.CollectiveHeader, metadata) -> None:
    """Tell ``target`` this rank gave up collective ``header``: the header alone, then a
    half-close, which the hub answers by failing the collective on every rank (and on ranks
    arriving later). If the cancelled stream's header did arrive, the hub already failed the
    collective or refuses the duplicate; either way no rank waits out the timeout."""

    async def header_only():
        yield encode_message(KIND_HEADER, header)

    try:
        call = target.stream(header_only(), metadata=metadata, timeout=ABANDON_TIMEOUT)
    except Exception as error:  # its channel was closed (a rejoin replaced the data plane)
        log.debug("collective seq %d: %s is no longer open to tell it was cancelled (%s)",
                  header.seq, target.address, type(error).__name__)
        return
    try:
        await call.read()  # the hub's ERROR frame: the collective has failed
    except Exception as error:  # best effort: the group may be closing under it
        log.debug("collective seq %d: telling %s it was cancelled failed (%s)", header.seq,
                  target.address, type(error).__name__)
    finally:
        call.cancel()


async def run_collective(targets: Sequence[Target], call: ops.CollectiveCall,
                         send: np.ndarray | None, out: np.ndarray, *,
                         session: Session, metadata, timeout: float) -> np.ndarray:
    """Run the collective ``call`` describes, sending from ``send`` (None: nothing to send);
    return ``out`` holding the result (with a wire format, decoded only once the whole
    encoded result arrived: :meth:`CollectivePlan.finish`).

    With one target, one stream carries every chunk (``header`` unchanged). With K targets
    (hub shards), the collective is striped: stripe k carries the chunks of
    :func:`gradstar.ops.in_stripe` over :func:`gradstar.ops.active_shards` streams, all
    running at once; the first stripe to fail ends the collective with its error and the
    others are cancelled (their shards then fail the collective on every rank too).

    The collective also ends, with the session's error, as soon as the session fails: a
    generation that is over fails every collective of it, and a stream to a hub or shard that
    answers nothing (stopped, or its host cut off) is noticed by the coordinator on its control
    connection, not on this bulk one, whose keepalive tolerates full links
    (:data:`gradstar.transport.channels.BULK_KEEPALIVE_TIMEOUT_MS`).

    Raises:
        What :func:`run_stream` raises; the session's failure once there is one.
    """
    work = asyncio.ensure_future(_run_collective(
        targets, call, send, out, session=session, metadata=metadata, timeout=timeout))
    failed = asyncio.ensure_future(session.wait_failed())
    try:
        await asyncio.wait((work, failed), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        failed.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise session.failure
    return work.result()


async def _run_collective(targets: Sequence[Target], call: ops.CollectiveCall,
                          send: np.ndarray | None, out: np.ndarray, *,
                          session: Session, metadata, timeout: float) -> np.ndarray:
    plan = CollectivePlan.for_call(call, send, out)
    geometry = call.geometry
    stripes = _stripe_count(targets, geometry)
    # A wire format travels in frames: the segment and the hub read payloads as the dtype's.
    segment = None if call.encoding is not None else _offer_segment(targets[:stripes], call)
    clean = False
    try:
        if stripes == 1 and len(targets) == 1:
            receives = plan.out_indices(i for r in geometry.receives for i in r)
            await run_stream(targets[0], _offering(call, targets[0], segment), plan,
                             geometry.sends, receives, session=session, metadata=metadata,
                             timeout=timeout, segment=segment)
            clean = True
            return plan.finish()
        streams = []
        for k in range(stripes):
            stripe = _offering(call, targets[k], segment)
            stripe.stripe, stripe.stripes = k, stripes
            sends = ops.in_stripe((geometry.sends,), k, stripes)
            receives = plan.out_indices(ops.in_stripe(geometry.receives, k, stripes))
            streams.append(asyncio.ensure_future(run_stream(
                targets[k], stripe, plan, sends, receives, session=session, metadata=metadata,
                timeout=timeout, segment=segment)))
        try:
            done, _ = await asyncio.wait(streams, return_when=asyncio.FIRST_EXCEPTION)
            for stream in streams:
                if stream in done and stream.exception() is not None:
                    raise stream.exception()
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        clean = True
        return plan.finish()
    finally:
        if segment is not None:
            # After a failure a hub may still be writing into the segment: never reuse it.
            (SEGMENTS.release if clean else SEGMENTS.discard)(segment)


def _stripe_count(targets: Sequence[Target], geometry: ops.Geometry) -> int:
    """How many of ``targets`` (hub shards) a collective is striped over; 1: unstriped."""
    return ops.active_shards(geometry.layout, len(targets)) if len(targets) > 1 else 1


def _notify(notice: Coroutine) -> None:
    """Run ``notice`` (telling the hub this rank gave up) on a task of its own, held until it
    ends: the event loop holds tasks only weakly."""
    task = asyncio.ensure_future(notice)
    _abandoning.add(task)
    task.add_done_callback(_abandoning.discard)


def issue(run: Callable[[], Coroutine[Any, Any, T]],
          abandon: Callable[[], Coroutine]) -> Awaitable[T]:
    """Start ``run()`` now, as a task of the running loop, and return that task.

    A task cancelled before its first step never ran ``run()`` at all, so nothing told the hub:
    then ``abandon()`` runs (on its own task, held until it ends) to do so. Without a running
    loop (the blocking API builds the call on its own thread and submits it to its loop at
    once) the coroutine itself is returned.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return run()
    started = False

    async def running():
        nonlocal started
        started = True
        return await run()

    def settled(task: asyncio.Task) -> None:
        if task.cancelled() and not started:
            _notify(abandon())

    task = loop.create_task(running())
    task.add_done_callback(settled)
    return task


async def abandon_collective(targets: Sequence[Target], call: ops.CollectiveCall,
                             metadata) -> None:
    """Tell the hub (each shard of the collective's stripes) that this rank gave up
    ``call`` before sending anything: :func:`_abandon` on every stripe's target."""
    stripes = _stripe_count(targets, call.geometry)
    notices = []
    for k in range(stripes):
        stripe = pb.CollectiveHeader()
        stripe.CopyFrom(call.header)
        if len(targets) > 1:
            stripe.stripe, stripe.stripes = k, stripes
        notices.append(_abandon(targets[k], stripe, metadata))
    await asyncio.gather(*notices)


def give_up(targets: Sequence[Target], call: ops.CollectiveCall, metadata) -> None:
    """Tell the hub, on a task of its own, that this rank will never issue ``call`` (a
    collective it reserved a seq for): :func:`abandon_collective`, so that no rank waits out
    the timeout for it. Call it on the loop."""
    _notify(abandon_collective(targets, call, metadata))


def _offer_segment(targets: Sequence[Target], call: ops.CollectiveCall) -> shm.Segment | None:
    """A segment for this collective if any target still takes offers and it moves bytes;
    its result region starts where the op's in-place rule puts it
    (:meth:`gradstar.ops.CollectiveCall.result_offset`)."""
    geometry = call.geometry
    if not any(t.shm.enabled for t in targets) or not shm.supported():
        return None
    size = call.result_offset() + geometry.out_layout.total_bytes
    if geometry.layout.total_bytes == 0 and geometry.out_layout.total_bytes == 0:
        return None
    try:
        return SEGMENTS.acquire(size)
    except OSError as error:  # out of memory for memfds, or fds: stream instead
        log.debug("no shared-memory segment of %d bytes (%s)", size, error)
        return None


def _offering(call: ops.CollectiveCall, target: Target,
              segment: shm.Segment | None) -> pb.CollectiveHeader:
    """A copy of ``call``'s header for ``target``, offering ``segment`` if the target takes
    offers."""
    copy = pb.CollectiveHeader()
    copy.CopyFrom(call.header)
    if segment is not None and target.shm.enabled:
        copy.shm.CopyFrom(pb.ShmSegment(
            pid=os.getpid(), fd=segment.fd, inode=segment.inode, size=segment.size,
            output_offset=call.result_offset(), key=segment.key,
            eager=segment.inode in target.shm.attached, host=shm.host_id()))
    return copy


# The bookkeeping and the targets are re-exported: this module is where a reader looks first.
__all__ = ["MAX_IDLE_STREAMS", "CollectivePlan", "OpenStream", "Phase", "SharedMemoryOffer",
           "StreamReceiver", "Target", "abandon_collective", "give_up", "issue", "run_collective",
           "run_stream"]

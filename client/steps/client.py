"""The rank's half of the Steps service (the hub's half is ``gradstar.coordinator.steps``):
contribute a gradient, fetch the aggregates after the ones applied, heartbeat, synchronize;
each call under a deadline. An asyncio object; :class:`~.sync.StepSync` drives it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
import numpy as np

from gradstar.config import ClientSettings
from gradstar.errors import ProtocolError, StepTimeoutError
from gradstar.proto.v1 import steps_pb2 as pb
from gradstar.proto.v1 import steps_pb2_grpc
from gradstar.sync_modes import SyncMode
from gradstar.transport.channels import (
    PART_BYTES,
    call_metadata,
    open_blocking_channel,
    open_channel,
)
from gradstar.transport.status import error_from_rpc, is_coordinator_verdict
from gradstar.wire.chunks import header_first
from gradstar.wire.formats import WIRE_NONE, WireFormat, decode_into, encode, format_from_wire

from ..collective.caller_stream import open_stream

#: Longest one Fetch or Synchronize waits on the hub; the client asks again until its deadline.
POLL_SECONDS = 5.0
#: gRPC's number for a channel's READY state.
_READY = grpc.ChannelConnectivity.READY.value[0]
#: The Contribute method's path (the caller's-thread stream names it).
CONTRIBUTE = "/gradstar.proto.v1.Steps/Contribute"


@dataclass(frozen=True)
class Aggregates:
    """Closed steps after the ones a rank applied: who made each, and the aggregates
    (``values[i]`` is step ``records[i].step``)."""

    steps: int
    records: list[pb.StepRecord]
    values: np.ndarray  # (len(records), numel) float32


class StepsClient:
    """Contribute, Fetch, Heartbeat and Synchronize for one rank of one model's ledger.

    Raises (from every method):
        StepMismatchError: the hub refused the call (mode, size, weight, duplicate).
        StepTimeoutError: no answer before the deadline.
        CoordinatorUnavailableError, AuthenticationError: as any call to the coordinator.
    """

    def __init__(self, settings: ClientSettings, address: str, model: str, *, job: str,
                 rank: int, generation: int, member_id: str) -> None:
        """One rank's client of ``model``'s ledger in ``job``, calling as the member (rank,
        generation, member id) its join made it: the hub refuses any other caller."""
        self.settings = settings
        self.address = address
        self._channel = open_channel(settings, address, bulk=True)
        self._stub = steps_pb2_grpc.StepsStub(self._channel)
        self._metadata = call_metadata(settings)
        #: The caller's-thread channel of :meth:`exchange_here` (made at its first call).
        self._blocking: grpc.Channel | None = None
        #: Its kept Contribute stream and that stream's deadline (seconds since the epoch).
        self._stream = None
        self._stream_until = 0.0
        self.key = pb.StepsKey(job=job, model=model, rank=rank, generation=generation,
                               member_id=member_id)
        #: Payload bytes sent and received.
        self.bytes_sent = 0
        self.bytes_received = 0
        #: The ledger's mode epoch and completed barriers as the last snapshot fetched found
        #: them.
        self.mode_epoch = self.barriers = 0

    @classmethod
    def for_group(cls, pg, model: str) -> StepsClient:
        """The client of ``model``'s ledger for ``pg``'s rank (a gradstar process group, sync
        or async: its settings, job, rank, generation, member id and collective address).
        Made on the loop its calls run on: grpc.aio binds a channel to the loop it is made on."""
        return cls(pg.settings, pg.collective_address, model, job=pg.job, rank=pg.rank,
                   generation=pg.generation, member_id=pg.member_id)

    async def contribute(self, mode: SyncMode, mode_epoch: int, base: int, weight: float,
                         grad: np.ndarray, timeout: float, wire: WireFormat | None = None,
                         ) -> pb.Contributed:
        """Send one gradient (flat float32) computed after ``base`` aggregates, encoded in
        ``wire`` if given (every rank of the ledger the same): the hub's verdict."""
        contributed, _ = await self.exchange(mode, mode_epoch, base, weight, grad, timeout, wire)
        return contributed

    async def exchange(self, mode: SyncMode, mode_epoch: int, base: int, weight: float,
                       grad: np.ndarray, timeout: float, wire: WireFormat | None = None,
                       fetch_limit: int = 0, await_step: float = 0.0,
                       hyper: tuple[float, ...] = (), buffers: int = 0,
                       ) -> tuple[pb.Contributed, Aggregates | None]:
        """:meth:`contribute`, and in the same call the aggregates closed after ``base`` (at
        most ``fetch_limit``; 0: none), after the hub waited up to ``await_step`` seconds (0:
        not at all) for the step the gradient joined to close; ``hyper``: the rank's optimizer
        hyperparameters (every step is applied with its contributions' weighted mean of them);
        ``buffers``: how many trailing values of ``grad`` are module buffers (never scaled).
        None instead of aggregates: not asked for, or the hub lacks some (:meth:`fetch` then
        says why)."""
        header, data = self._contribution(mode, mode_epoch, base, weight, grad, wire,
                                          fetch_limit, await_step, hyper, buffers)
        call = self._stub.Contribute(
            header_first(pb.ContributionPart, header, data, PART_BYTES), timeout=timeout,
            metadata=self._metadata)
        head, got = await self._call(self._read_steps(call, "Contribute"),
                                     "contributing a gradient", timeout)
        return self._verdict(head, got, data)

    def exchange_here(self, mode: SyncMode, mode_epoch: int, base: int, weight: float,
                      grad: np.ndarray, timeout: float, wire: WireFormat | None = None,
                      fetch_limit: int = 0, await_step: float = 0.0,
                      hyper: tuple[float, ...] = (), buffers: int = 0,
                      ) -> tuple[pb.Contributed, Aggregates | None]:
        """:meth:`exchange` on the caller's own thread (blocking; no hop to the event loop:
        its own channel and completion queue, as the direct lane's collectives), on one
        Contribute stream kept for the next calls (``ContributionHeader.streamed``): a
        contribution costs one message each way, and no call set-up on either side. Any
        failure ends that stream; the next call opens another."""
        header, data = self._contribution(mode, mode_epoch, base, weight, grad, wire,
                                          fetch_limit, await_step, hyper, buffers)
        header.streamed = True
        stream = self._kept_stream(timeout)
        try:
            for message in header_first(pb.ContributionPart, header, data, PART_BYTES):
                stream.send(message.SerializeToString())
            answer = stream.read()
            if answer is None:
                raise ProtocolError("a steps Contribute answer ended before its header")
            first = pb.StepsPart.FromString(answer)
            head, got = first.header, None
            if head.ready:
                got = self._assemble(head, _counted(stream, first.data, _answer_bytes(head)),
                                     "Contribute")
        except grpc.RpcError as rpc:
            self._drop_stream()
            raise self._error(rpc, "contributing a gradient", timeout) from None
        except BaseException:
            self._drop_stream()  # interrupted or malformed mid-answer: its place is unknown
            raise
        return self._verdict(head, got, data)

    def _kept_stream(self, timeout: float):
        """The kept Contribute stream, opened anew unless it has between ``timeout`` seconds
        and twice that left: each call has that long before its deadline (renewed every
        ``timeout`` seconds or so, a negligible cost)."""
        if self._stream is not None and (
                not self._stream.usable or not _connected(self._blocking)
                or not timeout <= self._stream_until - time.time() <= 2 * timeout):
            self._drop_stream()
        if self._stream is None:
            if self._blocking is None:
                self._blocking = open_blocking_channel(self.settings, self.address)
            self._stream_until = time.time() + 2 * timeout
            self._stream = open_stream(self._blocking, CONTRIBUTE, self._metadata,
                                       self._stream_until)
        return self._stream

    def _drop_stream(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.close()

    def _contribution(self, mode, mode_epoch, base, weight, grad, wire, fetch_limit,
                      await_step, hyper, buffers) -> tuple[pb.ContributionHeader, bytes]:
        header = pb.ContributionHeader(key=self.key, mode=mode.message(), mode_epoch=mode_epoch,
                                       numel=grad.shape[0], base=base, weight=weight,
                                       wire=WIRE_NONE if wire is None else wire.wire,
                                       fetch_limit=fetch_limit, await_step=await_step > 0,
                                       wait_seconds=await_step, hyper=hyper,
                                       buffer_numel=buffers)
        data = (np.ascontiguousarray(grad, dtype="<f4").tobytes() if wire is None
                else encode(wire, grad))
        return header, data

    def _verdict(self, head: pb.StepsHeader, got: Aggregates | None,
                 data: bytes) -> tuple[pb.Contributed, Aggregates | None]:
        self.bytes_sent += len(data)
        if not head.HasField("contributed"):
            raise ProtocolError("a steps Contribute answer carried no verdict")
        return head.contributed, got

    async def fetch(self, have: int, min_steps: int, timeout: float, limit: int = 0,
                    ) -> Aggregates:
        """The aggregates after ``have`` (at most ``limit``, if not 0) once at least
        ``min_steps`` steps closed.

        Raises:
            StepTimeoutError: not within ``timeout`` seconds.
            StepsBehindError: the hub no longer holds what this rank needs.
        """
        async def ask(wait: float) -> Aggregates | None:
            request = pb.FetchStepsRequest(key=self.key, have=have, min_steps=min_steps,
                                           wait_seconds=wait, limit=limit)
            # The hub answers "not yet" after ``wait``; an answer with aggregates may take
            # longer on a slow link: allow what is left of the call's time for it.
            deadline = max(wait + 10.0, until - time.monotonic())
            return await self._call(self._read_fetch(request, deadline), "fetching steps",
                                    deadline)

        until = time.monotonic() + timeout

        return await _poll(ask, timeout, f"Timed out: step {min_steps} of model "
                                         f"{self.key.model!r} did not close within {timeout:g} s")

    async def heartbeat(self, have: int, leave: bool = False, timeout: float = 5.0,
                        ) -> pb.StepsState:
        request = pb.StepsHeartbeat(key=self.key, have=have, leave=leave)
        return await self._call(self._stub.Heartbeat(request, timeout=timeout,
                                                     metadata=self._metadata),
                                "a steps heartbeat", timeout)

    async def synchronize(self, barrier: int, timeout: float,
                          next_mode: SyncMode | None = None) -> pb.SynchronizeReply:
        """Wait until every live rank reached barrier ``barrier``, asking to switch to
        ``next_mode`` there (None: no switch): the hub's answer (the step count to apply up to,
        the mode and its epoch from there on, and why a switch asked was refused)."""
        return await self._until_ready(
            self._stub.Synchronize, lambda wait: pb.SynchronizeRequest(
                key=self.key, barrier=barrier, wait_seconds=wait,
                next_mode=next_mode.message() if next_mode is not None else None),
            "synchronize()", timeout, f"Timed out: synchronize() of model {self.key.model!r} "
                                      f"waited {timeout:g} s for the other live ranks")

    async def resume(self, have: int, barriers: int, mode_epoch: int, timeout: float,
                     ) -> pb.ResumeReply:
        """Tell the ledger of a generation a restarted coordinator rebuilt where this rank
        stands (``have`` aggregates applied, ``barriers`` completed, ``mode_epoch``), waiting
        for the other ranks to: the step count it goes on from, and whether this rank loads or
        sends the snapshot there (:mod:`gradstar.coordinator.steps.resume`).

        Raises:
            StepResumeError: the coordinator cannot take this rank's steps back.
            StepTimeoutError: not every rank resumed within ``timeout`` seconds.
        """
        return await self._until_ready(
            self._stub.Resume, lambda wait: pb.ResumeRequest(
                key=self.key, have=have, barriers=barriers, mode_epoch=mode_epoch,
                wait_seconds=wait),
            "resuming the steps", timeout, f"Timed out: the steps of model {self.key.model!r} "
                                           f"waited {timeout:g} s for the other ranks to "
                                           "resume after a coordinator restart")

    async def _until_ready(self, method, request, what: str, timeout: float, timed_out: str):
        """``method(request(wait))`` (a unary call whose reply says ``ready``) asked again
        until its reply is ready, for ``timeout`` seconds in all (:func:`_poll`)."""
        async def ask(wait: float):
            reply = await self._call(method(request(wait), timeout=wait + 10.0,
                                            metadata=self._metadata), what, wait + 10.0)
            return reply if reply.ready else None

        return await _poll(ask, timeout, timed_out)

    async def put_snapshot(self, steps: int, layout: str, data: bytes, timeout: float) -> None:
        """Send this rank's state after ``steps`` aggregates."""
        header = pb.SnapshotHeader(key=self.key, steps=steps, layout=layout, nbytes=len(data))
        parts = header_first(pb.SnapshotPart, header, data, PART_BYTES)
        await self._call(self._stub.PutSnapshot(parts, timeout=timeout,
                                                metadata=self._metadata),
                         "sending a snapshot", timeout)
        self.bytes_sent += len(data)

    async def get_snapshot(self, timeout: float) -> tuple[int, str, bytes]:
        """The hub's latest snapshot (steps, layout, data), waiting for one up to ``timeout``;
        the ledger's mode epoch at that time is left in :attr:`mode_epoch`.

        Raises:
            StepTimeoutError: the hub held none within ``timeout`` seconds.
        """
        return await _poll(self._read_snapshot, timeout, (
            f"Timed out: the hub held no snapshot of model {self.key.model!r} within "
            f"{timeout:g} s (no live rank sent one)"))

    async def _read_snapshot(self, wait: float) -> tuple[int, str, bytes] | None:
        return await self._call(self._snapshot_answer(wait), "fetching a snapshot", wait + 10)

    async def _snapshot_answer(self, wait: float) -> tuple[int, str, bytes] | None:
        call = self._stub.GetSnapshot(pb.SnapshotRequest(key=self.key, wait_seconds=wait),
                                      timeout=wait + 10, metadata=self._metadata)
        head, data = None, bytearray()
        async for part in call:
            if head is None:
                head = part.header
                if not head.layout:
                    return None
            data += part.data
        if head is None or len(data) != head.nbytes:
            raise ProtocolError("a snapshot answer was cut or malformed")
        self.bytes_received += len(data)
        self.mode_epoch, self.barriers = head.mode_epoch, head.barriers
        return head.steps, head.layout, bytes(data)

    async def _read_fetch(self, request: pb.FetchStepsRequest, timeout: float,
                          ) -> Aggregates | None:
        call = self._stub.Fetch(request, timeout=timeout, metadata=self._metadata)
        return (await self._read_steps(call, "Fetch"))[1]

    async def _read_steps(self, call, what: str) -> tuple[pb.StepsHeader, Aggregates | None]:
        """A Fetch or Contribute answer: its header, and its aggregates (None: not ready)."""
        parts = call.__aiter__()
        try:
            first = await anext(parts)
        except StopAsyncIteration:
            raise ProtocolError(f"a steps {what} answer ended before its header") from None
        head = first.header
        if not head.ready:
            call.cancel()
            return head, None
        chunks, total, most = [], 0, _answer_bytes(head)
        async for part in parts:  # never held past what the header announced
            total += len(part.data)
            if total > most:
                raise ProtocolError(f"a steps {what} answer carried more data than it announced")
            chunks.append(part.data)
        return head, self._assemble(head, chunks, what)

    def _assemble(self, head: pb.StepsHeader, chunks: Iterable[bytes],
                  what: str) -> Aggregates:
        """The aggregates a ready answer's ``head`` announced, from its data parts (read as
        they are consumed)."""
        values = np.empty((len(head.records), head.numel), dtype="<f4")
        if values.size == 0:  # nothing closed since ``have``: no data parts follow
            return Aggregates(head.steps, list(head.records), values)
        fmt = format_from_wire(head.wire)
        each = 4 * head.numel if fmt is None else fmt.encoded_nbytes(head.numel)
        raw = values.reshape(-1) if fmt is None else np.empty(each * len(head.records), np.uint8)
        view = memoryview(raw).cast("B")
        filled = 0
        for data in chunks:
            n = len(data)
            if filled + n > len(view):
                raise ProtocolError(f"a steps {what} answer carried more data than it announced")
            view[filled:filled + n] = data
            filled += n
        if filled != len(view):
            raise ProtocolError(f"a steps {what} answer announced {len(head.records)} aggregates "
                                f"of {head.numel} values and carried {filled} bytes")
        if fmt is not None:  # every rank decodes the same bytes: the same float32 values
            for i, row in enumerate(values):
                decode_into(fmt, raw[i * each:(i + 1) * each], row)
        self.bytes_received += filled
        return Aggregates(head.steps, list(head.records), values.astype(np.float32, copy=False))

    async def _call(self, awaitable, what: str, timeout: float):
        try:
            return await awaitable
        except grpc.RpcError as rpc:
            raise self._error(rpc, what, timeout) from None

    def _error(self, rpc: grpc.RpcError, what: str, timeout: float) -> Exception:
        """The gradstar error a failed call names (a deadline the hub did not set: timeout)."""
        if rpc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not is_coordinator_verdict(rpc):
            return StepTimeoutError(f"Timed out: {what} got no answer from {self.address} "
                                    f"within {timeout:g} s")
        return error_from_rpc(rpc, what, self.address)

    async def close(self) -> None:
        """Close the channels (never while a call of :meth:`exchange_here` is under way)."""
        self._drop_stream()
        if self._blocking is not None:
            self._blocking.close()
        await self._channel.close()


def _connected(channel: grpc.Channel) -> bool:
    """Whether ``channel`` still has the connection a kept stream was opened on (READY; only
    that stream uses it, so a dropped connection, e.g. a restarted hub, leaves it IDLE until a
    new call): a kept stream on a dropped connection would fail a contribution the hub never
    saw, where a new stream reconnects."""
    state = getattr(getattr(channel, "_channel", None), "check_connectivity_state", None)
    return state is None or state(False) == _READY


def _counted(stream, first: bytes, total: int) -> Iterable[bytes]:
    """A streamed answer's data: ``first`` (its header's message's), then messages of
    ``stream`` until ``total`` bytes came (the stream stays open for the next call)."""
    got = len(first)
    if first:
        yield first
    while got < total:
        message = stream.read()
        if message is None:
            return  # ended early: the reader counts the bytes and names the error
        data = pb.StepsPart.FromString(message).data
        got += len(data)
        yield data


def _answer_bytes(head: pb.StepsHeader) -> int:
    """The data bytes a ready answer's header announces."""
    fmt = format_from_wire(head.wire)
    each = 4 * head.numel if fmt is None else fmt.encoded_nbytes(head.numel)
    return each * len(head.records)


async def _poll(ask, timeout: float, timed_out: str):
    """``await ask(wait)`` until it answers something other than None (the hub's "not yet"
    after waiting up to ``wait`` seconds), for ``timeout`` seconds in all.

    Raises:
        StepTimeoutError: ``timed_out``, when the time is up.
    """
    until = time.monotonic() + timeout
    while (left := until - time.monotonic()) > 0:
        # The hub answers "not yet" well inside the call's deadline, so the answer (not the
        # deadline) ends each poll.
        got = await ask(min(POLL_SECONDS, max(left - 1.0, left / 2)))
        if got is not None:
            return got
    raise StepTimeoutError(timed_out)


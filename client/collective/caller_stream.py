"""Blocking Collective streams for :mod:`.direct`, read on the caller's own thread.

gRPC's public blocking stream (:class:`QueuedStream`) crosses two threads per message: gRPC's
request-consumer thread takes each message from a queue and sends it, and the channel's poller
thread takes every completion from the channel's shared completion queue and wakes the caller.
For a small collective those hand-offs are most of a rank's CPU.

:class:`CallerStream` puts the stream on a completion queue of its own, as gRPC's blocking
*unary* call does, and the caller drives it: it starts the send and the receive itself and waits
in that queue, so a completed receive wakes it directly, with no thread in between (the figures:
docs/performance.md, "Figures behind the code"). That queue is gRPC-python's segregated call,
which its own blocking unary and stream-unary calls use but which is not public API;
:func:`open_stream` falls back to :class:`QueuedStream` where the installed grpcio lacks it
(``tests/unit/test_caller_stream.py`` fails if this grpcio would fall back). The messages, the
HTTP/2 stream, the deadline-less call, the metadata (the job's token) and TLS are the same.

Both classes read the same way: :meth:`CallerStream.read` returns the next message, None once
the hub ended the call with OK, or raises a :class:`grpc.RpcError` carrying the call's status
and trailing metadata (what :func:`gradstar.transport.status.error_from_rpc` translates);
:meth:`CallerStream.end` cancels the call from any thread, waking the reader.
"""

from __future__ import annotations

import queue
import time

import grpc

try:  # gRPC-python's own completion queues (see the module docstring)
    from grpc._cython import cygrpc
except ImportError:  # pragma: no cover - every grpcio has it; the fallback is for its API
    cygrpc = None

#: gRPC status codes by their number (the status of a call arrives as a number).
_CODES = {code.value[0]: code for code in grpc.StatusCode}

# Tags of the call's operations (each event names the batch it completes).
_STATUS, _INITIAL, _SEND, _RECEIVE = "status", "initial", "send", "receive"


class StreamStatus(grpc.RpcError):
    """How a :class:`CallerStream`'s call ended when it did not end OK (the interface of the
    errors gRPC's own calls raise: ``code()``, ``details()``, ``trailing_metadata()``)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailing = code, details, tuple(trailing or ())

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._trailing


class CallerStream:
    """A Collective stream on its own completion queue, driven by the one thread that sends and
    reads (:meth:`end` may come from any thread). See the module docstring."""

    def __init__(self, channel: grpc.Channel, method: str, metadata,
                 deadline: float | None = None) -> None:
        metadata = tuple(metadata or ())
        self._call = channel._channel.segregated_call(
            cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method.encode(), None, deadline,
            metadata, None,
            (((cygrpc.SendInitialMetadataOperation(metadata, 0),
               cygrpc.ReceiveStatusOnClientOperation(0)), _STATUS),
             ((cygrpc.ReceiveInitialMetadataOperation(0),), _INITIAL)),
            None, None)
        #: The operations started and not yet completed: gRPC frees the call and its queue
        #: when the last one completes, after which the queue must not be polled.
        self._due = {_STATUS, _INITIAL}
        self._status: StreamStatus | None = None
        self._ended = False  # the call's status arrived (OK or not)
        self._received: bytes | None = None
        #: Why :meth:`end` ended the stream from outside (None: it did not).
        self.ended_by: Exception | None = None

    def _start(self, operation, tag: str) -> bool:
        if tag in self._due or not self._call.operate((operation,), tag):
            return False
        self._due.add(tag)
        return True

    def _next(self) -> None:
        """Wait for the next completion and note what it says."""
        try:
            event = self._call.next_event()
        except BaseException:
            self._due.clear()  # gRPC freed the call and its queue (an interrupted wait)
            raise
        self._due.discard(event.tag)
        if event.tag == _STATUS:
            self._ended = True
            op = event.batch_operations[-1]  # after the initial metadata it was started with
            code = _CODES.get(op.code(), grpc.StatusCode.UNKNOWN)
            if code is not grpc.StatusCode.OK:
                self._status = StreamStatus(code, op.details() or "", op.trailing_metadata())
        elif event.tag == _RECEIVE:
            self._received = event.batch_operations[0].message() if event.success else None

    def send(self, message: bytes) -> None:
        """Start sending ``message`` (it goes out while the caller waits in :meth:`read`)."""
        while _SEND in self._due:  # one message in flight at a time
            self._next()
        self._start(cygrpc.SendMessageOperation(message, 0), _SEND)

    def done_sending(self) -> None:
        """Half-close: the hub's reader sees the end of the request stream."""
        while _SEND in self._due:
            self._next()
        self._start(cygrpc.SendCloseFromClientOperation(0), _SEND)

    def read(self) -> bytes | None:
        """The next message from the hub; None once the call ended with an OK status.

        Raises:
            grpc.RpcError: the call failed (or was cancelled).
        """
        self._received = None
        if self._start(cygrpc.ReceiveMessageOperation(0), _RECEIVE):
            while _RECEIVE in self._due:
                self._next()
            if self._received is not None:
                return self._received
        self._drain()  # the stream ended: its status (among what is due) says how
        if self._status is not None:
            raise self._status
        if not self._ended:  # the wait was interrupted before the status came
            raise StreamStatus(grpc.StatusCode.CANCELLED, "the stream was abandoned", ())
        return None

    def _drain(self) -> None:
        while self._due:
            self._next()

    def end(self, why: Exception) -> None:
        """Cancel the call under a reader waiting in :meth:`read` (any thread), saying why."""
        self.ended_by = why
        self._call.cancel(cygrpc.StatusCode.cancelled, str(why))

    @property
    def usable(self) -> bool:
        return self.ended_by is None and _STATUS in self._due  # its status has not come

    def close(self) -> None:
        """End the call and free it (on the thread that reads; never while it reads)."""
        if self._due:
            self._call.cancel(cygrpc.StatusCode.cancelled, "closed")
            self._drain()


class QueuedStream:
    """gRPC's public blocking Collective stream: its own thread writes what is queued here; the
    caller reads the answers (the fallback of :func:`open_stream`)."""

    def __init__(self, channel: grpc.Channel, method: str, metadata,
                 deadline: float | None = None) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        timeout = None if deadline is None else max(0.0, deadline - time.time())
        self.call = channel.stream_stream(method)(iter(self._requests.get, None),
                                                  metadata=metadata, timeout=timeout)
        #: Why :meth:`end` ended the stream from outside (None: it did not).
        self.ended_by: Exception | None = None

    def send(self, message: bytes) -> None:
        self._requests.put(message)

    def done_sending(self) -> None:
        self._requests.put(None)

    def read(self) -> bytes | None:
        """The next message from the hub; None once the call ended with an OK status.

        Raises:
            grpc.RpcError: the call failed (or was cancelled).
        """
        return next(self.call, None)

    def end(self, why: Exception) -> None:
        """Cancel the call under a reader waiting in :meth:`read` (any thread), saying why."""
        self.ended_by = why
        self.call.cancel()

    @property
    def usable(self) -> bool:
        return self.ended_by is None and self.call.is_active()

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


#: Either kind of blocking stream (they read, end and close alike).
BlockingStream = CallerStream | QueuedStream


def caller_streams_supported(channel: grpc.Channel) -> bool:
    """Whether :class:`CallerStream` works with this grpcio (its segregated calls exist)."""
    return cygrpc is not None and hasattr(getattr(channel, "_channel", None), "segregated_call")


def open_stream(channel: grpc.Channel, method: str, metadata,
                deadline: float | None = None) -> BlockingStream:
    """A blocking stream on ``channel`` (a Collective's, or a Steps Contribute's, which ends
    its requests with ``done_sending``; ``deadline``: seconds since the epoch, None: none): a
    :class:`CallerStream` where this grpcio allows, else a :class:`QueuedStream`."""
    if caller_streams_supported(channel):
        return CallerStream(channel, method, metadata, deadline)
    return QueuedStream(channel, method, metadata, deadline)


__all__ = ["BlockingStream", "CallerStream", "QueuedStream", "StreamStatus",
           "caller_streams_supported", "open_stream"]

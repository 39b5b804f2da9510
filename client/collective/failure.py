"""How a collective's stream ends, on every road a collective takes: one table of failures and
one ending, shared by the stream road (:func:`.stream.run_stream`, on the group's loop) and the
direct lane (:meth:`.direct.DirectLane.run`, on the caller's thread); torch's waited calls ride
one of the two (:meth:`gradstar.client.process_group.ProcessGroup.settled`). The two roads
write their read loops apart, as their I/O differs; they end the same way, through
:class:`StreamEnding`, as httpx's two transports map every failure through one table.

The rules, in order (:func:`classify` is the table):

1. A stream ended from outside carries its reason (the direct lane's watch: the session's
   failure, or the builtin :class:`TimeoutError` for a deadline that passed); that reason
   stands for whatever the read raised.
2. The hub's verdict is final: an ``ERROR`` frame (raised by the
   :class:`~.plan.StreamReceiver` as the error it names), a bad frame
   (:class:`~gradstar.errors.ProtocolError`), a gRPC status the hub set.
3. A deadline that passed, or a transport failure, asks the rank's session first, briefly
   (:meth:`~gradstar.client.session.Session.verdict`): a lost rank or hub, if that is why;
   otherwise a :class:`~gradstar.errors.CollectiveTimeoutError` naming the target, or the
   error the gRPC status translates to (:func:`gradstar.transport.status.error_from_rpc`).
4. A collective interrupted on this rank (cancelled, ``KeyboardInterrupt``) before the hub's
   accept tells the hub it gave up, so that no other rank waits out the timeout.
5. A stream whose collective completed (its end marker checked) goes back to its target's idle
   streams; every other ending closes it.

Whichever road a collective takes, the same fault therefore ends it with the same named error
(``tests/integration/test_roads.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from gradstar.errors import CollectiveTimeoutError, GradstarError
from gradstar.transport.status import error_from_rpc, is_coordinator_verdict

from .plan import Phase, StreamReceiver


@dataclass(frozen=True)
class Failure:
    """A row of the table: the error a stream's failure is raised as, unless the session names
    a lost rank or hub first (``ask_session``)."""

    error: GradstarError
    ask_session: bool


def classify(error: BaseException, what: str, address: str) -> Failure | None:
    """The table: what ``error``, raised while ``what`` (``"collective seq 7"``) read its
    stream to ``address``, ends the collective with; None: ``error`` is raised as it is (the
    hub's verdict, a bad frame, an interruption)."""
    if isinstance(error, TimeoutError) and not isinstance(error, GradstarError):
        return Failure(CollectiveTimeoutError(
            f"Timed out: {what} got no answer from {address} before its deadline"), True)
    if isinstance(error, grpc.RpcError):
        # Its traceback runs through gRPC's frames, which hold the call, and the error raised
        # for it keeps it as its context: whoever keeps that error (a failed Work, a list of
        # errors) would keep the call, and the call its TCP connection (OpenStream.close).
        error.__traceback__ = None
        # Not the hub's verdict: the transport failed (grpc-python can even report INTERNAL
        # when a connection dies mid-write), and the session may know why.
        return Failure(error_from_rpc(error, what, address), not is_coordinator_verdict(error))
    return None


def interrupted(error: BaseException) -> bool:
    """Whether ``error`` ended a collective from this rank's side (a cancelled task, an
    interrupted caller) rather than the hub, the transport or a deadline."""
    return not isinstance(error, GradstarError | grpc.RpcError | TimeoutError)


class StreamEnding:
    """Ends one collective's stream by the rules of the module docstring: ``async with`` around
    the stream road's read loop, ``with`` around the direct lane's.

    ``receiver`` is the stream's incoming side (its phase says whether the collective completed
    or was accepted); ``end_stream(clean)`` puts the stream back (``clean``) or closes it;
    ``abandon()`` tells the hub, without waiting, that this rank gave up. ``verdict`` asks the
    session for a lost rank or hub (a coroutine function on the loop; a blocking one on the
    caller's thread); ``ended_by()`` is the reason a stream was ended from outside, if any.

    Raises (on leaving the block):
        GradstarError: the named error of the table, or the session's verdict.
    """

    __slots__ = ("_abandon", "_end_stream", "_ended_by", "_receiver", "_verdict", "address",
                 "what")

    def __init__(self, what: str, address: str, receiver: StreamReceiver, *,
                 end_stream: Callable[[bool], None], abandon: Callable[[], None],
                 verdict: Callable[[], Awaitable[GradstarError | None]]
                 | Callable[[], GradstarError | None],
                 ended_by: Callable[[], BaseException | None] = lambda: None) -> None:
        self.what, self.address = what, address
        self._receiver = receiver
        self._end_stream = end_stream
        self._abandon = abandon
        self._verdict = verdict
        self._ended_by = ended_by

    def _end(self, error: BaseException | None) -> tuple[BaseException | None, Failure | None]:
        """Put the stream back or close it, tell the hub of an interruption before its accept;
        return what ended the collective (the reason a stream ended from outside stands for
        what its read raised) and the table's row for it (None: raise it as it is)."""
        phase = self._receiver.phase
        self._end_stream(phase is Phase.COMPLETE)
        if error is None:
            return None, None
        if interrupted(error):
            if phase is Phase.AWAITING_ACCEPT:
                self._abandon()
            return error, None
        cause = self._ended_by() or error
        return cause, classify(cause, self.what, self.address)

    def __enter__(self) -> StreamEnding:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        cause, failure = self._end(error)
        if failure is not None:
            raise (self._verdict() if failure.ask_session else None) or failure.error from None
        if cause is not error:
            raise cause from None
        return False

    async def __aenter__(self) -> StreamEnding:
        return self

    async def __aexit__(self, kind, error, traceback) -> bool:
        cause, failure = self._end(error)
        if failure is not None:
            named = await self._verdict() if failure.ask_session else None
            raise named or failure.error from None
        if cause is not error:
            raise cause from None
        return False


__all__ = ["Failure", "StreamEnding", "classify", "interrupted"]

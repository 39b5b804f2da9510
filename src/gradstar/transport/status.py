"""gradstar errors <-> gRPC statuses, both ways, in one place.

Servers end a call with :func:`abort` (the error's status code, message and, in trailing
metadata, its type and fields); clients turn a failed call back into the gradstar error it stands
for with :func:`error_from_rpc`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from gradstar import errors as e
from gradstar.errors import (
    ERROR_FIELDS_KEY,
    ERROR_NAME_KEY,
    AuthenticationError,
    CollectiveTimeoutError,
    CoordinatorUnavailableError,
    GradstarError,
    PayloadTooLargeError,
    error_from_wire,
)

_CODES: list[tuple[type[e.GradstarError], grpc.StatusCode]] = [
    # Before its base class: the caller is known (a valid job token), only not for this job.
    (e.JobAccessError, grpc.StatusCode.PERMISSION_DENIED),
    (e.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (e.CollectiveMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.WorldSizeMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.CollectiveTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (e.JoinTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (e.RankLostError, grpc.StatusCode.ABORTED),
    (e.PayloadTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.HubCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.DuplicateRankError, grpc.StatusCode.ALREADY_EXISTS),
    (e.CoordinatorDrainingError, grpc.StatusCode.UNAVAILABLE),
    (e.NotLeaderError, grpc.StatusCode.UNAVAILABLE),
    (e.ElectionUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (e.StaleCoordinatorError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.TooManyJobsError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.ProtocolError, grpc.StatusCode.DATA_LOSS),
    (e.InvalidCollectiveError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.ConfigurationError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.RendezvousError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.RoundMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.RoundTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_code(error: e.GradstarError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.UNKNOWN


async def abort(context: grpc.aio.ServicerContext, error: e.GradstarError) -> None:
    """End the call with ``error``'s status; the client rebuilds the same exception."""
    await context.abort(status_code(error), str(error), trailing_metadata=e.error_metadata(error))


@contextlib.asynccontextmanager
async def error_status(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """The one place a servicer's block turns a domain error into the call's status::

        async with error_status(context):
            ledger.contribute(...)   # a GradstarError here ends the call with its code

    Raises:
        grpc.aio.AbortError: (from ``context.abort``) a GradstarError was raised in the block.
    """
    try:
        yield
    except e.GradstarError as error:
        await abort(context, error)


def _trailing(error: grpc.RpcError) -> dict:
    try:
        return dict(error.trailing_metadata() or ())
    except Exception:  # a locally failed call may have no metadata at all
        return {}


def is_coordinator_verdict(error: grpc.RpcError) -> bool:
    """Whether the coordinator itself named the error (rather than the transport failing)."""
    return ERROR_NAME_KEY in _trailing(error)


def error_from_rpc(error: grpc.RpcError, what: str, target: str) -> GradstarError:
    """The gradstar error a failed call stands for; the coordinator's own errors keep their type."""
    trailing = _trailing(error)
    details = error.details() or ""
    if ERROR_NAME_KEY in trailing:
        return error_from_wire(trailing[ERROR_NAME_KEY], trailing.get(ERROR_FIELDS_KEY), details)
    code = error.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"the coordinator at {target} refused {what}: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return CoordinatorUnavailableError(
            f"lost the coordinator at {target} during {what}: {details or code.name}"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CollectiveTimeoutError(
            f"Timed out: {what} got no answer from {target} before its deadline")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PayloadTooLargeError(f"{what} was refused by {target}: {details}")
    if code == grpc.StatusCode.INTERNAL:
        # Never the coordinator's own verdict (each of those names its error): grpc-python
        # reports INTERNAL ("Internal error from Core") when a call it was still writing to was
        # ended under it, the status that ended it lost (grpc/grpc#36066).
        return CoordinatorUnavailableError(
            f"the call to the coordinator at {target} for {what} broke while this side was "
            f"still writing, and the coordinator's answer was lost (INTERNAL: {details})")
    return GradstarError(f"{what} failed at {target}: {code.name}: {details}")

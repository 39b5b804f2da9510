"""Mapping of gradstar errors to gRPC status codes, in one place for every servicer."""

from __future__ import annotations

import grpc

from gradstar import errors as e

_CODES: list[tuple[type[e.GradstarError], grpc.StatusCode]] = [
    (e.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (e.CollectiveMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.WorldSizeMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.CollectiveTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (e.JoinTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (e.RankLostError, grpc.StatusCode.ABORTED),
    (e.PayloadTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.DuplicateRankError, grpc.StatusCode.ALREADY_EXISTS),
    (e.CoordinatorDrainingError, grpc.StatusCode.UNAVAILABLE),
    (e.ProtocolError, grpc.StatusCode.DATA_LOSS),
    (e.InvalidCollectiveError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.ConfigurationError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.RendezvousError, grpc.StatusCode.FAILED_PRECONDITION),
]


def status_code(error: e.GradstarError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.UNKNOWN


async def abort(context: grpc.aio.ServicerContext, error: e.GradstarError) -> None:
    """End the call with ``error``'s status; the client rebuilds the same exception."""
    await context.abort(status_code(error), str(error), trailing_metadata=e.error_metadata(error))

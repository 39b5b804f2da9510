"""Token authentication: a server interceptor checking the ``authorization`` metadata.

Job calls (rendezvous, collectives) need ``Bearer <token>``; Admin calls and a hub shard's
registration (``ShardControl``: a shard is part of the hub, so registering one is an operator's
act, never a rank's) need the admin token (or, when none is set, the job token). Health and
reflection stay open so orchestrators can probe the coordinator. Tokens are compared in
constant time and never logged.

A refused call whose client streams requests is answered only once the client has
half-closed or stopped writing (bounded by :data:`DENIAL_DRAIN_SECONDS`): ending the call while
the client is still writing fails the client's pending write, and grpc-python then reports
INTERNAL ("Internal error from Core") to that client instead of our UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

import grpc

AUTH_KEY = "authorization"
ADMIN_PREFIXES = ("/gradstar.proto.v1.Admin/", "/gradstar.proto.v1.ShardControl/")
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: How long a refused streaming call reads (and discards) the client's requests, waiting for
#: its half-close, before it ends anyway. A collective's frames arrive at link speed, so this
#: covers every payload but a huge one on a slow link, while bounding what an unauthenticated
#: client can make the server read.
DENIAL_DRAIN_SECONDS = 2.0
#: ...or until the client has written nothing for this long: a client that stopped writing (a
#: rank's session after its join, a peer link after its hello) is waiting for an answer and has
#: no write in flight to fail, so it need not wait the full drain.
DENIAL_QUIET_SECONDS = 0.25


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents ``token``."""
    return ((AUTH_KEY, f"Bearer {token}"),)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right token with UNAUTHENTICATED before any handler runs."""

    def __init__(self, job_token: str | None, admin_token: str | None) -> None:
        admin = admin_token or job_token
        self._job = bearer(job_token)[0][1].encode() if job_token else None
        self._admin = bearer(admin)[0][1].encode() if admin else None

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        is_admin = method.startswith(ADMIN_PREFIXES)
        expected = self._admin if is_admin else self._job
        if expected is None:
            return await continuation(handler_call_details)
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_KEY:
                presented = value if isinstance(value, str) else value.decode("latin-1")
        if hmac.compare_digest(presented.encode("utf-8", "replace"), expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        what = "admin token" if is_admin else "job token"
        reason = "missing" if not presented else "wrong"
        return _denying(handler, f"{what} {reason}: pass the coordinator's {what} "
                                 f"({'GRADSTAR_ADMIN_TOKEN' if is_admin else 'GRADSTAR_TOKEN'})")


def _denying(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as ``handler`` that only aborts.

    It has no deserializer, so a streaming request is drained as raw bytes and a malformed one
    cannot turn the refusal into another status.
    """

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def drain_then_deny(requests, context):
        with contextlib.suppress(TimeoutError, grpc.RpcError):
            await asyncio.wait_for(_drain(requests), DENIAL_DRAIN_SECONDS)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(drain_then_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(drain_then_deny)
    return grpc.unary_stream_rpc_method_handler(deny)


async def _drain(requests) -> None:
    """Read and discard requests until the client half-closes.

    Raises:
        TimeoutError: the client wrote nothing for :data:`DENIAL_QUIET_SECONDS`.
    """
    frames = requests.__aiter__()
    with contextlib.suppress(StopAsyncIteration):
        while True:
            await asyncio.wait_for(anext(frames), DENIAL_QUIET_SECONDS)

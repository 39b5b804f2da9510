"""Token authentication: a server interceptor checking the ``authorization`` metadata.

Job calls (rendezvous, collectives) need ``Bearer <token>``; Admin calls and a hub shard's
registration (``ShardControl``: a shard is part of the hub, so registering one is an operator's
act, never a rank's) need the admin token (or, when none is set, the job token) — except a
node-local shard's registration for one job (``RegisterForJob``), which the job token opens:
that shard carries only the job's generations, nothing a rank of the job could not see; and
``Admin.GetStragglers``, which ranks read, takes either token. Health and
reflection stay open so orchestrators can probe the coordinator. Tokens are compared in
constant time and never logged.

Per-job tokens (:mod:`.job_tokens`): a server given the operator's job secret also admits, to
every call the job token opens, a token made for one job. The interceptor records that job for
the call (:data:`_CALLER_JOB`, a context variable of the call's task, which the servicer's
handler runs in), and every servicer that reads a job from its request asks
:func:`check_job_access` before it reads or changes anything of that job: a job's token then
reaches its own job only. A call admitted by the shared token or the admin token records
nothing and reaches every job, as without a secret; without a secret the check is one context
variable read.

A refused call whose client streams requests is answered only once the client has
half-closed or stopped writing (bounded by :data:`DENIAL_DRAIN_SECONDS`): ending the call while
the client is still writing fails the client's pending write, and grpc-python then reports
INTERNAL ("Internal error from Core", debug string ``Failed "execute_batch":
(SendMessageOperation,)``) to that client instead of our UNAUTHENTICATED (grpc/grpc#36066: the
failed write overwrites the status that already arrived). Silence alone cannot tell a client
waiting for its answer from one paused between two writes, so it is trusted only where waiting
is what a client does: after its opening message at most, and only for time during which this
loop kept time (a stall of the loop, from a full garbage collection or a starved CPU, leaves
frames the client sent unread, and stalls a client that shares the process).

Calls to methods this server does not know are drained too: their streaming shape is unknown,
and a draining handler answers a client of any shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from contextvars import ContextVar

import grpc

from gradstar.errors import JobAccessError

from .job_tokens import JobSecret

AUTH_KEY = "authorization"
ADMIN_PREFIXES = ("/gradstar.proto.v1.Admin/", "/gradstar.proto.v1.ShardControl/")
#: ShardControl methods a job token opens: a node-local shard registering for one job (it
#: serves that job's generations only, so a rank of the job gains nothing by starting one).
JOB_SCOPED = frozenset({"/gradstar.proto.v1.ShardControl/RegisterForJob"})
#: Admin methods the job token opens as well as the admin token: the stragglers view, which a
#: rank reads (ProcessGroup.straggler_stats): the lags of ranks the job token lets anyone join as.
RANKS_READ = frozenset({"/gradstar.proto.v1.Admin/GetStragglers"})
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: How long a refused streaming call reads (and discards) the client's requests, waiting for
#: its half-close, before it ends anyway. A collective's frames arrive at link speed, so this
#: covers every payload but a huge one on a slow link, and a client slowed by a loaded machine
#: (2 MB streams took up to 2.1 s with two CPU burners on a 2-core machine, past the 2 s this
#: once was), while bounding what an unauthenticated client can make the server read.
DENIAL_DRAIN_SECONDS = 10.0
#: ...or, for a client that wrote no more than its opening message, until it has written
#: nothing for this long while the loop kept time: such a client (a rank's session after its
#: join, a peer link after its hello) is waiting for an answer and has no write in flight to
#: fail, so it need not wait the full drain. A streaming client's second message must come
#: sooner, with room for a loaded CPU: the server's read, the window update and the client's
#: send each wait for one (what was seen: docs/performance.md, "Figures behind the code").
DENIAL_QUIET_SECONDS = 1.0
#: Quiet is counted in ticks of this length; a tick that ends over a tick late means the loop
#: stalled, and the count starts again.
_QUIET_TICK = 0.05
_BEARER = "Bearer "

#: The one job the current call may act for (its token is that job's own), or None: every job
#: (the shared or admin token, or a server without a job secret). Set by the interceptor in
#: the call's task, before its handler runs there; each call is a task of its own, so a value
#: never outlives its call.
_CALLER_JOB: ContextVar[str | None] = ContextVar("gradstar_caller_job", default=None)


def check_job_access(job: str) -> None:
    """Refuse the current call if its token opens another job than ``job``.

    A job's token opens the job and the jobs named under it, ``JOB/...``: the groups its ranks
    join as jobs of their own (torch's ``new_group``, ``JOB/groupN``; the two-level
    all_reduce's per-host groups, ``JOB/gN/host-KEY``), as a node-local shard for the job
    serves them too. Every servicer that names a job in its request calls this before it reads
    or changes any state of the job, so a refused call leaves the job as it was. With the
    shared token, the admin token or no job secret, it allows every job.

    Raises:
        JobAccessError: the call's token is another job's own token.
    """
    caller = _CALLER_JOB.get()
    if caller is not None and caller != job and not job.startswith(caller + "/"):
        raise JobAccessError(
            f"this call's token is the job token of job {caller!r}, which opens that job "
            f"only, not job {job!r}; job {job!r} needs its own token or the coordinator's "
            "shared job token", job=job)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that presents ``token``."""
    return ((AUTH_KEY, f"Bearer {token}"),)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right token with UNAUTHENTICATED before any handler runs.

    With ``job_secret``, a job token of any job (:class:`~.job_tokens.JobSecret`) is admitted
    wherever the shared job token is (and to ``RANKS_READ``), bound to its job for
    :func:`check_job_access`; job calls then need one of the two even when no shared token is
    set.
    """

    def __init__(self, job_token: str | None, admin_token: str | None,
                 job_secret: JobSecret | None = None) -> None:
        admin = admin_token or job_token
        self._job = bearer(job_token)[0][1].encode() if job_token else None
        self._admin = bearer(admin)[0][1].encode() if admin else None
        self._secret = job_secret

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        is_admin = method.startswith(ADMIN_PREFIXES) and method not in JOB_SCOPED
        expected = self._admin if is_admin else self._job
        if expected is None and self._secret is None:
            return await continuation(handler_call_details)
        presented = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_KEY:
                presented = value if isinstance(value, str) else value.decode("latin-1")
        token = presented.encode("utf-8", "replace")
        if expected is not None and hmac.compare_digest(token, expected):
            return await continuation(handler_call_details)
        ranks_read = method in RANKS_READ
        if ranks_read and ((self._job is None and self._secret is None) or (
                self._job is not None and hmac.compare_digest(token, self._job))):
            return await continuation(handler_call_details)
        if (self._secret is not None and (ranks_read or not is_admin)
                and presented.startswith(_BEARER)):
            job = self._secret.job_of(presented[len(_BEARER):])
            if job is not None:
                _CALLER_JOB.set(job)
                return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        what = "admin token" if is_admin else "job token"
        reason = "missing" if not presented else "wrong"
        var = "GRADSTAR_ADMIN_TOKEN" if is_admin else "GRADSTAR_TOKEN"
        whose = ("the coordinator's admin token" if is_admin
                 else "the coordinator's job token or your job's own token" if self._secret
                 else "the coordinator's job token")
        return _denying(handler, f"{what} {reason}: pass {whose} ({var} or {var}_FILE)")


def _denying(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as ``handler`` (a streaming one when the method is
    unknown) that only aborts.

    It has no deserializer, so a streaming request is drained as raw bytes and a malformed one
    cannot turn the refusal into another status.
    """

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def drain_then_deny(requests, context):
        with contextlib.suppress(TimeoutError, grpc.RpcError):
            await asyncio.wait_for(_drain(requests), DENIAL_DRAIN_SECONDS)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None or (handler.request_streaming and handler.response_streaming):
        return grpc.stream_stream_rpc_method_handler(drain_then_deny)
    if not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(drain_then_deny)
    return grpc.unary_stream_rpc_method_handler(deny)


async def _drain(requests) -> None:
    """Read and discard requests until the client half-closes. A client that has written no
    more than its opening message (a join, a hello, a header offering shared memory) may be
    waiting for an answer: it gets one once it has been quiet (:func:`_next_unless_quiet`).
    One that wrote more is streaming, and may pause for longer than that (a garbage collection
    in its process, a starved CPU, a link it shares): only its half-close says it is done."""
    frames = requests.__aiter__()
    for _ in range(2):  # its opening message, then a second: from there on it is streaming
        if await _next_unless_quiet(frames) is None:
            return
    async for _ in frames:
        pass


async def _next_unless_quiet(frames) -> bytes | None:
    """The next request, or None once the client has half-closed or has written nothing for
    :data:`DENIAL_QUIET_SECONDS` of ticks that this loop kept on time."""
    loop = asyncio.get_running_loop()
    # One read stays pending across ticks: cancelling a read closes grpc's request iterator.
    read = asyncio.ensure_future(anext(frames, None))
    quiet = 0.0
    try:
        while quiet < DENIAL_QUIET_SECONDS:
            started = loop.time()
            done, _ = await asyncio.wait((read,), timeout=_QUIET_TICK)
            if done:
                return read.result()
            # A tick over a tick late: the loop stalled, and with it a client that shares it.
            quiet = 0.0 if loop.time() - started > 2 * _QUIET_TICK else quiet + _QUIET_TICK
        return None
    finally:
        read.cancel()

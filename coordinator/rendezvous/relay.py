"""The coordinator's relay of peer streams to ranks that take no inbound connections.

A rank on an outbound-only host (behind NAT, a firewall that only lets connections out) cannot
be dialed by the ranks of other hosts, so its peer server (send/recv, Pipeline activations)
never sees their streams. Both ranks can dial the coordinator, so it joins them there. Three
calls of one method, ``PeerRelay/Relay`` (raw frames both ways, as ``PeerStream/Stream``), on
the coordinator's collective port; each names its caller as a member (job, generation, rank,
member id, in call metadata: :data:`RELAY_KEYS`), checked before anything else:

1. ``listen``: the outbound-only rank keeps one open from its join on. The hub writes on it the
   rank of every sender that wants a stream to it (4 bytes, big-endian).
2. ``send`` (peer = the receiver): a sender's peer stream. The hub tells the receiver's
   listener, and waits (:data:`ACCEPT_SECONDS`) for it to ``accept``.
3. ``accept`` (peer = the sender): the receiver's half. From here the hub copies each frame of
   either call to the other, one at a time each way (so it holds at most a frame per
   direction beyond gRPC's windows), until either side ends; then both calls end.

The hub reads none of the frames: the receiver checks the sender's hello (signed with the key
the pair shares, which the hub never sends to anyone else) as it checks a direct stream's. A
sender whose receiver has no listener, or does not accept in time, gets ``LinkLost``-like
``RendezvousError`` naming why; the receiver's own refusals travel back as its ERROR frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from gradstar.errors import GradstarError, ProtocolError, RendezvousError
from gradstar.transport.auth import check_job_access
from gradstar.transport.relay import caller, caller_host, notice, punch_notice
from gradstar.transport.status import abort
from gradstar.wire import RELAY_SERVICE

log = logging.getLogger(__name__)

#: How long a sender waits for its receiver to accept the relayed stream.
ACCEPT_SECONDS = 10.0
#: Senders waiting for one receiver's accept, at most (one per other rank is what a job has).
MAX_WAITING = 1 << 12


@dataclass(eq=False)
class _Listener:
    """A receiver's listen call: senders to announce, and their streams waiting for it."""

    #: Frames to write on it: notices of senders, and of punches (gradstar.transport.relay).
    notices: asyncio.Queue = field(default_factory=asyncio.Queue)
    #: sender rank -> futures the sender's call waits on, resolved with the accept's context.
    waiting: dict[int, list[asyncio.Future]] = field(default_factory=dict)


class RelayServicer:
    """``PeerRelay/Relay``: listen, send and accept (see the module docstring).

    ``members(job, generation, rank, member_id)`` binds a call to its caller (the rendezvous'
    ``bound_member``: raises a gradstar error for anyone else). ``punch(job, generation,
    stripe, host, port)`` serves ``PeerRelay/Punch`` (the shard registry's: NAT traversal to a
    hub shard, :mod:`gradstar.transport.traversal`).
    """

    def __init__(self, members: Callable[[str, int, int, str], object],
                 punch: Callable[[str, int, int, str, int], None] | None = None) -> None:
        self.members = members
        self.punch = punch
        self._listeners: dict[tuple[str, int, int], _Listener] = {}
        #: Set (and replaced) whenever a listener opens: senders waiting for one look again.
        self._listening = asyncio.Event()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            RELAY_SERVICE, {"Relay": grpc.stream_stream_rpc_method_handler(self.Relay),
                            "Punch": grpc.unary_unary_rpc_method_handler(self.Punch)})

    async def Punch(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """A member asks that the hub shard at stripe ``peer`` of its generation (role
        ``punch``), or the outbound-only rank ``peer`` (role ``punch-rank``, through its
        listener), punch towards the port it names (2 bytes, big-endian) on the host its
        request came from (gradstar.transport.traversal)."""
        try:
            job, generation, rank, member, role, peer = caller(context.invocation_metadata())
            if role not in ("punch", "punch-rank") or peer < 0 or len(request) != 2:
                raise ProtocolError("a punch names its stripe or rank in the relay metadata "
                                    "(role 'punch' or 'punch-rank') and its port in 2 bytes")
            check_job_access(job)
            self.members(job, generation, rank, member)
            host, port = caller_host(context.peer()), int.from_bytes(request, "big")
            if not host or not 0 < port < 65536:
                raise ProtocolError(f"a punch comes from a TCP host and names its port "
                                    f"(1-65535), not {port}")
            if role == "punch-rank":
                listener = self._listeners.get((job, generation, peer))
                if listener is None:
                    raise RendezvousError(f"rank {peer} of job {job!r} generation {generation} "
                                          "has no relay listener to be asked to punch back")
                if listener.notices.qsize() >= MAX_WAITING:
                    raise RendezvousError(f"rank {peer} of job {job!r} has {MAX_WAITING} "
                                          "notices waiting")
                listener.notices.put_nowait(punch_notice(rank, host, port))
            elif self.punch is None:
                raise RendezvousError("this coordinator has no hub shards to punch to")
            else:
                self.punch(job, generation, peer, host, port)
        except GradstarError as error:
            await abort(context, error)
        return b""

    async def Relay(self, request_iterator: AsyncIterator[bytes],
                    context: grpc.aio.ServicerContext) -> None:
        try:
            job, generation, rank, role, peer = self._caller(context)
        except GradstarError as error:
            await abort(context, error)
        if role == "listen":
            await self._listen((job, generation, rank), context)
        elif role == "send":
            await self._send((job, generation, peer), rank, context)
        else:
            await self._accept((job, generation, rank), peer, context)

    def _caller(self, context) -> tuple[str, int, int, str, int]:
        """(job, generation, rank, role, peer) of a relay call, its caller checked.

        Raises:
            ProtocolError: metadata missing or malformed.
            RendezvousError, JobAccessError: the caller is not that member.
        """
        job, generation, rank, member, role, peer = caller(context.invocation_metadata())
        if role not in ("listen", "send", "accept") or (role != "listen" and peer < 0):
            raise ProtocolError(f"a relay call's role is listen, send or accept (with a peer), "
                                f"not {role!r} (peer {peer})")
        check_job_access(job)
        self.members(job, generation, rank, member)
        return job, generation, rank, role, peer

    async def _listen(self, key: tuple[str, int, int], context) -> None:
        listener = self._listeners[key] = _Listener()  # a newer listen replaces an older one
        self._listening.set()
        self._listening = asyncio.Event()
        try:
            while True:
                await context.write(await listener.notices.get())
        finally:
            if self._listeners.get(key) is listener:
                del self._listeners[key]
            for futures in listener.waiting.values():
                for future in futures:
                    if not future.done():
                        future.cancel()

    async def _send(self, receiver: tuple[str, int, int], src: int, context) -> None:
        job, generation, dst = receiver
        listener = await self._listener(receiver)
        if listener is None:
            await abort(context, RendezvousError(
                f"rank {dst} of job {job!r} generation {generation} takes no inbound "
                "connections and has no relay open on the coordinator (it left, or its "
                f"version relays nothing), so rank {src} cannot reach it"))
        if sum(len(f) for f in listener.waiting.values()) >= MAX_WAITING:
            await abort(context, RendezvousError(
                f"rank {dst} of job {job!r} has {MAX_WAITING} relayed streams waiting"))
        future = asyncio.get_running_loop().create_future()
        listener.waiting.setdefault(src, []).append(future)
        listener.notices.put_nowait(notice(src))
        try:
            await asyncio.wait((future,), timeout=ACCEPT_SECONDS)
        finally:
            if not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):
                listener.waiting.get(src, []).remove(future)
        if future.cancelled():  # not accepted in time, or the receiver's listen ended
            await abort(context, RendezvousError(
                f"rank {dst} of job {job!r} did not accept rank {src}'s relayed peer stream "
                f"within {ACCEPT_SECONDS:g} s"))
        other, done = future.result()
        try:
            await _pipe(context, other)
        finally:
            done.set()

    async def _listener(self, receiver: tuple[str, int, int]) -> _Listener | None:
        """``receiver``'s listener, waiting up to ACCEPT_SECONDS for it to open (a receiver
        opens it as it joins, which a fast sender of the same generation may beat)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + ACCEPT_SECONDS
        while (listener := self._listeners.get(receiver)) is None:
            left = until - loop.time()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._listening.wait(), left)
        return listener

    async def _accept(self, receiver: tuple[str, int, int], src: int, context) -> None:
        listener = self._listeners.get(receiver)
        futures = listener.waiting.get(src, []) if listener is not None else []
        futures = [f for f in futures if not f.done()]
        if not futures:
            await abort(context, RendezvousError(
                f"no relayed stream from rank {src} waits for rank {receiver[2]}"))
        done = asyncio.Event()
        futures[0].set_result((context, done))  # the sender's call removes it
        await done.wait()  # the sender's call copies both ways; this call lives as long


async def _pipe(a, b) -> None:
    """Copy frames from each call to the other until either ends (then both end)."""

    async def copy(src, dst) -> None:
        while (frame := await src.read()) is not grpc.aio.EOF:
            await dst.write(frame)

    tasks = [asyncio.ensure_future(copy(a, b)), asyncio.ensure_future(copy(b, a))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError, Exception):
                await task

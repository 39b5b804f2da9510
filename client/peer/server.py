"""The rank's peer server: the receiving side of peer streams.

It checks each incoming stream's hello (job, generation, ranks, and the sender's proof that it
is the rank it claims; the job token is checked by the hub's interceptor before), reads the
messages of the stream, and files each one in the
:class:`~gradstar.client.peer.mailbox.Mailbox` of its sender, acknowledging it once it is filed.

How a stream ends decides what a receive still waiting for its sender raises: a goodbye (the
sender closed its process group) closes the sender's mailbox with
:class:`~gradstar.errors.RankFinishedError`; a stream that ends without one closes it with
:class:`LinkLost`, which the endpoint resolves into the hub's verdict. When this rank closes its
own group, :meth:`PeerServer.stop` answers every incoming stream with a ``RankFinishedError``
frame before it stops, so the senders' pending and later sends say that this rank finished.
The protocol is described in :mod:`gradstar.client.peer` and ``peer.proto``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from gradstar.config import ClientSettings
from gradstar.errors import (
    ConfigurationError,
    GradstarError,
    InvalidCollectiveError,
    ProtocolError,
    RankFinishedError,
)
from gradstar.proto.v1 import collective_pb2 as cpb
from gradstar.proto.v1 import peer_pb2 as ppb
from gradstar.transport.addresses import host_port
from gradstar.transport.channels import server_credentials
from gradstar.transport.serve import serve
from gradstar.transport.status import abort
from gradstar.wire import (
    KIND_ACCEPT,
    KIND_CHUNK,
    KIND_END,
    KIND_HEADER,
    MAX_CHUNK_BYTES,
    PEER_SERVICE,
    ChunkLayout,
    ChunkTracker,
    as_byte_view,
    check_chunk_count,
    check_header_size,
    check_shape,
    decode_message,
    dtype_from_wire,
    encode_error,
    encode_message,
    frame_kind,
    payload_bytes,
    receive_chunk,
)

from .mailbox import Mailbox, Mailboxes
from .proof import HelloVerifier

log = logging.getLogger(__name__)

#: How long :meth:`PeerServer.stop` spends telling the senders of incoming streams that this
#: rank finished (all streams at once), and then waits for their calls to end.
FAREWELL_TIMEOUT = 0.5
#: How long a refused peer stream is read before its call ends (see :func:`_drain`).
REFUSAL_LINGER = 2.0


class LinkLost(GradstarError):
    """Internal: a peer stream ended or broke; resolved into the hub's verdict or RankLostError."""

    def __init__(self, peer: int, detail: str) -> None:
        super().__init__(detail)
        self.peer = peer


@dataclass(frozen=True)
class Identity:
    """Who this rank is, known once the generation formed."""

    job: str
    generation: int
    rank: int
    world_size: int
    #: ``Joined.peer_keys``: by rank, the key this rank shares with that rank alone, which
    #: hellos between the two are signed with (empty at this rank's own index).
    peer_keys: tuple[bytes, ...] = field(default=(), repr=False)

    def key_for(self, rank: int) -> bytes:
        """The key this rank shares with ``rank`` (empty if the coordinator gave none)."""
        return self.peer_keys[rank] if 0 <= rank < len(self.peer_keys) else b""


class PeerServer:
    """The rank's peer server: checks each incoming stream's hello and files its messages.

    A thin edge: the buffering and matching live in the mailboxes.
    """

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self.identity: Identity | None = None
        self.mailboxes = Mailboxes((), 1, 0)
        #: Incoming streams by sender: their call contexts and the locks their writes take.
        self._inbound: dict[int, tuple[grpc.aio.ServicerContext, asyncio.Lock]] = {}
        self._verifier = HelloVerifier(())
        self._bound = asyncio.Event()
        self._server: grpc.aio.Server | None = None

    async def start(self, host: str) -> int:
        """Bind ``host``:``peer_port`` and serve; return the bound port.

        Raises:
            ConfigurationError: the address could not be bound.
        """
        s = self.settings
        token = s.token.get_secret_value() if s.token else None
        handler = grpc.method_handlers_generic_handler(
            PEER_SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(self.Stream)})
        bind = host_port(host, s.peer_port)
        creds = (server_credentials(s.tls_cert, s.tls_key, s.tls_ca)
                 if s.tls_cert is not None and s.tls_key is not None else None)
        try:
            server, port = serve(bind, (handler,), what="this rank's peer server", token=token,
                                 credentials=creds, bulk=True)
        except OSError:
            raise ConfigurationError(
                f"could not bind this rank's peer server to {bind}; set peer_host/peer_port "
                "(GRADSTAR_PEER_HOST, GRADSTAR_PEER_PORT) to a free local address"
            ) from None
        await server.start()
        self._server = server
        return port

    def bind(self, identity: Identity) -> None:
        s = self.settings
        self.mailboxes = Mailboxes((r for r in range(identity.world_size) if r != identity.rank),
                                   s.peer_buffer_messages, s.peer_buffer_bytes)
        self._verifier = HelloVerifier(identity.peer_keys)
        self.identity = identity
        self._bound.set()

    async def stop(self, error: GradstarError, farewell: GradstarError | None = None) -> None:
        """Close every mailbox with ``error`` and stop serving. With ``farewell`` (this rank
        closed its group cleanly), first send it to the sender of every incoming stream, so
        their sends raise it instead of a broken stream's error."""
        self.mailboxes.close(error)
        if self._server is None:
            return
        grace = None
        if farewell is not None and self._inbound:
            grace = FAREWELL_TIMEOUT
            _, late = await asyncio.wait(
                [asyncio.ensure_future(self._say(src, farewell)) for src in self._inbound],
                timeout=FAREWELL_TIMEOUT)
            for task in late:
                task.cancel()
        server, self._server = self._server, None
        await server.stop(grace)

    def streaming_from(self, src: int) -> bool:
        """Whether a stream from rank ``src`` is open (more may still come from it)."""
        return src in self._inbound

    async def _say(self, src: int, error: GradstarError) -> None:
        context, lock = self._inbound.get(src, (None, None))
        if context is None:
            return
        async with lock:
            try:
                await context.write(encode_error(error))
            except Exception:  # best effort: the stream may be ending under us
                return

    async def Stream(self, request_iterator: AsyncIterator[bytes],
                     context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        try:
            hello = decode_message(first, KIND_HEADER, ppb.PeerHello)
            mailbox = await self._accept(hello)
        except GradstarError as error:
            await context.write(encode_error(error))
            await _drain(context)
            await abort(context, error)
        me = self.identity
        await context.write(encode_message(
            KIND_ACCEPT, ppb.PeerAccept(rank=me.rank, generation=me.generation)))
        src = hello.src_rank
        lock = asyncio.Lock()
        self._inbound[src] = (context, lock)
        ending: GradstarError = LinkLost(src, f"rank {src}'s peer stream to rank {me.rank} broke")
        try:
            if await self._receive(context, mailbox, src, lock):
                ending = RankFinishedError(
                    f"rank {src} finished (closed its process group)", rank=src,
                    generation=me.generation)
        except (ProtocolError, InvalidCollectiveError) as error:
            mailbox.close(error)
            async with lock:
                await context.write(encode_error(error))
            await abort(context, error)
        finally:
            if self._inbound.get(src, (None,))[0] is context:
                del self._inbound[src]
            mailbox.close(ending)

    async def _accept(self, hello: ppb.PeerHello) -> Mailbox:
        timeout = self.settings.join_timeout
        try:
            await asyncio.wait_for(self._bound.wait(), timeout)
        except TimeoutError:
            raise ProtocolError(
                f"rank {hello.src_rank} opened a peer stream to a process that did not join "
                f"a generation within {timeout:g} s"
            ) from None
        me = self.identity
        if (hello.job, hello.generation, hello.dst_rank) != (me.job, me.generation, me.rank):
            raise ProtocolError(
                f"a peer stream for job {hello.job!r} generation {hello.generation} rank "
                f"{hello.dst_rank} reached rank {me.rank} of job {me.job!r} generation "
                f"{me.generation}"
            )
        mailbox = self.mailboxes.get(hello.src_rank)
        if mailbox is None:
            raise ProtocolError(f"rank {me.rank} got a peer stream from invalid rank "
                                f"{hello.src_rank} (world_size {me.world_size})")
        self._verifier.verify(hello)
        return mailbox

    @staticmethod
    async def _receive(context, mailbox: Mailbox, src: int, lock: asyncio.Lock) -> bool:
        """Read messages and acknowledge each once it is filed, until the sender says goodbye
        (True) or the stream ends without a goodbye (False: a cancelled call, as when the
        sender dies, also reads as EOF)."""
        who = f"peer stream from rank {src}"
        expected_seq = 1
        while (frame := await context.read()) is not grpc.aio.EOF:
            if frame_kind(frame) == KIND_END:
                decode_message(frame, KIND_END, cpb.CollectiveEnd)
                return True
            check_header_size(frame, who)
            header = decode_message(frame, KIND_HEADER, ppb.PeerMessageHeader)
            if header.seq != expected_seq:
                raise ProtocolError(f"{who}: message seq {header.seq}, expected {expected_seq}")
            expected_seq += 1
            info = dtype_from_wire(header.dtype)
            shape = check_shape(header.shape, who)
            nbytes = payload_bytes(shape, header.dtype)
            if not 0 < header.chunk_bytes <= MAX_CHUNK_BYTES:
                raise ProtocolError(f"{who}: chunk_bytes {header.chunk_bytes} is out of range")
            layout = ChunkLayout(1, nbytes, header.chunk_bytes)
            check_chunk_count(layout.count, nbytes, header.chunk_bytes, who)
            reservation = await mailbox.admit(header.tag, nbytes)
            out, detach = _in_place(reservation.into, info.numpy, nbytes), None
            if out is not None:
                detach = _detached
            else:
                try:
                    out = np.empty(shape, dtype=info.numpy)
                except (MemoryError, ValueError) as error:
                    raise ProtocolError(f"{who}: cannot hold message {header.seq} of shape "
                                        f"{shape} ({type(error).__name__}: {error})") from None
            out_bytes = as_byte_view(out)
            tracker = ChunkTracker(layout, who)
            while True:
                frame = await context.read()
                if frame is grpc.aio.EOF:
                    # The sender died or hung up mid-message (both read as EOF here): a lost
                    # link, named by the session as a lost rank, not a protocol error. The
                    # partial message is dropped; the receive waiting for it fails.
                    log.debug("%s ended in the middle of message %d", who, header.seq)
                    return False
                kind = frame_kind(frame)
                if kind == KIND_CHUNK:
                    receive_chunk(frame, tracker, out_bytes)
                elif kind == KIND_END:
                    tracker.finish(decode_message(frame, KIND_END, cpb.CollectiveEnd))
                    break
                else:
                    raise ProtocolError(f"{who}: unexpected frame of kind {kind} in a message")
            mailbox.put(reservation, (out, header.array_kind), detach)
            async with lock:
                await context.write(encode_message(KIND_ACCEPT, ppb.PeerAck(seq=header.seq)))
        return False


async def _drain(context) -> None:
    """Read what a refused client still writes, until it hangs up or for REFUSAL_LINGER
    seconds: ending the call while it writes can make grpc-python report INTERNAL to it
    instead of the refusal it was sent."""

    async def until_eof():
        while await context.read() is not grpc.aio.EOF:
            pass

    with contextlib.suppress(TimeoutError, grpc.RpcError, grpc.aio.AbortError):
        await asyncio.wait_for(until_eof(), REFUSAL_LINGER)


def _in_place(into, dtype: np.dtype, nbytes: int) -> np.ndarray | None:
    """``into`` if a message of ``nbytes`` of ``dtype`` can be written straight into it (a
    C-contiguous array of that dtype and size); else None (the message gets its own array)."""
    if (isinstance(into, np.ndarray) and into.dtype == dtype and into.nbytes == nbytes
            and into.flags.c_contiguous and into.flags.writeable):
        return into
    return None


def _detached(value: tuple[np.ndarray, int]) -> tuple[np.ndarray, int]:
    """A message written into a receive's destination, copied out of it (that receive gave
    up, so the destination is no longer the message's to use)."""
    arr, kind = value
    return arr.copy(), kind

"""Rank-to-rank streams: the peer server every rank runs, and its outgoing links.

The protocol (frames in ``protos/gradstar/proto/v1/peer.proto``):

* Every rank starts a :class:`~gradstar.client.peer_server.PeerServer` before it joins
  (``peer_host``:``peer_port``, port 0 by default) and registers its address at rendezvous;
  ``Joined.peers`` tells every rank where the others are.
* The first ``send`` to a rank opens ONE long-lived bidirectional stream to it (a
  :class:`PeerLink`): a hello naming job, generation, sender and receiver, answered by an
  accept once the receiver has checked them. Every later message to that rank rides the same
  stream: a header (seq, tag, dtype, shape, chunking), chunk frames with CRC-32s (the collective
  codec of :mod:`gradstar.wire`) and an end marker with the chunk and byte count. The receiver
  acknowledges each complete message by its seq; ``send`` completes with that acknowledgement,
  so a completed send is held by the receiver.
* The receiver files each message in the :class:`~gradstar.client.mailbox.Mailbox` of its
  sender, where ``recv(src, tag)`` matches it by tag. Early messages are buffered up to
  ``peer_buffer_messages`` / ``peer_buffer_bytes`` per sender; past that the server stops
  reading the stream and flow control holds the sender back.
* A rank closing its process group ends each of its streams with a goodbye (an empty end
  marker), so its receivers can tell an orderly close from a broken stream.
* Failure: channels use the hub's keepalive options (a dead or frozen peer breaks its streams
  in seconds), and every wait also watches the rank's session with the hub, whose
  generation-failure notice names the lost rank. A broken stream waits briefly for that notice
  and raises it; without one it raises :class:`~gradstar.errors.RankLostError` naming the peer.
  Every wait is bounded by the operation's timeout
  (:class:`~gradstar.errors.CollectiveTimeoutError` naming the peer).
* Security: the job token travels in call metadata and the peer server checks it with the
  hub's interceptor. With ``tls_cert`` and ``tls_key`` the peer server serves TLS with them
  (requiring client certificates from ``tls_ca`` when set), and links use the same credentials
  as the hub's channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque

import grpc
import ml_dtypes
import numpy as np

from gradstar.channels import client_credentials
from gradstar.channels import secure_or_insecure_channel as open_channel
from gradstar.config import ClientSettings
from gradstar.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    ConfigurationError,
    GradstarError,
    ProcessGroupClosedError,
    ProtocolError,
    RankLostError,
)
from gradstar.proto.v1 import collective_pb2 as cpb
from gradstar.proto.v1 import peer_pb2 as ppb
from gradstar.wire import (
    KIND_ACCEPT,
    KIND_END,
    KIND_ERROR,
    KIND_HEADER,
    ChunkLayout,
    aligned_chunk_bytes,
    as_byte_view,
    decode_error,
    decode_message,
    dtype_info,
    encode_chunk,
    encode_message,
    frame_kind,
)

from .peer_server import PEER_METHOD, Identity, LinkLost, PeerServer, host_port

__all__ = ["PEER_METHOD", "Identity", "LinkLost", "PeerEndpoint", "PeerLink", "PeerServer",
           "array_kind", "restore_array"]

# How long a broken peer stream waits for the hub to say which rank was lost before naming the
# peer itself (the hub usually knows within milliseconds of a process dying).
LINK_GRACE = 3.0
_WILDCARDS = ("", "0.0.0.0", "::")


def _rpc_detail(error: grpc.RpcError) -> str:
    try:
        return f"{error.code().name}: {error.details()}"
    except Exception:  # a locally failed call may carry neither
        return type(error).__name__


def array_kind(x) -> int:
    """The ArrayKind of a value ``to_numpy`` accepted."""
    return ppb.ARRAY_KIND_NUMPY if isinstance(x, np.ndarray) else ppb.ARRAY_KIND_TORCH


def restore_array(arr: np.ndarray, kind: int):
    """``arr`` as the type the sender passed: a torch tensor for ARRAY_KIND_TORCH when torch
    is installed here, else the numpy array."""
    if kind != ppb.ARRAY_KIND_TORCH:
        return arr
    try:
        import torch
    except ImportError:
        return arr
    if arr.dtype == ml_dtypes.bfloat16:
        # numpy has no bfloat16: hand torch the same bits as int16 and reinterpret them.
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


class PeerLink:
    """The sending side of this rank's stream to rank ``dst``.

    Messages are written one at a time in call order; acknowledgements come back in the same
    order. Once the stream fails every pending and later send raises the same error.
    """

    def __init__(self, identity: Identity, dst: int, address: str, settings: ClientSettings,
                 metadata) -> None:
        self.identity = identity
        self.dst = dst
        self.address = address
        self.settings = settings
        tls = settings.tls_ca or settings.tls_cert
        creds = (client_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key)
                 if tls else None)
        self._channel = open_channel(address, creds)
        self._metadata = metadata
        self._call = None
        self._reader: asyncio.Task | None = None
        self._write_lock = asyncio.Lock()
        self._pending: deque[tuple[int, asyncio.Future]] = deque()
        self._seq = 0
        self.error: GradstarError | None = None

    async def open(self) -> None:
        """Connect, say hello and wait for the receiver's accept.

        Raises:
            AuthenticationError: the peer server refused the token.
            LinkLost: the peer could not be reached within ``connect_timeout``.
            GradstarError: the receiver refused the hello (its ERROR frame).
        """
        me, timeout = self.identity, self.settings.connect_timeout
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise LinkLost(self.dst, f"rank {me.rank} could not reach rank {self.dst}'s peer "
                                     f"server at {self.address} within {timeout:g} s") from None
        self._call = self._channel.stream_stream(PEER_METHOD)(metadata=self._metadata)
        try:
            await self._call.write(encode_message(KIND_HEADER, ppb.PeerHello(
                job=me.job, generation=me.generation, src_rank=me.rank, dst_rank=self.dst)))
            first = await asyncio.wait_for(self._call.read(), timeout + LINK_GRACE)
            if first is grpc.aio.EOF:
                raise LinkLost(self.dst, f"rank {self.dst} closed the peer stream at once")
            if frame_kind(first) == KIND_ERROR:
                raise decode_error(first)
            decode_message(first, KIND_ACCEPT, ppb.PeerAccept)
        except grpc.RpcError as error:
            raise self._translate(error) from None
        except TimeoutError:
            raise LinkLost(self.dst, f"rank {self.dst} did not accept a peer stream within "
                                     f"{timeout + LINK_GRACE:g} s") from None
        self._reader = asyncio.create_task(self._read_acks(), name=f"gradstar-peer-{self.dst}")

    def _translate(self, error: grpc.RpcError) -> GradstarError:
        if error.code() == grpc.StatusCode.UNAUTHENTICATED:
            return AuthenticationError(
                f"rank {self.dst}'s peer server at {self.address} refused rank "
                f"{self.identity.rank}: {error.details()}")
        return LinkLost(self.dst, f"rank {self.identity.rank}'s peer stream to rank {self.dst} "
                                  f"broke ({_rpc_detail(error)})")

    async def _read_acks(self) -> None:
        try:
            while (frame := await self._call.read()) is not grpc.aio.EOF:
                if frame_kind(frame) == KIND_ERROR:
                    raise decode_error(frame)
                ack = decode_message(frame, KIND_ACCEPT, ppb.PeerAck)
                if not self._pending or self._pending[0][0] != ack.seq:
                    raise ProtocolError(f"rank {self.dst} acknowledged message {ack.seq}, "
                                        "which is not the next one pending")
                _, future = self._pending.popleft()
                if not future.done():
                    future.set_result(None)
            self._fail(LinkLost(self.dst, f"rank {self.dst} ended its peer stream from rank "
                                          f"{self.identity.rank}"))
        except grpc.RpcError as error:
            self._fail(self._translate(error))
        except GradstarError as error:
            self._fail(error)

    def _fail(self, error: GradstarError) -> None:
        if self.error is None:
            self.error = error
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(self.error)
        if self._call is not None:
            self._call.cancel()

    async def send(self, arr: np.ndarray, array_kind: int, tag: str) -> None:
        """Write one message and wait for the receiver's acknowledgement.

        A send cancelled while its frames are being written leaves half a message on the
        stream, so it fails the link.

        Raises:
            LinkLost, AuthenticationError, ProtocolError: the link failed.
        """
        if self.error is not None:
            raise self.error
        chunk_bytes = aligned_chunk_bytes(self.settings.chunk_bytes, arr.dtype.itemsize)
        layout = ChunkLayout(1, arr.nbytes, chunk_bytes)
        data = as_byte_view(arr)
        async with self._write_lock:
            if self.error is not None:
                raise self.error
            self._seq += 1
            seq = self._seq
            acked = asyncio.get_running_loop().create_future()
            self._pending.append((seq, acked))
            header = ppb.PeerMessageHeader(
                seq=seq, tag=tag, dtype=dtype_info(arr.dtype).wire, shape=arr.shape,
                chunk_bytes=chunk_bytes, array_kind=array_kind)
            try:
                await self._call.write(encode_message(KIND_HEADER, header))
                for index in range(layout.count):
                    offset, length = layout.span(index)
                    await self._call.write(encode_chunk(index, data[offset:offset + length]))
                await self._call.write(encode_message(
                    KIND_END, cpb.CollectiveEnd(chunks=layout.count, bytes=arr.nbytes)))
            except asyncio.CancelledError:
                self._fail(LinkLost(self.dst, f"a send to rank {self.dst} was abandoned "
                                              "mid-message, which ends the stream"))
                raise
            except Exception as error:  # the call ended under us: grpc raises several types
                self._fail(self._translate(error) if isinstance(error, grpc.RpcError) else
                           LinkLost(self.dst, f"writing to rank {self.dst}'s peer stream "
                                              f"failed ({type(error).__name__})"))
        await acked

    async def close(self, error: GradstarError) -> None:
        """End the stream with a goodbye, so the receiver can tell it from a broken one; sends
        still waiting raise ``error``."""
        if self.error is None and self._call is not None:
            async def goodbye():
                async with self._write_lock:
                    await self._call.write(encode_message(KIND_END, cpb.CollectiveEnd()))
                    await self._call.done_writing()
                # Cancelling at once could discard the goodbye before the receiver reads it;
                # the receiver ends the call once it has.
                await asyncio.shield(self._reader)

            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(goodbye(), 1.0)
        self._fail(error)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._channel.close()


class PeerEndpoint:
    """A rank's point-to-point side: its peer server, its links and the session it watches."""

    def __init__(self, settings: ClientSettings, metadata) -> None:
        self.settings = settings
        self.server = PeerServer(settings)
        self._metadata = metadata
        self._links: dict[int, asyncio.Future] = {}
        self._session = None
        self.identity: Identity | None = None
        self.peers: dict[int, str] = {}
        self.address = ""
        #: Set by :meth:`close`: what operations still waiting raise.
        self.closed: ProcessGroupClosedError | None = None

    async def start(self, advertise: str = "") -> str:
        """Start the peer server; return the address to register at rendezvous.

        ``advertise`` overrides the address (for NAT or a hostname the others resolve).
        """
        s = self.settings
        if s.world_size == 1:
            return ""  # no other rank to talk to
        if (s.tls_ca or s.tls_cert) and not (s.tls_cert and s.tls_key):
            # TLS to the hub but no certificate to serve with: no plaintext fallback. The
            # empty address makes sends to this rank fail with a ConfigurationError.
            return ""
        port = await self.server.start()
        host = s.peer_host
        if host in _WILDCARDS:
            host = socket.gethostname()
        self.address = advertise or host_port(host, port)
        return self.address

    def bind(self, identity: Identity, peers: dict[int, str], session) -> None:
        self.identity, self.peers, self._session = identity, peers, session
        self.server.bind(identity)

    async def _link(self, dst: int) -> PeerLink:
        opening = self._links.get(dst)
        if opening is None:
            address = self.peers.get(dst, "")
            if not address:
                raise ConfigurationError(
                    f"rank {dst} registered no peer address, so rank {self.identity.rank} "
                    "cannot send to it: a rank configured for TLS needs tls_cert and tls_key "
                    "to serve peer streams")
            link = PeerLink(self.identity, dst, address, self.settings, self._metadata)
            opening = self._links[dst] = asyncio.ensure_future(self._open(link))
        return await asyncio.shield(opening)

    @staticmethod
    async def _open(link: PeerLink) -> PeerLink:
        try:
            await link.open()
        except BaseException as error:
            await link.close(error if isinstance(error, GradstarError) else
                             LinkLost(link.dst, f"opening the stream to rank {link.dst} failed"))
            raise
        return link

    async def send(self, arr: np.ndarray, array_kind: int, dst: int, tag: str,
                   timeout: float) -> None:
        """Send ``arr`` to ``dst``; completes once ``dst`` holds it. See the module docstring."""

        async def go():
            link = await self._link(dst)
            await link.send(arr, array_kind, tag)

        await self._guarded(go(), dst, timeout, lambda: CollectiveTimeoutError(
            f"rank {self.identity.rank}'s send of tag {tag} to rank {dst} was not received "
            f"within {timeout:g} s", missing_ranks=[dst]))

    async def recv(self, src: int, tag: str, timeout: float) -> tuple[np.ndarray, int]:
        """The next message from ``src`` with ``tag``: (array, ArrayKind)."""
        mailbox = self.server.mailboxes[src]
        found, value = mailbox.try_take(tag)
        if found:  # already complete: no other rank is needed, even if the generation failed
            return value
        if self._session.failure is not None:
            raise self._session.failure

        def timed_out():
            stalled = (f"; its stream is stalled on tag {mailbox.stalled_on} because this "
                       f"rank's buffer for it is full (tags held: {mailbox.held_tags()[:8]})"
                       if mailbox.stalled_on is not None else "")
            return CollectiveTimeoutError(
                f"rank {self.identity.rank} received no message with tag {tag} from rank "
                f"{src} within {timeout:g} s{stalled}", missing_ranks=[src])

        return await self._guarded(mailbox.take(tag), src, timeout, timed_out)

    async def _guarded(self, coro, peer: int, timeout: float, timeout_error):
        """Run ``coro`` until it ends, the generation fails or ``timeout`` passes.

        A lost link waits up to :data:`LINK_GRACE` for the hub's verdict (which names the rank
        that died) and otherwise blames ``peer``.
        """
        work = asyncio.ensure_future(coro)
        verdict = asyncio.ensure_future(self._session.failure_within(timeout))
        try:
            await asyncio.wait((work, verdict), return_when=asyncio.FIRST_COMPLETED)
        finally:
            verdict.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if not work.cancelled() and work.exception() is None:
            return work.result()
        if work.cancelled():
            failure = self._session.failure
            raise failure if failure is not None else timeout_error()
        error = work.exception()
        if isinstance(error, LinkLost) and self.closed is not None:
            raise self.closed from None
        if isinstance(error, LinkLost):
            failure = await self._session.failure_within(LINK_GRACE)
            if failure is not None:
                raise failure from None
            raise RankLostError(
                f"{error} and the coordinator reported no failure within {LINK_GRACE:g} s: "
                f"rank {error.peer} is treated as lost by rank {self.identity.rank}",
                rank=error.peer, generation=self.identity.generation) from None
        raise error

    async def close(self) -> None:
        """Say goodbye on every link and stop the peer server. Idempotent."""
        rank = self.identity.rank if self.identity is not None else "?"
        self.closed = ProcessGroupClosedError(f"rank {rank}'s process group was closed")
        links = list(self._links.values())
        self._links.clear()

        async def close_link(opening: asyncio.Future) -> None:
            opening.cancel()  # only if still opening; an open link says goodbye
            with contextlib.suppress(Exception, asyncio.CancelledError):
                link = await opening
                await link.close(self.closed)

        await asyncio.gather(*(close_link(opening) for opening in links))
        await self.server.stop(self.closed)

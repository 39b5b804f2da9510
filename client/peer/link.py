"""The sending side of one peer stream (the protocol is in :mod:`gradstar.client.peer`)."""


from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import grpc
import numpy as np

from gradstar.config import ClientSettings
from gradstar.errors import (
    AuthenticationError,
    ConfigurationError,
    GradstarError,
    ProtocolError,
)
from gradstar.proto.v1 import peer_pb2 as ppb
from gradstar.transport.channels import client_credentials
from gradstar.transport.channels import secure_or_insecure_channel as open_channel
from gradstar.transport.tls_check import connect_or_diagnose
from gradstar.wire import (
    KIND_ACCEPT,
    KIND_ERROR,
    KIND_HEADER,
    PEER_METHOD,
    ChunkLayout,
    aligned_chunk_bytes,
    as_byte_view,
    decode_error,
    decode_message,
    dtype_info,
    encode_message,
    end_frame,
    frame_kind,
    iter_chunk_frames,
)

from .. import session
from .proof import sign
from .server import Identity, LinkLost


def _rpc_detail(error: grpc.RpcError) -> str:
    try:
        return f"{error.code().name}: {error.details()}"
    except Exception:  # a locally failed call may carry neither
        return type(error).__name__


class PeerLink:
    """The sending side of this rank's stream to rank ``dst``.

    Messages are written one at a time in call order; acknowledgements come back in the same
    order. Once the stream fails every pending and later send raises the same error.
    """

    def __init__(self, identity: Identity, dst: int, address: str, settings: ClientSettings,
                 metadata, method: str = PEER_METHOD, authority: str = "") -> None:
        """A link to ``dst``'s peer server at ``address``; with ``method`` RELAY_METHOD,
        ``address`` is the coordinator's relay (:mod:`.relay`); with ``authority``, a local
        route punched through to ``dst``'s server there (NAT traversal)."""
        self.identity = identity
        self._method = method
        self.dst = dst
        self.address = address
        self.settings = settings
        tls = settings.tls_ca or settings.tls_cert
        creds = (client_credentials(settings.tls_ca, settings.tls_cert, settings.tls_key)
                 if tls else None)
        self._channel = open_channel(address, creds, bulk=True, authority=authority)
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
            AuthenticationError: the peer server refused the token or this rank's proof of
                being who it is.
            ConfigurationError: TLS settings keep the link from connecting (a certificate from
                another CA or for another name, a missing client certificate, TLS on one side
                only), named within a second or two instead of after ``connect_timeout``.
            LinkLost: the peer could not be reached within ``connect_timeout``.
            GradstarError: the receiver refused the hello (its ERROR frame).
        """
        me, s = self.identity, self.settings
        timeout = s.connect_timeout
        server = f"rank {self.dst}'s peer server at {self.address}"
        try:
            problem = await connect_or_diagnose(self._channel, self.address, timeout,
                                                s.tls_ca, s.tls_cert, s.tls_key)
        except TimeoutError:
            raise LinkLost(self.dst, f"rank {me.rank} could not reach {server} within "
                                     f"{timeout:g} s") from None
        if problem is not None:
            # Not LinkLost: the peer is alive and retrying cannot help, so it must not be
            # reported as a lost rank.
            raise ConfigurationError(f"rank {me.rank} could not connect to {server}: {problem}")
        self._call = self._channel.stream_stream(self._method)(metadata=self._metadata)
        try:
            await self._call.write(encode_message(KIND_HEADER, sign(
                me.key_for(self.dst), ppb.PeerHello(job=me.job, generation=me.generation,
                                                    src_rank=me.rank, dst_rank=self.dst))))
            first = await asyncio.wait_for(self._call.read(), timeout + session.VERDICT_GRACE)
            if first is grpc.aio.EOF:
                raise LinkLost(self.dst, f"rank {self.dst} closed the peer stream at once")
            if frame_kind(first) == KIND_ERROR:
                raise decode_error(first)
            decode_message(first, KIND_ACCEPT, ppb.PeerAccept)
        except grpc.RpcError as error:
            raise self._translate(error) from None
        except TimeoutError:
            raise LinkLost(self.dst, f"rank {self.dst} did not accept a peer stream within "
                                     f"{timeout + session.VERDICT_GRACE:g} s") from None
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
                for frame in iter_chunk_frames(data, layout):
                    await self._call.write(frame)
                await self._call.write(end_frame(layout.count, arr.nbytes))
            except asyncio.CancelledError:
                self._fail(LinkLost(self.dst, f"a send to rank {self.dst} was abandoned "
                                              "mid-message, which ends the stream"))
                raise
            except Exception as error:  # the call ended under us: grpc raises several types
                self._fail(self._translate(error) if isinstance(error, grpc.RpcError) else
                           LinkLost(self.dst, f"writing to rank {self.dst}'s peer stream "
                                              f"failed ({type(error).__name__})"))
        await acked

    async def close(self, error: GradstarError, say_goodbye: bool = True) -> None:
        """End the stream with a goodbye, so the receiver can tell it from a broken one; sends
        still waiting raise ``error``. ``say_goodbye=False``: end it without one (this rank did not
        finish: its generation failed), so the receiver waits for the hub's verdict."""
        if say_goodbye and self.error is None and self._call is not None:
            async def goodbye():
                async with self._write_lock:
                    await self._call.write(end_frame(0, 0))
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


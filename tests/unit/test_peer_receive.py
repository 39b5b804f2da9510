"""The receiving side of a peer stream, frame by frame (no sockets): a stream that ends in the
middle of a message (its sender died: a cancelled call reads as EOF) is a lost link, which the
endpoint resolves into the hub's verdict on the sender, not a protocol error."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from gradstar.client.peer.mailbox import Mailbox, tag_key
from gradstar.client.peer.server import LinkLost, PeerServer
from gradstar.errors import ProtocolError
from gradstar.proto.v1 import collective_pb2 as cpb
from gradstar.proto.v1 import peer_pb2 as ppb
from gradstar.wire import (
    KIND_END,
    KIND_HEADER,
    ChunkLayout,
    dtype_info,
    encode_message,
    iter_chunk_frames,
)

TAG = tag_key(0)


class _Context:
    """What the peer server reads: ``frames`` in order, then EOF; what it writes, kept."""

    def __init__(self, frames):
        self.frames = list(frames)
        self.written = []

    async def read(self):
        return self.frames.pop(0) if self.frames else grpc.aio.EOF

    async def write(self, message):
        self.written.append(message)


def _message(seq: int, arr: np.ndarray, chunk_bytes: int) -> list[bytes]:
    header = ppb.PeerMessageHeader(seq=seq, tag=TAG, dtype=dtype_info(arr.dtype).wire,
                                   shape=arr.shape, chunk_bytes=chunk_bytes)
    layout = ChunkLayout(1, arr.nbytes, chunk_bytes)
    chunks = list(iter_chunk_frames(memoryview(arr).cast("B"), layout))
    end = encode_message(KIND_END, cpb.CollectiveEnd(chunks=len(chunks), bytes=arr.nbytes))
    return [encode_message(KIND_HEADER, header), *chunks, end]


def _receive(frames, mailbox: Mailbox):
    return asyncio.run(PeerServer._receive(_Context(frames), mailbox, 1, asyncio.Lock()))


def test_a_stream_ending_mid_message_is_a_lost_link_and_delivers_nothing():
    first = np.arange(16, dtype=np.float32)
    second = np.arange(1024, dtype=np.float32)
    cut = _message(2, second, 1024)[:2]  # its header and the first of its four chunks
    mailbox = Mailbox(1, max_messages=4, max_bytes=1 << 20)
    assert _receive(_message(1, first, 1024) + cut, mailbox) is False
    found, (value, _) = mailbox.try_take(TAG)
    assert found
    np.testing.assert_array_equal(value, first)  # the whole message before the cut arrived
    assert mailbox.try_take(TAG)[0] is False  # the cut one did not, not even in part


def test_a_receive_waiting_for_a_cut_message_fails_with_the_lost_link():
    async def run():
        mailbox = Mailbox(1, max_messages=4, max_bytes=1 << 20)
        waiting = asyncio.ensure_future(mailbox.take(TAG, into=np.zeros(1024, np.float32)))
        await asyncio.sleep(0)
        frames = _message(1, np.ones(1024, dtype=np.float32), 1024)[:3]
        ended_cleanly = await PeerServer._receive(_Context(frames), mailbox, 1, asyncio.Lock())
        assert ended_cleanly is False
        # What PeerServer.Stream does with a stream that ended without a goodbye:
        mailbox.close(LinkLost(1, "rank 1's peer stream to rank 0 broke"))
        with pytest.raises(LinkLost):
            await asyncio.wait_for(waiting, 5)

    asyncio.run(run())


def test_a_bad_frame_mid_message_is_still_a_protocol_error():
    frames = _message(1, np.ones(1024, dtype=np.float32), 1024)
    frames[2] = frames[0]  # a header where a chunk must come
    with pytest.raises(ProtocolError, match="unexpected frame"):
        _receive(frames, Mailbox(1, max_messages=4, max_bytes=1 << 20))

"""Frames: the messages of a collective or peer stream, and the method paths they travel on.

A collective stream is a sequence of raw frames (identity serializers, no protobuf around the
payload). The first byte of every frame is its kind:

- ``HEADER`` / ``ACCEPT`` / ``END`` / ``ERROR``: the kind byte followed by a serialized protobuf
  message (``CollectiveHeader``, ``CollectiveAccept``, ``CollectiveEnd``, ``CollectiveFailure``).
- ``CHUNK``: the kind byte, three zero bytes, then little-endian ``u32 index``, ``u32 length``,
  ``u32 crc32`` of the payload, then ``length`` raw little-endian tensor bytes.
- ``SHM_ATTACH`` (a ``ShmAttach`` message) and ``SHM_CHUNK`` (kind byte, three zero bytes,
  ``u32 index``): the same-host fast path, where a chunk's payload is in a shared-memory segment
  (:mod:`gradstar.transport.shm`) instead of in the frame.
- ``BATCH``: several small frames in one message, each after its ``u32`` length: control
  frames, chunk frames of at most :data:`MAX_BATCHED_CHUNK_BYTES` payload bytes, and a
  ``HEADER`` as the first frame only (a small collective's whole input in one message).

Any frame that is short, long, corrupt or of the wrong kind raises
:class:`~gradstar.errors.ProtocolError`.
"""

from __future__ import annotations

import ctypes
import functools
import json
import struct
from collections.abc import Sequence

import numpy as np

from gradstar.errors import GradstarError, InvalidCollectiveError, ProtocolError, error_from_wire
from gradstar.proto.v1 import collective_pb2 as pb

try:
    # ISA-L's CRC-32 is the same checksum as zlib's, many times faster (the figures:
    # docs/performance.md, "Figures behind the code").
    from isal.isal_zlib import crc32
except ImportError:  # platforms without an isal wheel: same values, slower
    from zlib import crc32

# Raw-frame streams are registered with identity serializers under these names (the services
# are declared in collective.proto and peer.proto for reflection and documentation).
COLLECTIVE_SERVICE = "gradstar.proto.v1.Collective"
COLLECTIVE_METHOD = f"/{COLLECTIVE_SERVICE}/Stream"
PEER_SERVICE = "gradstar.proto.v1.PeerStream"
PEER_METHOD = f"/{PEER_SERVICE}/Stream"
#: The coordinator's relay of peer streams to ranks that take no inbound connections
#: (``gradstar.coordinator.rendezvous.relay``): the same frames, carried over connections
#: both ranks dial.
RELAY_SERVICE = "gradstar.proto.v1.PeerRelay"
RELAY_METHOD = f"/{RELAY_SERVICE}/Relay"
#: NAT traversal to a hub shard (gradstar.transport.traversal): unary, the caller's port.
PUNCH_METHOD = f"/{RELAY_SERVICE}/Punch"

KIND_HEADER = 1
KIND_ACCEPT = 2
KIND_CHUNK = 3
KIND_END = 4
KIND_ERROR = 5
#: Shared-memory fast path (:mod:`gradstar.transport.shm`): the hub's attach verdict, and a
#: chunk whose payload is in the rank's segment rather than in the frame.
KIND_SHM_ATTACH = 6
KIND_SHM_CHUNK = 7
#: Several small frames in one message (:func:`encode_batch`): each gRPC message costs both
#: ends far more CPU than its bytes (on the shared-memory path, and for small tensors, a
#: collective is mostly messages), so frames that are ready together travel together. Holds
#: control frames and small chunk frames (:func:`batchable`), and a header only as its first
#: frame; never an error or another batch.
KIND_BATCH = 8
_BATCHABLE = frozenset((KIND_ACCEPT, KIND_END, KIND_SHM_ATTACH, KIND_SHM_CHUNK))

_HEADER_KIND = bytes((KIND_HEADER,))
_CHUNK_HEADER = struct.Struct("<B3xIII")
CHUNK_HEADER_BYTES = _CHUNK_HEADER.size
#: Frame of a chunk whose payload is in a shared-memory segment: kind, pad, chunk index.
_SHM_CHUNK = struct.Struct("<B3xI")
#: Length prefix of each frame in a batch.
_BATCH_ITEM = struct.Struct("<I")
#: Most frames one batch holds (a sender packs fewer; a receiver refuses more).
MAX_BATCH_FRAMES = 256
#: Largest chunk payload that may travel in a batch. Joining a chunk into a batch copies it
#: once more, which costs less than the gRPC message it saves up to a few hundred KiB
#: (docs/performance.md, "Figures behind the code"); 64 KiB keeps the copy well under the
#: message.
MAX_BATCHED_CHUNK_BYTES = 64 << 10
#: Most bytes a sender joins into one batch (a receiver is bounded by gRPC's message limit).
MAX_BATCH_BYTES = 256 << 10
#: Largest header frame accepted: a header is small, so anything larger is refused unparsed.
MAX_HEADER_BYTES = 64 << 10


def check_header_size(frame: bytes, who: str) -> None:
    """Refuse a header frame over :data:`MAX_HEADER_BYTES` before parsing it.

    Raises:
        InvalidCollectiveError: the frame is too large to be a header.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise InvalidCollectiveError(
            f"{who} sent a header of {len(frame)} bytes; headers are at most "
            f"{MAX_HEADER_BYTES} bytes")


def encode_message(kind: int, message) -> bytes:
    """A control frame: the kind byte and a serialized protobuf message."""
    return bytes((kind,)) + message.SerializeToString()


def decode_message(frame: bytes, kind: int, message_type):
    """Parse a control frame of the expected ``kind``; raises ProtocolError otherwise."""
    if not frame or frame[0] != kind:
        got = frame[0] if frame else "empty"
        raise ProtocolError(f"expected a frame of kind {kind}, got {got}")
    message = message_type()
    try:
        message.ParseFromString(memoryview(frame)[1:])
    except Exception as exc:  # protobuf raises DecodeError or RuntimeWarning-derived errors
        raise ProtocolError(f"corrupt {message_type.__name__} frame: {exc}") from None
    return message


# The control frames of a collective are the same few bytes step after step (an accept of one
# chunk, an end marker of one chunk of 100 bytes): each is encoded once and shared (an immutable
# bytes object), and decoded once and shared (:func:`decode_shared`: read, never changed): a
# tiny collective would encode and decode six of them on the hub and two on each rank.
# 256 distinct ones each, the oldest forgotten.

@functools.lru_cache(maxsize=256)
def accept_frame(output_chunks: int) -> bytes:
    """The ``ACCEPT`` frame announcing ``output_chunks`` result chunks."""
    return encode_message(KIND_ACCEPT, pb.CollectiveAccept(output_chunks=output_chunks))


def end_frame(chunks: int, nbytes: int, late: Sequence[pb.LateRank] = ()) -> bytes:
    """The ``END`` frame of a stream of ``chunks`` chunks of ``nbytes`` payload bytes in all
    (a hub's names the ranks its collective waited for, ``late``)."""
    if late:
        return encode_message(KIND_END, pb.CollectiveEnd(chunks=chunks, bytes=nbytes, late=late))
    return _end_frame(chunks, nbytes)


@functools.lru_cache(maxsize=256)
def _end_frame(chunks: int, nbytes: int) -> bytes:
    return encode_message(KIND_END, pb.CollectiveEnd(chunks=chunks, bytes=nbytes))


def decode_shared(frame: bytes, kind: int, message_type):
    """:func:`decode_message` for the small control frames that repeat (accept, end marker):
    the message is shared by every equal frame, so read it, never change it. A refused frame
    is not kept (it raises each time)."""
    if len(frame) > _SHARED_FRAME_BYTES:
        return decode_message(frame, kind, message_type)
    return _decode_shared(frame, kind, message_type)


# Counts alone are a few bytes; an end marker naming several late ranks is decoded each time.
_SHARED_FRAME_BYTES = 32


@functools.lru_cache(maxsize=256)
def _decode_shared(frame: bytes, kind: int, message_type):
    return decode_message(frame, kind, message_type)


def encode_error(error: GradstarError) -> bytes:
    """An ERROR frame carrying ``error`` so the client can raise the same exception."""
    return encode_message(KIND_ERROR, pb.CollectiveFailure(
        error=type(error).__name__, fields_json=json.dumps(error.fields()), message=str(error)))


def decode_error(frame: bytes) -> GradstarError:
    """The exception an ERROR frame describes."""
    failure = decode_message(frame, KIND_ERROR, pb.CollectiveFailure)
    return error_from_wire(failure.error, failure.fields_json, failure.message)


def frame_kind(frame: bytes) -> int:
    if not frame:
        raise ProtocolError("empty frame")
    return frame[0]


def batchable(frame) -> bool:
    """Whether ``frame`` may travel in a batch: a small control frame (accept, end marker,
    shared-memory attach verdict or chunk announcement) or a chunk frame of at most
    :data:`MAX_BATCHED_CHUNK_BYTES` payload bytes. (A header may too, as a batch's first
    frame.)"""
    if not isinstance(frame, bytes) or not frame:
        return False
    if frame[0] == KIND_CHUNK:
        return len(frame) <= CHUNK_HEADER_BYTES + MAX_BATCHED_CHUNK_BYTES
    return frame[0] in _BATCHABLE


def encode_batch(frames: Sequence[bytes]) -> bytes:
    """One message carrying ``frames`` in order: each :func:`batchable`, the first may be a
    header."""
    parts = [bytes((KIND_BATCH,))]
    for frame in frames:
        parts += (_BATCH_ITEM.pack(len(frame)), frame)
    return b"".join(parts)


def frames_of(message: bytes) -> list[bytes]:
    """The frames a message carries: itself, or a batch's frames in order. Where each frame
    may come (a header first of all, chunks after an accept, ...) is the receiver's state
    machine's to check, as for frames that come alone.

    Raises:
        ProtocolError: a malformed batch (truncated, empty, too many frames, or holding a frame
            that may not travel in one, or a header anywhere but first).
    """
    if not message or message[0] != KIND_BATCH:
        return [message]
    frames, pos, end = [], 1, len(message)
    while pos < end:
        if pos + _BATCH_ITEM.size > end or len(frames) == MAX_BATCH_FRAMES:
            raise ProtocolError(f"malformed batch of {end} bytes")
        (length,) = _BATCH_ITEM.unpack_from(message, pos)
        pos += _BATCH_ITEM.size
        frame = message[pos:pos + length]
        pos += length
        if pos > end or not (batchable(frame) or (
                not frames and frame[:1] == _HEADER_KIND and len(frame) <= MAX_HEADER_BYTES)):
            raise ProtocolError(f"malformed batch of {end} bytes")
        frames.append(frame)
    if not frames:
        raise ProtocolError("empty batch")
    return frames


def encode_chunk(index: int, payload) -> bytes:
    """A chunk frame around ``payload`` (an array or buffer); the one copy every send costs."""
    if isinstance(payload, np.ndarray):
        # memoryview cannot describe ml_dtypes' bfloat16; a uint8 view of the same bytes can.
        payload = payload.reshape(-1).view(np.uint8)
    view = memoryview(payload).cast("B")
    header = _CHUNK_HEADER.pack(KIND_CHUNK, index, view.nbytes, crc32(view))
    return b"".join((header, view))


# A bytes object is immutable once shared, but CPython builds one by allocating it uninitialised
# and filling it (PyBytes_FromStringAndSize(NULL, n)). The hub does the same for reduced chunks,
# so the reduction writes straight into the frame gRPC sends instead of into a buffer that
# encode_chunk would then copy. Frames are never shorter than the header, so never the shared
# empty or one-byte objects.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype = ctypes.c_void_p
_bytes_data.argtypes = (ctypes.py_object,)


def chunk_frame_buffer(length: int) -> tuple[bytes, memoryview]:
    """A new, unshared chunk frame of ``length`` payload bytes and a writable view of all of it.

    Fill ``view[CHUNK_HEADER_BYTES:]``, call :func:`seal_chunk_frame`, and only then hand the
    bytes object to anyone else.
    """
    frame = _new_bytes(None, CHUNK_HEADER_BYTES + length)
    raw = (ctypes.c_char * len(frame)).from_address(_bytes_data(frame))
    return frame, memoryview(raw).cast("B")


def seal_chunk_frame(frame: bytes, view: memoryview, index: int) -> bytes:
    """Write the header (index, length, checksum) of a frame filled through ``view``."""
    payload = view[CHUNK_HEADER_BYTES:]
    _CHUNK_HEADER.pack_into(view, 0, KIND_CHUNK, index, payload.nbytes, crc32(payload))
    return frame


def encode_shm_chunk(index: int) -> bytes:
    """The frame announcing that chunk ``index`` is in place in a shared-memory segment
    (:mod:`gradstar.transport.shm`) rather than in the frame."""
    return _SHM_CHUNK.pack(KIND_SHM_CHUNK, index)


def decode_shm_chunk(frame: bytes) -> int:
    """The chunk index of a frame from :func:`encode_shm_chunk`."""
    if len(frame) != _SHM_CHUNK.size:
        raise ProtocolError(f"shared-memory chunk frame of {len(frame)} bytes, expected "
                            f"{_SHM_CHUNK.size}")
    return _SHM_CHUNK.unpack(frame)[1]


def decode_chunk(frame: bytes) -> tuple[int, memoryview]:
    """(index, payload view) of a chunk frame whose length and checksum are verified."""
    if len(frame) < CHUNK_HEADER_BYTES:
        raise ProtocolError(f"chunk frame of {len(frame)} bytes is shorter than its header")
    kind, index, length, crc = _CHUNK_HEADER.unpack_from(frame)
    if kind != KIND_CHUNK:
        raise ProtocolError(f"expected a chunk frame, got kind {kind}")
    payload = memoryview(frame)[CHUNK_HEADER_BYTES:]
    if payload.nbytes != length:
        raise ProtocolError(
            f"chunk {index} declares {length} payload bytes but carries {payload.nbytes}"
        )
    if crc32(payload) != crc:
        raise ProtocolError(f"chunk {index} failed its checksum")
    return index, payload



__all__ = [
    "CHUNK_HEADER_BYTES", "COLLECTIVE_METHOD", "COLLECTIVE_SERVICE", "KIND_ACCEPT", "KIND_BATCH",
    "KIND_CHUNK", "KIND_END", "KIND_ERROR", "KIND_HEADER", "KIND_SHM_ATTACH", "KIND_SHM_CHUNK",
    "MAX_BATCHED_CHUNK_BYTES", "MAX_BATCH_BYTES", "MAX_BATCH_FRAMES", "MAX_HEADER_BYTES",
    "PEER_METHOD", "PEER_SERVICE", "PUNCH_METHOD", "RELAY_METHOD", "RELAY_SERVICE",
    "accept_frame", "batchable", "check_header_size",
    "chunk_frame_buffer", "decode_chunk", "decode_error", "decode_message", "decode_shared",
    "decode_shm_chunk", "encode_batch", "encode_chunk", "encode_error", "encode_message",
    "encode_shm_chunk", "end_frame", "frame_kind", "frames_of", "seal_chunk_frame",
]

"""The frame codec of collective streams: dtypes, chunk layouts and frames.

A collective stream is a sequence of raw frames (identity serializers, no protobuf around the
payload). The first byte of every frame is its kind:

- ``HEADER`` / ``ACCEPT`` / ``END`` / ``ERROR``: the kind byte followed by a serialized protobuf
  message (``CollectiveHeader``, ``CollectiveAccept``, ``CollectiveEnd``, ``CollectiveFailure``).
- ``CHUNK``: the kind byte, three zero bytes, then little-endian ``u32 index``, ``u32 length``,
  ``u32 crc32`` of the payload, then ``length`` raw little-endian tensor bytes.
- ``SHM_ATTACH`` (a ``ShmAttach`` message) and ``SHM_CHUNK`` (kind byte, three zero bytes,
  ``u32 index``): the same-host fast path, where a chunk's payload is in a shared-memory segment
  (:mod:`gradstar.transport.shm`) instead of in the frame.

A tensor is cut by a :class:`ChunkLayout` into segments (one per shard or per rank) and each
segment into chunks of at most ``chunk_bytes``. Both sides compute the layout from the header,
so a chunk's index alone determines where its bytes belong, and a receiver can prove it got every
chunk exactly once before it uses the result. Any frame that is short, long, out of range,
repeated or fails its checksum raises :class:`~gradstar.errors.ProtocolError`.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from gradstar.errors import (
    ConfigurationError,
    GradstarError,
    InvalidCollectiveError,
    ProtocolError,
    error_from_wire,
)
from gradstar.proto.v1 import collective_pb2 as pb

try:
    # ISA-L's CRC-32 is the same checksum as zlib's at ~13x the speed (56 vs 4 GB/s measured
    # here); at 4 GB/s the checksums were a quarter of the hub's CPU time.
    from isal.isal_zlib import crc32
except ImportError:  # platforms without an isal wheel: same values, slower
    from zlib import crc32

# Raw-frame streams are registered with identity serializers under these names (the services
# are declared in collective.proto and peer.proto for reflection and documentation).
COLLECTIVE_SERVICE = "gradstar.proto.v1.Collective"
COLLECTIVE_METHOD = f"/{COLLECTIVE_SERVICE}/Stream"
PEER_SERVICE = "gradstar.proto.v1.PeerStream"
PEER_METHOD = f"/{PEER_SERVICE}/Stream"

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
#: ends far more CPU than its bytes (on the shared-memory path a collective is mostly messages),
#: so frames that are ready together travel together. Never holds a header, a chunk with its
#: payload, an error or another batch.
KIND_BATCH = 8
_BATCHABLE = frozenset((KIND_ACCEPT, KIND_END, KIND_SHM_ATTACH, KIND_SHM_CHUNK))

_CHUNK_HEADER = struct.Struct("<B3xIII")
CHUNK_HEADER_BYTES = _CHUNK_HEADER.size
#: Frame of a chunk whose payload is in a shared-memory segment: kind, pad, chunk index.
_SHM_CHUNK = struct.Struct("<B3xI")
#: Length prefix of each frame in a batch.
_BATCH_ITEM = struct.Struct("<I")
#: Most frames one batch holds (a sender packs fewer; a receiver refuses more).
MAX_BATCH_FRAMES = 256

DEFAULT_CHUNK_BYTES = 2 << 20
MAX_CHUNK_BYTES = 16 << 20
# Bounds checked before anything is sized or iterated from a header: a header is small, a tensor
# has at most as many dimensions as torch allows, and the chunk count (one tracker byte each)
# stays bounded however small a chunk a sender asks for.
MAX_HEADER_BYTES = 64 << 10
MAX_NDIM = 64
MAX_CHUNKS = 1 << 20


@dataclass(frozen=True)
class DTypeInfo:
    """One supported dtype: its name, wire enum, numpy dtype and the dtype the hub reduces in."""

    name: str
    wire: int
    numpy: np.dtype
    accumulate: np.dtype


_DTYPES = [
    DTypeInfo("float32", pb.DTYPE_FLOAT32, np.dtype(np.float32), np.dtype(np.float32)),
    DTypeInfo("float64", pb.DTYPE_FLOAT64, np.dtype(np.float64), np.dtype(np.float64)),
    # Half precision is reduced in float32 so sums over many ranks do not lose precision.
    DTypeInfo("float16", pb.DTYPE_FLOAT16, np.dtype(np.float16), np.dtype(np.float32)),
    DTypeInfo("bfloat16", pb.DTYPE_BFLOAT16, np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)),
    DTypeInfo("int32", pb.DTYPE_INT32, np.dtype(np.int32), np.dtype(np.int32)),
    DTypeInfo("int64", pb.DTYPE_INT64, np.dtype(np.int64), np.dtype(np.int64)),
]
_BY_NUMPY = {d.numpy: d for d in _DTYPES}
_BY_WIRE = {d.wire: d for d in _DTYPES}
SUPPORTED_DTYPES = tuple(d.name for d in _DTYPES)


def check_shape(shape, who: str) -> tuple[int, ...]:
    """``shape`` as a tuple, refused before any arithmetic on it if it has over
    :data:`MAX_NDIM` dimensions.

    Raises:
        InvalidCollectiveError: too many dimensions.
    """
    if len(shape) > MAX_NDIM:
        raise InvalidCollectiveError(
            f"{who} sent a shape of {len(shape)} dimensions; at most {MAX_NDIM} are supported")
    return tuple(shape)


def payload_bytes(shape, dtype_wire: int) -> int:
    """Bytes of a tensor of ``shape`` in wire dtype ``dtype_wire``; check the shape with
    :func:`check_shape` first where it comes from outside.

    Raises:
        ProtocolError: unknown dtype.
    """
    return math.prod(shape) * dtype_from_wire(dtype_wire).numpy.itemsize


def check_chunk_count(count: int, nbytes: int, chunk_bytes: int, who: str) -> None:
    """Refuse a layout of over :data:`MAX_CHUNKS` chunks before anything is sized from it.

    Raises:
        InvalidCollectiveError: naming the smallest chunk size that would do.
    """
    if count > MAX_CHUNKS:
        least = -(-nbytes // MAX_CHUNKS)
        raise InvalidCollectiveError(
            f"{who}: chunk_bytes {chunk_bytes} cuts {nbytes} bytes into {count} chunks, over "
            f"the limit of {MAX_CHUNKS}; use chunk_bytes of at least {least}")


def check_header_size(frame: bytes, who: str) -> None:
    """Refuse a header frame over :data:`MAX_HEADER_BYTES` before parsing it.

    Raises:
        InvalidCollectiveError: the frame is too large to be a header.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise InvalidCollectiveError(
            f"{who} sent a header of {len(frame)} bytes; headers are at most "
            f"{MAX_HEADER_BYTES} bytes")


def dtype_info(dtype: np.dtype) -> DTypeInfo:
    """The :class:`DTypeInfo` of a numpy dtype; raises ConfigurationError if unsupported."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"dtype {dtype} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def dtype_from_wire(wire: int) -> DTypeInfo:
    """The :class:`DTypeInfo` of a wire enum value; raises ProtocolError if unknown."""
    try:
        return _BY_WIRE[wire]
    except KeyError:
        raise ProtocolError(f"unknown dtype {wire} in collective header") from None


def aligned_chunk_bytes(chunk_bytes: int, itemsize: int) -> int:
    """``chunk_bytes`` rounded down to whole elements, so every chunk reduces elementwise."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ConfigurationError(
            f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}"
        )
    return max(itemsize, chunk_bytes - chunk_bytes % itemsize)


@dataclass(frozen=True)
class ChunkLayout:
    """``segments`` equal segments of ``segment_bytes``, each cut into chunks of ``chunk_bytes``.

    Chunk ``i`` is chunk ``i % per_segment`` of segment ``i // per_segment``; the last chunk of
    each segment may be shorter. A zero-byte segment has no chunks.
    """

    segments: int
    segment_bytes: int
    chunk_bytes: int

    @property
    def per_segment(self) -> int:
        return -(-self.segment_bytes // self.chunk_bytes)

    @property
    def count(self) -> int:
        return self.segments * self.per_segment

    @property
    def total_bytes(self) -> int:
        return self.segments * self.segment_bytes

    def span(self, index: int) -> tuple[int, int]:
        """(byte offset, byte length) of chunk ``index`` within the whole buffer."""
        if not 0 <= index < self.count:
            raise ProtocolError(f"chunk index {index} is out of range 0..{self.count - 1}")
        segment, i = divmod(index, self.per_segment)
        start = i * self.chunk_bytes
        length = min(self.chunk_bytes, self.segment_bytes - start)
        return segment * self.segment_bytes + start, length

    def segment_of(self, index: int) -> int:
        return index // self.per_segment


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
    shared-memory attach verdict or chunk announcement)."""
    return isinstance(frame, bytes) and bool(frame) and frame[0] in _BATCHABLE


def encode_batch(frames: Sequence[bytes]) -> bytes:
    """One message carrying ``frames`` (each :func:`batchable`) in order."""
    parts = [bytes((KIND_BATCH,))]
    for frame in frames:
        parts += (_BATCH_ITEM.pack(len(frame)), frame)
    return b"".join(parts)


def frames_of(message: bytes) -> list[bytes]:
    """The frames a message carries: itself, or a batch's frames in order.

    Raises:
        ProtocolError: a malformed batch (truncated, empty, too many frames, or holding a frame
            that may not travel in one).
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
        if pos > end or not batchable(frame):
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


class ChunkTracker:
    """Checks that chunks of a layout arrive once each, with the right lengths, and all of them.

    ``allowed`` (a set of indices) narrows what may arrive, as when a stream carries one stripe
    of a layout or a rank must not get its own segment back.
    """

    def __init__(self, layout: ChunkLayout, who: str = "stream",
                 allowed: frozenset[int] | set[int] | None = None) -> None:
        self.layout = layout
        self.who = who
        self.allowed = allowed
        self._seen = bytearray(layout.count)
        self.received = 0
        self.bytes = 0

    @property
    def expected(self) -> int:
        """How many chunks complete the stream."""
        return self.layout.count if self.allowed is None else len(self.allowed)

    def admit(self, index: int, payload: memoryview) -> int:
        """Record chunk ``index``; return its byte offset. Raises ProtocolError if it is bad."""
        offset, length = self.layout.span(index)
        if self.allowed is not None and index not in self.allowed:
            raise ProtocolError(f"{self.who}: chunk {index} does not belong on this stream")
        if payload.nbytes != length:
            raise ProtocolError(
                f"{self.who}: chunk {index} has {payload.nbytes} bytes, expected {length}"
            )
        if self._seen[index]:
            raise ProtocolError(f"{self.who}: chunk {index} arrived twice")
        self._seen[index] = 1
        self.received += 1
        self.bytes += length
        return offset

    def finish(self, end: pb.CollectiveEnd, expected_chunks: int | None = None) -> None:
        """Check the end marker against what arrived; raises ProtocolError on any gap."""
        expected = self.expected if expected_chunks is None else expected_chunks
        if end.chunks != expected or self.received != expected:
            raise ProtocolError(
                f"{self.who}: stream ended after {self.received} of {expected} chunks "
                f"(end marker says {end.chunks})"
            )
        if end.bytes != self.bytes:
            raise ProtocolError(
                f"{self.who}: end marker says {end.bytes} bytes, received {self.bytes}"
            )


# The two helpers every chunk stream uses (hub, rank collectives, peer links): one cuts a buffer
# into frames, the other checks a frame and copies it into place.

def iter_chunk_frames(buffer: memoryview, layout: ChunkLayout, indices=None):
    """Frames for the chunks ``indices`` (default all) of ``buffer`` laid out by ``layout``;
    each costs the one copy a send needs (see :func:`encode_chunk`)."""
    for index in range(layout.count) if indices is None else indices:
        offset, length = layout.span(index)
        yield encode_chunk(index, buffer[offset:offset + length])


def receive_chunk(frame: bytes, tracker: ChunkTracker, out: memoryview) -> int:
    """Decode a chunk frame, admit it to ``tracker`` and copy its payload to its place in
    ``out`` (a byte view of the result laid out by ``tracker.layout``); return its index.

    Raises:
        ProtocolError: a corrupt, misplaced, repeated or wrongly sized chunk.
    """
    index, payload = decode_chunk(frame)
    place_chunk(index, payload, tracker, out)
    return index


def place_chunk(index: int, payload: memoryview, tracker: ChunkTracker,
                out: memoryview) -> None:
    """Admit chunk ``index`` to ``tracker`` and copy ``payload`` to its place in ``out``
    (from a frame, or from a shared-memory segment).

    Raises:
        ProtocolError: a misplaced, repeated or wrongly sized chunk.
    """
    offset = tracker.admit(index, payload)
    out[offset:offset + payload.nbytes] = payload


def as_byte_view(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    return memoryview(array.reshape(-1).view(np.uint8))

"""Chunks: how a tensor is cut into chunk frames and joined back, proven complete.

A tensor is cut by a :class:`ChunkLayout` into segments (one per shard or per rank) and each
segment into chunks of at most ``chunk_bytes``. Both sides compute the layout from the header,
so a chunk's index alone determines where its bytes belong, and a :class:`ChunkTracker` lets a
receiver prove it got every chunk exactly once before it uses the result. Every chunk stream
(hub, rank collectives, peer links) sends through :func:`iter_chunk_frames` and receives through
:func:`receive_chunk` (or :func:`place_chunk` for a payload in shared memory).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from gradstar.errors import ConfigurationError, InvalidCollectiveError, ProtocolError
from gradstar.proto.v1 import collective_pb2 as pb

from .frames import decode_chunk, encode_chunk

T = TypeVar("T")

DEFAULT_CHUNK_BYTES = 2 << 20
MAX_CHUNK_BYTES = 16 << 20
#: Most chunks a layout may have (its tracker keeps a bit per chunk), however small a chunk a
#: sender asks for; checked before anything is sized from a header.
MAX_CHUNKS = 1 << 20


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

    # Derived once per layout (cached in the instance: a tiny collective read them ~40 times).
    @functools.cached_property
    def per_segment(self) -> int:
        return -(-self.segment_bytes // self.chunk_bytes)

    @functools.cached_property
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


def tracker_bytes(chunks: int) -> int:
    """Bytes a :class:`ChunkTracker` keeps for a layout of ``chunks`` chunks (a bit each)."""
    return (chunks + 7) // 8


class ChunkTracker:
    """Checks that chunks of a layout arrive once each, with the right lengths, and all of them.

    ``allowed`` (any container of indices with a length) narrows what may arrive, as when a
    stream carries one stripe of a layout or a rank must not get its own segment back.

    Which chunks arrived is a bit per chunk of the layout (:func:`tracker_bytes`), allocated
    when the first chunk arrives: a header alone (all the hub holds of a collective that is
    not matched yet) costs none of it.
    """

    def __init__(self, layout: ChunkLayout, who: str = "stream", allowed=None) -> None:
        self.layout = layout
        self.who = who
        self.allowed = allowed
        self._seen: bytearray | None = None
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
        if self._seen is None:
            self._seen = bytearray(tracker_bytes(self.layout.count))
        byte, bit = index >> 3, 1 << (index & 7)
        if self._seen[byte] & bit:
            raise ProtocolError(f"{self.who}: chunk {index} arrived twice")
        self._seen[byte] |= bit
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


def split_parts(data: bytes | memoryview, part_bytes: int) -> Iterator[bytes]:
    """The data of a header-first protobuf stream (the Rounds and Steps services), cut into
    parts of at most ``part_bytes``, in order (none for empty data); the sender's half of
    :func:`take_part`."""
    for start in range(0, len(data), part_bytes):
        yield bytes(data[start:start + part_bytes])


def header_first(part: Callable[..., T], header: object, data: bytes | memoryview,
                 part_bytes: int) -> Iterator[T]:
    """The messages of a header-first protobuf stream: ``part(header=header, data=...)`` with
    the first part of ``data`` (empty if none), then ``part(data=...)`` for each other part
    (:func:`split_parts`): every such stream's sender (Steps, Rounds, both ways)."""
    pieces = split_parts(data, part_bytes)
    yield part(header=header, data=next(pieces, b""))
    for piece in pieces:
        yield part(data=piece)


def take_part(data: bytes, view: memoryview, filled: int, max_part: int, what: str) -> int:
    """Copy one data part of a header-first protobuf stream (the Rounds and Steps services)
    into ``view`` at ``filled``; the new fill. ``what`` names the stream ("a rounds").

    Raises:
        ProtocolError: the part is over ``max_part`` bytes, or past what the header announced.
    """
    n = len(data)
    if n > max_part:
        raise ProtocolError(f"{what} data part of {n} bytes is over the {max_part}-byte chunk "
                            "limit")
    if filled + n > len(view):
        raise ProtocolError(f"{what} stream sent more data than its header announced")
    view[filled:filled + n] = data
    return filled + n


def as_byte_view(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    if array.dtype.isbuiltin == 1 and array.flags.c_contiguous and array.size:
        # numpy's own dtypes export a buffer: cast it (a quarter of the time of the two views
        # below, which a tiny collective's rank paid three times per call).
        return memoryview(array).cast("B")
    # ml_dtypes' bfloat16 cannot describe itself in a buffer, nor can an empty array be cast;
    # a uint8 view of the bytes can.
    return memoryview(array.reshape(-1).view(np.uint8))


__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_CHUNKS", "MAX_CHUNK_BYTES", "ChunkLayout", "ChunkTracker",
           "aligned_chunk_bytes", "as_byte_view", "check_chunk_count", "header_first",
           "iter_chunk_frames",
           "place_chunk", "receive_chunk", "split_parts", "take_part", "tracker_bytes"]

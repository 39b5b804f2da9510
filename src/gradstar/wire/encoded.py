"""Chunk layouts of a collective whose payload travels in a wire format (:mod:`.formats`).

The layout of a collective is computed as always, in the tensor's own dtype (the *values
layout*); with a wire format, each chunk travels encoded on its own. Because a chunk holds whole
blocks (its element count a multiple of the format's block) the encoded chunks of a segment
have the sizes of a :class:`~gradstar.wire.ChunkLayout` themselves (the *wire layout*): equal
chunks, the last one shorter, the same count and the same indices. So trackers, stripes,
geometry and end markers work on the wire layout unchanged, and a buffer laid out by it (the
encoded chunks end to end) is what a rank sends from and receives into; :meth:`Encoding.encode`
and :meth:`Encoding.decode` convert between the two layouts chunk by chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gradstar.proto.v1 import collective_pb2 as pb

from .chunks import ChunkLayout
from .dtypes import dtype_from_wire
from .formats import WireFormat, decode_into, encode_into, format_from_wire
from .frames import CHUNK_HEADER_BYTES, chunk_frame_buffer, seal_chunk_frame

logger = logging.getLogger(__name__)

_F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class Encoding:
    """A wire format applied to a tensor whose elements are ``itemsize`` bytes (the values
    layout's unit)."""

    format: WireFormat
    itemsize: int

    @classmethod
    def of_header(cls, header: pb.CollectiveHeader) -> Encoding | None:
        """The encoding a header asks for (None: the tensor travels in its own dtype).

        Raises:
            ProtocolError: an unknown wire format or dtype.
        """
        fmt = format_from_wire(header.wire)
        if fmt is None:
            return None
        return cls(fmt, dtype_from_wire(header.dtype).numpy.itemsize)

    def layout(self, values: ChunkLayout) -> ChunkLayout:
        """The wire layout of ``values`` (see the module docstring)."""
        chunk = values.chunk_bytes // self.itemsize
        full, rest = divmod(values.segment_bytes // self.itemsize, chunk)
        size = self.format.encoded_nbytes
        return ChunkLayout(values.segments, full * size(chunk) + size(rest), size(chunk))

    def elements(self, values: ChunkLayout, index: int) -> tuple[int, int]:
        """(first element, element count) of chunk ``index`` of ``values``."""
        offset, length = values.span(index)
        return offset // self.itemsize, length // self.itemsize

    def encode(self, x: np.ndarray, values: ChunkLayout, indices: Iterable[int]) -> np.ndarray:
        """A buffer laid out by the wire layout holding chunks ``indices`` of ``x`` (cut by
        ``values``) encoded; other chunks' bytes are left unset."""
        wire = self.layout(values)
        flat = x.reshape(-1)
        buf = np.empty(wire.total_bytes, np.uint8)
        for index in indices:
            first, n = self.elements(values, index)
            offset, length = wire.span(index)
            encode_into(self.format, flat[first:first + n], buf[offset:offset + length])
        return buf

    def frames(self, x: np.ndarray, values: ChunkLayout, indices: Iterable[int]):
        """Chunk frames of chunks ``indices`` of ``x`` (cut by ``values``), each encoded
        straight into its frame when it is asked for: a rank's encoding overlaps its sending,
        and costs no copy besides the one every send costs."""
        wire = self.layout(values)
        flat = x.reshape(-1)
        for index in indices:
            first, n = self.elements(values, index)
            frame, view = chunk_frame_buffer(wire.span(index)[1])
            encode_into(self.format, flat[first:first + n], view[CHUNK_HEADER_BYTES:])
            yield seal_chunk_frame(frame, view, index)

    def decode(self, buf: np.ndarray, values: ChunkLayout, indices: Iterable[int],
               out: np.ndarray) -> None:
        """Decode chunks ``indices`` of ``buf`` (laid out by the wire layout of ``values``) into
        their places in ``out`` (a C-contiguous float array laid out by ``values``)."""
        wire = self.layout(values)
        flat = out.reshape(-1)
        staging = None if flat.dtype == _F32 else np.empty(values.chunk_bytes // self.itemsize,
                                                           _F32)
        for index in indices:
            first, n = self.elements(values, index)
            offset, length = wire.span(index)
            if staging is None:
                decode_into(self.format, buf[offset:offset + length], flat[first:first + n])
            else:  # float64 / half precision results: decoded in float32, then cast
                decode_into(self.format, buf[offset:offset + length], staging[:n])
                flat[first:first + n] = staging[:n]


def carries(dtype) -> bool:
    """Whether a wire format can carry tensors of ``dtype`` (the float dtypes gradstar
    supports: float32, float64, float16, bfloat16)."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"


def aligned_wire_chunk_bytes(chunk_bytes: int, itemsize: int, fmt: WireFormat | None) -> int:
    """``chunk_bytes`` rounded down to whole blocks of ``fmt`` (at least one), so no block
    straddles two chunks; unchanged without a format or for a cast."""
    if fmt is None or not fmt.block:
        return chunk_bytes
    unit = itemsize * fmt.block
    return max(unit, chunk_bytes - chunk_bytes % unit)


__all__ = ["Encoding", "aligned_wire_chunk_bytes", "carries"]

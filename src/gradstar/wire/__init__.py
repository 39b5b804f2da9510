"""The frame codec of collective streams: dtypes, chunk layouts and frames.

A collective stream is a sequence of raw frames (identity serializers, no protobuf around the
payload), each starting with its kind byte; a tensor travels as chunk frames cut by a layout
that both sides compute from the stream's header, so a chunk's index alone determines where its
bytes belong, and a receiver can prove it got every chunk exactly once before it uses the
result. Any frame that is short, long, out of range, repeated or fails its checksum raises
:class:`~gradstar.errors.ProtocolError`.

Three modules, every name re-exported here (``from gradstar.wire import X``):

- :mod:`.dtypes`: what a tensor is on the wire (dtypes, shapes, sizes);
- :mod:`.frames`: the frame kinds and their encoders and decoders, and the method paths;
- :mod:`.chunks`: :class:`ChunkLayout`, :class:`ChunkTracker` and the ONE chunk send helper
  (:func:`iter_chunk_frames`) and ONE receive helper (:func:`receive_chunk`) every stream uses.

:mod:`.formats` (the compressed wire formats: bf16, fp16, int8, int4) is imported by name,
``from gradstar.wire.formats import encode``, and not re-exported here: its function names
(``encode``, ``decode``) would read ambiguously beside the frame codec's.
"""

from .chunks import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    ChunkLayout,
    ChunkTracker,
    aligned_chunk_bytes,
    as_byte_view,
    check_chunk_count,
    iter_chunk_frames,
    place_chunk,
    receive_chunk,
    tracker_bytes,
)
from .dtypes import (
    MAX_NDIM,
    SUPPORTED_DTYPES,
    DTypeInfo,
    bfloat16,
    check_shape,
    dtype_from_wire,
    dtype_info,
    numpy_dtype_name,
    payload_bytes,
)
from .frames import (
    CHUNK_HEADER_BYTES,
    COLLECTIVE_METHOD,
    COLLECTIVE_SERVICE,
    KIND_ACCEPT,
    KIND_BATCH,
    KIND_CHUNK,
    KIND_END,
    KIND_ERROR,
    KIND_HEADER,
    KIND_SHM_ATTACH,
    KIND_SHM_CHUNK,
    MAX_BATCH_BYTES,
    MAX_BATCH_FRAMES,
    MAX_BATCHED_CHUNK_BYTES,
    MAX_HEADER_BYTES,
    PEER_METHOD,
    PEER_SERVICE,
    PUNCH_METHOD,
    RELAY_METHOD,
    RELAY_SERVICE,
    accept_frame,
    batchable,
    check_header_size,
    chunk_frame_buffer,
    decode_chunk,
    decode_error,
    decode_message,
    decode_shared,
    decode_shm_chunk,
    encode_batch,
    encode_chunk,
    encode_error,
    encode_message,
    encode_shm_chunk,
    end_frame,
    frame_kind,
    frames_of,
    seal_chunk_frame,
)

__all__ = [
    "CHUNK_HEADER_BYTES",
    "COLLECTIVE_METHOD",
    "COLLECTIVE_SERVICE",
    "DEFAULT_CHUNK_BYTES",
    "KIND_ACCEPT",
    "KIND_BATCH",
    "KIND_CHUNK",
    "KIND_END",
    "KIND_ERROR",
    "KIND_HEADER",
    "KIND_SHM_ATTACH",
    "KIND_SHM_CHUNK",
    "MAX_BATCHED_CHUNK_BYTES",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_FRAMES",
    "MAX_CHUNKS",
    "MAX_CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "PEER_METHOD",
    "PEER_SERVICE",
    "PUNCH_METHOD",
    "RELAY_METHOD",
    "RELAY_SERVICE",
    "SUPPORTED_DTYPES",
    "ChunkLayout",
    "ChunkTracker",
    "DTypeInfo",
    "accept_frame",
    "aligned_chunk_bytes",
    "as_byte_view",
    "batchable",
    "bfloat16",
    "check_chunk_count",
    "check_header_size",
    "check_shape",
    "chunk_frame_buffer",
    "decode_chunk",
    "decode_error",
    "decode_message",
    "decode_shared",
    "decode_shm_chunk",
    "dtype_from_wire",
    "dtype_info",
    "encode_batch",
    "encode_chunk",
    "encode_error",
    "encode_message",
    "encode_shm_chunk",
    "end_frame",
    "frame_kind",
    "frames_of",
    "iter_chunk_frames",
    "numpy_dtype_name",
    "payload_bytes",
    "place_chunk",
    "receive_chunk",
    "seal_chunk_frame",
    "tracker_bytes",
]

"""The frame codec: dtypes, chunk layouts, chunk and control frames, and stream reassembly.

The contract under test (``gradstar.wire``): a tensor survives encode -> decode -> reassemble
bit for bit, and any frame that is short, long, corrupted, repeated, missing or out of range
raises ProtocolError before a result is returned.
"""

from __future__ import annotations

import math
import re
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradstar.errors import ConfigurationError, ProtocolError
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import (
    CHUNK_HEADER_BYTES,
    DEFAULT_CHUNK_BYTES,
    KIND_ACCEPT,
    KIND_CHUNK,
    KIND_END,
    KIND_HEADER,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    SUPPORTED_DTYPES,
    ChunkLayout,
    ChunkTracker,
    accept_frame,
    aligned_chunk_bytes,
    as_byte_view,
    decode_chunk,
    decode_message,
    decode_shared,
    dtype_from_wire,
    dtype_info,
    encode_chunk,
    encode_message,
    end_frame,
    frame_kind,
    iter_chunk_frames,
    tracker_bytes,
)

DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.int32),
    np.dtype(np.int64),
]

# Byte offsets inside a chunk frame header ("<B3xIII").
KIND_BYTE = 0
PADDING_BYTES = range(1, 4)
INDEX_BYTES = range(4, 8)
LENGTH_BYTES = range(8, 12)
CRC_BYTES = range(12, 16)

PROPERTY = settings(
    max_examples=200,
    deadline=None,
    database=None,  # keep the repository free of .hypothesis/ state from unit runs
    suppress_health_check=[HealthCheck.too_slow],
)


# -- strategies and helpers --------------------------------------------------------------------


def random_bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


@st.composite
def tensors(draw, min_side: int = 0) -> np.ndarray:
    """Arrays of every supported dtype and any shape (scalars and 0-size included).

    The contents are random bit patterns (NaNs, infinities, subnormals included), drawn from a
    seed rather than element by element so that misplaced chunks never happen to match.
    """
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=min_side, max_side=7))
    nbytes = math.prod(shape) * dtype.itemsize
    raw = random_bytes(draw(st.integers(0, 2**32 - 1)), nbytes)
    return raw.view(dtype).reshape(shape)


def chunk_sizes(itemsize: int):
    """Aligned chunk sizes: mostly a few elements, sometimes bigger than any test tensor."""
    raw = st.one_of(st.integers(1, 96), st.sampled_from([DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES]))
    return raw.map(lambda n: aligned_chunk_bytes(n, itemsize))


def end_frame_for(layout: ChunkLayout) -> bytes:
    return end_frame(layout.count, layout.total_bytes)


def receive(frames: list[bytes], end: bytes, layout: ChunkLayout) -> np.ndarray:
    """What a receiver does: decode, admit, copy into place, then check the end marker."""
    out = np.zeros(layout.total_bytes, dtype=np.uint8)
    tracker = ChunkTracker(layout, "test stream")
    for frame in frames:
        index, payload = decode_chunk(frame)
        offset = tracker.admit(index, payload)
        out[offset:offset + payload.nbytes] = np.frombuffer(payload, dtype=np.uint8)
    tracker.finish(decode_message(end, KIND_END, pb.CollectiveEnd))
    return out


def layout_for(array: np.ndarray, chunk_bytes: int) -> ChunkLayout:
    return ChunkLayout(1, array.nbytes, chunk_bytes)


def flip(frame: bytes, position: int, mask: int) -> bytes:
    corrupted = bytearray(frame)
    corrupted[position] ^= mask
    return bytes(corrupted)


@st.composite
def streams(draw):
    """(array, layout, frames) for a non-empty tensor cut into one or more chunks."""
    array = draw(tensors(min_side=1))
    layout = layout_for(array, draw(chunk_sizes(array.dtype.itemsize)))
    frames = list(iter_chunk_frames(as_byte_view(array), layout))
    return array, layout, frames


# -- round trips ---------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data(), array=tensors())
def test_every_tensor_round_trips_bit_for_bit(data, array):
    layout = layout_for(array, data.draw(chunk_sizes(array.dtype.itemsize)))
    frames = list(iter_chunk_frames(as_byte_view(array), layout))

    out = receive(frames, end_frame_for(layout), layout)

    assert len(frames) == layout.count
    np.testing.assert_array_equal(out, array.reshape(-1).view(np.uint8))
    restored = out.view(array.dtype).reshape(array.shape)
    assert restored.dtype == array.dtype and restored.shape == array.shape


@PROPERTY
@given(data=st.data(), array=tensors())
def test_encode_chunk_per_span_matches_iter_chunk_frames(data, array):
    layout = layout_for(array, data.draw(chunk_sizes(array.dtype.itemsize)))
    buffer = as_byte_view(array)

    by_hand = []
    for index in range(layout.count):
        offset, length = layout.span(index)
        by_hand.append(encode_chunk(index, buffer[offset:offset + length]))

    assert by_hand == list(iter_chunk_frames(buffer, layout))


@PROPERTY
@given(data=st.data(), array=tensors())
def test_chunks_reassemble_in_any_arrival_order(data, array):
    layout = layout_for(array, data.draw(chunk_sizes(array.dtype.itemsize)))
    frames = data.draw(st.permutations(list(iter_chunk_frames(as_byte_view(array), layout))))

    out = receive(frames, end_frame_for(layout), layout)

    np.testing.assert_array_equal(out, array.reshape(-1).view(np.uint8))


@PROPERTY
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    segments=st.integers(1, 5),
    elements_per_segment=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_multi_segment_layouts_round_trip(data, dtype, segments, elements_per_segment, seed):
    segment_bytes = elements_per_segment * dtype.itemsize
    array = random_bytes(seed, segments * segment_bytes).view(dtype)
    layout = ChunkLayout(segments, segment_bytes, data.draw(chunk_sizes(dtype.itemsize)))
    frames = list(iter_chunk_frames(as_byte_view(array), layout))

    out = receive(frames, end_frame_for(layout), layout)

    assert layout.total_bytes == array.nbytes
    np.testing.assert_array_equal(out, array.view(np.uint8))


@PROPERTY
@given(data=st.data(), array=tensors())
def test_a_subset_of_chunks_round_trips_with_expected_chunks(data, array):
    layout = layout_for(array, data.draw(chunk_sizes(array.dtype.itemsize)))
    indices = data.draw(st.lists(st.integers(0, max(layout.count - 1, 0)), unique=True)
                        if layout.count else st.just([]))
    frames = list(iter_chunk_frames(as_byte_view(array), layout, indices))
    expected_bytes = sum(layout.span(i)[1] for i in indices)
    tracker = ChunkTracker(layout)

    for frame in frames:
        tracker.admit(*decode_chunk(frame))
    tracker.finish(pb.CollectiveEnd(chunks=len(indices), bytes=expected_bytes), len(indices))

    assert tracker.received == len(indices)
    assert tracker.bytes == expected_bytes


def test_as_byte_view_shares_memory_with_the_array():
    array = np.arange(6, dtype=np.int32).reshape(2, 3)

    view = as_byte_view(array)
    array[1, 2] = -1

    assert view.nbytes == array.nbytes
    assert bytes(view[-4:]) == np.int32(-1).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (3, 0)], ids=str)
def test_as_byte_view_is_the_arrays_bytes_flat_and_writable(dtype, shape):
    array = np.arange(math.prod(shape), dtype=np.float32).astype(dtype).reshape(shape)

    view = as_byte_view(array)

    assert (view.ndim, view.format, view.nbytes) == (1, "B", array.nbytes)
    assert bytes(view) == array.tobytes()
    if array.size:
        view[:] = bytes(array.nbytes)  # writes reach the array
        assert not array.any()


def test_as_byte_view_of_a_scalar_array_is_its_bytes():
    scalar = np.array(1.5, dtype=ml_dtypes.bfloat16)

    assert bytes(as_byte_view(scalar)) == scalar.tobytes()


def test_chunk_frame_layout_is_kind_padding_index_length_crc_payload():
    frame = encode_chunk(7, b"abc")

    assert frame[:4] == bytes((KIND_CHUNK, 0, 0, 0))
    assert int.from_bytes(frame[4:8], "little") == 7
    assert int.from_bytes(frame[8:12], "little") == 3
    assert len(frame) == CHUNK_HEADER_BYTES + 3
    assert frame[CHUNK_HEADER_BYTES:] == b"abc"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_chunk_accepts_a_numpy_array_of_every_dtype(dtype):
    # The hub frames ChunkReducer.finish()'s array directly; bfloat16 has no buffer format.
    values = np.arange(5).astype(dtype)

    index, payload = decode_chunk(encode_chunk(3, values))

    assert index == 3
    assert bytes(payload) == values.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_chunk_accepts_a_scalar_array(dtype):
    value = np.array(2, dtype=dtype)

    _, payload = decode_chunk(encode_chunk(0, value))

    assert bytes(payload) == value.tobytes()


# -- corrupted, truncated and malformed chunk frames ---------------------------------------------


@PROPERTY
@given(stream=streams(), data=st.data())
def test_a_truncated_chunk_frame_raises(stream, data):
    _, _, frames = stream
    frame = data.draw(st.sampled_from(frames))
    cut = data.draw(st.integers(0, len(frame) - 1))

    with pytest.raises(ProtocolError):
        decode_chunk(frame[:cut])


@PROPERTY
@given(stream=streams(), extra=st.binary(min_size=1, max_size=8), data=st.data())
def test_a_chunk_frame_with_trailing_bytes_raises(stream, extra, data):
    _, _, frames = stream
    frame = data.draw(st.sampled_from(frames))

    with pytest.raises(ProtocolError, match="declares"):
        decode_chunk(frame + extra)


@PROPERTY
@given(stream=streams(), data=st.data(), mask=st.integers(1, 255))
def test_one_flipped_byte_outside_the_padding_fails_the_stream(stream, data, mask):
    _, layout, frames = stream
    which = data.draw(st.integers(0, len(frames) - 1))
    positions = [KIND_BYTE, *range(INDEX_BYTES.start, len(frames[which]))]
    position = data.draw(st.sampled_from(positions))
    frames[which] = flip(frames[which], position, mask)

    with pytest.raises(ProtocolError):
        receive(frames, end_frame_for(layout), layout)


@PROPERTY
@given(stream=streams(), data=st.data(), mask=st.integers(1, 255))
def test_one_flipped_byte_outside_the_index_is_caught_by_decode_chunk(stream, data, mask):
    _, _, frames = stream
    frame = data.draw(st.sampled_from(frames))
    positions = [KIND_BYTE, *range(LENGTH_BYTES.start, len(frame))]
    position = data.draw(st.sampled_from(positions))

    with pytest.raises(ProtocolError):
        decode_chunk(flip(frame, position, mask))


@PROPERTY
@given(stream=streams(), data=st.data(), mask=st.integers(1, 255))
def test_a_flipped_payload_byte_fails_the_checksum(stream, data, mask):
    _, _, frames = stream
    frame = data.draw(st.sampled_from(frames))
    position = data.draw(st.integers(CHUNK_HEADER_BYTES, len(frame) - 1))

    with pytest.raises(ProtocolError, match="failed its checksum"):
        decode_chunk(flip(frame, position, mask))


@PROPERTY
@given(stream=streams(), data=st.data(), mask=st.integers(1, 255))
def test_flipped_padding_bytes_are_ignored_and_the_data_stays_correct(stream, data, mask):
    array, layout, frames = stream
    which = data.draw(st.integers(0, len(frames) - 1))
    frames[which] = flip(frames[which], data.draw(st.sampled_from(PADDING_BYTES)), mask)

    out = receive(frames, end_frame_for(layout), layout)

    np.testing.assert_array_equal(out, array.reshape(-1).view(np.uint8))


def test_a_flipped_length_byte_names_the_declared_length():
    frame = flip(encode_chunk(2, b"\x00" * 8), LENGTH_BYTES.start, 0x01)

    with pytest.raises(ProtocolError, match="chunk 2 declares 9 payload bytes but carries 8"):
        decode_chunk(frame)


def test_a_flipped_crc_byte_fails_the_checksum():
    frame = flip(encode_chunk(0, b"payload!"), CRC_BYTES.start, 0x80)

    with pytest.raises(ProtocolError, match="chunk 0 failed its checksum"):
        decode_chunk(frame)


def test_a_flipped_index_byte_is_caught_when_the_index_repeats():
    layout = ChunkLayout(1, 16, 4)
    frames = list(iter_chunk_frames(memoryview(bytes(range(16))), layout))
    frames[0] = flip(frames[0], INDEX_BYTES.start, 0x01)  # chunk 0 now claims to be chunk 1

    with pytest.raises(ProtocolError, match="chunk 1 arrived twice"):
        receive(frames, end_frame_for(layout), layout)


@pytest.mark.parametrize("kind", [0, KIND_HEADER, KIND_ACCEPT, KIND_END, 5, 255])
def test_a_chunk_frame_with_the_wrong_kind_byte_raises(kind):
    frame = bytearray(encode_chunk(0, b"abcd"))
    frame[0] = kind

    with pytest.raises(ProtocolError, match=f"expected a chunk frame, got kind {kind}$"):
        decode_chunk(bytes(frame))


def test_a_control_frame_is_not_a_chunk_frame():
    with pytest.raises(ProtocolError):
        decode_chunk(end_frame(1, 4))


def test_an_empty_frame_is_shorter_than_a_chunk_header():
    with pytest.raises(ProtocolError, match="chunk frame of 0 bytes is shorter than its header"):
        decode_chunk(b"")


# -- duplicated, missing, misplaced chunks and bad end markers -----------------------------------


@PROPERTY
@given(stream=streams(), data=st.data())
def test_a_duplicated_chunk_raises(stream, data):
    _, layout, frames = stream
    repeated = data.draw(st.sampled_from(frames))
    frames.insert(data.draw(st.integers(0, len(frames))), repeated)

    with pytest.raises(ProtocolError, match="arrived twice"):
        receive(frames, end_frame_for(layout), layout)


@PROPERTY
@given(stream=streams(), data=st.data())
def test_a_missing_chunk_raises_at_the_end_marker(stream, data):
    _, layout, frames = stream
    del frames[data.draw(st.integers(0, len(frames) - 1))]

    expected = f"stream ended after {layout.count - 1} of {layout.count} chunks"
    with pytest.raises(ProtocolError, match=re.escape(expected)):
        receive(frames, end_frame_for(layout), layout)


@PROPERTY
@given(stream=streams(), delta=st.integers(-5, 5).filter(bool))
def test_an_end_marker_with_the_wrong_chunk_count_raises(stream, delta):
    _, layout, frames = stream
    end = end_frame(max(layout.count + delta, 0), layout.total_bytes)

    with pytest.raises(ProtocolError, match="end marker says"):
        receive(frames, end, layout)


@PROPERTY
@given(stream=streams(), delta=st.integers(-64, 64).filter(bool))
def test_an_end_marker_with_the_wrong_byte_count_raises(stream, delta):
    _, layout, frames = stream
    end = end_frame(layout.count, max(layout.total_bytes + delta, 0))

    with pytest.raises(ProtocolError, match=f"received {layout.total_bytes}$"):
        receive(frames, end, layout)


def test_an_empty_tensor_needs_an_end_marker_of_zero_chunks():
    layout = ChunkLayout(1, 0, 8)
    tracker = ChunkTracker(layout, "rank 3")

    tracker.finish(pb.CollectiveEnd(chunks=0, bytes=0))
    with pytest.raises(ProtocolError, match=re.escape("rank 3: stream ended after 0 of 0 chunks")):
        tracker.finish(pb.CollectiveEnd(chunks=1, bytes=0))


@pytest.mark.parametrize("index", [3, 4, 1000, 2**32 - 1])
def test_a_chunk_index_past_the_layout_raises(index):
    layout = ChunkLayout(1, 12, 4)
    tracker = ChunkTracker(layout)

    with pytest.raises(ProtocolError, match=f"chunk index {index} is out of range 0..2"):
        tracker.admit(*decode_chunk(encode_chunk(index, b"\x00" * 4)))


@pytest.mark.parametrize("length", [0, 3, 5])
def test_a_chunk_of_the_wrong_length_raises(length):
    tracker = ChunkTracker(ChunkLayout(1, 12, 4), "rank 1")

    with pytest.raises(ProtocolError, match=f"rank 1: chunk 0 has {length} bytes, expected 4"):
        tracker.admit(*decode_chunk(encode_chunk(0, b"\x00" * length)))


def test_the_short_last_chunk_must_have_its_exact_length():
    tracker = ChunkTracker(ChunkLayout(1, 10, 4))

    with pytest.raises(ProtocolError, match="chunk 2 has 4 bytes, expected 2"):
        tracker.admit(*decode_chunk(encode_chunk(2, b"\x00" * 4)))


def test_a_rejected_chunk_does_not_count_as_received():
    tracker = ChunkTracker(ChunkLayout(1, 8, 4))

    with pytest.raises(ProtocolError):
        tracker.admit(*decode_chunk(encode_chunk(0, b"\x00" * 3)))
    offset = tracker.admit(*decode_chunk(encode_chunk(0, b"\x00" * 4)))

    assert (offset, tracker.received, tracker.bytes) == (0, 1, 4)


# -- control frames ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            KIND_HEADER,
            pb.CollectiveHeader(job="j", generation=3, group="g", seq=9, rank=1, member_id="m",
                                reduce_op=pb.REDUCE_OP_MAX, dtype=pb.DTYPE_BFLOAT16,
                                shape=[2, 0, 5], root=1, chunk_bytes=4096, timeout_seconds=2.5),
        ),
        (KIND_ACCEPT, pb.CollectiveAccept(output_chunks=4, output_bytes=100)),
        (KIND_END, pb.CollectiveEnd(chunks=17, bytes=1 << 40)),
        (KIND_END, pb.CollectiveEnd()),
    ],
)
def test_control_messages_round_trip(kind, message):
    frame = encode_message(kind, message)

    assert frame_kind(frame) == kind
    assert decode_message(frame, kind, type(message)) == message


@pytest.mark.parametrize("late", [[], [pb.LateRank(rank=3, lag_seconds=0.25)]],
                         ids=["on-time", "late-rank"])
def test_the_made_once_control_frames_are_the_encoded_messages(late):
    assert accept_frame(7) == encode_message(KIND_ACCEPT, pb.CollectiveAccept(output_chunks=7))
    assert accept_frame(7) is accept_frame(7)  # made once
    assert end_frame(3, 300, late) == encode_message(
        KIND_END, pb.CollectiveEnd(chunks=3, bytes=300, late=late))
    assert end_frame(3, 301) != end_frame(3, 300)


@pytest.mark.parametrize("message", [
    pb.CollectiveEnd(chunks=2, bytes=200),
    pb.CollectiveEnd(chunks=2, bytes=200, late=[pb.LateRank(rank=r, lag_seconds=r / 10)
                                                for r in range(8)]),  # past the shared size
], ids=["small", "large"])
def test_decode_shared_reads_what_decode_message_reads(message):
    frame = encode_message(KIND_END, message)

    assert decode_shared(frame, KIND_END, pb.CollectiveEnd) == message
    # An equal frame (another bytes object) of the small kind gets the same, shared message.
    again = decode_shared(bytes(bytearray(frame)), KIND_END, pb.CollectiveEnd)
    assert again == message
    assert (again is decode_shared(frame, KIND_END, pb.CollectiveEnd)) == (len(frame) <= 32)


def test_decode_shared_refuses_a_bad_frame_every_time():
    frame = bytes((KIND_END,)) + b"\x08"  # a varint cut short
    for _ in range(2):  # a refusal is not remembered as an answer
        with pytest.raises(ProtocolError, match="corrupt CollectiveEnd frame"):
            decode_shared(frame, KIND_END, pb.CollectiveEnd)
    with pytest.raises(ProtocolError, match="expected a frame of kind 2, got 4"):
        decode_shared(end_frame(1, 4), KIND_ACCEPT, pb.CollectiveAccept)


def test_decode_message_of_the_wrong_kind_raises():
    frame = encode_message(KIND_ACCEPT, pb.CollectiveAccept(output_chunks=1))

    with pytest.raises(ProtocolError, match="expected a frame of kind 4, got 2"):
        decode_message(frame, KIND_END, pb.CollectiveEnd)


def test_decode_message_of_a_chunk_frame_raises():
    with pytest.raises(ProtocolError, match="expected a frame of kind 1, got 3"):
        decode_message(encode_chunk(0, b"abcd"), KIND_HEADER, pb.CollectiveHeader)


def test_decode_message_of_an_empty_frame_raises():
    with pytest.raises(ProtocolError, match="expected a frame of kind 4, got empty"):
        decode_message(b"", KIND_END, pb.CollectiveEnd)


@pytest.mark.parametrize(
    "body",
    [b"\xff", b"\x08", b"\x08\xff\xff", b"\x0a\x05ab", b"\x07", b"\x0f\x00"],
    ids=["bad-tag", "varint-cut", "varint-unterminated", "length-past-end", "bad-wire-type",
         "group-end"],
)
def test_decode_message_of_garbage_raises(body):
    with pytest.raises(ProtocolError, match="corrupt CollectiveEnd frame"):
        decode_message(bytes((KIND_END,)) + body, KIND_END, pb.CollectiveEnd)


@PROPERTY
@given(body=st.binary(max_size=64))
def test_decode_message_of_any_bytes_returns_a_message_or_raises_protocol_error(body):
    try:
        message = decode_message(bytes((KIND_END,)) + body, KIND_END, pb.CollectiveEnd)
    except ProtocolError:
        return
    assert isinstance(message, pb.CollectiveEnd)


def test_frame_kind_of_an_empty_frame_raises():
    with pytest.raises(ProtocolError, match="empty frame"):
        frame_kind(b"")


# -- layouts -------------------------------------------------------------------------------------


def test_layout_of_one_segment_cuts_a_short_last_chunk():
    layout = ChunkLayout(segments=1, segment_bytes=10, chunk_bytes=4)

    assert (layout.per_segment, layout.count, layout.total_bytes) == (3, 3, 10)
    assert [layout.span(i) for i in range(3)] == [(0, 4), (4, 4), (8, 2)]


def test_layout_of_several_segments_restarts_chunks_at_each_segment():
    layout = ChunkLayout(segments=3, segment_bytes=10, chunk_bytes=4)

    assert (layout.per_segment, layout.count, layout.total_bytes) == (3, 9, 30)
    assert layout.span(3) == (10, 4)
    assert layout.span(5) == (18, 2)
    assert layout.span(8) == (28, 2)
    assert [layout.segment_of(i) for i in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_layout_with_chunks_larger_than_a_segment_has_one_chunk_per_segment():
    layout = ChunkLayout(segments=2, segment_bytes=12, chunk_bytes=DEFAULT_CHUNK_BYTES)

    assert layout.count == 2
    assert [layout.span(i) for i in range(2)] == [(0, 12), (12, 12)]


@pytest.mark.parametrize("segments", [1, 4])
def test_layout_of_zero_byte_segments_has_no_chunks(segments):
    layout = ChunkLayout(segments=segments, segment_bytes=0, chunk_bytes=8)

    assert (layout.per_segment, layout.count, layout.total_bytes) == (0, 0, 0)
    with pytest.raises(ProtocolError, match="chunk index 0 is out of range"):
        layout.span(0)


@pytest.mark.parametrize("index", [-1, 9])
def test_layout_span_out_of_range_raises(index):
    layout = ChunkLayout(segments=3, segment_bytes=10, chunk_bytes=4)

    with pytest.raises(ProtocolError, match=f"chunk index {index} is out of range 0..8"):
        layout.span(index)


@PROPERTY
@given(
    itemsize=st.sampled_from([2, 4, 8]),
    segments=st.integers(1, 6),
    elements=st.integers(0, 50),
    raw_chunk=st.integers(1, 128),
)
def test_layout_spans_tile_each_segment_with_aligned_chunks(itemsize, segments, elements,
                                                            raw_chunk):
    chunk_bytes = aligned_chunk_bytes(raw_chunk, itemsize)
    layout = ChunkLayout(segments, elements * itemsize, chunk_bytes)

    position = 0
    for index in range(layout.count):
        offset, length = layout.span(index)
        segment = layout.segment_of(index)
        assert offset == position  # no gap, no overlap
        assert 0 < length <= chunk_bytes
        assert offset % itemsize == 0 and length % itemsize == 0
        assert segment * layout.segment_bytes <= offset
        assert offset + length <= (segment + 1) * layout.segment_bytes
        position += length
    assert position == layout.total_bytes


@PROPERTY
@given(chunk_bytes=st.integers(1, MAX_CHUNK_BYTES), itemsize=st.sampled_from([2, 4, 8]))
def test_aligned_chunk_bytes_rounds_down_to_whole_elements(chunk_bytes, itemsize):
    aligned = aligned_chunk_bytes(chunk_bytes, itemsize)

    assert aligned % itemsize == 0
    assert aligned == max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    assert aligned <= MAX_CHUNK_BYTES


def test_aligned_chunk_bytes_rounds_a_tiny_chunk_up_to_one_element():
    assert aligned_chunk_bytes(3, 8) == 8


@pytest.mark.parametrize("chunk_bytes", [0, -1, MAX_CHUNK_BYTES + 1, 1 << 40])
def test_aligned_chunk_bytes_out_of_range_raises(chunk_bytes):
    expected = f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}"
    with pytest.raises(ConfigurationError, match=re.escape(expected)):
        aligned_chunk_bytes(chunk_bytes, 4)


# -- dtypes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_info_round_trips_through_its_wire_value(dtype):
    info = dtype_info(dtype)

    assert info.numpy == dtype
    assert info.name == str(dtype)
    assert dtype_from_wire(info.wire) is info


@pytest.mark.parametrize(
    ("dtype", "accumulate"),
    [
        (np.float32, np.float32),
        (np.float64, np.float64),
        (np.float16, np.float32),
        (ml_dtypes.bfloat16, np.float32),
        (np.int32, np.int32),
        (np.int64, np.int64),
    ],
)
def test_half_precision_accumulates_in_float32(dtype, accumulate):
    assert dtype_info(dtype).accumulate == np.dtype(accumulate)


def test_dtype_info_accepts_type_objects_and_names():
    assert dtype_info(np.float32) is dtype_info(np.dtype("float32")) is dtype_info("float32")


def test_supported_dtypes_lists_the_six_wire_dtypes():
    assert SUPPORTED_DTYPES == ("float32", "float64", "float16", "bfloat16", "int32", "int64")


@pytest.mark.parametrize("dtype", [np.complex64, np.bool_, np.uint8, np.int8, np.complex128,
                                   "not-a-dtype"], ids=str)
def test_dtype_info_of_an_unsupported_dtype_raises(dtype):
    with pytest.raises(ConfigurationError, match="is not supported; use one of float32, "):
        dtype_info(dtype)


@pytest.mark.parametrize("wire", [pb.DTYPE_UNSPECIFIED, 99, -1])
def test_dtype_from_wire_of_an_unknown_value_raises(wire):
    with pytest.raises(ProtocolError, match=f"unknown dtype {wire} in collective header"):
        dtype_from_wire(wire)


# -- frames built in place (the hub's reduced chunks) ----------------------------------------


@pytest.mark.parametrize("length", [1, 7, 4096, 3 << 20])
def test_frame_built_in_place_decodes_like_encode_chunk(length):
    from gradstar.wire import chunk_frame_buffer, seal_chunk_frame

    payload = np.random.default_rng(length).integers(0, 256, size=length, dtype=np.uint8)
    frame, view = chunk_frame_buffer(length)
    view[CHUNK_HEADER_BYTES:] = payload.tobytes()
    sealed = seal_chunk_frame(frame, view, 41)

    assert sealed is frame and isinstance(frame, bytes)
    assert frame == encode_chunk(41, payload)
    index, decoded = decode_chunk(frame)
    assert index == 41 and bytes(decoded) == payload.tobytes()


def test_frames_built_in_place_are_distinct_objects():
    from gradstar.wire import chunk_frame_buffer, seal_chunk_frame

    frames = []
    for value in (1, 2):
        frame, view = chunk_frame_buffer(8)
        view[CHUNK_HEADER_BYTES:] = bytes([value]) * 8
        frames.append(seal_chunk_frame(frame, view, value))
    assert frames[0] is not frames[1]
    assert decode_chunk(frames[0])[1].tobytes() == b"\x01" * 8
    assert decode_chunk(frames[1])[1].tobytes() == b"\x02" * 8


# -- batches: several small frames in one message ----------------------------------------------


def _control_frames():
    from gradstar.wire import KIND_ACCEPT, KIND_END, encode_shm_chunk
    return [encode_message(KIND_ACCEPT, pb.CollectiveAccept(output_chunks=3)),
            encode_shm_chunk(0), encode_shm_chunk(2 ** 31),
            encode_message(KIND_END, pb.CollectiveEnd(chunks=3, bytes=12))]


def test_a_batch_carries_its_frames_in_order_and_a_plain_frame_is_itself():
    from gradstar.wire import encode_batch, frames_of
    frames = _control_frames()
    assert frames_of(encode_batch(frames)) == frames
    for frame in frames:
        assert frames_of(frame) == [frame]


@pytest.mark.parametrize("cut", [1, 3, 6, -1])
def test_a_truncated_batch_is_a_protocol_error(cut):
    from gradstar.wire import encode_batch, frames_of
    with pytest.raises(ProtocolError, match=r"malformed batch|empty batch"):
        frames_of(encode_batch(_control_frames())[:cut])


def test_a_batch_may_not_hold_a_large_chunk_a_later_header_an_error_or_a_batch():
    from gradstar.errors import GradstarError
    from gradstar.wire import (
        KIND_HEADER,
        MAX_BATCHED_CHUNK_BYTES,
        encode_batch,
        encode_chunk,
        encode_error,
        frames_of,
    )
    inner = encode_batch(_control_frames()[:2])
    for frame in (encode_chunk(0, np.ones(MAX_BATCHED_CHUNK_BYTES + 1, np.uint8)),
                  encode_message(KIND_HEADER, pb.CollectiveHeader(seq=1)),
                  encode_error(GradstarError("x")), inner):
        with pytest.raises(ProtocolError, match="malformed batch"):
            frames_of(encode_batch([_control_frames()[0], frame]))


def test_a_small_collective_travels_whole_header_first_in_one_batch():
    from gradstar.wire import (
        KIND_END,
        KIND_HEADER,
        MAX_BATCHED_CHUNK_BYTES,
        encode_batch,
        encode_chunk,
        frames_of,
    )
    frames = [encode_message(KIND_HEADER, pb.CollectiveHeader(seq=1)),
              encode_chunk(0, np.ones(MAX_BATCHED_CHUNK_BYTES, np.uint8)),
              encode_chunk(1, np.arange(3, dtype=np.float32)),
              encode_message(KIND_END, pb.CollectiveEnd(chunks=2,
                                                        bytes=MAX_BATCHED_CHUNK_BYTES + 12))]
    assert frames_of(encode_batch(frames)) == frames


def test_a_batch_of_more_frames_than_the_limit_is_refused():
    from gradstar.wire import MAX_BATCH_FRAMES, encode_batch, encode_shm_chunk, frames_of
    assert len(frames_of(encode_batch([encode_shm_chunk(i)
                                       for i in range(MAX_BATCH_FRAMES)]))) == MAX_BATCH_FRAMES
    with pytest.raises(ProtocolError, match="malformed batch"):
        frames_of(encode_batch([encode_shm_chunk(i) for i in range(MAX_BATCH_FRAMES + 1)]))


def test_a_tracker_holds_a_bit_per_chunk_and_only_once_chunks_arrive():
    # A header at the chunk limit: 2^20 chunks of 2 bytes. The hub builds this tracker for a
    # header alone, so until a chunk comes it must hold nothing per chunk.
    layout = ChunkLayout(1, 2 * MAX_CHUNKS, 2)
    tracemalloc.start()
    try:
        tracker = ChunkTracker(layout, "rank 0")
        before = tracemalloc.get_traced_memory()[0]
        for index in (0, 9, MAX_CHUNKS - 1):
            tracker.admit(*decode_chunk(encode_chunk(index, b"\x00\x00")))
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert before < 4096
    assert tracker_bytes(MAX_CHUNKS) == MAX_CHUNKS // 8
    assert MAX_CHUNKS // 8 <= after - before < MAX_CHUNKS // 8 + 4096
    # Each chunk once: the bits of its neighbours are not its own.
    for index in (0, 9, MAX_CHUNKS - 1):
        with pytest.raises(ProtocolError, match=f"chunk {index} arrived twice"):
            tracker.admit(*decode_chunk(encode_chunk(index, b"\x00\x00")))
    for index in (1, 8, 10, MAX_CHUNKS - 2):
        tracker.admit(*decode_chunk(encode_chunk(index, b"\x00\x00")))
    assert tracker.received == 7

"""ChunkReducer against numpy for every reduce op and dtype, and BufferPool reuse."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gradstar.coordinator.collective.reduce import BufferPool, ChunkReducer
from gradstar.errors import InvalidCollectiveError
from gradstar.ops import REDUCE_OP_NAMES
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import ChunkLayout, as_byte_view, dtype_info

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int64]
OPS = [pb.REDUCE_OP_SUM, pb.REDUCE_OP_MEAN, pb.REDUCE_OP_MIN, pb.REDUCE_OP_MAX,
       pb.REDUCE_OP_PROD]

# Reference reductions over axis 0 of the stacked contributions, in the accumulator dtype.
NUMPY_REFERENCE = {
    pb.REDUCE_OP_SUM: lambda s, acc: np.sum(s, axis=0, dtype=acc),
    pb.REDUCE_OP_MEAN: lambda s, acc: np.mean(s, axis=0, dtype=acc),
    pb.REDUCE_OP_MIN: lambda s, acc: np.min(s.astype(acc), axis=0),
    pb.REDUCE_OP_MAX: lambda s, acc: np.max(s.astype(acc), axis=0),
    pb.REDUCE_OP_PROD: lambda s, acc: np.prod(s, axis=0, dtype=acc),
}


def op_dtype_cases():
    for op in OPS:
        for dtype in DTYPES:
            if op == pb.REDUCE_OP_MEAN and np.dtype(dtype).kind == "i":
                continue  # rejected; see test_mean_of_integers_raises
            yield pytest.param(op, np.dtype(dtype), id=f"{REDUCE_OP_NAMES[op]}-{np.dtype(dtype)}")


def contributions(dtype: np.dtype, world_size: int, length: int, seed: int) -> list[np.ndarray]:
    """Values whose sums and products are exact in every dtype (eighths in -4..4, small ints).

    Exact intermediate results make the reference independent of summation order, so the
    comparison below can demand equality rather than a tolerance.
    """
    rng = np.random.default_rng(seed)
    if dtype.kind == "i":
        return [rng.integers(-50, 51, size=length).astype(dtype) for _ in range(world_size)]
    return [(rng.integers(-32, 33, size=length) / 8).astype(dtype) for _ in range(world_size)]


def reduce_views(reducer: ChunkReducer, views: list[memoryview]) -> np.ndarray:
    """The hub's sequence for one chunk: fold every arrival but the last, finish into a frame."""
    slot = None
    for view in views[:-1]:
        slot = reducer.fold(slot, view)
    out = np.empty(views[-1].nbytes, dtype=np.uint8)
    reducer.finish_into(slot, views[-1], as_byte_view(out))
    return out.view(reducer.dtype.numpy)


def reduce_chunk(reducer: ChunkReducer, arrays: list[np.ndarray]) -> np.ndarray:
    return reduce_views(reducer, [as_byte_view(a) for a in arrays])


def make_reducer(op: int, dtype, world_size: int, pool: BufferPool | None = None) -> ChunkReducer:
    return ChunkReducer(op, dtype_info(dtype), world_size, pool or BufferPool())


# -- every op x dtype x world size -------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize(("op", "dtype"), list(op_dtype_cases()))
def test_reduction_matches_numpy(op, dtype, world_size):
    arrays = contributions(dtype, world_size, length=33, seed=world_size * 100 + op)
    accumulate = dtype_info(dtype).accumulate

    result = reduce_chunk(make_reducer(op, dtype, world_size), arrays)

    expected = NUMPY_REFERENCE[op](np.stack(arrays), accumulate).astype(dtype)
    assert result.dtype == dtype
    np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize(("op", "dtype"), list(op_dtype_cases()))
def test_reduction_chunk_by_chunk_reassembles_to_the_whole_reduction(op, dtype):
    world_size, length = 3, 50
    arrays = contributions(dtype, world_size, length, seed=op)
    layout = ChunkLayout(1, length * dtype.itemsize, chunk_bytes=7 * dtype.itemsize)
    reducer = make_reducer(op, dtype, world_size)
    views = [as_byte_view(a) for a in arrays]
    out = np.empty(length, dtype=dtype)
    out_bytes = as_byte_view(out)

    for index in range(layout.count):
        offset, size = layout.span(index)
        result = reduce_views(reducer, [view[offset:offset + size] for view in views])
        out_bytes[offset:offset + size] = as_byte_view(result)

    np.testing.assert_array_equal(out, reduce_chunk(make_reducer(op, dtype, world_size), arrays))


def test_integer_sum_wraps_like_numpy():
    big = np.array([np.iinfo(np.int32).max, np.iinfo(np.int32).min], dtype=np.int32)
    one = np.array([1, -1], dtype=np.int32)

    result = reduce_chunk(make_reducer(pb.REDUCE_OP_SUM, np.int32, 2), [big, one])

    np.testing.assert_array_equal(result, big + one)


def test_min_and_max_propagate_nan_like_numpy():
    a = np.array([np.nan, 1.0, 2.0], dtype=np.float32)
    b = np.array([0.0, np.nan, -2.0], dtype=np.float32)

    low = reduce_chunk(make_reducer(pb.REDUCE_OP_MIN, np.float32, 2), [a, b])
    high = reduce_chunk(make_reducer(pb.REDUCE_OP_MAX, np.float32, 2), [a, b])

    np.testing.assert_array_equal(low, np.minimum(a, b))
    np.testing.assert_array_equal(high, np.maximum(a, b))


def test_reduction_does_not_modify_the_contributions():
    arrays = contributions(np.dtype(np.float32), 3, length=8, seed=1)
    before = [a.copy() for a in arrays]

    reduce_chunk(make_reducer(pb.REDUCE_OP_SUM, np.float32, 3), arrays)

    for array, original in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(array, original)


# -- half precision accumulates in float32 -----------------------------------------------------


def naive_sum(values: list[np.ndarray]) -> np.ndarray:
    """What summing in the wire dtype would give: every partial sum rounded to that dtype."""
    total = values[0].copy()
    with np.errstate(over="ignore"):
        for v in values[1:]:
            total = total + v
    return total


@pytest.mark.parametrize(
    ("dtype", "values", "expected", "naive"),
    [
        # 2048 + 1 rounds back to 2048 in float16 (spacing 2), three times over; float32 keeps
        # 2051, which rounds once to 2052.
        pytest.param(np.float16, [2048, 1, 1, 1], 2052, 2048, id="float16-rounding"),
        # 60000 + 60000 overflows float16 (max 65504) and inf never comes back.
        pytest.param(np.float16, [60000, 60000, -60000, -60000], 0, np.inf,
                     id="float16-overflow"),
        # bfloat16 keeps 8 significant bits: 256 + 1 rounds to 256; float32 gives 259 -> 260.
        pytest.param(ml_dtypes.bfloat16, [256, 1, 1, 1], 260, 256, id="bfloat16-rounding"),
    ],
)
def test_half_precision_sum_accumulates_in_float32(dtype, values, expected, naive):
    arrays = [np.array([v], dtype=dtype) for v in values]

    result = reduce_chunk(make_reducer(pb.REDUCE_OP_SUM, dtype, len(values)), arrays)

    assert naive_sum(arrays)[0] == naive  # the trap the float32 accumulator avoids
    assert result.dtype == np.dtype(dtype)
    assert result[0] == expected
    float32_then_cast = np.sum([a.astype(np.float32) for a in arrays], axis=0).astype(dtype)
    np.testing.assert_array_equal(result, float32_then_cast)


def test_half_precision_mean_of_values_whose_sum_overflows_float16():
    arrays = [np.array([60000, -60000], dtype=np.float16)] * 4

    result = reduce_chunk(make_reducer(pb.REDUCE_OP_MEAN, np.float16, 4), arrays)

    np.testing.assert_array_equal(result, np.array([60000, -60000], dtype=np.float16))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_accumulator_is_float32(dtype):
    reducer = make_reducer(pb.REDUCE_OP_SUM, dtype, 3)

    slot = reducer.fold(None, as_byte_view(np.ones(4, dtype=dtype)))
    slot = reducer.fold(slot, as_byte_view(np.ones(4, dtype=dtype)))

    assert slot.acc.dtype == np.float32


# -- invalid reducers ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_mean_of_integers_raises(dtype):
    name = np.dtype(dtype).name
    with pytest.raises(InvalidCollectiveError, match=f"op='mean' is not defined for {name} "
                                                     "tensors; use op='sum' and divide"):
        make_reducer(pb.REDUCE_OP_MEAN, dtype, 2)


@pytest.mark.parametrize("op", [pb.REDUCE_OP_UNSPECIFIED, 99])
def test_unknown_reduce_op_raises(op):
    with pytest.raises(InvalidCollectiveError, match=f"unknown reduce op {op}$"):
        make_reducer(op, np.float32, 2)


def test_invalid_collective_error_is_also_a_value_error():
    with pytest.raises(ValueError, match="not defined for int64"):
        make_reducer(pb.REDUCE_OP_MEAN, np.int64, 2)


# -- buffer pool ---------------------------------------------------------------------------------


def test_pool_hands_back_the_same_buffer_after_give():
    pool = BufferPool()
    buf = pool.take(np.dtype(np.float32), 16)

    pool.give(buf)

    assert pool.idle_bytes == buf.nbytes
    assert pool.take(np.dtype(np.float32), 16) is buf
    assert pool.idle_bytes == 0


def test_pool_take_when_empty_allocates_the_requested_dtype_and_length():
    buf = BufferPool().take(np.dtype(np.int64), 5)

    assert (buf.dtype, buf.shape) == (np.dtype(np.int64), (5,))


def test_pool_keeps_buffers_apart_by_dtype_and_length():
    pool = BufferPool()
    buf = pool.take(np.dtype(np.float32), 16)
    pool.give(buf)

    other_length = pool.take(np.dtype(np.float32), 8)
    other_dtype = pool.take(np.dtype(np.int32), 16)

    assert other_length is not buf and other_dtype is not buf
    assert pool.take(np.dtype(np.float32), 16) is buf


def test_pool_drops_a_buffer_larger_than_max_bytes():
    pool = BufferPool(max_bytes=100)
    big = np.empty(26, dtype=np.float32)  # 104 bytes

    pool.give(big)

    assert pool.idle_bytes == 0
    assert pool.take(np.dtype(np.float32), 26) is not big


def test_pool_holds_at_most_max_bytes_idle():
    pool = BufferPool(max_bytes=100)
    bufs = [np.empty(10, dtype=np.float32) for _ in range(3)]  # 40 bytes each

    for buf in bufs:
        pool.give(buf)

    assert pool.idle_bytes == 80
    kept = [pool.take(np.dtype(np.float32), 10) for _ in range(3)]
    assert {id(b) for b in kept[:2]} == {id(bufs[0]), id(bufs[1])}
    assert kept[2] is not bufs[2]
    assert pool.idle_bytes == 0


def test_pool_accepts_a_buffer_that_fills_it_exactly():
    pool = BufferPool(max_bytes=40)
    buf = np.empty(10, dtype=np.float32)

    pool.give(buf)

    assert pool.idle_bytes == 40
    assert pool.take(np.dtype(np.float32), 10) is buf


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_reducer_reuses_a_released_accumulator_and_overwrites_it(dtype):
    reducer = make_reducer(pb.REDUCE_OP_SUM, dtype, 3, BufferPool())
    first = [np.full(6, v, dtype=dtype) for v in (3, 4, 5)]
    second = [np.full(6, v, dtype=dtype) for v in (1, 2, 0)]

    slot = reducer.fold(reducer.fold(None, as_byte_view(first[0])), as_byte_view(first[1]))
    acc = slot.acc
    out = np.empty(6, dtype=dtype)
    reducer.finish_into(slot, as_byte_view(first[2]), as_byte_view(out))
    np.testing.assert_array_equal(out, np.full(6, 12, dtype=dtype))
    reused = reducer.fold(reducer.fold(None, as_byte_view(second[0])), as_byte_view(second[1]))

    assert reused.acc is acc
    reducer.finish_into(reused, as_byte_view(second[2]), as_byte_view(out))
    np.testing.assert_array_equal(out, np.full(6, 3, dtype=dtype))

"""all_reduce(x, out=...): the result written into the caller's buffer, ``out=x`` in place, over
a real coordinator, on shared memory and on the stream, with many chunks per tensor."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest
import torch

from gradstar.errors import ConfigurationError, InvalidCollectiveError

from .conftest import close_all, join_all
from .test_collectives import DTYPES, assert_matches, inputs, reference

WORLD = 3


@pytest.fixture(params=[True, False], ids=["shm", "stream"])
async def groups(coordinator, request):
    gs = await join_all(coordinator.address, WORLD, chunk_bytes=256,
                        shared_memory=request.param)
    yield gs
    await close_all(gs)


async def each(groups, call):
    return await asyncio.wait_for(asyncio.gather(*(call(g) for g in groups)), 30)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_in_place_all_reduce_matches_numpy(groups, dtype):
    xs = inputs(dtype, (5, 77))  # 385 elements: many 256-byte chunks and a short last one
    want = reference(xs, "sum", dtype)
    mine = [x.copy() for x in xs]
    outs = await each(groups, lambda g: g.all_reduce(mine[g.rank], out=mine[g.rank]))
    for g, out in zip(groups, outs, strict=True):
        assert out is mine[g.rank]
        assert_matches(out, want, dtype, "sum")


async def test_in_place_into_torch_tensors_of_every_kind(groups):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        xs = [torch.arange(300).reshape(3, 100).to(dtype) * (r + 1) for r in range(WORLD)]
        want = torch.arange(300).reshape(3, 100).to(dtype) * sum(range(1, WORLD + 1))
        outs = await each(groups, lambda g, xs=xs: g.all_reduce(xs[g.rank], out=xs[g.rank]))
        for g, out in zip(groups, outs, strict=True):
            assert out is xs[g.rank] and torch.equal(out, want), dtype


async def test_into_another_buffer_leaves_the_input_alone(groups):
    xs = inputs(np.float32, (40,))
    outs_given = [np.full(40, np.nan, dtype=np.float32) for _ in range(WORLD)]
    before = [x.copy() for x in xs]
    await each(groups, lambda g: g.all_reduce(xs[g.rank], op="max", out=outs_given[g.rank]))
    want = reference(xs, "max", np.float32)
    for x, kept, out in zip(xs, before, outs_given, strict=True):
        np.testing.assert_array_equal(x, kept)
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize(("out", "error", "message"), [
    (np.zeros(4, dtype=np.float64), InvalidCollectiveError, "out= must match the input"),
    (np.zeros(5, dtype=np.float32), InvalidCollectiveError, "out= must match the input"),
    (np.zeros(8, dtype=np.float32)[::2], ConfigurationError, "writable, C-contiguous"),
    (torch.zeros(4, 2)[:, 0], ConfigurationError, "writable, C-contiguous"),
    (torch.zeros(4, device="meta"), ConfigurationError, "Tensor on meta"),
    ([0.0] * 4, ConfigurationError, "got list"),
    (np.zeros(4, dtype=ml_dtypes.bfloat16), InvalidCollectiveError, "dtype float32"),
], ids=["dtype", "shape", "strided", "strided-tensor", "meta", "list", "bf16"])
async def test_a_bad_out_is_refused_before_anything_is_sent(coordinator, out, error, message):
    (g,) = await join_all(coordinator.address, 1, job="bad-out")
    try:
        with pytest.raises(error, match=message):
            g.all_reduce(np.ones(4, dtype=np.float32), out=out)
        # Nothing was issued: the next collective still works and takes the next seq.
        result = await asyncio.wait_for(g.all_reduce(np.ones(4, dtype=np.float32)), 20)
        np.testing.assert_array_equal(result, np.ones(4))
    finally:
        await close_all([g])


async def test_a_small_collective_of_more_chunks_than_the_read_window_is_exact(groups):
    # 40 KB in 256-byte chunks: on the stream, 160 chunks in one message with the header, more
    # than the hub's read window lets it take before the collective matches (the rest waits
    # for the reader); the result must be exact all the same.
    xs = [np.arange(10_000, dtype=np.int32) * (r + 1) for r in range(WORLD)]
    outs = await each(groups, lambda g: g.all_reduce(xs[g.rank]))
    want = np.arange(10_000, dtype=np.int32) * sum(range(1, WORLD + 1))
    for out in outs:
        np.testing.assert_array_equal(out, want)

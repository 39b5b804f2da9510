"""Every collective x every dtype against a numpy reference, over a real coordinator.

Ranks here are AsyncProcessGroups in one process (real sockets, real server); the tests with
real OS processes live in test_multiprocess.py.
"""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest
import torch

from .conftest import close_all, join_all

WORLD = 3
DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int64]
OPS = ["sum", "mean", "min", "max", "prod"]
# Small chunks force many chunk frames per tensor, with a short last chunk.
CHUNK_BYTES = 256


def inputs(dtype, shape, world=WORLD):
    rng = np.random.default_rng(1234)
    if np.dtype(dtype).kind == "i":
        return [rng.integers(-50, 50, size=shape).astype(dtype) for _ in range(world)]
    return [rng.uniform(0.5, 1.5, size=shape).astype(dtype) for _ in range(world)]


def reference(xs, op, dtype):
    acc_dtype = np.float32 if dtype in (np.float16, ml_dtypes.bfloat16) else dtype
    stack = np.stack([x.astype(acc_dtype) for x in xs])
    result = {
        "sum": lambda: stack.sum(axis=0, dtype=acc_dtype),
        "mean": lambda: stack.sum(axis=0, dtype=acc_dtype) / len(xs),
        "min": lambda: stack.min(axis=0),
        "max": lambda: stack.max(axis=0),
        "prod": lambda: stack.prod(axis=0, dtype=acc_dtype),
    }[op]()
    return np.asarray(result).astype(dtype)


def assert_matches(got, want, dtype, op):
    assert got.dtype == np.dtype(dtype) and got.shape == want.shape
    if np.dtype(dtype).kind == "i" or op in ("min", "max"):
        np.testing.assert_array_equal(got, want)
    else:
        # The hub folds ranks in arrival order, so float sums may differ from numpy's order by
        # rounding; the bound is a few ulps of the accumulation dtype, cast to the wire dtype.
        rtol = {np.float64: 1e-12, np.float32: 1e-6}.get(dtype, 1e-2)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol)


@pytest.fixture
async def groups(coordinator):
    gs = await join_all(coordinator.address, WORLD, chunk_bytes=CHUNK_BYTES)
    yield gs
    await close_all(gs)


async def run_all(groups, call):
    return await asyncio.wait_for(asyncio.gather(*(call(g) for g in groups)), 30)


@pytest.mark.parametrize(("op", "dtype"), [
    (op, dtype) for op in OPS for dtype in DTYPES
    # mean of integers is rejected: test_mean_of_ints_is_rejected
    if not (op == "mean" and np.dtype(dtype).kind == "i")
], ids=str)
async def test_all_reduce_matches_numpy(groups, dtype, op):
    xs = inputs(dtype, (7, 61))
    outs = await run_all(groups, lambda g: g.all_reduce(xs[g.rank], op=op))
    want = reference(xs, op, dtype)
    for out in outs:
        assert_matches(out, want, dtype, op)
    # Every rank received the very same reduced bytes.
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)


async def test_mean_of_ints_is_rejected(groups):
    from gradstar.errors import InvalidCollectiveError

    xs = inputs(np.int32, (5,))
    results = await asyncio.wait_for(asyncio.gather(
        *(g.all_reduce(xs[g.rank], op="mean") for g in groups), return_exceptions=True), 10)
    for r in results:
        assert isinstance(r, InvalidCollectiveError)
        assert "op='mean' is not defined for int32" in str(r)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_broadcast_from_every_source(groups, dtype):
    xs = inputs(dtype, (5, 33))
    for src in range(WORLD):
        outs = await run_all(groups, lambda g, s=src: g.broadcast(xs[g.rank], src=s))
        for out in outs:
            np.testing.assert_array_equal(out, xs[src])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_all_gather_returns_every_rank_in_order(groups, dtype):
    xs = inputs(dtype, (3, 50))
    outs = await run_all(groups, lambda g: g.all_gather(xs[g.rank]))
    for out in outs:
        assert len(out) == WORLD
        for r in range(WORLD):
            np.testing.assert_array_equal(out[r], xs[r])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["sum", "max"])
async def test_reduce_scatter_keeps_own_shard(groups, dtype, op):
    xs = inputs(dtype, (WORLD * 4, 45))
    outs = await run_all(groups, lambda g: g.reduce_scatter(xs[g.rank], op=op))
    want = reference(xs, op, dtype)
    for r, out in enumerate(outs):
        assert_matches(out, want[r * 4:(r + 1) * 4], dtype, op)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (4, 0, 3)], ids=str)
async def test_degenerate_shapes(groups, shape):
    xs = inputs(np.float32, shape)
    outs = await run_all(groups, lambda g: g.all_reduce(xs[g.rank], op="max"))
    for out in outs:
        assert out.shape == shape
        np.testing.assert_array_equal(out, reference(xs, "max", np.float32))
    gathered = await run_all(groups, lambda g: g.all_gather(xs[g.rank]))
    assert all(o[r].shape == shape for o in gathered for r in range(WORLD))


async def test_barrier_waits_for_every_rank(groups):
    first, *rest = groups
    early = asyncio.ensure_future(first.barrier())
    await asyncio.sleep(0.3)
    assert not early.done(), "barrier finished before the other ranks reached it"
    await asyncio.wait_for(asyncio.gather(early, *(g.barrier() for g in rest)), 10)


async def test_concurrent_collectives_match_by_call_order(groups):
    """Several collectives in flight at once, awaited in a different order than issued."""
    xs = [inputs(np.float64, (100,))[i] for i in range(WORLD)]

    async def issue(g):
        a = g.all_reduce(xs[g.rank] * 1, op="sum")
        b = g.all_reduce(xs[g.rank] * 2, op="sum")
        c = g.all_gather(np.array([g.rank]))
        return await asyncio.gather(c, b, a)

    outs = await run_all(groups, issue)
    total = sum(xs)
    for c, b, a in outs:
        np.testing.assert_allclose(a, total)
        np.testing.assert_allclose(b, 2 * total)
        assert [int(v[0]) for v in c] == list(range(WORLD))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
async def test_torch_tensors_in_torch_tensors_out(groups, dtype):
    xs = [torch.arange(40).reshape(4, 10).to(dtype) + r for r in range(WORLD)]
    outs = await run_all(groups, lambda g: g.all_reduce(xs[g.rank], op="sum"))
    want = sum(x.to(torch.float32) for x in xs).to(dtype)
    for out in outs:
        assert isinstance(out, torch.Tensor) and out.dtype == dtype
        assert torch.equal(out, want)
    gathered = await run_all(groups, lambda g: g.all_gather(xs[g.rank]))
    for out in gathered:
        assert all(torch.equal(out[r], xs[r]) for r in range(WORLD))


async def test_input_is_not_modified(groups):
    xs = inputs(np.float32, (64,))
    copies = [x.copy() for x in xs]
    await run_all(groups, lambda g: g.all_reduce(xs[g.rank], op="sum"))
    for x, c in zip(xs, copies, strict=True):
        np.testing.assert_array_equal(x, c)


async def test_jobs_on_one_coordinator_are_isolated(coordinator):
    """Two jobs issue the same seq numbers at once; each gets only its own ranks' data."""
    a = await join_all(coordinator.address, 2, job="job-a", chunk_bytes=CHUNK_BYTES)
    b = await join_all(coordinator.address, 3, job="job-b", chunk_bytes=CHUNK_BYTES)
    try:
        outs = await asyncio.wait_for(asyncio.gather(
            *(g.all_reduce(np.full(100, 1.0)) for g in a),
            *(g.all_reduce(np.full(100, 10.0)) for g in b)), 20)
        for out in outs[:2]:
            np.testing.assert_array_equal(out, np.full(100, 2.0))
        for out in outs[2:]:
            np.testing.assert_array_equal(out, np.full(100, 30.0))
        assert {g.generation for g in a + b} == {1}
    finally:
        await close_all(a + b)

"""all_reduce_coalesced: lists of numpy arrays and torch tensors over a real coordinator.

Ranks are AsyncProcessGroups in this process (real sockets, real server), and for the blocking
form ProcessGroups on threads.
"""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest
import torch

import gradstar
from gradstar.client import device
from gradstar.errors import ConfigurationError, InvalidCollectiveError
from tests.integration.conftest import close_all, join_all

WORLD = 3
# A few hundred bytes: the arrays below need several buckets per dtype.
TINY_MB = 300 / (1 << 20)
SHAPES = [(7, 61), (5,), (), (3, 4, 2), (0, 3), (1,)]
FLOATS = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
INTS = [np.int32, np.int64]


def arrays_of(rank: int, dtypes) -> list[np.ndarray]:
    """Every shape in every dtype, interleaved (so the dtypes' buckets interleave too)."""
    rng = np.random.default_rng(100 + rank)
    out = []
    for shape in SHAPES:
        for dtype in dtypes:
            if np.dtype(dtype).kind == "i":
                out.append(rng.integers(-50, 50, size=shape).astype(dtype))
            else:
                out.append(rng.uniform(0.5, 1.5, size=shape).astype(dtype))
    return out


def expected(per_rank: list[list[np.ndarray]], op: str) -> list[np.ndarray]:
    want = []
    for xs in zip(*per_rank, strict=True):
        dtype = xs[0].dtype
        acc = np.float32 if dtype in (np.float16, ml_dtypes.bfloat16) else dtype
        total = np.stack([x.astype(acc) for x in xs]).sum(axis=0, dtype=acc)
        want.append(np.asarray(total / len(xs) if op == "mean" else total).astype(dtype))
    return want


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "i":
        np.testing.assert_array_equal(got, want)
    else:
        rtol = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6}.get(want.dtype, 1e-2)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol)


@pytest.fixture
async def groups(coordinator):
    gs = await join_all(coordinator.address, WORLD, chunk_bytes=256)
    yield gs
    await close_all(gs)


async def each(groups, call):
    return await asyncio.wait_for(asyncio.gather(*(call(g) for g in groups)), 30)


@pytest.mark.parametrize(("op", "dtypes"), [("sum", FLOATS + INTS), ("mean", FLOATS)])
async def test_numpy_arrays_of_every_dtype_and_shape(groups, op, dtypes):
    per_rank = [arrays_of(r, dtypes) for r in range(WORLD)]

    outs = await each(groups, lambda g: g.all_reduce_coalesced(per_rank[g.rank], op=op,
                                                               bucket_cap_mb=TINY_MB))

    want = expected(per_rank, op)
    for out in outs:
        assert len(out) == len(want)
        for got, w in zip(out, want, strict=True):
            assert isinstance(got, np.ndarray)
            assert_same(got, w)


@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "staged"])
@pytest.mark.parametrize("op", ["sum", "mean"])
async def test_torch_tensors_come_back_as_tensors_of_their_dtype(groups, op, staged,
                                                                 monkeypatch):
    if staged:  # CPU tensors take a CUDA tensor's path: host copies out, new tensors back
        monkeypatch.setattr(device, "STAGED_DEVICES", ("cuda", "cpu"))
    dtypes = FLOATS if op == "mean" else FLOATS + INTS
    per_rank = [arrays_of(r, dtypes) for r in range(WORLD)]

    def tensors(rank):
        return [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                if a.dtype == ml_dtypes.bfloat16 else torch.from_numpy(a.copy())
                for a in per_rank[rank]]

    outs = await each(groups, lambda g: g.all_reduce_coalesced(tensors(g.rank), op=op,
                                                               bucket_cap_mb=TINY_MB))

    want = expected(per_rank, op)
    for out in outs:
        for got, sent, w in zip(out, tensors(0), want, strict=True):
            assert isinstance(got, torch.Tensor)
            assert got.dtype == sent.dtype and got.shape == sent.shape
            as_numpy = (got.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                        if got.dtype == torch.bfloat16 else got.numpy())
            assert_same(as_numpy, w)


async def test_default_cap_sends_one_bucket_per_dtype(groups):
    per_rank = [[np.full(4, r, np.float32), np.full(3, r, np.float64), np.full(2, r, np.float32)]
                for r in range(WORLD)]
    outs = await each(groups, lambda g: g.all_reduce_coalesced(per_rank[g.rank]))
    for out in outs:
        assert [o.tolist() for o in out] == [[1.0] * 4, [1.0] * 3, [1.0] * 2]


async def test_empty_list_gives_empty_list(groups):
    assert await each(groups, lambda g: g.all_reduce_coalesced([])) == [[]] * WORLD


async def test_mean_of_integers_is_rejected_on_every_rank(groups):
    results = await asyncio.wait_for(asyncio.gather(
        *(g.all_reduce_coalesced([np.ones(3, np.int32)], op="mean") for g in groups),
        return_exceptions=True), 30)
    assert all(isinstance(r, InvalidCollectiveError) for r in results)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"op": "median"}, "unknown reduce op 'median'"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a positive number"),
])
async def test_bad_arguments_raise_before_anything_is_sent(groups, kwargs, message):
    for g in groups:
        with pytest.raises(ConfigurationError, match=message):
            g.all_reduce_coalesced([np.ones(3, np.float32)], **kwargs)
    # No rank consumed a sequence number: the next collective still matches.
    outs = await each(groups, lambda g: g.all_reduce(np.ones(2, np.float32)))
    assert all(o.tolist() == [3.0, 3.0] for o in outs)


async def test_unsupported_element_type_is_a_configuration_error(groups):
    with pytest.raises(ConfigurationError, match="expected a numpy array or a torch tensor"):
        groups[0].all_reduce_coalesced([[1.0, 2.0]])


async def test_blocking_process_group_wraps_it_with_async_op(coordinator):
    def rank_main(rank: int):
        with gradstar.init_process_group(coordinator=coordinator.address, job="coalesced-sync",
                                         world_size=2, rank=rank, timeout=20,
                                         join_timeout=20) as pg:
            xs = [np.full((2, 3), rank + 1, np.float32), torch.full((4,), rank + 1.0)]
            blocking = pg.all_reduce_coalesced(xs, op="sum", bucket_cap_mb=TINY_MB)
            work = pg.all_reduce_coalesced(xs, op="mean", async_op=True)
            return blocking, work.wait(timeout=20)

    results = await asyncio.wait_for(asyncio.gather(
        *(asyncio.to_thread(rank_main, r) for r in range(2))), 60)
    for blocking, averaged in results:
        assert isinstance(blocking[0], np.ndarray) and isinstance(blocking[1], torch.Tensor)
        np.testing.assert_array_equal(blocking[0], np.full((2, 3), 3.0, np.float32))
        assert blocking[1].tolist() == [3.0] * 4
        np.testing.assert_array_equal(averaged[0], np.full((2, 3), 1.5, np.float32))
        assert averaged[1].tolist() == [1.5] * 4

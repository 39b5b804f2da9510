"""Reducing collectives in compressed wire formats, over a real coordinator (and real shard
processes) on 127.0.0.1:0.

The contract under test: with ``wire=`` every reducing collective gives every rank the same
result, within the error bound that the codec documents (each rank's round trip, float32
accumulation, and one more round trip of the result), against a float64 reference; the bytes
that cross are the encoded ones; NaN and Inf are carried; ranks that disagree on the format
get a CollectiveMismatchError naming both calls; a format that cannot apply is refused before
anything is sent, and the group goes on working.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar import errors
from gradstar.wire.formats import FORMATS, error_bound

from .conftest import close_all, join_all

NAMES = sorted(FORMATS)
# 1 KiB chunks of float32: 256 elements, four blocks of 64, so a few thousand elements make
# many chunks; lengths that are no multiple of anything leave short last blocks and chunks.
CHUNK_BYTES = 1024


def inputs(world: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Magnitudes that differ per region, so block scales differ.
    scale = np.repeat(10.0 ** rng.uniform(-3, 3, size=-(-n // 100)), 100)[:n]
    return [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(world)]


def input_bound(name: str, x: np.ndarray, segments: int) -> np.ndarray:
    """The round-trip bound of ``x`` as a rank encodes it: each segment from its own start."""
    return np.concatenate([error_bound(name, s) for s in np.split(x.reshape(-1), segments)])


def result_bound(name: str, xs: list[np.ndarray], op: str, segments: int = 1) -> np.ndarray:
    """Bound on |result - float64 reference|: every rank's round trip, float32 accumulation,
    and the result's own round trip (bounded from above through |sum| + the errors so far)."""
    world = len(xs)
    ins = sum(input_bound(name, x, segments) for x in xs)
    mags = sum(np.abs(x.astype(np.float64)).reshape(-1) for x in xs)
    acc = 2.0**-20 * mags
    before = ins + acc
    high = mags + before
    if op == "mean":
        before, high = before / world, high / world
    if segments == 1:
        return before + error_bound(name, high.astype(np.float32)).reshape(before.shape)
    return before  # the caller adds the result's bound on its own segment


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack([x.astype(np.float64) for x in xs])
    return {"sum": stack.sum(0), "mean": stack.mean(0), "min": stack.min(0),
            "max": stack.max(0), "prod": stack.prod(0)}[op]


async def all_reduce_everywhere(groups, xs, op, wire):
    return await asyncio.gather(*(g.all_reduce(x, op, wire=wire)
                                  for g, x in zip(groups, xs, strict=True)))


@pytest.mark.parametrize("shards", [0, 2])
async def test_every_format_and_op_is_within_its_bound_on_every_rank(start_coordinator, shards):
    coordinator = await start_coordinator(shards=shards) if shards else await start_coordinator()
    for world in (2, 4):
        groups = await join_all(coordinator.address, world, job=f"w{world}",
                                chunk_bytes=CHUNK_BYTES)
        try:
            for name in NAMES:
                ops = ["sum", "mean", "min", "max"] + (["prod"] if not FORMATS[name].block
                                                       else [])
                for op in ops:
                    xs = inputs(world, 3001, seed=world)
                    if op == "prod":  # keep products in range
                        xs = [np.float32(1) + x / np.float32(1e4) for x in xs]
                    results = await all_reduce_everywhere(groups, xs, op, name)
                    for r in results[1:]:
                        np.testing.assert_array_equal(r, results[0])
                    assert results[0].dtype == np.float32 and results[0].shape == xs[0].shape
                    err = np.abs(results[0].astype(np.float64) - reference(xs, op))
                    bound = result_bound(name, xs, op)
                    if op == "prod":  # relative errors of the factors add up
                        bound = np.abs(reference(xs, op)) * (world + 1) * 2.0**-7
                    assert (err <= bound).all(), (world, name, op, np.max(err - bound))
                    assert err.max() > 0 or name == "fp16"  # it really went through the codec
        finally:
            await close_all(groups)


@pytest.mark.parametrize("shards", [0, 2])
async def test_reduce_scatter_in_every_format_is_within_its_bound(start_coordinator, shards):
    coordinator = await start_coordinator(shards=shards) if shards else await start_coordinator()
    world = 3
    groups = await join_all(coordinator.address, world, job="rs", chunk_bytes=CHUNK_BYTES)
    try:
        for name in NAMES:
            for op in ("sum", "mean"):
                xs = [x.reshape(world * 7, 53) for x in inputs(world, world * 7 * 53, seed=5)]
                results = await asyncio.gather(*(g.reduce_scatter(x, op, wire=name)
                                                 for g, x in zip(groups, xs, strict=True)))
                ref = reference(xs, op)
                before = result_bound(name, xs, op, segments=world).reshape(ref.shape)
                for rank, got in enumerate(results):
                    assert got.shape == (7, 53)
                    part = slice(rank * 7, (rank + 1) * 7)
                    high = (np.abs(ref[part]) + 2 * before[part]).astype(np.float32)
                    bound = before[part] + error_bound(name, high).reshape(7, 53)
                    err = np.abs(got.astype(np.float64) - ref[part])
                    assert (err <= bound).all(), (name, op, rank, np.max(err - bound))
    finally:
        await close_all(groups)


async def test_the_encoded_bytes_are_what_crosses(coordinator):
    groups = await join_all(coordinator.address, 2, job="bytes")
    n = 1 << 16
    try:
        xs = inputs(2, n, seed=1)
        await all_reduce_everywhere(groups, xs, "sum", None)
        plain = coordinator.rendezvous.jobs["bytes"].counters.bytes_in
        for name in NAMES:
            before = coordinator.rendezvous.jobs["bytes"].counters.bytes_in
            await all_reduce_everywhere(groups, xs, "sum", name)
            sent = coordinator.rendezvous.jobs["bytes"].counters.bytes_in - before
            assert sent == 2 * FORMATS[name].encoded_nbytes(n), name
            assert sent <= plain * (0.5 if name in ("bf16", "fp16") else
                                    0.27 if name == "int8" else 0.15)
    finally:
        await close_all(groups)


@pytest.mark.parametrize("name", NAMES)
async def test_nan_and_inf_are_carried_and_do_not_spread(coordinator, name):
    groups = await join_all(coordinator.address, 2, job=f"nan-{name}", chunk_bytes=CHUNK_BYTES)
    try:
        xs = inputs(2, 1000, seed=3)
        xs = [np.clip(x, -1000, 1000) for x in xs]
        xs[0][10], xs[1][500], xs[0][700], xs[1][701] = np.nan, np.inf, -np.inf, -np.inf
        results = await all_reduce_everywhere(groups, xs, "sum", name)
        got = results[0]
        assert np.isnan(got[10]) and got[500] == np.inf and got[700] == got[701] == -np.inf
        others = np.ones(1000, bool)
        others[[10, 500, 700, 701]] = False
        assert np.isfinite(got[others]).all()
    finally:
        await close_all(groups)


async def test_ranks_that_disagree_on_the_format_are_named_on_every_rank(start_coordinator):
    coordinator = await start_coordinator(shards=2)
    groups = await join_all(coordinator.address, 3, job="mismatch", chunk_bytes=CHUNK_BYTES)
    try:
        x = np.ones(5000, np.float32)
        outcomes = await asyncio.gather(
            groups[0].all_reduce(x, wire="int8"), groups[1].all_reduce(x, wire="int8"),
            groups[2].all_reduce(x, wire="bf16"), return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, errors.CollectiveMismatchError), outcome
            message = str(outcome)
            assert "wire differs" in message
            assert "wire='int8'" in message and "wire='bf16'" in message
            assert "rank 2" in message
        # One rank without a format, against one with it.
        outcomes = await asyncio.gather(
            groups[0].reduce_scatter(np.ones((6, 64), np.float32)),
            groups[1].reduce_scatter(np.ones((6, 64), np.float32), wire="int4"),
            groups[2].reduce_scatter(np.ones((6, 64), np.float32)), return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, errors.CollectiveMismatchError), outcome
            assert "wire='int4'" in str(outcome) and "wire differs" in str(outcome)
    finally:
        await close_all(groups)


async def test_a_format_that_cannot_apply_is_refused_before_anything_is_sent(coordinator):
    groups = await join_all(coordinator.address, 2, job="refused")
    try:
        g = groups[0]
        with pytest.raises(errors.ConfigurationError, match="int32 tensor travels exactly"):
            g.all_reduce(np.ones(8, np.int32), wire="int8")
        with pytest.raises(errors.ConfigurationError, match="op='prod' does not take"):
            g.all_reduce(np.ones(8, np.float32), "prod", wire="int4")
        with pytest.raises(errors.ConfigurationError, match="'int2' is not supported"):
            g.reduce_scatter(np.ones((2, 8), np.float32), wire="int2")
        # Nothing went out and no sequence number was taken: the ranks still match.
        results = await asyncio.gather(*(h.all_reduce(np.ones(8, np.float32), wire="bf16")
                                         for h in groups))
        np.testing.assert_array_equal(results[1], np.full(8, 2, np.float32))
    finally:
        await close_all(groups)


async def test_other_float_dtypes_travel_encoded_and_come_back_in_their_dtype(coordinator):
    groups = await join_all(coordinator.address, 2, job="dtypes", chunk_bytes=CHUNK_BYTES)
    try:
        for dtype in (np.float64, np.float16):
            xs = [x.astype(dtype) for x in inputs(2, 999, seed=9)]
            xs = [np.clip(x, -100, 100) for x in xs]
            results = await all_reduce_everywhere(groups, xs, "mean", "int8")
            assert results[0].dtype == dtype
            ref = reference(xs, "mean")
            as32 = [x.astype(np.float32) for x in xs]
            slack = 2.0**-10 * np.abs(ref) if dtype == np.float16 else 0
            bound = result_bound("int8", as32, "mean") + slack
            assert (np.abs(results[0].astype(np.float64) - ref) <= bound).all(), dtype
    finally:
        await close_all(groups)


async def test_coalesced_buckets_encode_their_floats_and_keep_integers_exact(coordinator):
    groups = await join_all(coordinator.address, 2, job="coalesced", chunk_bytes=CHUNK_BYTES)
    try:
        xs = inputs(2, 1500, seed=11)
        lists = [[x[:1000].reshape(10, 100), np.arange(7, dtype=np.int32) * (g.rank + 1),
                  x[1000:]] for g, x in zip(groups, xs, strict=True)]
        results = await asyncio.gather(*(g.all_reduce_coalesced(arrays, "sum", wire="int8")
                                         for g, arrays in zip(groups, lists, strict=True)))
        got = results[0]
        np.testing.assert_array_equal(got[1], np.arange(7, dtype=np.int32) * 3)
        assert got[1].dtype == np.int32
        flat = np.concatenate([got[0].reshape(-1), got[2]])
        # One float32 bucket: the two float arrays end to end, encoded as one tensor.
        err = np.abs(flat.astype(np.float64) - reference(xs, "sum"))
        assert (err <= result_bound("int8", xs, "sum")).all()
        assert err.max() > 0
    finally:
        await close_all(groups)


@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
async def test_outer_rounds_take_encoded_pseudo_gradients_and_keep_the_model_float32(
        coordinator, name):
    world, n, lr = 3, 2000, 0.7
    groups = await join_all(coordinator.address, world, job=f"diloco-{name}",
                            chunk_bytes=CHUNK_BYTES)
    try:
        start = inputs(1, n, seed=20)[0]
        seeded = await asyncio.gather(*(g.sync_global_model(start, model="m", rule="seed")
                                        for g in groups))
        # The seed travels in float32 (the mean of three equal vectors, to float32 rounding).
        np.testing.assert_allclose(seeded[2], start, rtol=2**-22)
        start = seeded[0]
        grads = [x / np.float32(100) for x in inputs(world, n, seed=21)]
        new = await asyncio.gather(*(g.sync_global_model(d, model="m", rule="outer_sgd",
                                                         outer_lr=lr, wire=name)
                                     for g, d in zip(groups, grads, strict=True)))
        for r in new[1:]:
            np.testing.assert_array_equal(r, new[0])
        assert new[0].dtype == np.float32
        # The model the hub keeps is exactly what the ranks got back: float32, not re-encoded.
        stored = coordinator.averaging.models(f"diloco-{name}")["m"].params
        np.testing.assert_array_equal(stored, new[0])
        want = start.astype(np.float64) - lr * reference(grads, "mean")
        bound = lr * sum(error_bound(name, d) for d in grads) / world
        bound += 2.0**-20 * (np.abs(start) + lr * np.abs(want))  # float32 arithmetic
        err = np.abs(new[0].astype(np.float64) - want)
        assert (err <= bound).all(), np.max(err - bound)
        assert err.max() > 2.0**-20 * np.abs(start).max()  # the pseudo-gradients were encoded
        # The hub read the encoded bytes: a fraction of float32's.
        detail = coordinator.rendezvous.jobs[f"diloco-{name}"].counters
        assert detail.bytes_in < world * n * 4 * (1 + FORMATS[name].ratio()) + 4096
    finally:
        await close_all(groups)

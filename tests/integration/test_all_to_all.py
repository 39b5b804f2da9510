"""all_to_all and all_to_all_single over a real coordinator on 127.0.0.1:0 and the ranks' own
peer servers (the groups of one job live in this process; tests/parallel runs them as separate
processes). Results are checked against a reference computed here."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest
import torch

from gradstar import errors
from gradstar.client.peer import tag_key

from .conftest import close_all, join_all


def splits_of(world: int, seed: int, empty: bool = True) -> list[list[int]]:
    """sends[i][j]: rows rank i sends rank j, uneven, some zero."""
    rng = np.random.default_rng(seed)
    sends = rng.integers(0, 7, size=(world, world)).tolist()
    if empty:
        sends[0][world - 1] = 0
        sends[world - 1][world - 1] = 0
    return sends


def reference(inputs: list[np.ndarray], sends: list[list[int]], rank: int) -> np.ndarray:
    """What rank ``rank`` must get: split ``rank`` of every rank's input, in rank order."""
    parts = []
    for src, x in enumerate(inputs):
        start = sum(sends[src][:rank])
        parts.append(x[start:start + sends[src][rank]])
    return np.concatenate(parts)


async def run_all(groups, call):
    return await asyncio.wait_for(asyncio.gather(*(call(g) for g in groups),
                                                 return_exceptions=True), 60)


@pytest.fixture
async def trio(coordinator):
    groups = await join_all(coordinator.address, 3, job="a2a", chunk_bytes=4096)
    yield groups
    await close_all(groups)


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_uneven_splits_match_a_local_reference(coordinator, world):
    groups = await join_all(coordinator.address, world, job=f"a2a{world}", chunk_bytes=4096)
    try:
        sends = splits_of(world, seed=world)
        row = (5, 100)  # 2 KB rows: several 4 KB chunks per split
        inputs = [np.random.default_rng(r).standard_normal((sum(sends[r]), *row))
                  for r in range(world)]
        results = await run_all(groups, lambda g: g.all_to_all_single(
            inputs[g.rank], [sends[s][g.rank] for s in range(world)], sends[g.rank]))
        for rank, got in enumerate(results):
            want = reference(inputs, sends, rank)
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    finally:
        await close_all(groups)


async def test_equal_splits_by_default_with_torch_tensors_and_every_dtype(trio):
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                  torch.int64):
        inputs = [(torch.arange(12) + 100 * r).reshape(6, 2).to(dtype) for r in range(3)]
        results = await run_all(trio, lambda g, inputs=inputs: g.all_to_all_single(
            inputs[g.rank]))
        for rank, got in enumerate(results):
            assert isinstance(got, torch.Tensor) and got.dtype == dtype
            want = torch.cat([inputs[src][2 * rank:2 * rank + 2] for src in range(3)])
            assert torch.equal(got, want), (dtype, rank)


async def test_all_to_all_lists_keep_each_arrays_shape(trio):
    def inputs_of(rank):
        return [np.full((dst + 1, rank + 1), 10 * rank + dst, np.int32) for dst in range(3)]

    results = await run_all(trio, lambda g: g.all_to_all(inputs_of(g.rank)))
    for rank, got in enumerate(results):
        assert [a.shape for a in got] == [(rank + 1, src + 1) for src in range(3)]
        assert [int(a.flat[0]) for a in got] == [10 * src + rank for src in range(3)]
    empty = await run_all(trio, lambda g: g.all_to_all([np.zeros((0, 4), ml_dtypes.bfloat16)] * 3))
    assert all(a.shape == (0, 4) and a.dtype == ml_dtypes.bfloat16 for r in empty for a in r)


async def test_concurrent_all_to_alls_and_peer_messages_do_not_mix(trio):
    sends = [[2, 2, 2], [1, 3, 2], [1, 3, 2]]
    expects = [[sends[s][r] for s in range(3)] for r in range(3)]
    firsts = [np.arange(6.0) + 10 * r for r in range(3)]
    seconds = [np.arange(12.0).reshape(6, 2) - 100 * r for r in range(3)]

    async def rank_work(g):
        r = g.rank
        # Issued together: two all_to_alls and a user message on the same peer streams.
        return await asyncio.gather(
            g.all_to_all_single(firsts[r]),
            g.all_to_all_single(seconds[r], expects[r], sends[r]),
            g.recv((r - 1) % 3, tag=0), g.send(np.array([r]), (r + 1) % 3, tag=0))

    results = await run_all(trio, rank_work)
    for rank, (first, second, note, _) in enumerate(results):
        np.testing.assert_array_equal(first, reference(firsts, [[2, 2, 2]] * 3, rank))
        np.testing.assert_array_equal(second, reference(seconds, sends, rank))
        assert note.tolist() == [(rank - 1) % 3]


async def test_mismatched_split_sizes_fail_every_rank_with_the_same_named_error(trio):
    sends = [[1, 2, 3], [0, 4, 1], [2, 2, 0]]
    expects = [[sends[s][r] for s in range(3)] for r in range(3)]
    expects[2][1] += 1  # rank 2 expects 2 rows from rank 1, which sends it 1
    inputs = [np.ones((sum(sends[r]), 3)) for r in range(3)]
    results = await run_all(trio, lambda g: g.all_to_all_single(
        inputs[g.rank], expects[g.rank], sends[g.rank]))
    assert all(isinstance(e, errors.CollectiveMismatchError) for e in results), results
    assert len({str(e) for e in results}) == 1
    assert "rank 1 sends 1 rows to rank 2 (its input_split_sizes[2] = 1) but rank 2 expects 2 " \
           "from rank 1 (its output_split_sizes[1] = 2)" in str(results[0])
    # Nothing moved, nothing is left behind: the next call works.
    again = await run_all(trio, lambda g: g.all_to_all_single(np.full(3, float(g.rank))))
    assert [a.tolist() for a in again] == [[0.0, 1.0, 2.0]] * 3
    assert all(not box.held_tags()
               for g in trio for box in g._peer_endpoint.server.mailboxes.values())


async def test_ranks_that_disagree_on_dtype_or_call_fail_every_rank(trio):
    results = await run_all(trio, lambda g: g.all_to_all_single(
        np.ones(3, np.float64 if g.rank == 1 else np.float32)))
    assert all(isinstance(e, errors.CollectiveMismatchError) and e.field == "dtype"
               for e in results), results
    assert "rank 1 passes float64 but rank 0 passes float32" in str(results[0])
    results = await run_all(trio, lambda g: g.all_reduce(np.ones(3)) if g.rank == 2
                            else g.all_to_all_single(np.ones(3)))
    assert all(isinstance(e, errors.CollectiveMismatchError) for e in results), results
    assert any("all_to_all (or all_to_all_single)" in str(e) for e in results)
    results = await run_all(trio, lambda g: g.all_to_all([np.ones(1)] * 3) if g.rank == 0
                            else g.all_to_all_single(np.ones(3)))
    assert all(isinstance(e, errors.CollectiveMismatchError) and e.field == "op"
               for e in results), results


@pytest.mark.parametrize("call, message", [
    (lambda g: g.all_to_all_single(np.ones(4)), "dim 0 (4) must be divisible by world_size 3"),
    (lambda g: g.all_to_all_single(np.ones(4), None, [1, 1, 1]), "sums to 3"),
    (lambda g: g.all_to_all_single(np.ones(3), [1, 1], [1, 1, 1]), "has 2 entries"),
    (lambda g: g.all_to_all_single(np.array(1.0)), "at least 1 dimension"),
    (lambda g: g.all_to_all([np.ones(1)] * 2), "one array per rank (3), got 2"),
    (lambda g: g.all_to_all([np.ones(1), np.ones(1, np.int64), np.ones(1)]), "share one dtype"),
])
async def test_invalid_arguments_raise_at_the_call(trio, call, message):
    with pytest.raises(errors.InvalidCollectiveError, match=message.replace("(", r"\(")
                       .replace(")", r"\)")):
        call(trio[0])


async def test_a_timed_out_all_to_all_names_the_missing_rank(trio):
    results = await run_all(trio[:2], lambda g: g.all_to_all_single(np.ones(3), timeout=0.5))
    assert all(isinstance(e, errors.CollectiveTimeoutError) and e.missing_ranks == [2]
               for e in results), results


async def test_one_rank_alone_gets_its_own_input(start_coordinator):
    coordinator = await start_coordinator()
    (g,) = await join_all(coordinator.address, 1, job="solo")
    try:
        assert (await g.all_to_all_single(np.arange(4), [4], [4])).tolist() == [0, 1, 2, 3]
        assert [a.tolist() for a in await g.all_to_all([np.arange(2)])] == [[0, 1]]
    finally:
        await close_all([g])


async def test_plans_through_a_sharded_hub(start_coordinator):
    coordinator = await start_coordinator(shards=2)
    groups = await join_all(coordinator.address, 3, job="a2a-shards")
    try:
        assert all(len(g.shards) == 2 for g in groups)
        sends = splits_of(3, seed=7)
        inputs = [np.arange(sum(sends[r]) * 2, dtype=np.int64).reshape(-1, 2) + 1000 * r
                  for r in range(3)]
        results = await run_all(groups, lambda g: g.all_to_all_single(
            inputs[g.rank], [sends[s][g.rank] for s in range(3)], sends[g.rank]))
        for rank, got in enumerate(results):
            np.testing.assert_array_equal(got, reference(inputs, sends, rank))
    finally:
        await close_all(groups)


async def test_the_blocking_group_wraps_the_same_calls(coordinator):
    import gradstar

    def rank(r):
        with gradstar.init_process_group(coordinator=coordinator.address, job="a2a-sync",
                                         world_size=2, rank=r, timeout=20) as pg:
            work = pg.all_to_all_single(np.arange(4) + 10 * r, [1, 3] if r else [3, 1],
                                        [3, 1] if r == 0 else [1, 3], async_op=True)
            return work.wait(timeout=30).tolist(), [a.tolist() for a in pg.all_to_all(
                [np.array([r, 0]), np.array([r, 1])])]

    (single0, list0), (single1, list1) = await asyncio.wait_for(asyncio.gather(
        asyncio.to_thread(rank, 0), asyncio.to_thread(rank, 1)), 60)
    assert single0 == [0, 1, 2, 10] and single1 == [3, 11, 12, 13]
    assert list0 == [[0, 0], [1, 0]] and list1 == [[0, 1], [1, 1]]


async def test_a_posted_receive_takes_its_payload_in_place_and_only_when_it_fits(trio):
    a, b, _ = trio
    x = np.arange(5000, dtype=np.float32)  # 5 chunks of 4 KB
    peers = b._peer_endpoint
    tag = "in place"
    key = tag_key(tag)
    for into, in_place in [(np.zeros(5000, np.float32), True),
                           (np.zeros((50, 100), np.float32), True),  # same bytes, other shape
                           (np.zeros(5000, np.float64), False), (np.zeros(4999, np.float32),
                                                                 False)]:
        before = into.copy()
        receiving = asyncio.ensure_future(peers.recv(0, key, 10, into))
        await asyncio.sleep(0.01)  # posted before the message arrives
        await a.send(x, 1, tag=tag)
        got, _ = await asyncio.wait_for(receiving, 10)
        assert (got is into) == in_place
        np.testing.assert_array_equal(got.reshape(-1), x)
        if not in_place:
            np.testing.assert_array_equal(into, before)

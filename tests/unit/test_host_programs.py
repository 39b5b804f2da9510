"""The two-level collectives' programs (:mod:`gradstar.client.hierarchy.programs`) run by the real
interpreter (:class:`HostHierarchy`) against an in-memory hub, without sockets: every op equals
its flat definition on contiguous, non-contiguous and uneven host layouts; calls in flight at
once pair up by the order they were made however their stages' timing differs between ranks;
a failed stage fails the other ranks' later stages at once rather than at their timeout."""

from __future__ import annotations

import asyncio
import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest

from gradstar import ops
from gradstar.client.hierarchy import HostHierarchy, plan, two_level
from gradstar.client.hierarchy.two_level import MAX_SEGMENTS, MIN_SEGMENT_BYTES, segments
from gradstar.errors import CollectiveError, CollectiveMismatchError
from gradstar.proto.v1 import collective_pb2 as pb

SUM, MAX, MEAN = pb.REDUCE_OP_SUM, pb.REDUCE_OP_MAX, pb.REDUCE_OP_MEAN
_REDUCE = {SUM: np.add, MAX: np.maximum, pb.REDUCE_OP_MIN: np.minimum,
           pb.REDUCE_OP_PROD: np.multiply}


class Hub:
    """Matches collectives by (group, seq), as the real hub does, checks the fields it checks
    and completes each after a random delay (so stages end in different orders on different
    ranks). ``fail`` names (group, seq) pairs to fail instead."""

    def __init__(self, seed: int, fail: frozenset = frozenset()) -> None:
        self.random = random.Random(seed)
        self.fail = fail
        self.pending: dict[tuple[str, int], dict[int, tuple]] = {}
        self.ended: dict[tuple[str, int], CollectiveError] = {}
        self.sizes: dict[str, int] = {}

    def arrive(self, group: str, seq: int, rank: int, call: tuple) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if (group, seq) in self.ended:  # given up before this rank came: the same error
            future.set_exception(self.ended[(group, seq)])
            return future
        arrivals = self.pending.setdefault((group, seq), {})
        arrivals[rank] = (*call, future)
        if len(arrivals) == self.sizes[group]:
            del self.pending[(group, seq)]
            asyncio.get_running_loop().call_later(self.random.uniform(0, 0.01), self._complete,
                                                  group, seq, arrivals)
        return future

    def give_up(self, group: str, seq: int, rank: int) -> None:
        error = CollectiveError(f"rank {rank} of {group} gave up seq {seq}")
        self.ended[(group, seq)] = error
        for *_, future in self.pending.pop((group, seq), {}).values():
            future.set_exception(error)

    def _complete(self, group: str, seq: int, arrivals: dict) -> None:
        first = arrivals[min(arrivals)][:5]
        error = None
        if (group, seq) in self.fail:
            error = CollectiveError(f"{group} seq {seq} failed (injected)")
        for rank, call in arrivals.items():
            if call[:5] != first:
                error = CollectiveMismatchError(f"{group} seq {seq}: rank {rank} sent {call[:5]}, "
                                                f"another {first}")
        if error is None:
            self._compute(arrivals)
        for *_, future in arrivals.values():
            if future.done():  # given up meanwhile
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(None)

    @staticmethod
    def _compute(arrivals: dict) -> None:
        op, reduce_op, root = arrivals[0][0], arrivals[0][1], arrivals[0][2]
        ranks = sorted(arrivals)
        sends = {r: arrivals[r][5] for r in ranks}
        if op in (ops.ALL_REDUCE, ops.REDUCE_SCATTER):
            total = sends[ranks[0]].copy()
            for r in ranks[1:]:
                _REDUCE[reduce_op](total, sends[r], out=total)
            m = total.shape[0] // len(ranks)
            for r in ranks:
                part = total if op == ops.ALL_REDUCE else total[r * m:(r + 1) * m]
                np.copyto(arrivals[r][6], part)
        elif op == ops.BROADCAST:
            for r in ranks:
                if r != root:
                    np.copyto(arrivals[r][6], sends[root])
        elif op == ops.ALL_GATHER:
            for r in ranks:
                for s in ranks:
                    arrivals[r][6][s] = sends[s][s]


class FakeGroup:
    """One rank's member of one group, with the reserve/run/give_up calls of
    :class:`AsyncProcessGroup`, its seqs taken at reservation as there."""

    def __init__(self, hub: Hub, name: str, rank: int) -> None:
        self.hub, self.name, self.rank, self.seq = hub, name, rank, 0

    def reserve(self, op, like, *, reduce_op=0, root=0, timeout=None, wire=None):
        # wire: the real group's argument (a leaders' stage's format); these stages take none.
        self.seq += 1
        return (self.seq, (op, reduce_op, root, like.shape, like.dtype.str))

    def run_reserved(self, reserved, send, out):
        seq, fields = reserved
        future = self.hub.arrive(self.name, seq, self.rank, (*fields, send, out))

        async def run():
            await future
            return out

        return asyncio.ensure_future(run())

    def give_up(self, reserved) -> None:
        self.hub.give_up(self.name, reserved[0], self.rank)

    async def close(self) -> None:
        pass


async def _ranks(hub: Hub, hosts: dict[int, str]) -> list[HostHierarchy]:
    """Every rank's started HostHierarchy over ``hub``."""
    result = []
    for rank in sorted(hosts):
        session = SimpleNamespace(failure=None, failure_within=_never, verdict=_none, ride=None)
        group = SimpleNamespace(rank=rank, job="j", generation=1, shards=["s"], session=session,
                                settings=SimpleNamespace(hierarchical=True, join_timeout=5))

        async def join(job, size, member, rank=rank):
            name = job.rsplit("/", 1)[1]
            hub.sizes[name] = size
            return FakeGroup(hub, name, member)

        hierarchy = HostHierarchy(group, hosts, join)
        await hierarchy.start()
        result.append(hierarchy)
    return result


async def _never(timeout):
    await asyncio.sleep(timeout)


async def _none():
    return None


def _same(x):
    return x


def _inputs(world: int, dtype, rows: int = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    if np.dtype(dtype).kind == "i":
        return [rng.integers(-(1 << 30), 1 << 30, (rows, 3)).astype(dtype) for _ in range(world)]
    return [rng.standard_normal((rows, 3)).astype(dtype) for _ in range(world)]


LAYOUTS = {
    "2x2 contiguous": {0: "a", 1: "a", 2: "b", 3: "b"},
    "2x2 interleaved": {0: "a", 1: "b", 2: "a", 3: "b"},
    "3x2 shuffled": {0: "c", 1: "a", 2: "b", 3: "a", 4: "c", 5: "b"},
    "uneven 2+1": {0: "b", 1: "a", 2: "b"},
}


@pytest.mark.parametrize("dtype", ["int64", "int32", "float64", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_op_equals_its_flat_definition(layout, dtype):
    world = len(layout)
    xs = _inputs(world, dtype)
    stacked = np.stack(xs)
    exact = np.dtype(dtype).kind == "i"

    def same(got, want):
        if exact:
            return got.dtype == want.dtype and np.array_equal(got, want)
        return got.dtype == want.dtype and np.allclose(got, want, rtol=1e-5, atol=1e-5)

    async def main():
        hierarchies = await _ranks(Hub(seed=world), layout)
        m = xs[0].shape[0] // world
        calls = []
        for h, x in zip(hierarchies, xs, strict=True):
            r = h.plan.rank
            calls.append([
                h.all_reduce(x, SUM, np.empty_like(x), _same, None),
                h.broadcast(x, world - 1, _same, None),
                h.broadcast(x, 0, _same, None),
                h.all_reduce(x, MAX, np.empty_like(x), _same, None),
            ] + ([
                h.all_gather(x, _same, None),
                h.reduce_scatter(x, SUM, _same, None),
            ] if h.plan.uniform else []) + ([
                h.reduce_scatter(x, MEAN, _same, None),
                h.all_reduce(x, MEAN, np.empty_like(x), _same, None),
            ] if not exact and h.plan.uniform else []))
            assert h.takes(ops.ALL_GATHER, x) == h.plan.uniform
            assert h.takes(ops.REDUCE_SCATTER, x, SUM) == h.plan.uniform
            assert h.takes(ops.REDUCE_SCATTER, x, MEAN) == (h.plan.uniform and not exact)
        results = await asyncio.gather(*(asyncio.gather(*c) for c in calls))
        total = stacked.sum(axis=0, dtype=dtype)
        for r, got in enumerate(results):
            assert same(got[0], total)
            assert same(got[1], xs[-1]) and same(got[2], xs[0])
            assert same(got[3], stacked.max(axis=0))
            if len(got) > 4:
                assert same(got[4], stacked)
                assert same(got[5], total[r * m:(r + 1) * m])
            if len(got) > 6:
                assert same(got[6], total[r * m:(r + 1) * m] / world)
                assert same(got[7], total / world)

    asyncio.run(main())


def test_calls_made_at_different_times_pair_up_by_call_order():
    """Each rank makes its calls with its own pauses, so one rank's second call comes before
    its first call's later stages are issued, another's after: reserved seqs pair them up."""
    layout = LAYOUTS["2x2 interleaved"]
    xs = _inputs(4, "int64", rows=8)

    async def rank_calls(h, x, pauses):
        works = []
        for k, pause in enumerate(pauses):
            await asyncio.sleep(pause)
            x_k = x + k
            works.append(h.all_reduce(x_k, SUM, np.empty_like(x_k), _same, None) if k % 2 == 0
                         else h.broadcast(x_k, k % 4, _same, None))
        return await asyncio.gather(*works)

    async def main():
        for seed in range(5):
            hierarchies = await _ranks(Hub(seed=seed), layout)
            rng = random.Random(seed)
            results = await asyncio.gather(*(
                rank_calls(h, x, [rng.uniform(0, 0.02) for _ in range(8)])
                for h, x in zip(hierarchies, xs, strict=True)))
            for got in results:
                for k in range(8):
                    want = (sum(xs) + 4 * k) if k % 2 == 0 else xs[k % 4] + k
                    assert np.array_equal(got[k], want), (seed, k)

    asyncio.run(main())


def test_a_failed_leaders_stage_fails_every_rank_at_once():
    layout = LAYOUTS["2x2 contiguous"]
    xs = _inputs(4, "int64")

    async def main():
        hierarchies = await _ranks(Hub(seed=1, fail=frozenset({("leaders", 1)})), layout)
        calls = [h.all_gather(x, _same, None) for h, x in zip(hierarchies, xs, strict=True)]
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 2)
        assert all(isinstance(o, CollectiveError) for o in outcomes), outcomes
        # the leaders' own error, and the non-leaders' host broadcast given up by their leader
        assert "injected" in str(outcomes[0]) and "gave up" in str(outcomes[1])
        # the next call runs on seqs of its own
        again = [h.all_gather(x, _same, None) for h, x in zip(hierarchies, xs, strict=True)]
        for got in await asyncio.wait_for(asyncio.gather(*again), 2):
            assert np.array_equal(got, np.stack(xs))

    asyncio.run(main())


@pytest.mark.parametrize("when", ["before it ran", "in its first stage"])
def test_a_call_cancelled_on_one_rank_fails_on_every_rank_at_once(when):
    layout = LAYOUTS["2x2 contiguous"]
    xs = _inputs(4, "int64")

    async def main():
        hierarchies = await _ranks(Hub(seed=3), layout)
        calls = [h.reduce_scatter(x, SUM, _same, None) for h, x in zip(hierarchies, xs,
                                                                        strict=True)]
        if when != "before it ran":
            await asyncio.sleep(0)  # every call has issued its host all_reduce
        calls[0].cancel()  # a leader: its leaders' stage and its host broadcast are given up
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 2)
        assert isinstance(outcomes[0], asyncio.CancelledError)
        assert all(isinstance(o, CollectiveError) for o in outcomes[1:]), outcomes

    asyncio.run(main())


def test_a_rank_that_disagrees_on_src_gets_a_mismatch_not_another_tensor():
    layout = LAYOUTS["2x2 interleaved"]
    xs = _inputs(4, "int64")

    async def main():
        hierarchies = await _ranks(Hub(seed=2), layout)
        calls = [h.broadcast(x, 0 if h.plan.rank != 3 else 1, _same, None)
                 for h, x in zip(hierarchies, xs, strict=True)]
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 2)
        # Rank 3 (host b) meets only its own leader, whose stages look the same whether src is
        # 0 or 1: the tag names whose tensor it got. The others got what they asked for.
        assert isinstance(outcomes[3], CollectiveMismatchError)
        assert "called broadcast with src=1, but the tensor it received is not rank 1's" in str(
            outcomes[3])
        assert all(np.array_equal(o, xs[0]) for o in outcomes[:3]), outcomes

    asyncio.run(main())


def test_host_block_order_and_places():
    p = plan(2, LAYOUTS["3x2 shuffled"])
    assert p.layout == ((0, 4), (1, 3), (2, 5))
    assert p.order == (0, 4, 1, 3, 2, 5) and not p.in_rank_order and p.uniform
    assert (p.host_index, p.local_rank, p.rank, p.world_size) == (2, 0, 2, 6)
    assert p.place(3) == (1, 1)
    assert plan(0, LAYOUTS["2x2 contiguous"]).in_rank_order
    assert not plan(0, LAYOUTS["uneven 2+1"]).uniform
    with pytest.raises(ValueError, match="rank 9 is on none of the 3 hosts"):
        p.place(9)


def test_segments_cut_large_tensors_into_equal_pieces_covering_them():
    assert segments(1000, 4) == [slice(0, 1000)]
    numel = 2 * MIN_SEGMENT_BYTES // 4 - 1  # just under two segments' worth: one piece
    assert segments(numel, 4) == [slice(0, numel)]
    for numel, itemsize in [(16 << 20, 4), (3 * MIN_SEGMENT_BYTES // 8 + 5, 8), (10**8, 8)]:
        pieces = segments(numel, itemsize)
        assert 2 <= len(pieces) <= MAX_SEGMENTS
        assert pieces[0].start == 0 and pieces[-1].stop == numel
        assert all(a.stop == b.start for a, b in itertools.pairwise(pieces))
        assert all((s.stop - s.start) * itemsize >= MIN_SEGMENT_BYTES for s in pieces)


@pytest.mark.parametrize("layout", ["2x2 interleaved", "3x2 shuffled"])
@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_a_large_all_reduce_runs_as_a_pipeline_of_segments(monkeypatch, layout, dtype):
    """Segments cut small here (so the in-memory hub sees 4): exact, means divided once, and a
    segment's host all_reduce is issued only once the segment before it finished its own."""
    monkeypatch.setattr(two_level, "MIN_SEGMENT_BYTES", 64)
    hosts = LAYOUTS[layout]
    world = len(hosts)
    xs = _inputs(world, dtype, rows=24)
    assert len(segments(xs[0].size, xs[0].itemsize)) == MAX_SEGMENTS

    async def main():
        hub = Hub(seed=world)
        issued, completed = [], []
        arrive, complete = hub.arrive, hub._complete

        def arrive_logged(group, seq, rank, call):
            issued.append((group, seq, rank, len(completed)))
            return arrive(group, seq, rank, call)

        def complete_logged(group, seq, arrivals):
            completed.append((group, seq))
            complete(group, seq, arrivals)

        hub.arrive, hub._complete = arrive_logged, complete_logged
        hierarchies = await _ranks(hub, hosts)
        ops_ = [SUM, MEAN] if dtype == "float32" else [SUM, MAX]
        results = await asyncio.gather(*(
            asyncio.gather(*(h.all_reduce(x, op, np.empty_like(x), _same, None) for op in ops_))
            for h, x in zip(hierarchies, xs, strict=True)))
        stacked = np.stack(xs)
        want = [stacked.sum(axis=0, dtype=dtype)]
        want.append(want[0] / world if dtype == "float32" else stacked.max(axis=0))
        for got in results:
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype
                assert np.allclose(g, w, rtol=1e-5) if dtype == "float32" else \
                    np.array_equal(g, w)
        # Each host group's host all_reduces (every other local seq of a call: reduce, then
        # broadcast) are issued in order, each after the one before it completed.
        for group in {g for g, *_ in issued if g != "leaders"}:
            firsts = sorted({seq for g, seq, *_ in issued if g == group})[0:2 * MAX_SEGMENTS:2]
            for before, after in itertools.pairwise(firsts):
                done_at = completed.index((group, before))
                assert all(n > done_at for g, seq, _, n in issued
                           if g == group and seq == after), (group, before, after)

    asyncio.run(main())

"""Arrival summaries without sockets (gradstar.coordinator.metrics.arrivals): what one
collective records, bounded memory for any number of collectives and ranks, quantiles, merging
the shards' reports, and who is flagged."""

from __future__ import annotations

import math
import sys

import pytest

from gradstar.coordinator.metrics.arrivals import (
    BOUNDS,
    LAG_BUCKETS,
    LATE_KEPT,
    NBUCKETS,
    ArrivalBook,
    RankArrivals,
    flagged,
    from_message,
    merge,
    merged,
    slowest,
    to_fields,
)
from gradstar.proto.v1 import shard_pb2 as spb


def test_one_collective_gives_lags_the_last_rank_and_what_the_others_waited_for_it():
    book = ArrivalBook()
    late = book.collective("j", [(2, 10.0), (0, 10.002), (1, 10.25)])
    ranks = book.ranks("j")
    assert {r: round(s.last_lag, 6) for r, s in ranks.items()} == {2: 0.0, 0: 0.002, 1: 0.25}
    assert [ranks[r].last for r in (0, 1, 2)] == [0, 1, 0]
    # Without rank 1 the collective would have started at rank 0's header, 0.248 s sooner.
    assert ranks[1].cost == pytest.approx(0.248)
    # Named to every rank: those at least 5 ms late, latest first.
    assert [(r, round(lag, 6)) for r, lag in late] == [(1, 0.25)]
    assert book.collective("j", [(0, 1.0), (1, 1.001)]) == []  # within 5 ms: nobody


def test_the_late_list_is_the_latest_few_latest_first():
    book = ArrivalBook()
    arrivals = [(r, 0.1 * r) for r in range(20)]
    late = book.collective("j", arrivals)
    assert [r for r, _ in late] == list(range(19, 19 - LATE_KEPT, -1))


def test_a_summary_stays_the_same_size_however_many_collectives():
    book = ArrivalBook()
    for i in range(20_000):
        book.collective("j", [(0, 0.0), (1, 0.001 * (i % 7)), (2, 0.2)])
    s = book.ranks("j")[2]
    assert len(s.buckets) == NBUCKETS and book.entries == 3
    assert s.collectives == 20_000 and s.last == 20_000
    assert sys.getsizeof(s.buckets) < 1024
    assert s.quantile(0.5) == pytest.approx(0.2) and s.ewma == pytest.approx(0.2)


def test_the_book_keeps_at_most_max_entries_whatever_the_ranks():
    book = ArrivalBook(max_entries=100)
    for job in range(10):
        book.collective(f"j{job}", [(r, r * 1e-3) for r in range(50)])
    assert book.entries == 100 and sum(len(t) for t in book.jobs.values()) == 100
    assert book.dropped == 8 * 50
    book.forget("j0")
    assert book.entries == 50
    book.collective("new", [(0, 0.0), (1, 0.0)])
    assert book.entries == 52


def test_quantiles_within_a_bucket_and_exact_for_a_steady_lag():
    s = RankArrivals()
    for lag in [0.001] * 50 + [0.1] * 45 + [2.0] * 5:
        s.observe(lag)
    assert s.quantile(0.5) == pytest.approx(0.001, rel=0.3)
    assert 0.1 <= s.quantile(0.95) <= 2.0
    assert s.quantile(1.0) == pytest.approx(2.0)
    assert s.mean == pytest.approx((0.05 + 4.5 + 10) / 100)
    steady = RankArrivals()
    for _ in range(30):
        steady.observe(0.3)
    assert steady.quantile(0.5) == pytest.approx(0.3) == steady.quantile(0.95)
    assert RankArrivals().quantile(0.5) == 0.0
    huge = RankArrivals()
    huge.observe(100.0)
    assert huge.quantile(0.5) == 100.0  # above every bound: the largest seen


def test_prometheus_counts_follow_the_metrics_buckets():
    assert BOUNDS[3::4] == LAG_BUCKETS
    s = RankArrivals()
    for lag in (0.0, 0.0001, 0.0003, 0.01, 0.011, 29.0, 31.0):
        s.observe(lag)
    counts = s.prometheus_counts()
    assert len(counts) == len(LAG_BUCKETS) + 1 and sum(counts) == 7
    cumulative = dict(zip((*LAG_BUCKETS, math.inf), [sum(counts[:i + 1])
                                                     for i in range(len(counts))], strict=True))
    assert cumulative[0.0001] == 2 and cumulative[0.0005] == 3 and cumulative[0.01] == 4
    assert cumulative[30.0] == 6 and cumulative[math.inf] == 7


def test_merging_adds_counts_and_weights_the_mean():
    a, b = RankArrivals(), RankArrivals()
    for _ in range(3):
        a.observe(0.1)
    a.arrived_last(0.05)
    b.observe(0.3)
    m = merge([a, b, RankArrivals()])
    assert (m.collectives, m.last, m.cost) == (4, 1, 0.05)
    assert m.ewma == pytest.approx((3 * 0.1 + 0.3) / 4)
    assert m.last_lag == 0.1  # the source with the most collectives
    assert (m.min_lag, m.max_lag) == (0.1, 0.3) and sum(m.buckets) == 4
    view = merged([{0: a}, None, {0: b, 1: a}])
    assert view[0].collectives == 4 and view[1] is a


def test_a_report_round_trips_and_hostile_fields_are_tamed():
    s = RankArrivals()
    for lag in (0.0, 0.02, 0.5):
        s.observe(lag)
    s.arrived_last(0.4)
    message = spb.RankArrivals(job="j", rank=3, **to_fields(s))
    assert from_message(spb.RankArrivals.FromString(message.SerializeToString())) == s
    bad = spb.RankArrivals(job="j", rank=0, collectives=2, last=9, lag_sum_seconds=math.nan,
                           lag_ewma_seconds=-1.0, max_lag_seconds=math.inf,
                           buckets=[1] * (NBUCKETS + 5))
    tamed = from_message(bad)
    assert tamed.last == 2 and tamed.lag_sum == 0.0 and tamed.ewma == 0.0
    assert tamed.max_lag == 0.0 and len(tamed.buckets) == NBUCKETS and tamed.buckets[-1] == 6


def test_changed_summaries_are_taken_a_limited_number_at_a_time():
    book = ArrivalBook()
    book.collective("j", [(r, 0.0) for r in range(5)])
    first = book.changed(3)
    assert [(j, r) for j, r, _ in first] == [("j", 0), ("j", 1), ("j", 2)]
    assert [(j, r) for j, r, _ in book.changed(10)] == [("j", 3), ("j", 4)]
    assert book.changed(10) == []
    book.collective("j", [(4, 0.0), (0, 0.0)])
    book.forget("j")
    assert book.changed(10) == []


def steady(lag: float, n: int = 10) -> RankArrivals:
    s = RankArrivals()
    for _ in range(n):
        s.observe(lag)
    return s


def test_flagged_are_the_ranks_that_stand_out():
    assert flagged({0: steady(0.001), 1: steady(0.0), 2: steady(0.2)}) == {2}
    # A slow host's two ranks of eight are flagged together.
    ranks = {r: steady(0.15 if r in (4, 5) else 0.001) for r in range(8)}
    assert flagged(ranks) == {4, 5}
    assert slowest(ranks)[:2] == [4, 5]
    assert flagged({r: steady(0.004 + r * 1e-3) for r in range(4)}) == set()  # jitter
    assert flagged({0: steady(1.0)}) == set()


def _lagging(lag: float, times: int = 5) -> RankArrivals:
    summary = RankArrivals()
    for _ in range(times):
        summary.observe(lag)
    return summary


def test_two_level_stages_are_folded_into_the_jobs_own_ranks():
    from gradstar.coordinator.metrics.arrivals import stage_arrivals

    # Hosts a (ranks 0, 3), b (1, 4), c (2, 5); leaders ordered by lowest rank: a, b, c.
    hosts = {0: "a", 1: "b", 2: "c", 3: "a", 4: "b", 5: "c"}
    groups = {
        "j/g4/leaders": {0: _lagging(0.0), 1: _lagging(0.3), 2: _lagging(0.0)},  # b is late
        # Rank 3 a bit late in a; a's leader late at home only for its wait among the leaders.
        "j/g4/host-a": {0: _lagging(0.5), 1: _lagging(0.005)},
        "j/g4/host-b": {0: _lagging(0.0), 1: _lagging(0.0)},
    }
    ranks = stage_arrivals("j", 4, hosts, lambda name: groups.get(name, {}))
    assert sorted(ranks) == [0, 1, 2, 3, 4, 5]
    assert ranks[1].ewma == ranks[4].ewma == pytest.approx(0.3)  # the slowed host's ranks
    assert ranks[3].ewma == pytest.approx(0.005) and ranks[0].ewma == 0.0
    assert flagged(ranks) == {1, 4}
    # One rank per host, or one host: no stages, nothing folded.
    assert stage_arrivals("j", 4, {0: "a", 1: "b"}, lambda name: groups["j/g4/leaders"]) == {}
    assert stage_arrivals("j", 4, {0: "a", 1: "a"}, lambda name: groups["j/g4/host-a"]) == {}

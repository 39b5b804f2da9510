"""Who the collectives wait for: each rank's arrival offsets, summarised in bounded memory
(no I/O; the engine feeds it, shards report it, the views read it).

What is measured. Wherever a collective runs (the coordinator's engine, every hub shard) the
engine takes one timestamp per rank when its header arrives. Once every rank has arrived,
:meth:`ArrivalBook.collective` turns those timestamps into each rank's *lag* (its offset from
the first rank's header) and charges the last rank with the seconds the collective waited for
it alone (its lag minus the second latest one's: without it, the collective would have started
that much sooner). Nothing is done per chunk. A collective striped over hub shards is measured
by the shard carrying stripe 0 only (a rank sends all its stripes' headers at once, so one
stripe's arrivals are the collective's), which also keeps each collective counted once when
the coordinator merges the shards' summaries with its own.

What is kept, per job and rank (:class:`RankArrivals`, a fixed size whatever the number of
collectives): counts (collectives, times last), the sum, latest and largest lag, an
exponentially weighted mean of the lag (:data:`EWMA_WEIGHT`: the last ~10 collectives count
most, so the order of ranks follows what happens now), a histogram of the lag over
:data:`BOUNDS` (the Prometheus buckets of ``/metrics``, each cut in :data:`SPLIT`, for medians
and 95th percentiles within a few per cent), and the seconds the others waited for it. The
book holds at most :data:`MAX_ENTRIES` (job, rank) summaries; ranks beyond that are counted in
:attr:`ArrivalBook.dropped`, not kept. A job's summaries go when the job does
(:meth:`ArrivalBook.forget`).

Merging (the coordinator's view of a job: its own book and every shard's reports): counts,
sums and histograms add, the largest lag is the largest, and the weighted mean and the latest
lag are the counts-weighted mean and the latest of the source with the most collectives.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gradstar.node_shard import HOST_GROUP

#: The Prometheus buckets of ``gradstar_rank_arrival_lag_seconds``, seconds: ranks in step
#: arrive within milliseconds; stragglers lag by seconds.
LAG_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0, 10.0, 30.0)
#: Each of those cut in this many equal parts: the summary's own buckets, for quantiles.
SPLIT = 4
BOUNDS = tuple(hi if k == SPLIT else lo + (hi - lo) * k / SPLIT
               for lo, hi in zip((0.0, *LAG_BUCKETS), LAG_BUCKETS, strict=False)
               for k in range(1, SPLIT + 1))
#: Buckets of a summary: one per bound, and one above them all.
NBUCKETS = len(BOUNDS) + 1
#: Weight of the newest collective in the exponentially weighted mean lag.
EWMA_WEIGHT = 0.2
#: (job, rank) summaries a book keeps at most (~0.7 KB each).
MAX_ENTRIES = 1 << 16
#: A collective's ranks that arrive at least this long after the first are named to every rank
#: at its end (:meth:`ArrivalBook.collective`), the latest :data:`LATE_KEPT` of them.
LATE_FLOOR = 0.005
LATE_KEPT = 8
#: A rank is flagged as a straggler when its weighted mean lag is at least this many seconds
#: and twice the median rank's: jitter of a few milliseconds flags nobody, and a slow host's
#: ranks are flagged together.
STRAGGLER_LAG = 0.01


@dataclass(slots=True)
class RankArrivals:
    """One rank's arrivals at one job's collectives (see the module docstring)."""

    collectives: int = 0
    last: int = 0
    lag_sum: float = 0.0
    ewma: float = 0.0
    last_lag: float = 0.0
    max_lag: float = 0.0
    min_lag: float = 0.0
    #: Seconds the collectives it arrived last in waited for it alone, summed.
    cost: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * NBUCKETS)

    def observe(self, lag: float) -> None:
        """One collective, which this rank reached ``lag`` seconds after the first rank."""
        first = not self.collectives
        self.ewma = lag if first else self.ewma + EWMA_WEIGHT * (lag - self.ewma)
        self.min_lag = lag if first else min(self.min_lag, lag)
        self.collectives += 1
        self.lag_sum += lag
        self.last_lag = lag
        self.max_lag = max(self.max_lag, lag)
        self.buckets[bisect.bisect_left(BOUNDS, lag)] += 1

    def arrived_last(self, waited: float) -> None:
        """It was the last rank of that collective, which waited ``waited`` seconds for it."""
        self.last += 1
        self.cost += waited

    @property
    def mean(self) -> float:
        return self.lag_sum / self.collectives if self.collectives else 0.0

    @property
    def last_share(self) -> float:
        """The share of its collectives in which it arrived last."""
        return self.last / self.collectives if self.collectives else 0.0

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of its lags (0 <= q <= 1), interpolated within a bucket whose
        edges are narrowed to the smallest and largest lag seen (so a steady lag comes out
        as itself); 0.0 before any collective."""
        if not self.collectives:
            return 0.0
        target = q * self.collectives
        running = 0
        for i, n in enumerate(self.buckets):
            if n and running + n >= target:
                lo = BOUNDS[i - 1] if i else 0.0
                hi = BOUNDS[i] if i < len(BOUNDS) else self.max_lag
                hi = min(hi, self.max_lag)
                lo = min(max(lo, self.min_lag), hi)
                return lo + (hi - lo) * max(target - running, 0.0) / n
            running += n
        return self.max_lag

    def prometheus_counts(self) -> list[int]:
        """Collectives per bucket of :data:`LAG_BUCKETS` (and one above), not cumulative."""
        fine = self.buckets
        return [sum(fine[i:i + SPLIT]) for i in range(0, len(BOUNDS), SPLIT)] + [fine[-1]]


def merge(parts: Iterable[RankArrivals]) -> RankArrivals:
    """The sum of ``parts``: one rank as several sources measured it, or several ranks."""
    out = RankArrivals()
    lead = None
    for p in parts:
        if not p.collectives:
            continue
        if lead is None or p.collectives > lead.collectives:
            lead = p
        out.min_lag = min(out.min_lag, p.min_lag) if out.collectives else p.min_lag
        out.max_lag = max(out.max_lag, p.max_lag)
        out.ewma += p.ewma * p.collectives
        out.collectives += p.collectives
        out.last += p.last
        out.lag_sum += p.lag_sum
        out.cost += p.cost
        for i, n in enumerate(p.buckets[:NBUCKETS]):
            out.buckets[i] += n
    if lead is not None:
        out.ewma /= out.collectives
        out.last_lag = lead.last_lag
    return out


def merged(sources: Iterable[Mapping[int, RankArrivals] | None]) -> dict[int, RankArrivals]:
    """Per rank, the merge of every source's summary (sources: rank -> summary, or None)."""
    by_rank: dict[int, list[RankArrivals]] = {}
    for source in sources:
        for rank, summary in (source or {}).items():
            by_rank.setdefault(rank, []).append(summary)
    return {rank: parts[0] if len(parts) == 1 else merge(parts)
            for rank, parts in sorted(by_rank.items())}


def slowest(ranks: Mapping[int, RankArrivals]) -> list[int]:
    """Ranks, slowest first: by weighted mean lag, then by the seconds the others waited."""
    return sorted(ranks, key=lambda r: (-ranks[r].ewma, -ranks[r].cost, r))


def flagged(ranks: Mapping[int, RankArrivals]) -> set[int]:
    """The ranks that stand out (see :data:`STRAGGLER_LAG`); none in a job of one rank."""
    if len(ranks) < 2:
        return set()
    floor = max(STRAGGLER_LAG, 2 * statistics.median(s.ewma for s in ranks.values()))
    return {r for r, s in ranks.items() if s.ewma >= floor}


class ArrivalBook:
    """Every job's per-rank summaries, as one engine measures them."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        #: Whether :meth:`collective` measures (off: the overhead benchmark's reference).
        self.enabled = True
        self.jobs: dict[str, dict[int, RankArrivals]] = {}
        self.entries = 0
        #: Arrivals not kept because the book was full.
        self.dropped = 0
        self._changed: dict[tuple[str, int], None] = {}

    def collective(self, job: str,
                   arrivals: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
        """Record one collective of ``job`` whose every rank has arrived: ``arrivals`` are
        (rank, time) in arrival order. Returns the ranks it waited for, latest first, as
        (rank, lag): the latest :data:`LATE_KEPT` with a lag of :data:`LATE_FLOOR` or more."""
        if not self.enabled or not arrivals:
            return []
        first = arrivals[0][1]
        table = self.jobs.get(job)
        if table is None:
            table = self.jobs[job] = {}
        summary = None
        for rank, at in arrivals:
            summary = table.get(rank)
            if summary is None:
                if self.entries >= self.max_entries:
                    self.dropped += 1
                    continue  # summary stays None: a dropped last rank is charged nothing
                summary = table[rank] = RankArrivals()
                self.entries += 1
            summary.observe(at - first)
            self._changed[(job, rank)] = None
        if len(arrivals) > 1 and summary is not None:
            summary.arrived_last(arrivals[-1][1] - arrivals[-2][1])
        late = []
        for rank, at in reversed(arrivals[-LATE_KEPT:]):
            if at - first < LATE_FLOOR:
                break
            late.append((rank, at - first))
        return late

    def ranks(self, job: str) -> dict[int, RankArrivals]:
        return self.jobs.get(job, {})

    def changed(self, limit: int) -> list[tuple[str, int, RankArrivals]]:
        """Up to ``limit`` summaries changed since they were last taken, oldest change first
        (a shard's report); the rest stay for the next call."""
        out = []
        for key in list(self._changed)[:limit]:
            del self._changed[key]
            summary = self.jobs.get(key[0], {}).get(key[1])
            if summary is not None:
                out.append((key[0], key[1], summary))
        return out

    def forget(self, job: str) -> None:
        """Drop ``job``'s summaries (the job was dropped)."""
        table = self.jobs.pop(job, None)
        if table is not None:
            self.entries -= len(table)
            for rank in table:
                self._changed.pop((job, rank), None)


def to_fields(summary: RankArrivals) -> dict:
    """The summary as the fields of a ``RankArrivals`` message (shard.proto), less job/rank."""
    return {"collectives": summary.collectives, "last": summary.last,
            "lag_sum_seconds": summary.lag_sum, "lag_ewma_seconds": summary.ewma,
            "last_lag_seconds": summary.last_lag, "max_lag_seconds": summary.max_lag,
            "min_lag_seconds": summary.min_lag,
            "cost_seconds": summary.cost, "buckets": summary.buckets}


def from_message(message) -> RankArrivals:
    """A summary from a ``RankArrivals`` message; a histogram of another length (a shard of
    another version) is fitted to :data:`NBUCKETS`, its excess counted in the top bucket."""
    buckets = list(message.buckets[:NBUCKETS])
    buckets += [0] * (NBUCKETS - len(buckets))
    buckets[-1] += sum(message.buckets[NBUCKETS:])
    values = (message.lag_sum_seconds, message.lag_ewma_seconds, message.last_lag_seconds,
              message.max_lag_seconds, message.min_lag_seconds, message.cost_seconds)
    lag_sum, ewma, last_lag, max_lag, min_lag, cost = (
        v if math.isfinite(v) and v >= 0 else 0.0 for v in values)
    return RankArrivals(message.collectives, min(message.last, message.collectives), lag_sum,
                        ewma, last_lag, max_lag, min(min_lag, max_lag), cost, buckets)


def stage_arrivals(job: str, generation: int, hosts: Mapping[int, str],
                   arrivals_of: Callable[[str], Mapping[int, RankArrivals]],
                   ) -> dict[int, RankArrivals]:
    """The arrivals of a two-level job's stages (gradstar.client.hierarchy) by its own ranks.

    A generation that spans hosts with several ranks on some runs its collectives in groups of
    their own: ``JOB/gN/host-KEY`` (a host's ranks, local rank i = the host's i-th rank in
    rank order) and ``JOB/gN/leaders`` (one rank per host, hosts ordered by their lowest
    rank). ``hosts`` is the generation's rank -> host key; ``arrivals_of(name)`` a group's
    summaries. A host's lag among the leaders is its every rank's (across hosts the hub sees
    hosts: a slowed host's ranks are all named); a rank's lag within its host is its own,
    but for the host's leader, whose wait among the leaders makes it late at home. Where a
    rank has both, the larger (by recent lag) stands.
    """
    by_host: dict[str, list[int]] = {}
    for rank in sorted(hosts):
        by_host.setdefault(hosts[rank], []).append(rank)
    if len(by_host) < 2 or all(len(ranks) == 1 for ranks in by_host.values()):
        return {}
    layout = sorted(by_host.values(), key=lambda ranks: ranks[0])
    base = f"{job}/g{generation}"
    out: dict[int, RankArrivals] = {}

    def take(rank: int, summary: RankArrivals) -> None:
        if rank not in out or summary.ewma > out[rank].ewma:
            out[rank] = summary

    for index, summary in arrivals_of(f"{base}/leaders").items():
        for rank in layout[index] if 0 <= index < len(layout) else ():
            take(rank, summary)
    for key, ranks in by_host.items():
        for local, summary in arrivals_of(f"{base}{HOST_GROUP}{key}").items():
            # Not the leader's (local rank 0): it reaches its host's next collective late by
            # its wait in the leaders' stage, the other hosts' doing; its own slowness shows
            # there, as its host's.
            if 0 < local < len(ranks):
                take(ranks[local], summary)
    return out

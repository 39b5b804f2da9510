"""Prometheus metrics of the coordinator (served over :mod:`gradstar.transport.http`).

``gradstar coordinator --metrics-port 9400`` serves ``GET /metrics`` in the Prometheus text
format (version 0.0.4). Two kinds of numbers:

- *observed* by the collective engine as collectives happen (:class:`CollectiveMetrics`):
  how long collectives take from the first rank's header to the last END frame, and each
  rank's *arrival lag*, the seconds between the first rank's header and its own. A straggler
  shows as a rank whose lag histogram sits high and whose ``gradstar_rank_last_arrivals_total``
  grows fastest (the rank every collective waited for).
- *read* at scrape time from the rendezvous, the jobs' counters and the averaging store (jobs,
  generations, members, heartbeat ages, bytes, completed and failed collectives, global-model
  rounds), so nothing is counted twice.

Why no prometheus_client: everything here runs on the coordinator's event loop, so the state is
read without locks, and the server is a few lines of asyncio rather than a second thread and a
runtime dependency. The format is checked against prometheus_client's own parser in the tests.

Label cardinality: series are per job and per (job, rank), kept while the coordinator runs.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gradstar.errors import GradstarError
from gradstar.ops import op_name

log = logging.getLogger(__name__)

#: Collective durations, seconds: from a few hundred microseconds on loopback to minutes.
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0)
#: Arrival lags, seconds: ranks in step arrive within milliseconds; stragglers lag by seconds.
LAG_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    """A cumulative Prometheus histogram with fixed upper bounds."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f"{name}_bucket{_labels({**labels, 'le': le})} {running}")
        out.append(f"{name}_sum{_labels(labels)} {_number(self.total)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class CollectiveMetrics:
    """What the collective engine observes; it calls :meth:`arrived` and :meth:`finished`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: (job, op name, "completed" | "failed") -> duration histogram
        self.durations: dict[tuple[str, str, str], Histogram] = {}
        #: (job, rank) -> arrival lag histogram; the last lag; how often it arrived last
        self.lags: dict[tuple[str, int], Histogram] = {}
        self.last_lag: dict[tuple[str, int], float] = {}
        self.last_arrivals: dict[tuple[str, int], int] = {}

    def forget(self, job: str) -> None:
        """Drop ``job``'s series (its state was dropped: see Rendezvous.drop_idle)."""
        for table in (self.durations, self.lags, self.last_lag, self.last_arrivals):
            for key in [k for k in table if k[0] == job]:
                del table[key]

    def arrived(self, job: str, rank: int, started: float, world: int, arrived: int) -> None:
        """Rank ``rank`` sent its header; ``started`` is when the first one arrived."""
        lag = max(self.clock() - started, 0.0)
        key = (job, rank)
        hist = self.lags.get(key)
        if hist is None:
            hist = self.lags[key] = Histogram(LAG_BUCKETS)
        hist.observe(lag)
        self.last_lag[key] = lag
        if arrived == world and world > 1:
            self.last_arrivals[key] = self.last_arrivals.get(key, 0) + 1

    def finished(self, job: str, op: str, started: float, failed: bool,
                 error: GradstarError | None = None) -> None:
        """A collective ended (``error``: why it failed; the status page shows it)."""
        key = (job, op, "failed" if failed else "completed")
        hist = self.durations.get(key)
        if hist is None:
            hist = self.durations[key] = Histogram(DURATION_BUCKETS)
        hist.observe(max(self.clock() - started, 0.0))


def render(rendezvous, collectives: CollectiveMetrics, averaging=None, *,
           serving: bool = True, now: float | None = None, shards=None) -> str:
    """The coordinator's metrics in the Prometheus text format; with ``shards`` (a
    :class:`~.shards.ShardRegistry`) job totals include what the shards carried, and each shard
    has its own series."""
    now = time.monotonic() if now is None else now
    out: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)

    jobs = sorted(rendezvous.jobs.items())
    family("gradstar_serving", "gauge", "1 while the coordinator takes new joins, 0 once draining.",
           [f"gradstar_serving {1 if serving and not rendezvous.draining else 0}"])
    states: dict[str, int] = {"running": 0, "forming": 0, "completed": 0, "failed": 0, "idle": 0}
    for _, job in jobs:
        states[job.state] = states.get(job.state, 0) + 1
    family("gradstar_jobs", "gauge", "Jobs known to the coordinator, by state.",
           [f"gradstar_jobs{_labels({'state': s})} {n}" for s, n in sorted(states.items())])
    gens, world, members, inflight, ages = [], [], [], [], []
    b_in, b_out, done, failed, generations = [], [], [], [], []
    for name, job in jobs:
        labels = {"job": name}
        gen = job.generation
        gens.append(f"gradstar_job_generation{_labels(labels)} {gen.number if gen else 0}")
        generations.append(
            f"gradstar_job_generations_formed_total{_labels(labels)} {job.generations_formed}")
        world.append(f"gradstar_job_world_size{_labels(labels)} {job.world_size}")
        live = gen.live_members if gen is not None else []
        members.append(f"gradstar_job_members{_labels(labels)} {len(live) or len(job.forming)}")
        inflight.append(f"gradstar_collectives_in_flight{_labels(labels)} "
                        f"{len(gen.collectives) if gen is not None else 0}")
        for m in sorted(live, key=lambda m: m.rank):
            ages.append(f"gradstar_member_heartbeat_age_seconds"
                        f"{_labels({**labels, 'rank': str(m.rank)})} "
                        f"{_number(max(now - m.last_seen, 0.0))}")
        c = job.counters
        s_in, s_out, s_done, s_failed = (shards.job_totals(name) if shards is not None
                                         else (0, 0, {}, {}))
        b_in.append(f"gradstar_bytes_received_total{_labels(labels)} {c.bytes_in + s_in}")
        b_out.append(f"gradstar_bytes_sent_total{_labels(labels)} {c.bytes_out + s_out}")
        for metric, counts, target in (
                ("gradstar_collectives_completed_total", _added(c.completed, s_done), done),
                ("gradstar_collectives_failed_total", _added(c.failed, s_failed), failed)):
            for op, n in sorted(counts.items()):
                target.append(f"{metric}{_labels({**labels, 'op': op_name(op)})} {n}")
    family("gradstar_job_generation", "gauge", "Number of the job's current generation.", gens)
    family("gradstar_job_generations_formed_total", "counter",
           "Generations formed by the job (re-joins after failures add one each).", generations)
    family("gradstar_job_world_size", "gauge", "Ranks the job needs.", world)
    family("gradstar_job_members", "gauge", "Live members of the current generation (or joiners "
           "while forming).", members)
    family("gradstar_collectives_in_flight", "gauge", "Collectives matched or waiting for ranks.",
           inflight)
    family("gradstar_member_heartbeat_age_seconds", "gauge",
           "Seconds since each live member was last heard from.", ages)
    family("gradstar_bytes_received_total", "counter",
           "Tensor payload bytes the hub received from the job's ranks.", b_in)
    family("gradstar_bytes_sent_total", "counter",
           "Chunk frame bytes the hub sent to the job's ranks.", b_out)
    family("gradstar_collectives_completed_total", "counter", "Collectives completed, by op.",
           done)
    family("gradstar_collectives_failed_total", "counter", "Collectives failed, by op.", failed)

    durations: list[str] = []
    for (job, op, outcome), hist in sorted(collectives.durations.items()):
        durations += hist.lines("gradstar_collective_duration_seconds",
                                {"job": job, "op": op, "outcome": outcome})
    family("gradstar_collective_duration_seconds", "histogram",
           "Seconds from a collective's first header to its completion or failure.", durations)
    lags: list[str] = []
    last: list[str] = []
    stragglers: list[str] = []
    for (job, rank), hist in sorted(collectives.lags.items()):
        labels = {"job": job, "rank": str(rank)}
        lags += hist.lines("gradstar_rank_arrival_lag_seconds", labels)
        last.append(f"gradstar_rank_last_arrival_lag_seconds{_labels(labels)} "
                    f"{_number(collectives.last_lag[(job, rank)])}")
        stragglers.append(f"gradstar_rank_last_arrivals_total{_labels(labels)} "
                          f"{collectives.last_arrivals.get((job, rank), 0)}")
    family("gradstar_rank_arrival_lag_seconds", "histogram",
           "Seconds between the first rank's header of a collective and this rank's.", lags)
    family("gradstar_rank_last_arrival_lag_seconds", "gauge",
           "This rank's arrival lag in its latest collective.", last)
    family("gradstar_rank_last_arrivals_total", "counter",
           "Collectives in which this rank arrived last (the one the others waited for).",
           stragglers)
    rounds: list[str] = []
    if averaging is not None:
        for name, _ in jobs:
            for model, state in sorted(averaging.models(name).items()):
                labels = _labels({"job": name, "model": model})
                rounds.append(f"gradstar_global_model_rounds{labels} {state.rounds}")
    family("gradstar_global_model_rounds", "gauge",
           "Averaging rounds completed on each global model (LocalSGD, DiLoCo).", rounds)
    if shards is not None:
        _shard_families(family, shards, now)
    return "\n".join(out) + "\n"


def _shard_families(family, shards, now: float) -> None:
    up, s_in, s_out, ages = [], [], [], []
    for slot, r in sorted(shards.slots.items()):
        labels = _labels({"shard": str(slot), "address": r.address})
        up.append(f"gradstar_shard_up{labels} {1 if r.state == 'up' else 0}")
        s_in.append(f"gradstar_shard_bytes_received_total{labels} {r.stats.bytes_in}")
        s_out.append(f"gradstar_shard_bytes_sent_total{labels} {r.stats.bytes_out}")
        ages.append(f"gradstar_shard_report_age_seconds{labels} "
                    f"{_number(max(now - r.last_report, 0.0))}")
    family("gradstar_shards_expected", "gauge",
           "Hub shards that must be up for the coordinator to report SERVING.",
           [f"gradstar_shards_expected {shards.expected}"])
    family("gradstar_shard_up", "gauge", "1 while the hub shard is registered, 0 once lost.", up)
    family("gradstar_shard_bytes_received_total", "counter",
           "Tensor payload bytes the shard received from ranks (as of its last report).", s_in)
    family("gradstar_shard_bytes_sent_total", "counter",
           "Chunk frame bytes the shard sent to ranks (as of its last report).", s_out)
    family("gradstar_shard_report_age_seconds", "gauge",
           "Seconds since the shard last reported its counters.", ages)


def _added(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value))

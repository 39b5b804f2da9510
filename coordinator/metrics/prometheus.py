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
runtime dependency. For the same reason the page is rendered on the loop, in slices, rather
than in a thread that would read the state while the loop changes it. The format is checked
against prometheus_client's own parser in the tests.

Label cardinality: series are per job and per (job, rank), kept while the job is (see
``--job-retention``); only jobs that formed a generation have them. The page is bounded: at most
``--metrics-max-bytes`` (1 MiB by default; jobs whose series would not fit are left out and
counted in ``gradstar_metrics_jobs_omitted``), and it is rendered in slices between which the
event loop runs, so a scrape never holds collectives up for long.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gradstar.errors import GradstarError
from gradstar.ops import op_name
from gradstar.proto.v1 import collective_pb2 as pb

from .arrivals import LAG_BUCKETS, ArrivalBook, RankArrivals, merge, merged, slowest, stage_arrivals
from .steps import steps_families

log = logging.getLogger(__name__)

#: Collective durations, seconds: from a few hundred microseconds on loopback to minutes.
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0)


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
    """What the collective engine observes: it calls :meth:`finished`, and feeds
    :attr:`arrivals` (each rank's arrival lag, :mod:`.arrivals`) as collectives match."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: (job, op name, "completed" | "failed") -> duration histogram
        self.durations: dict[tuple[str, str, str], Histogram] = {}
        #: Per job and rank: arrival lags, last arrivals, seconds the others waited.
        self.arrivals = ArrivalBook()

    def matched(self, job: str, stripe: int,
                arrivals: list[tuple[int, float]]) -> list[pb.LateRank]:
        """Every rank of a collective of ``job`` arrived: (rank, time), in arrival order.
        Returns the ranks it waited for, for every rank's END (see :mod:`.arrivals`). A
        striped collective is measured once, on stripe 0."""
        if stripe:
            return []
        return [pb.LateRank(rank=rank, lag_seconds=lag)
                for rank, lag in self.arrivals.collective(job, arrivals)]

    def forget(self, job: str) -> None:
        """Drop ``job``'s series (its state was dropped: see Rendezvous.drop_idle)."""
        for key in [k for k in self.durations if k[0] == job]:
            del self.durations[key]
        self.arrivals.forget(job)

    def finished(self, job: str, op: str, started: float, failed: bool,
                 error: GradstarError | None = None) -> None:
        """A collective ended (``error``: why it failed; the status page shows it)."""
        key = (job, op, "failed" if failed else "completed")
        hist = self.durations.get(key)
        if hist is None:
            hist = self.durations[key] = Histogram(DURATION_BUCKETS)
        hist.observe(max(self.clock() - started, 0.0))


#: Ranks of a job whose arrival series are named (the slowest, by weighted mean lag); the
#: others are summed in one series, ``rank="others"``, so a large job's page stays small.
RANKS_NAMED = 16
#: Largest /metrics page, bytes (``--metrics-max-bytes``): jobs' series beyond it are left out,
#: and counted in ``gradstar_metrics_jobs_omitted``.
METRICS_MAX_BYTES = 1 << 20
#: Room kept for what is not a job's own series: the HELP and TYPE lines, the jobs-by-state and
#: omitted-jobs gauges, and the shards' families (a few hundred bytes per shard, 64 at most).
_FIXED_RESERVE = 48 << 10
#: Jobs rendered between two yields to the event loop (:func:`render_async`): each costs a few
#: tens of microseconds per series, so a slice keeps the loop waiting for a millisecond or so.
JOBS_PER_SLICE = 32
#: Order of the state gauge; and which jobs get their series first when not all fit.
_STATES = ("running", "forming", "failed", "completed", "idle")

# The per-job families, in page order: (name, type, help).
_JOB_FAMILIES = (
    ("gradstar_job_generation", "gauge", "Number of the job's current generation."),
    ("gradstar_job_generations_formed_total", "counter",
     "Generations formed by the job (re-joins after failures add one each)."),
    ("gradstar_job_rebuilds_total", "counter",
     "Generations of the job taken back from their rejoining ranks after a coordinator restart."),
    ("gradstar_job_rejoin_wait_seconds", "gauge",
     "The longest a rank waited at the job's latest rebuild, from losing its coordinator to "
     "the generation rebuilt."),
    ("gradstar_job_world_size", "gauge", "Ranks the job needs."),
    ("gradstar_job_max_world_size", "gauge", "Most ranks the job may grow to (0: fixed)."),
    ("gradstar_job_min_world_size", "gauge", "Fewest ranks departures may leave (0: none)."),
    ("gradstar_job_resizes_total", "counter",
     "Generations formed by the job's members moving at a step boundary (grown or shrunk)."),
    ("gradstar_job_joining_at_boundary", "gauge",
     "Ranks waiting to join the job at its next step boundary."),
    ("gradstar_job_members", "gauge",
     "Live members of the current generation (or joiners while forming)."),
    ("gradstar_collectives_in_flight", "gauge", "Collectives matched or waiting for ranks."),
    ("gradstar_member_heartbeat_age_seconds", "gauge",
     "Seconds since each live member was last heard from."),
    ("gradstar_bytes_received_total", "counter",
     "Tensor payload bytes the hub received from the job's ranks."),
    ("gradstar_bytes_sent_total", "counter", "Chunk frame bytes the hub sent to the job's ranks."),
    ("gradstar_collectives_completed_total", "counter", "Collectives completed, by op."),
    ("gradstar_collectives_failed_total", "counter", "Collectives failed, by op."),
    ("gradstar_collective_duration_seconds", "histogram",
     "Seconds from a collective's first header to its completion or failure."),
    ("gradstar_rank_arrival_lag_seconds", "histogram",
     "Seconds between the first rank's header of a collective and this rank's."),
    ("gradstar_rank_last_arrival_lag_seconds", "gauge",
     "This rank's arrival lag in its latest collective."),
    ("gradstar_rank_last_arrivals_total", "counter",
     "Collectives in which this rank arrived last (the one the others waited for)."),
    ("gradstar_rank_waited_for_seconds_total", "counter",
     "Seconds collectives waited for this rank alone (as the last: its lag minus the second "
     "latest rank's)."),
    ("gradstar_global_model_rounds", "gauge",
     "Averaging rounds completed on each global model (LocalSGD, DiLoCo)."),
)


def render(rendezvous, collectives: CollectiveMetrics, averaging=None, *,
           serving: bool = True, now: float | None = None, shards=None,
           max_bytes: int = METRICS_MAX_BYTES, rounds=None, steps=None) -> str:
    """The coordinator's metrics in the Prometheus text format (see :func:`render_async`)."""
    parts = _render(rendezvous, collectives, averaging, serving, now, shards, max_bytes, rounds,
                    steps)
    try:
        while True:
            next(parts)
    except StopIteration as done:
        return done.value


async def render_async(rendezvous, collectives: CollectiveMetrics, averaging=None, *,
                       serving: bool = True, shards=None,
                       max_bytes: int = METRICS_MAX_BYTES, rounds=None, steps=None) -> str:
    """The coordinator's metrics in the Prometheus text format, yielding to the event loop
    every :data:`JOBS_PER_SLICE` jobs, so that collectives never wait long behind a scrape.

    With ``shards`` (a :class:`~..shards.ShardRegistry`) job totals include what the shards
    carried, and each shard has its own series. Only jobs that formed a generation have series
    (joins that never form leave none); the page is at most ``max_bytes`` long: the jobs whose
    series would not fit (running ones go first, then by name) are left out, and counted in
    ``gradstar_metrics_jobs_omitted``. With ``rounds`` (a :class:`~..rounds.RoundsTable`) each
    fault-tolerant fragment and replica has its series (rounds, participants, misses, joins);
    with ``steps`` (a :class:`~..steps.StepsTable`) each sync-mode DDP model and its ranks
    (steps closed, live ranks, contributions, drops, staleness).
    """
    parts = _render(rendezvous, collectives, averaging, serving, None, shards, max_bytes, rounds,
                    steps)
    try:
        while True:
            next(parts)
            await asyncio.sleep(0)
    except StopIteration as done:
        return done.value


def _render(rendezvous, collectives: CollectiveMetrics, averaging, serving: bool,
            now: float | None, shards, max_bytes: int, rounds=None, steps=None):
    """The page, as a generator that yields between slices of jobs and returns the text.

    Jobs may come and go between slices: the table and the collective metrics are copied
    first, and a job dropped meanwhile is rendered as it was.
    """
    now = time.monotonic() if now is None else now
    jobs = list(rendezvous.jobs.values())
    states = dict.fromkeys(_STATES, 0)
    for job in jobs:
        states[job.state] = states.get(job.state, 0) + 1
    # Series by job, copied now: the engine adds to these tables while the page is rendered.
    durations: dict[str, list] = {}
    for (job, op, outcome), hist in sorted(collectives.durations.items()):
        durations.setdefault(job, []).append((op, outcome, hist))
    lags = {job.name: _rank_series(job_arrivals(collectives, shards, job.name, job.generation))
            for job in jobs if job.formed}
    formed = sorted((j for j in jobs if j.formed),
                    key=lambda j: (_STATES.index(j.state) if j.state in _STATES else 9, j.name))
    shard_lines: list[str] = []
    if shards is not None:
        _shard_families(lambda *f: shard_lines.extend(_family(*f)), shards, now)
    if rounds is not None:
        _rounds_families(lambda *f: shard_lines.extend(_family(*f)), rounds)
    if steps is not None:
        steps_families(lambda *f: shard_lines.extend(_family(*f)), _labels, steps)
    budget = max_bytes - _FIXED_RESERVE - sum(len(line) + 1 for line in shard_lines)
    samples: dict[str, list[str]] = {name: [] for name, _, _ in _JOB_FAMILIES}
    omitted = 0
    for i, job in enumerate(formed):
        if i and i % JOBS_PER_SLICE == 0:
            yield
        lines = _job_samples(job, durations.get(job.name, ()), lags.get(job.name, ()),
                             averaging, shards, now)
        size = sum(len(line) + 1 for family in lines.values() for line in family)
        if size > budget:
            omitted += 1
            continue
        budget -= size
        for name, family in lines.items():
            samples[name].extend(family)
    out = _family("gradstar_serving", "gauge",
                  "1 while the coordinator takes new joins, 0 once draining.",
                  [f"gradstar_serving {1 if serving and not rendezvous.draining else 0}"])
    out += _family("gradstar_jobs", "gauge", "Jobs known to the coordinator, by state.",
                   [f"gradstar_jobs{_labels({'state': s})} {n}"
                    for s, n in sorted(states.items())])
    out += _family("gradstar_metrics_jobs_omitted", "gauge",
                   f"Jobs whose series this page leaves out to stay under {max_bytes} bytes.",
                   [f"gradstar_metrics_jobs_omitted {omitted}"])
    for name, kind, help_text in _JOB_FAMILIES:
        out += _family(name, kind, help_text, samples[name])
    out += shard_lines
    return "\n".join(out) + "\n"


def _family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _job_samples(job, durations, lags, averaging, shards, now: float) -> dict[str, list[str]]:
    """One job's series, by family."""
    out: dict[str, list[str]] = {name: [] for name, _, _ in _JOB_FAMILIES}
    name = job.name
    labels = {"job": name}
    gen = job.generation
    out["gradstar_job_generation"].append(
        f"gradstar_job_generation{_labels(labels)} {gen.number if gen else 0}")
    out["gradstar_job_generations_formed_total"].append(
        f"gradstar_job_generations_formed_total{_labels(labels)} {job.generations_formed}")
    out["gradstar_job_rebuilds_total"].append(
        f"gradstar_job_rebuilds_total{_labels(labels)} {job.counters.rebuilds}")
    out["gradstar_job_rejoin_wait_seconds"].append(
        f"gradstar_job_rejoin_wait_seconds{_labels(labels)} "
        f"{_number(job.counters.rejoin_wait_seconds)}")
    out["gradstar_job_world_size"].append(
        f"gradstar_job_world_size{_labels(labels)} {job.world_size}")
    for family, value in (("gradstar_job_max_world_size", job.max_world_size),
                          ("gradstar_job_min_world_size", job.min_world_size),
                          ("gradstar_job_resizes_total", job.resizes),
                          ("gradstar_job_joining_at_boundary", job.at_boundary[0])):
        out[family].append(f"{family}{_labels(labels)} {value}")
    live = gen.live_members if gen is not None else []
    out["gradstar_job_members"].append(
        f"gradstar_job_members{_labels(labels)} {len(live) or len(job.forming)}")
    out["gradstar_collectives_in_flight"].append(
        f"gradstar_collectives_in_flight{_labels(labels)} "
        f"{len(gen.collectives) if gen is not None else 0}")
    for m in sorted(live, key=lambda m: m.rank):
        out["gradstar_member_heartbeat_age_seconds"].append(
            f"gradstar_member_heartbeat_age_seconds{_labels({**labels, 'rank': str(m.rank)})} "
            f"{_number(max(now - m.last_seen, 0.0))}")
    c = job.counters
    s_in, s_out, s_done, s_failed = (shards.job_totals(name) if shards is not None
                                     else (0, 0, {}, {}))
    out["gradstar_bytes_received_total"].append(
        f"gradstar_bytes_received_total{_labels(labels)} {c.bytes_in + s_in}")
    out["gradstar_bytes_sent_total"].append(
        f"gradstar_bytes_sent_total{_labels(labels)} {c.bytes_out + s_out}")
    for metric, counts in (("gradstar_collectives_completed_total", _added(c.completed, s_done)),
                           ("gradstar_collectives_failed_total", _added(c.failed, s_failed))):
        for op, n in sorted(counts.items()):
            out[metric].append(f"{metric}{_labels({**labels, 'op': op_name(op)})} {n}")
    for op, outcome, hist in durations:
        out["gradstar_collective_duration_seconds"] += hist.lines(
            "gradstar_collective_duration_seconds", {"job": name, "op": op, "outcome": outcome})
    for rank, summary in lags:
        rank_labels = {"job": name, "rank": rank}
        hist = Histogram(LAG_BUCKETS)
        hist.counts, hist.total, hist.count = (summary.prometheus_counts(), summary.lag_sum,
                                               summary.collectives)
        out["gradstar_rank_arrival_lag_seconds"] += hist.lines(
            "gradstar_rank_arrival_lag_seconds", rank_labels)
        out["gradstar_rank_last_arrival_lag_seconds"].append(
            f"gradstar_rank_last_arrival_lag_seconds{_labels(rank_labels)} "
            f"{_number(summary.last_lag)}")
        out["gradstar_rank_last_arrivals_total"].append(
            f"gradstar_rank_last_arrivals_total{_labels(rank_labels)} {summary.last}")
        out["gradstar_rank_waited_for_seconds_total"].append(
            f"gradstar_rank_waited_for_seconds_total{_labels(rank_labels)} "
            f"{_number(summary.cost)}")
    if averaging is not None:
        for model, state in sorted(averaging.models(name).items()):
            out["gradstar_global_model_rounds"].append(
                f"gradstar_global_model_rounds{_labels({'job': name, 'model': model})} "
                f"{state.rounds}")
    return out


def job_arrivals(collectives: CollectiveMetrics, shards, job: str,
                 generation=None) -> dict[int, RankArrivals]:
    """``job``'s per-rank arrival summaries wherever its collectives ran: the coordinator's
    own engine and, with ``shards`` (a :class:`~..shards.ShardRegistry`), every hub shard;
    with its current ``generation``, also its two-level stages' (:func:`.arrivals.
    stage_arrivals`), by its own ranks."""
    def of(name: str) -> dict[int, RankArrivals]:
        own = collectives.arrivals.ranks(name)
        return dict(own) if shards is None else merged([own, *shards.job_arrivals(name)])

    ranks = of(job)
    if generation is not None:
        hosts = {rank: m.host for rank, m in generation.members.items()}
        for rank, summary in stage_arrivals(job, generation.number, hosts, of).items():
            if rank not in ranks or summary.ewma > ranks[rank].ewma:
                ranks[rank] = summary
    return ranks


def _rank_series(ranks: dict[int, RankArrivals]) -> list[tuple[str, RankArrivals]]:
    """A job's arrival series: the :data:`RANKS_NAMED` slowest ranks by name, in rank order,
    and the others summed in one series labelled ``rank="others"``."""
    if len(ranks) <= RANKS_NAMED:
        return [(str(r), s) for r, s in sorted(ranks.items())]
    order = slowest(ranks)
    named = sorted(order[:RANKS_NAMED])
    return [*((str(r), ranks[r]) for r in named),
            ("others", merge(ranks[r] for r in order[RANKS_NAMED:]))]


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


def _rounds_families(family, rounds) -> None:
    """Fault-tolerant rounds (:mod:`..rounds`): per fragment and per replica."""
    done, participants, missed_last = [], [], []
    joins, contributed, missed, late = [], [], [], []
    for job in rounds.jobs():
        for model, fragment, frag, held in rounds.job_fragments(job):
            labels = _labels({"job": job, "model": model, "fragment": str(fragment)})
            last = frag.history[-1] if frag.history else None
            done.append(f"gradstar_rounds_completed{labels} {held.rounds}")
            participants.append(f"gradstar_round_replicas{labels} "
                                f"{len(last.participants) if last else 0}")
            missed_last.append(f"gradstar_round_replicas_missed{labels} "
                               f"{len(last.missed) if last else 0}")
        for name, r in sorted(rounds.replicas.get(job, {}).items()):
            labels = _labels({"job": job, "replica": name})
            joins.append(f"gradstar_replica_joins_total{labels} {r.joins}")
            contributed.append(f"gradstar_replica_rounds_total{labels} {r.contributed}")
            missed.append(f"gradstar_replica_rounds_missed_total{labels} {r.missed}")
            late.append(f"gradstar_replica_rounds_late_total{labels} {r.late}")
    family("gradstar_rounds_completed", "gauge",
           "Outer rounds completed on each fragment of a global model.", done)
    family("gradstar_round_replicas", "gauge",
           "Replicas that took part in the fragment's last completed round.", participants)
    family("gradstar_round_replicas_missed", "gauge",
           "Replicas dropped from the fragment's last completed round.", missed_last)
    family("gradstar_replica_joins_total", "counter",
           "Times the replica joined the rounds (first start and restarts).", joins)
    family("gradstar_replica_rounds_total", "counter",
           "Contributions the replica's rounds took.", contributed)
    family("gradstar_replica_rounds_missed_total", "counter",
           "Rounds that closed without the replica while it was expected.", missed)
    family("gradstar_replica_rounds_late_total", "counter",
           "Contributions that came after their round had closed.", late)


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

"""What the coordinator's status page shows, as data: jobs, their ranks with straggler lag
(wherever their collectives ran: the coordinator and its hub shards; :mod:`.stragglers`),
traffic rates, recent failures and hub shards.

:class:`CoordinatorStatus` reads the hub's own state (the rendezvous, the collective metrics,
the shard registry) on its event loop, so nothing is copied or locked, and adds the two things
that state does not keep:

- *rates*: bytes per second in and out of each job over the last :data:`RATE_WINDOW` seconds,
  from samples of the jobs' cumulative byte counters (:class:`TrafficRates`; the coordinator's
  liveness sweep samples, and so does every snapshot);
- *recent failures*: the last :data:`FAILURES_KEPT` failed generations and collectives with
  their time and message (:class:`FailureLog`). A failed generation is logged once, by the
  rendezvous hook; the collectives it takes down with it are not logged again.

:meth:`CoordinatorStatus.snapshot` returns plain JSON-able data; :mod:`.page` renders it
and serves it. Nothing here does I/O.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from gradstar.ops import op_name

from ..metrics import CollectiveMetrics, job_arrivals
from ..metrics.arrivals import RankArrivals
from ..rendezvous.rendezvous import Generation, Job, Rendezvous
from ..shards.registry import ShardRegistry
from .stragglers import host_of, straggler_rows

log = logging.getLogger(__name__)

#: Seconds over which byte rates are averaged.
RATE_WINDOW = 10.0
#: Failures the log keeps (newest first on the page).
FAILURES_KEPT = 20
#: Samples closer together than this are merged (a page refreshed in a loop must not grow the
#: sample buffers), and samples kept per job at most.
_MIN_SAMPLE_GAP = 0.25
_MAX_SAMPLES = int(RATE_WINDOW / _MIN_SAMPLE_GAP) + 2


class TrafficRates:
    """Bytes per second in and out of each job over a sliding window, from samples of the
    jobs' cumulative counters (which only grow while a job exists)."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        #: job -> (time, bytes in, bytes out), oldest first
        self._samples: dict[str, deque[tuple[float, int, int]]] = {}

    def sample(self, job: str, now: float, bytes_in: int, bytes_out: int) -> None:
        samples = self._samples.setdefault(job, deque(maxlen=_MAX_SAMPLES))
        if len(samples) >= 2 and now - samples[-2][0] < _MIN_SAMPLE_GAP:
            samples[-1] = (now, bytes_in, bytes_out)  # the newest moves; spacing stays
        else:
            samples.append((now, bytes_in, bytes_out))
        # Keep one sample at or before the window's start, so the rate spans the whole window.
        while len(samples) > 2 and samples[1][0] <= now - self.window:
            samples.popleft()

    def rate(self, job: str) -> tuple[float, float]:
        """(bytes in, bytes out) per second between the oldest sample in the window and the
        newest; zeros before two samples exist."""
        samples = self._samples.get(job)
        if not samples or len(samples) < 2:
            return 0.0, 0.0
        t0, in0, out0 = samples[0]
        t1, in1, out1 = samples[-1]
        span = t1 - t0
        if span <= 0:
            return 0.0, 0.0
        return max(in1 - in0, 0) / span, max(out1 - out0, 0) / span

    def keep_only(self, jobs) -> None:
        """Forget the samples of jobs not in ``jobs`` (dropped by the rendezvous)."""
        for name in [n for n in self._samples if n not in jobs]:
            del self._samples[name]


@dataclass
class Failure:
    """One entry of the failure log; ``count`` repeats of the same message in a row."""

    time: float  # seconds since the epoch
    job: str
    message: str
    count: int = 1


class FailureLog:
    """The last ``kept`` failures, newest last; a repeat of the newest entry (same job and
    message, as when several collectives fail with one error) counts up instead of adding one."""

    def __init__(self, kept: int = FAILURES_KEPT,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._entries: deque[Failure] = deque(maxlen=kept)

    def record(self, job: str, message: str) -> None:
        last = self._entries[-1] if self._entries else None
        if last is not None and (last.job, last.message) == (job, message):
            last.count += 1
            last.time = self.clock()
            return
        self._entries.append(Failure(self.clock(), job, message))

    @property
    def entries(self) -> list[Failure]:
        """Newest first."""
        return list(reversed(self._entries))


class FailureRecordingMetrics(CollectiveMetrics):
    """The collective engine's metrics, which also log its failed collectives.

    A collective of a failed generation is not logged (the generation's failure is, once), nor
    one failed while :meth:`quiet` is active for its job.
    """

    def __init__(self, rendezvous: Rendezvous, failures: FailureLog,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.rendezvous = rendezvous
        self.failures = failures
        self._quiet: set[str] = set()

    def finished(self, job: str, op: str, started: float, failed: bool,
                 error: BaseException | None = None) -> None:
        super().finished(job, op, started, failed)
        if not failed or job in self._quiet:
            return
        state = self.rendezvous.jobs.get(job)
        gen = state.generation if state is not None else None
        if gen is not None and gen.failure is not None:
            return
        # The engine does not pass the error (yet); a member that finished while others were
        # live is the one cause the generation itself records.
        cause = error or (gen.finished_error if gen is not None else None)
        seconds = max(self.clock() - started, 0.0)
        message = f"{op} failed after {seconds:.1f} s"
        self.failures.record(job, f"{message}: {cause}" if cause is not None else message)

    @contextlib.contextmanager
    def quiet(self, job: str) -> Iterator[None]:
        """Log no collective failures of ``job`` inside the block."""
        self._quiet.add(job)
        try:
            yield
        finally:
            self._quiet.discard(job)


class CoordinatorStatus:
    """The status page's data, read from the hub's state.

    The coordinator wires it in: ``metrics`` is the collective engine's metrics object,
    :meth:`generation_failed` is called from the rendezvous' failure hook (around failing the
    generation's collectives), :meth:`sample` from the liveness sweep.
    """

    def __init__(self, rendezvous: Rendezvous, shards: ShardRegistry | None = None, *,
                 serving: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, rounds=None,
                 steps=None) -> None:
        self.rendezvous = rendezvous
        #: DDP's sync-mode step ledgers (a :class:`~gradstar.coordinator.steps.StepsTable`).
        self.steps = steps
        #: The fault-tolerant rounds (a :class:`~gradstar.coordinator.rounds.RoundsTable`), if any.
        self.rounds = rounds
        self.shards = shards
        self.serving = serving
        self.clock = clock
        self.wall_clock = wall_clock
        self.started = clock()
        self.rates = TrafficRates()
        self.failures = FailureLog(clock=wall_clock)
        #: Who leads (``leadership_json`` of :mod:`.leadership`), set by the coordinator.
        self.leadership: Callable[[], dict] | None = None
        self.metrics = FailureRecordingMetrics(rendezvous, self.failures, clock)

    @contextlib.contextmanager
    def generation_failed(self, gen: Generation) -> Iterator[None]:
        """Log ``gen``'s failure; the collectives failed inside the block are part of it."""
        self.failures.record(gen.job.name, f"generation {gen.number}: {gen.failure}")
        with self.metrics.quiet(gen.job.name):
            yield

    def job_bytes(self, job: Job) -> tuple[int, int]:
        """(bytes in, bytes out) of ``job``, the coordinator's plus what its shards report."""
        b_in, b_out = job.counters.bytes_in, job.counters.bytes_out
        if self.shards is not None:
            s_in, s_out, _, _ = self.shards.job_totals(job.name)
            b_in, b_out = b_in + s_in, b_out + s_out
        return b_in, b_out

    def sample(self, now: float | None = None) -> None:
        """Sample every job's byte counters for the rates."""
        now = self.clock() if now is None else now
        jobs = self.rendezvous.jobs
        self.rates.keep_only(jobs)
        for name, job in jobs.items():
            self.rates.sample(name, now, *self.job_bytes(job))

    def snapshot(self) -> dict:
        """Everything the page shows, as JSON-able data (see :mod:`.page`)."""
        now = self.clock()
        self.sample(now)
        shards = self.shards
        return {
            "generated_at": self.wall_clock(),
            "serving": bool(self.serving()) and not self.rendezvous.draining,
            "draining": self.rendezvous.draining,
            "uptime_seconds": now - self.started,
            "rate_window_seconds": self.rates.window,
            "jobs": [self._job(job, now) for _, job in sorted(self.rendezvous.jobs.items())],
            "failures": [asdict(f) for f in self.failures.entries],
            "shards": {"expected": shards.expected if shards is not None else 0,
                       "slots": self._shards(now)},
            "rounds": self._rounds(),
            "steps": [asdict(view) for view in self.steps.summaries()]
                     if self.steps is not None else [],
            "leadership": self.leadership() if self.leadership is not None else None,
        }

    def _rounds(self) -> list[dict]:
        """Per job with outer rounds: fragments (last round's replicas) and replicas."""
        table = self.rounds
        if table is None:
            return []
        now = table.clock()
        out = []
        for job in table.jobs():
            fragments = []
            for model, fragment, frag, held in table.job_fragments(job):
                last = frag.history[-1] if frag.history else None
                fragments.append({"model": model, "fragment": fragment, "rounds": held.rounds,
                                  "replicas": list(last.participants) if last else [],
                                  "dropped": list(last.missed) if last else []})
            replicas = [{"replica": name, "joins": r.joins, "rounds": r.contributed,
                         "missed": r.missed, "late": r.late,
                         "last_seen_seconds": now - r.last_seen}
                        for name, r in sorted(table.replicas.get(job, {}).items())]
            out.append({"job": job, "fragments": fragments, "replicas": replicas})
        return out

    def _job(self, job: Job, now: float) -> dict:
        gen = job.generation
        c = job.counters
        completed, failed = dict(c.completed), dict(c.failed)
        if self.shards is not None:
            _, _, s_done, s_failed = self.shards.job_totals(job.name)
            for mine, theirs in ((completed, s_done), (failed, s_failed)):
                for op, n in theirs.items():
                    mine[op] = mine.get(op, 0) + n
        b_in, b_out = self.job_bytes(job)
        rate_in, rate_out = self.rates.rate(job.name)
        arrivals = job_arrivals(self.metrics, self.shards, job.name, job.generation)
        return {
            "name": job.name,
            "state": job.state,
            "world_size": job.world_size,
            # Size limits (0: none) and resizes at step boundaries (:mod:`..rendezvous.resize`).
            "min_world_size": job.min_world_size,
            "max_world_size": job.max_world_size,
            "resizes": job.resizes,
            "joining_at_boundary": job.at_boundary[0],
            "departing_at_boundary": job.at_boundary[1],
            "generation": gen.number if gen is not None else 0,
            "generations_formed": job.generations_formed,
            "members": len(gen.live_members) if gen is not None else 0,
            "joining": len(job.forming),
            "in_flight": len(gen.collectives) if gen is not None else 0,
            # Hub shards the generation stripes over (they measure its arrivals and report).
            "shards": len(gen.shards) if gen is not None else 0,
            "bytes_in": b_in,
            "bytes_out": b_out,
            "bytes_in_per_second": rate_in,
            "bytes_out_per_second": rate_out,
            "collectives_completed": {op_name(op): n for op, n in sorted(completed.items())},
            "collectives_failed": {op_name(op): n for op, n in sorted(failed.items())},
            "last_failure": c.last_failure,
            "rebuilds": c.rebuilds,
            "rejoin_wait_seconds": c.rejoin_wait_seconds,
            "ranks": self._ranks(gen, arrivals, now),
            # Every rank with measurements, slowest first (:mod:`.stragglers`).
            "stragglers": straggler_rows(job, arrivals),
        }

    def _ranks(self, gen: Generation | None, arrivals: dict[int, RankArrivals],
               now: float) -> list[dict]:
        ranks = []
        for rank, member in sorted((gen.members if gen is not None else {}).items()):
            lags = arrivals.get(rank)
            state = ("live" if not member.left else "finished" if member.finished else "lost")
            ranks.append({
                "rank": rank,
                "state": state,
                "host": host_of(member),
                "heartbeat_age_seconds": (max(now - member.last_seen, 0.0) if not member.left
                                          else None),
                "collectives": lags.collectives if lags is not None else 0,
                "last_lag_seconds": lags.last_lag if lags is not None else None,
                "mean_lag_seconds": lags.mean if lags is not None else None,
                "last_arrivals": lags.last if lags is not None else 0,
            })
        return ranks

    def _shards(self, now: float) -> list[dict]:
        if self.shards is None:
            return []
        return [{"slot": slot, "address": r.address, "state": r.state,
                 "bytes_in": r.stats.bytes_in, "bytes_out": r.stats.bytes_out,
                 "jobs": sorted(j.job for j in r.stats.jobs if j.active),
                 "report_age_seconds": max(now - r.last_report, 0.0)}
                for slot, r in sorted(self.shards.slots.items())]

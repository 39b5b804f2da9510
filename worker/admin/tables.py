"""What ``gradstar admin`` prints: tables for people, dicts for ``--json``. No I/O here."""

from __future__ import annotations

from collections.abc import Sequence

from gradstar.config import size_limits_text
from gradstar.ops import op_name
from gradstar.proto.v1 import admin_pb2


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "") -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    numeric = [all(isinstance(row[i], int | float) for row in rows) and bool(rows)
               for i in range(len(headers))]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if num else c.ljust(w)
                 for c, w, num in zip(r, widths, numeric, strict=True)]
        lines.append(indent + "  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if ranks else "-"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def jobs_table(jobs: Sequence[admin_pb2.JobSummary]) -> str:
    if not jobs:
        return "no jobs"
    return table(("JOB", "STATE", "GENERATION", "MEMBERS", "SIZE", "RESIZES"),
                 [(j.job, j.state, j.generation, f"{j.members}/{j.world_size}", size_limits(j),
                   j.resizes) for j in jobs])


def size_limits(j: admin_pb2.JobSummary) -> str:
    return size_limits_text(j.world_size, j.min_world_size, j.max_world_size, j.resizes,
                            j.joining_at_boundary, j.departing_at_boundary)


def rates_between(before: admin_pb2.GetJobResponse, after: admin_pb2.GetJobResponse,
                  seconds: float) -> dict:
    """Throughput of a job between two snapshots ``seconds`` apart."""
    def completed(reply):
        return sum(o.completed for o in reply.ops)

    span = max(seconds, 1e-9)
    return {"seconds": seconds,
            "collectives_per_second": (completed(after) - completed(before)) / span,
            "bytes_in_per_second": (after.bytes_in - before.bytes_in) / span,
            "bytes_out_per_second": (after.bytes_out - before.bytes_out) / span}


def job_status(job: admin_pb2.GetJobResponse, rates: dict | None = None) -> str:
    s = job.summary
    lines = [f"job {s.job}: {s.state}, generation {s.generation}, {s.members}/{s.world_size} "
             f"members, size {size_limits(s)}, {s.resizes} resizes"]
    if rates is not None:
        lines.append(f"  throughput   {rates['collectives_per_second']:.1f} collectives/s, "
                     f"{_bytes(rates['bytes_in_per_second'])}/s in, "
                     f"{_bytes(rates['bytes_out_per_second'])}/s out "
                     f"(over the last {rates['seconds']:.1f} s)")
    lines.append(f"  traffic      {_bytes(job.bytes_in)} in, {_bytes(job.bytes_out)} out")
    ops = ", ".join(f"{op_name(o.op)} {o.completed}" + (f" ({o.failed} failed)" if o.failed
                                                       else "") for o in job.ops)
    lines.append(f"  collectives  {ops or 'none yet'}")
    if job.members:
        lines.append("  members")
        lines.append(table(("RANK", "PEER", "HEARTBEAT AGE"),
                           [(m.rank, m.peer_address or "-",
                             f"{m.last_heartbeat_age_seconds:.1f} s") for m in job.members],
                           indent="    "))
    if job.in_flight:
        lines.append("  in flight")
        lines.append(table(("SEQ", "GROUP", "OP", "AGE", "ARRIVED", "WAITING FOR"),
                           [(c.seq, c.group, op_name(c.op), f"{c.age_seconds:.1f} s",
                             _ranks(c.arrived_ranks), _ranks(c.missing_ranks))
                            for c in job.in_flight], indent="    "))
    else:
        lines.append("  in flight    none")
    if job.models:
        lines.append("  global models")
        lines.append(table(("MODEL", "ROUNDS", "PARAMETERS"),
                           [(m.name, m.rounds, m.parameters) for m in job.models],
                           indent="    "))
    if job.rebuilds:
        lines.append(f"  rebuilt      {job.rebuilds} time(s) after coordinator restarts; ranks "
                     f"waited up to {job.rejoin_wait_seconds:.1f} s at the latest")
    if job.last_failure:
        lines.append(f"  last failure {job.last_failure}")
    return "\n".join(lines)


def status_report(address: str, health: str, jobs: Sequence[admin_pb2.GetJobResponse],
                  rates: dict[str, dict] | None = None) -> str:
    header = f"coordinator {address}: {health}, {len(jobs)} job{'s' if len(jobs) != 1 else ''}"
    body = [job_status(j, (rates or {}).get(j.summary.job)) for j in jobs]
    return "\n\n".join([header, *body])


def summary_as_dict(s: admin_pb2.JobSummary) -> dict:
    return {"job": s.job, "state": s.state, "generation": s.generation,
            "world_size": s.world_size, "members": s.members,
            "min_world_size": s.min_world_size, "max_world_size": s.max_world_size,
            "resizes": s.resizes, "joining_at_boundary": s.joining_at_boundary,
            "departing_at_boundary": s.departing_at_boundary}


def job_as_dict(job: admin_pb2.GetJobResponse, rates: dict | None = None) -> dict:
    """``--json`` form of a job: the GetJob reply with op names, plus throughput if measured."""
    out = summary_as_dict(job.summary)
    out.update(
        bytes_in=job.bytes_in, bytes_out=job.bytes_out,
        collectives={op_name(o.op): {"completed": o.completed, "failed": o.failed}
                     for o in job.ops},
        live_members=[{"rank": m.rank, "peer_address": m.peer_address,
                       "last_heartbeat_age_seconds": m.last_heartbeat_age_seconds}
                      for m in job.members],
        in_flight=[{"seq": c.seq, "group": c.group, "op": op_name(c.op),
                    "age_seconds": c.age_seconds, "arrived_ranks": list(c.arrived_ranks),
                    "missing_ranks": list(c.missing_ranks)} for c in job.in_flight],
        global_models=[{"name": m.name, "rounds": m.rounds, "parameters": m.parameters}
                       for m in job.models],
        last_failure=job.last_failure, rebuilds=job.rebuilds,
        rejoin_wait_seconds=job.rejoin_wait_seconds,
    )
    if rates is not None:
        out["throughput"] = rates
    return out


def shards_table(reply: admin_pb2.ListShardsResponse) -> str:
    """The data-plane shards, one line each, under a line saying how many are up."""
    up = sum(1 for s in reply.shards if s.state == "up")
    if not reply.shards:
        head = ("no hub shards: the coordinator carries every collective itself"
                if not reply.expected else f"0 of {reply.expected} expected hub shards are up")
        return head
    head = f"{up} hub shard(s) up" + (f" of {reply.expected} expected" if reply.expected else "")
    rows = [(s.slot, s.address, s.state, _bytes(s.bytes_in), _bytes(s.bytes_out),
             f"{s.last_report_age_seconds:.1f} s", ", ".join(s.jobs) or "-")
            for s in reply.shards]
    return head + "\n" + table(("SLOT", "ADDRESS", "STATE", "IN", "OUT", "REPORTED", "JOBS"),
                                rows, indent="  ")


def shards_as_dict(reply: admin_pb2.ListShardsResponse) -> dict:
    return {"expected": reply.expected, "shards": [
        {"slot": s.slot, "address": s.address, "state": s.state, "bytes_in": s.bytes_in,
         "bytes_out": s.bytes_out, "jobs": list(s.jobs),
         "last_report_age_seconds": s.last_report_age_seconds} for s in reply.shards]}


def rounds_table(job: str, reply: admin_pb2.ListRoundsResponse) -> str:
    """A job's fault-tolerant rounds: fragments (last round's replicas), then replicas."""
    frags = [(f.model, f.fragment, f.rounds, f.parameters, ", ".join(f.last_participants) or "-",
              ", ".join(f.last_missed) or "-", f.open_contributions) for f in reply.fragments]
    reps = [(r.replica, r.joins, r.contributed, r.missed, r.late,
             f"{r.last_seen_age_seconds:.1f} s") for r in reply.replicas]
    return (f"job {job}: {len(reply.fragments)} fragment(s), {len(reply.replicas)} replica(s)\n"
            + table(("MODEL", "FRAGMENT", "ROUNDS", "PARAMS", "LAST ROUND", "DROPPED", "OPEN"),
                    frags, indent="  ") + "\n"
            + table(("REPLICA", "JOINS", "ROUNDS", "MISSED", "LATE", "SEEN"), reps,
                    indent="  "))


def rounds_as_dict(job: str, reply: admin_pb2.ListRoundsResponse) -> dict:
    return {"job": job, "fragments": [
        {"model": f.model, "fragment": f.fragment, "rounds": f.rounds,
         "parameters": f.parameters, "last_participants": list(f.last_participants),
         "last_missed": list(f.last_missed), "open_contributions": f.open_contributions}
        for f in reply.fragments], "replicas": [
        {"replica": r.replica, "joins": r.joins, "contributed": r.contributed,
         "missed": r.missed, "late": r.late, "last_seen_age_seconds": r.last_seen_age_seconds}
        for r in reply.replicas]}


def steps_table(job: str, reply: admin_pb2.ListStepsResponse) -> str:
    """A job's sync-mode DDP steps: per model its mode and steps, then its ranks."""
    parts = []
    for m in reply.models:
        stale = ", ".join(f"{k}: {n}" for k, n in sorted(m.staleness.items())) or "-"
        rows = [(r.rank, "live" if r.live else "out", r.base, r.contributed, r.dropped)
                for r in m.ranks]
        parts.append(f"job {job} model {m.model}: {m.mode}, {m.steps} steps closed, "
                     f"{len(m.live)} of {m.world_size} ranks live, {m.dropped} dropped, "
                     f"staleness {stale}\n"
                     + table(("RANK", "STATE", "AT STEP", "CONTRIBUTED", "DROPPED"), rows,
                             indent="  "))
    return "\n".join(parts)


def steps_as_dict(job: str, reply: admin_pb2.ListStepsResponse) -> dict:
    return {"job": job, "models": [
        {"model": m.model, "mode": m.mode, "steps": m.steps, "world_size": m.world_size,
         "live": list(m.live), "dropped": m.dropped,
         "staleness": {str(k): n for k, n in sorted(m.staleness.items())},
         "snapshot_steps": None if m.snapshot_steps < 0 else m.snapshot_steps,
         "ranks": [{"rank": r.rank, "live": r.live, "base": r.base,
                    "contributed": r.contributed, "dropped": r.dropped} for r in m.ranks]}
        for m in reply.models]}
def _lag(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def stragglers_table(reply: admin_pb2.GetStragglersResponse) -> str:
    """Who the job's collectives wait for: ranks slowest first, flagged ones marked."""
    flagged = [r.rank for r in reply.ranks if r.flagged]
    head = (f"job {reply.job}: {reply.ranks_total} rank(s) measured; "
            + (f"straggler(s): {', '.join(f'rank {r}' for r in flagged)}" if flagged
               else "no rank stands out"))
    if not reply.ranks:
        return f"job {reply.job}: no collective measured yet"
    rows = [(r.rank, r.host or "-", _lag(r.median_lag_seconds), _lag(r.p95_lag_seconds),
             _lag(r.ewma_lag_seconds), f"{r.last_share * 100:.0f}%", _lag(r.waited_seconds),
             r.collectives, "straggler" if r.flagged else "") for r in reply.ranks]
    return head + "\n" + table(("RANK", "HOST", "MEDIAN LAG", "P95 LAG", "RECENT LAG", "LAST",
                                 "OTHERS WAITED", "COLLECTIVES", ""), rows, indent="  ")


def stragglers_as_dict(reply: admin_pb2.GetStragglersResponse) -> dict:
    """``--json``: the ranks slowest first, each with its rank, host and lag figures (seconds;
    ``last_share`` a fraction)."""
    fields = ("rank", "host", "address", "collectives", "ewma_lag_seconds",
              "median_lag_seconds", "p95_lag_seconds", "mean_lag_seconds", "last_lag_seconds",
              "max_lag_seconds", "last_arrivals", "last_share", "waited_seconds", "flagged")
    return {"job": reply.job, "ranks_total": reply.ranks_total,
            "ranks": [{f: getattr(r, f) for f in fields} for r in reply.ranks]}


def leadership_as_dict(address: str, reply: admin_pb2.GetLeadershipResponse | None,
                       problem: str = "") -> dict:
    """One coordinator's view of who leads (``gradstar admin leader --json``)."""
    if reply is None:
        return {"coordinator": address, "error": problem}
    return {"coordinator": address, "elected": reply.elected, "role": reply.role,
            "leader": reply.leader, "term": reply.term,
            "leader_since_unix": reply.leader_since_unix, "takeovers": reply.takeovers,
            "rebuilds": reply.rebuilds, "rejoin_wait_seconds": reply.rejoin_wait_seconds}


def leadership_table(views: Sequence[dict], now: float) -> str:
    """``gradstar admin leader``: one row per coordinator asked."""
    rows = []
    for v in views:
        if "error" in v:
            rows.append((v["coordinator"], "unreachable", "-", "-", "-", "-", "-"))
            continue
        since = (f"{now - v['leader_since_unix']:.0f} s ago" if v["leader_since_unix"]
                 else "-")
        rows.append((v["coordinator"], v["role"] if v["elected"] else "leader (no --ha)",
                     v["leader"] or "-", v["term"], since, v["takeovers"],
                     f"{v['rejoin_wait_seconds']:.2f} s"))
    return table(("COORDINATOR", "ROLE", "LEADER", "TERM", "LEADS SINCE", "TAKEOVERS",
                  "RANKS WAITED"), rows)

"""Who a job's collectives wait for, as operators see it: one row per rank, slowest first, with
its host and lag figures (the status page, ``/status.json``, ``Admin.GetStragglers`` and so
``gradstar admin stragglers`` and ``ProcessGroup.straggler_stats``).

The figures are the merge of every place the job's collectives ran (:func:`..metrics.
job_arrivals`: the coordinator's engine and its hub shards, node-local ones included; see
:mod:`..metrics.arrivals` for what is measured and how it merges). Nothing here does I/O.
"""

from __future__ import annotations

from gradstar.proto.v1 import admin_pb2 as apb
from gradstar.transport.addresses import split_host_port

from ..metrics.arrivals import RankArrivals, flagged, slowest
from ..rendezvous.rendezvous import Job, Member


def host_of(member: Member | None) -> str:
    """What operators call the rank's host: the host name it joined with, else its peer
    server's host, else its host key; '' for a rank not in the current generation."""
    if member is None:
        return ""
    if member.hostname:
        return member.hostname
    return split_host_port(member.peer_address)[0] or member.host


def straggler_rows(job: Job | None, ranks: dict[int, RankArrivals],
                   limit: int = 0) -> list[dict]:
    """Rows for ``ranks`` (rank -> merged summary) of ``job``, slowest first, at most
    ``limit`` (0: all). Lags are seconds; ``last_share`` is a fraction."""
    marked = flagged(ranks)
    order = slowest(ranks)
    members = job.generation.members if job is not None and job.generation is not None else {}
    rows = []
    for rank in order[:limit] if limit else order:
        s, member = ranks[rank], members.get(rank)
        rows.append({
            "rank": rank,
            "host": host_of(member),
            "address": member.peer_address if member is not None else "",
            "collectives": s.collectives,
            "ewma_lag_seconds": s.ewma,
            "median_lag_seconds": s.quantile(0.5),
            "p95_lag_seconds": s.quantile(0.95),
            "mean_lag_seconds": s.mean,
            "last_lag_seconds": s.last_lag,
            "max_lag_seconds": s.max_lag,
            "last_arrivals": s.last,
            "last_share": s.last_share,
            "waited_seconds": s.cost,
            "flagged": rank in marked,
        })
    return rows


def stragglers_reply(name: str, job: Job | None, ranks: dict[int, RankArrivals],
                     limit: int = 0) -> apb.GetStragglersResponse:
    """``Admin.GetStragglers``'s answer."""
    return apb.GetStragglersResponse(
        job=name, ranks_total=len(ranks),
        ranks=[apb.RankStragglerStats(**row) for row in straggler_rows(job, ranks, limit)])

"""Naming the straggler: three real rank processes, one of which sleeps a fixed delay before
every all_reduce, on a plain coordinator and on one whose collectives are striped over two hub
shards (``--shards 2``: the shards measure and report, the coordinator merges).

What must hold wherever the collectives ran, whatever the machine's load: the late rank is first
and its lag is at least about the delay (a sleep cannot make it arrive sooner), every figure is
consistent with the others and with how long the ranks themselves waited (no upper bound in
wall time: a loaded machine only adds lag), the flags follow the flagging rule, each collective
is counted once, every view — Admin.GetStragglers, /metrics, /status.json, the ranks' own
``pg.straggler_stats()`` — shows the same numbers, and each rank's log names it, once in its
window.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import statistics
import time

import grpc
import pytest

from gradstar.coordinator.metrics.arrivals import EWMA_WEIGHT, STRAGGLER_LAG
from gradstar.proto.v1 import admin_pb2, admin_pb2_grpc

from .conftest import finish, spawn_ranks

WORLD = 3
SLOW = 2
DELAY = 0.2
ROUNDS = 10
#: Collectives of the scenario (rank_script's late_rank): a warm-up barrier, whose END tells
#: each rank it may start (seq 1), then the ROUNDS measured all_reduces (seq 2 on).
COLLECTIVES = ROUNDS + 1
#: A rank's figures, the same in every view (they come from one summary).
FIELDS = ("rank", "host", "address", "collectives", "ewma_lag_seconds", "median_lag_seconds",
          "p95_lag_seconds", "mean_lag_seconds", "last_lag_seconds", "max_lag_seconds",
          "last_arrivals", "last_share", "waited_seconds", "flagged")
#: Slack for float arithmetic on sums of a few monotonic-clock differences.
EPS = 1e-6


async def http_get(port: int, path: str) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return (await asyncio.wait_for(reader.read(), 10)).decode().partition("\r\n\r\n")[2]
    finally:
        writer.close()


async def stragglers(coordinator, job: str) -> admin_pb2.GetStragglersResponse:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        return await admin_pb2_grpc.AdminStub(channel).GetStragglers(
            admin_pb2.GetStragglersRequest(job=job), timeout=5)


def as_rows(ranks, fields=FIELDS) -> list[dict]:
    """``ranks`` (messages, dataclasses or dicts, slowest first) as dicts of ``fields``."""
    return [{f: r[f] if isinstance(r, dict) else getattr(r, f) for f in fields} for r in ranks]


def flagged_by_rule(rows: list[dict]) -> list[int]:
    """The ranks the flagging rule names (gradstar.coordinator.metrics.arrivals.flagged), from
    the rows' weighted mean lags: at least STRAGGLER_LAG and twice the median rank's."""
    floor = max(STRAGGLER_LAG, 2 * statistics.median(r["ewma_lag_seconds"] for r in rows))
    return [r["rank"] for r in rows if r["ewma_lag_seconds"] >= floor]


def check_consistent(rows: list[dict]) -> None:
    """What holds of any view's rows (slowest first) however the collectives were timed.

    The flags are checked against the rule, not against the scenario: in a quiet run the rule
    flags the late rank alone, but a fast rank stalled for a few times the delay near the end
    may hold half the late rank's weighted mean lag, and then the rule rightly flags nobody.
    """
    # Slowest first: by weighted mean lag, then by the seconds the others waited, then by rank.
    assert [r["rank"] for r in rows] == [r["rank"] for r in sorted(
        rows, key=lambda r: (-r["ewma_lag_seconds"], -r["waited_seconds"], r["rank"]))], rows
    assert [r["rank"] for r in rows if r["flagged"]] == flagged_by_rule(rows), rows
    for r in rows:
        n, top = r["collectives"], r["max_lag_seconds"]
        # Lags are offsets from the first rank: none below 0; the quantiles, the weighted and
        # plain means and the latest lie among them.
        assert 0 <= r["median_lag_seconds"] <= r["p95_lag_seconds"] + EPS <= top + 2 * EPS, r
        for f in ("ewma_lag_seconds", "mean_lag_seconds", "last_lag_seconds"):
            assert 0 <= r[f] <= top + EPS, (f, r)
        assert 0 <= r["last_arrivals"] <= n and r["last_share"] == r["last_arrivals"] / n, r
        # In a collective it came last to, the others waited for it its lag less the second
        # latest rank's: at most its lag. So in all, at most the sum of its lags.
        assert 0 <= r["waited_seconds"] <= r["mean_lag_seconds"] * n + EPS, r



def check_slow_first(rows: list[dict], slow: list[int], world: int, min_lag: float) -> None:
    """One view's ``rows`` (slowest first) show the ranks ``slow``, which slept before every
    collective: figures consistent and flags as the rule says (:func:`check_consistent`), every
    rank of ``world`` once, ``slow`` first with a median lag of at least ``min_lag`` (a lower
    bound: a sleep cannot make them arrive sooner), and every other rank's median at most half
    the least of theirs (relative, as load delays every rank; the flagging rule's margin; a
    median, as one stall of a fast rank must not decide it)."""
    check_consistent(rows)
    assert sorted(r["rank"] for r in rows) == list(range(world)), rows
    first = rows[:len(slow)]
    assert sorted(r["rank"] for r in first) == sorted(slow), rows
    least = min(r["median_lag_seconds"] for r in first)
    assert least >= min_lag, rows
    assert all(2 * r["median_lag_seconds"] <= least for r in rows[len(slow):]), rows

def check_ranks(rows: list[dict], durations: dict[int, list[float]]) -> None:
    """``rows`` (one view's, slowest first) show the scenario: SLOW first with its delay as lag,
    each collective counted once. ``durations``: per rank, how long each of its COLLECTIVES
    took it (call to return, on its own clock)."""
    # A rank that sleeps DELAY after the previous END reaches the next collective about DELAY
    # after the others (less only where the others stall too: hence 0.7).
    check_slow_first(rows, [SLOW], WORLD, 0.7 * DELAY)
    assert all(r["collectives"] == COLLECTIVES for r in rows), rows  # each collective once
    assert sum(r["last_arrivals"] for r in rows) == COLLECTIVES, rows  # one last rank in each
    slow, others = rows[0], rows[1:]
    assert slow["host"] == socket.gethostname(), rows
    assert slow["waited_seconds"] >= 0.7 * DELAY * ROUNDS, slow
    # Its weighted mean: the warm-up barrier's lag (about 0: nobody sleeps before it) keeps the
    # weight (1 - EWMA_WEIGHT) ** ROUNDS, the rounds' lags (each at least about DELAY) the rest.
    assert slow["ewma_lag_seconds"] >= (1 - (1 - EWMA_WEIGHT) ** ROUNDS) * 0.7 * DELAY, slow
    # It came last to most rounds: a fast rank comes last only where it stalls longer than the
    # delay.
    assert slow["last_arrivals"] > ROUNDS / 2, slow
    # Upper bounds without wall time, from causality: a rank's header reaches the hub after the
    # first rank called the collective, and before that rank's call returns (its result needs
    # every rank's data). So in each collective a rank's lag is at most how long the collective
    # took some other rank.
    for r in rows:
        bound = [max(d[k] for s, d in durations.items() if s != r["rank"])
                 for k in range(COLLECTIVES)]
        assert r["max_lag_seconds"] <= max(bound) + EPS, (r, bound)
        assert r["mean_lag_seconds"] * COLLECTIVES <= sum(bound) + EPS, (r, bound)
    # The others together were waited for less than the late rank, but for the warm-up barrier
    # (its wait, at most its longest call, may be charged to any rank: start-up).
    barrier = max(d[0] for d in durations.values())
    assert sum(o["waited_seconds"] for o in others) < slow["waited_seconds"] + barrier, rows


def check_log(err: str, job: str, rows: list[dict], durations: dict[int, list[float]]) -> None:
    """A rank's log (``err``) names the ranks a collective waited for over the threshold (DELAY
    / 2), once in its (long) window; ``rows``: the admin view, ``durations`` as above."""
    lines = [line for line in err.splitlines() if "waited for rank" in line]
    assert len(lines) == 1, err[-3000:]
    said = re.search(rf"collective seq (\d+) of job '{re.escape(job)}' waited for (.+?); next "
                     r"such line", lines[0])
    assert said, lines[0]
    seq, named = int(said[1]), re.findall(r"rank (\d+) \(host ([^)]*)\) (\S+) s late", said[2])
    # Nothing else in the list; each rank once, with its host.
    assert "; ".join(f"rank {r} (host {h}) {lag} s late" for r, h, lag in named) == said[2]
    ranks = [int(r) for r, _, _ in named]
    lags = [float(lag) for _, _, lag in named]
    assert len(set(ranks)) == len(ranks) and set(ranks) <= set(range(WORLD)), lines[0]
    assert {h for _, h, _ in named} == {socket.gethostname()}, lines[0]
    # Latest first, none under the threshold (lags to 3 significant digits: 0.5% slack).
    assert lags == sorted(lags, reverse=True) and lags[-1] >= DELAY / 2, lines[0]
    # The collective it names: 1 <= seq <= COLLECTIVES, seq 1 the barrier. The lags it gives
    # are the hub's (within each rank's largest) and obey causality as above.
    assert 1 <= seq <= COLLECTIVES, lines[0]
    by_rank = {r["rank"]: r for r in rows}
    for rank, lag in zip(ranks, lags, strict=True):
        assert lag <= by_rank[rank]["max_lag_seconds"] * 1.005, (lines[0], rows)
        bound = max(d[seq - 1] for s, d in durations.items() if s != rank)
        assert lag <= bound * 1.005 + EPS, (lines[0], durations)
    # The first collective over the threshold is nearly always the first round (seq 2), where
    # the late rank is DELAY late; it names SLOW there and at any later round (where it may also
    # name a fast rank that stalled). Only the warm-up barrier may name anyone: start-up (a
    # rank's first collective sets up its streams) can hold any rank back there.
    if seq > 1:
        assert SLOW in ranks, lines[0]


@pytest.mark.parametrize("shards", [0, 2])
async def test_a_late_rank_is_named_wherever_its_collectives_run(start_coordinator, shards):
    coordinator = await start_coordinator(shards=shards, metrics_port=0)
    job = f"late-{shards}"
    procs = await spawn_ranks("late_rank", coordinator.address, WORLD, job, str(SLOW),
                              str(DELAY), str(ROUNDS), GRADSTAR_CHUNK_BYTES=256,
                              GRADSTAR_STRAGGLER_LOG_SECONDS=DELAY / 2,
                              GRADSTAR_STRAGGLER_LOG_WINDOW=600)
    results = [await finish(p, 60) for p in procs]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    if shards:
        assert len(coordinator.shards.up) == shards
        # Striped over both shards: they measured it (stripe 0's), not the coordinator.
        assert coordinator.engine.metrics.arrivals.ranks(job) == {}
    # What each rank read through pg.straggler_stats() (once every collective was in it), and
    # how long each of its collectives took it.
    seen, durations = [], {}
    for rank, (_, out, _) in enumerate(results):
        report = json.loads(out.strip().splitlines()[-1])
        assert report["job"] == job and report["ranks_total"] == WORLD
        assert len(report["durations"]) == COLLECTIVES
        seen.append(as_rows(report["ranks"]))
        durations[rank] = report["durations"]
    check_ranks(seen[0], durations)
    # The admin view (the coordinator's merge of its own and its shards' measurements).
    deadline = time.monotonic() + 5
    while True:
        reply = await stragglers(coordinator, job)
        if all(r.collectives == COLLECTIVES for r in reply.ranks) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    rows = as_rows(reply.ranks)
    check_ranks(rows, durations)
    # Every collective is in every view, so they all show the very same figures: the ranks',
    # the admin view's and /status.json's.
    assert all(s == rows for s in seen), (seen, rows)
    status = json.loads(await http_get(coordinator.metrics_port, "/status.json"))
    (mine,) = [j for j in status["jobs"] if j["name"] == job]
    assert as_rows(mine["stragglers"]) == rows
    # /metrics: the same counts and sums (printed as repr: exact).
    page = await http_get(coordinator.metrics_port, "/metrics")

    def series(name: str) -> dict[int, str]:
        return {int(m[1]): m[2] for m in re.finditer(
            rf'{name}{{job="{job}",rank="(\d+)"}} (\S+)', page)}

    by_rank = {r["rank"]: r for r in rows}
    counts = series("gradstar_rank_arrival_lag_seconds_count")
    assert counts == {r: str(COLLECTIVES) for r in range(WORLD)}
    assert {r: float(v) / COLLECTIVES for r, v in series(
        "gradstar_rank_arrival_lag_seconds_sum").items()} == {
        r: s["mean_lag_seconds"] for r, s in by_rank.items()}
    assert {r: int(v) for r, v in series("gradstar_rank_last_arrivals_total").items()} == {
        r: s["last_arrivals"] for r, s in by_rank.items()}
    assert {r: float(v) for r, v in series("gradstar_rank_waited_for_seconds_total").items()} == {
        r: s["waited_seconds"] for r, s in by_rank.items()}
    assert {r: float(v) for r, v in series("gradstar_rank_last_arrival_lag_seconds").items()} == {
        r: s["last_lag_seconds"] for r, s in by_rank.items()}
    # Every rank's log names the late rank and its host, once in its (long) window.
    for _, _, err in results:
        check_log(err, job, rows, durations)

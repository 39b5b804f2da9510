"""The status page without sockets: the snapshot read from a rendezvous driven directly, the
rates and failure log on fake clocks, and the HTML rendered from hand-made snapshots (escaping,
content security policy, the numbers in the cells)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from html.parser import HTMLParser

import pytest

from gradstar.coordinator.metrics.arrivals import ArrivalBook, to_fields
from gradstar.coordinator.rendezvous import Rendezvous
from gradstar.coordinator.shards import ShardRegistry
from gradstar.coordinator.views import (
    CoordinatorStatus,
    FailureLog,
    TrafficRates,
    render_html,
    render_json,
    status_routes,
)
from gradstar.errors import RankLostError
from gradstar.ops import ALL_REDUCE
from gradstar.proto.v1 import shard_pb2 as spb

HOSTILE = "<script>alert(1)</script>"
ATTRIBUTE = '" onmouseover="alert(2)'


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Cells(HTMLParser):
    """The page as a browser reads it: every element's attributes and text, and script bodies."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict, list[str]]] = []
        self._open: list[tuple[str, dict, list[str]]] = []
        self.scripts: list[str] = []
        self.styles: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        # Where it sits: the data-job / data-rank / data-ranks-of / data-straggler(s-of) of the
        # elements around it
        # (see cells()).
        for _, outer, _ in self._open:
            for key in ("data-job", "data-rank", "data-ranks-of", "data-straggler",
                        "data-stragglers-of"):
                if key in outer:
                    attrs.setdefault(f"in-{key}", outer[key])
        element = (tag, attrs, [])
        self.elements.append(element)
        if tag not in ("meta", "br", "img", "input", "link"):
            self._open.append(element)

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _, _, text in self._open:
            text.append(data)
        if self._open and self._open[-1][0] == "script":
            self.scripts.append(data)
        if self._open and self._open[-1][0] == "style":
            self.styles.append(data)

    def cells(self, **where) -> dict[str, tuple[str | None, str]]:
        """{data-field: (data-value, text)} of the cells inside the row ``where`` names."""
        where = {f"in-{k.replace('_', '-')}": v for k, v in where.items()}
        return {a["data-field"]: (a.get("data-value"), text) for a, text in self.find("td")
                if "data-field" in a and all(a.get(k) == v for k, v in where.items())}

    def find(self, tag: str | None = None, **attrs) -> list[tuple[dict, str]]:
        return [(a, "".join(text)) for t, a, text in self.elements
                if (tag is None or t == tag)
                and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def snapshot(**changes) -> dict:
    job = {"name": "j", "state": "running", "world_size": 2, "generation": 1,
           "min_world_size": 0, "max_world_size": 2, "resizes": 0, "joining_at_boundary": 0,
           "departing_at_boundary": 0, "generations_formed": 1, "members": 2, "joining": 0,
           "in_flight": 0, "shards": 0,
           "bytes_in": 8000, "bytes_out": 8128, "bytes_in_per_second": 1234.5,
           "bytes_out_per_second": 0.0, "collectives_completed": {"all_reduce": 3},
           "collectives_failed": {}, "last_failure": "",
           "ranks": [{"rank": 0, "state": "live", "heartbeat_age_seconds": 0.2,
                      "collectives": 3, "last_lag_seconds": 0.0, "mean_lag_seconds": 0.0,
                      "last_arrivals": 0},
                     {"rank": 1, "state": "live", "heartbeat_age_seconds": 0.4,
                      "collectives": 3, "last_lag_seconds": 0.3, "mean_lag_seconds": 0.1,
                      "last_arrivals": 3}]}
    base = {"generated_at": 1_800_000_000.0, "serving": True, "draining": False,
            "uptime_seconds": 75.0, "rate_window_seconds": 10.0, "jobs": [job],
            "failures": [], "shards": {"expected": 0, "slots": []}}
    return {**base, **changes}


# -- rates and the failure log --------------------------------------------------------------------


def test_rates_are_bytes_over_the_window_of_samples():
    rates = TrafficRates(window=10)
    assert rates.rate("j") == (0.0, 0.0)  # nothing to compare with yet
    rates.sample("j", 0.0, 0, 0)
    rates.sample("j", 2.0, 4000, 1000)
    assert rates.rate("j") == (2000.0, 500.0)
    for t in range(3, 30):  # 1000 bytes in a second, then silence from t = 20
        rates.sample("j", float(t), 4000 + 1000 * min(t - 2, 18), 1000)
    # The window ends at 29 and starts at the newest sample at or before 19: one second of
    # traffic in ten.
    assert rates.rate("j") == pytest.approx((1000 / 10, 0.0))
    rates.keep_only({"other"})
    assert rates.rate("j") == (0.0, 0.0)


def test_samples_close_together_are_merged_so_a_page_in_a_loop_cannot_grow_them():
    rates = TrafficRates(window=10)
    for i in range(10_000):
        rates.sample("j", i * 0.001, i, 0)
    assert len(rates._samples["j"]) <= 10 / 0.25 + 2
    assert rates.rate("j")[0] == pytest.approx(1000, rel=0.01)


def test_failure_log_keeps_the_newest_and_counts_repeats():
    clock = Clock(100.0)
    log = FailureLog(kept=3, clock=clock)
    for i in range(5):
        clock.now += 1
        log.record("j", f"failure {i}")
        log.record("j", f"failure {i}")
    assert [(f.message, f.count, f.time) for f in log.entries] == [
        ("failure 4", 2, 105.0), ("failure 3", 2, 104.0), ("failure 2", 2, 103.0)]


# -- the snapshot, from a rendezvous driven directly ----------------------------------------------


async def formed(rendezvous: Rendezvous, job: str, world: int):
    members = [rendezvous.offer(job, world, r, f"127.0.0.1:{5000 + r}") for r in range(world)]
    await asyncio.wait_for(asyncio.gather(*(m.joined for m in members)), 2)
    return members[0].generation, members


async def test_snapshot_shows_jobs_ranks_lags_bytes_and_shards():
    clock = Clock()
    rendezvous = Rendezvous(heartbeat_timeout=10)
    shards = ShardRegistry(rendezvous, expected=1)
    status = CoordinatorStatus(rendezvous, shards, clock=clock, wall_clock=lambda: 5e8)
    gen, members = await formed(rendezvous, "j", 3)
    gen.job.counters.bytes_in, gen.job.counters.bytes_out = 1000, 1100
    gen.job.counters.completed[ALL_REDUCE] = 2
    record = shards.register(spb.ShardHello(address="10.0.0.7:1", slot=-1))
    shards.report(record, spb.ShardStats(bytes_in=50, bytes_out=60, jobs=[
        spb.ShardJob(job="j", bytes_in=50, bytes_out=60, active=True)]))
    status.sample()
    clock.now += 2
    gen.job.counters.bytes_in += 2000
    # Rank 2 arrives 0.5 s after rank 0 at both collectives: the straggler.
    m = status.metrics
    for _ in range(2):
        m.arrivals.collective("j", [(0, 10.0), (1, 10.1), (2, 10.5)])
    # A shard measured a third one (it reports only the ranks whose summaries changed).
    theirs = ArrivalBook()
    theirs.collective("j", [(0, 0.0), (1, 0.1), (2, 0.5)])
    shards.report(record, spb.ShardStats(bytes_in=50, bytes_out=60, jobs=[
        spb.ShardJob(job="j", bytes_in=50, bytes_out=60, active=True)], arrivals=[
        spb.RankArrivals(job="j", rank=r, **to_fields(s)) for r, s in theirs.ranks("j").items()]))
    rendezvous.leave(members[1])
    clock.now += 1

    snap = status.snapshot()
    json.dumps(snap)  # JSON-able as it is
    (job,) = snap["jobs"]
    assert {k: job[k] for k in ("name", "state", "world_size", "generation", "members",
                                "bytes_in", "bytes_out", "collectives_completed")} == {
        "name": "j", "state": "running", "world_size": 3, "generation": 1, "members": 2,
        "bytes_in": 3050, "bytes_out": 1160, "collectives_completed": {"all_reduce": 2}}
    # 2000 bytes over the 3 s since the first sample
    assert job["bytes_in_per_second"] == pytest.approx(2000 / 3.0)
    ranks = {r["rank"]: r for r in job["ranks"]}
    assert [ranks[r]["state"] for r in range(3)] == ["live", "finished", "live"]
    assert ranks[2]["last_lag_seconds"] == pytest.approx(0.5)
    assert ranks[2]["mean_lag_seconds"] == pytest.approx(0.5)
    assert ranks[2]["collectives"] == 3  # the coordinator's two and the shard's one
    assert ranks[2]["last_arrivals"] == 3 and ranks[0]["last_arrivals"] == 0
    assert ranks[2]["host"] == "127.0.0.1"  # no host name given: its peer address's host
    stragglers = job["stragglers"]
    assert [(r["rank"], r["flagged"]) for r in stragglers] == [(2, True), (1, False),
                                                                (0, False)]
    assert stragglers[0]["waited_seconds"] == pytest.approx(3 * 0.4)
    assert stragglers[0]["last_share"] == 1.0
    assert stragglers[0]["median_lag_seconds"] == pytest.approx(0.5, rel=0.05)
    assert ranks[1]["heartbeat_age_seconds"] is None
    assert snap["shards"] == {"expected": 1, "slots": [{
        "slot": 0, "address": "10.0.0.7:1", "state": "up", "bytes_in": 50, "bytes_out": 60,
        "jobs": ["j"], "report_age_seconds": snap["shards"]["slots"][0]["report_age_seconds"]}]}
    assert snap["serving"] and snap["generated_at"] == 5e8 and snap["failures"] == []
    assert job["shards"] == 0  # the shard registered after the generation formed


async def test_a_failed_generation_is_one_failure_and_collective_failures_are_logged():
    clock = Clock()
    rendezvous = Rendezvous(heartbeat_timeout=10)
    status = CoordinatorStatus(rendezvous, clock=clock, wall_clock=lambda: 7.0)
    gen, _ = await formed(rendezvous, "j", 2)
    # A collective failing while the generation is healthy (a mismatch, a timeout): logged.
    status.metrics.finished("j", "all_reduce", clock.now - 1.5, failed=True)
    status.metrics.finished("j", "broadcast", clock.now, failed=False)
    # A generation failing takes its pending collectives with it: one entry, the reason.
    rendezvous.fail(gen, RankLostError("rank 1 of job 'j' was lost (test)", rank=1,
                                       generation=1))
    with status.generation_failed(gen):
        status.metrics.finished("j", "all_reduce", clock.now, failed=True)
    status.metrics.finished("j", "all_reduce", clock.now, failed=True)  # still the same failure
    assert [(f["job"], f["message"], f["time"]) for f in status.snapshot()["failures"]] == [
        ("j", "generation 1: rank 1 of job 'j' was lost (test)", 7.0),
        ("j", "all_reduce failed after 1.5 s", 7.0)]
    assert status.snapshot()["jobs"][0]["state"] == "failed"


async def test_a_collective_failed_by_a_finished_rank_says_so():
    rendezvous = Rendezvous(heartbeat_timeout=10)
    status = CoordinatorStatus(rendezvous)
    _, members = await formed(rendezvous, "j", 3)
    rendezvous.leave(members[2])
    for _ in range(2):
        status.metrics.finished("j", "all_reduce", 0.0, failed=True)
    (failure,) = status.snapshot()["failures"]
    assert failure["count"] == 2
    assert re.fullmatch(r"all_reduce failed after [\d.]+ s: rank 2 of job 'j' finished .*",
                        failure["message"])


# -- the page -------------------------------------------------------------------------------------


def test_page_shows_jobs_ranks_bytes_and_marks_the_straggler():
    page = Cells(render_html(snapshot()))
    cells = page.cells(data_job="j")
    assert cells["state"] == (None, "running")
    assert cells["bytes_in"] == ("8000", "8.0 kB")
    assert cells["bytes_out"] == ("8128", "8.1 kB")
    assert cells["bytes_in_per_second"] == ("1234.5", "1.2 kB/s")
    assert cells["world_size"] == ("2", "2")
    assert cells["size"] == (None, "fixed") and cells["resizes"] == ("0", "0")
    assert cells["collectives_completed"] == ("3", "3")
    (slow, text), = page.find("tr", data_rank="1")
    assert slow.get("class") == "slowest" and "slowest" in text
    assert page.cells(data_rank="1")["last_lag_seconds"] == ("0.3", "300.0 ms")
    assert page.cells(data_rank="1")["mean_lag_seconds"] == ("0.1", "100.0 ms")
    assert page.cells(data_rank="0")["state"] == (None, "live")
    assert page.find("tr", data_rank="0")[0][0].get("class") is None
    assert page.find("p", id="no-failures") and page.find("p", id="no-shards")
    assert "up 1 min 15 s" in render_html(snapshot())


def test_only_a_rank_that_stands_out_is_the_straggler():
    def slowest(*lags: float, shards: int = 0) -> list[str]:
        snap = snapshot()
        job = snap["jobs"][0]
        job["shards"] = shards
        job["ranks"] = [{**job["ranks"][0], "rank": r, "mean_lag_seconds": lag}
                        for r, lag in enumerate(lags)]
        page = Cells(render_html(snap))
        return [a["data-rank"] for a, _ in page.find("tr", **{"class": "slowest"})]

    assert slowest(0.0, 0.3) == ["1"]
    assert slowest(0.0154, 0.0157, 0.0137) == []  # jitter of a few milliseconds
    assert slowest(0.005, 0.0) == []  # under STRAGGLER_LAG
    assert slowest(0.04, 0.02, 0.01) == ["0"]
    assert slowest(None, None) == []


def straggler_row(rank: int, host: str, median: float, flagged: bool) -> dict:
    return {"rank": rank, "host": host, "address": f"{host}:1", "collectives": 20,
            "ewma_lag_seconds": median, "median_lag_seconds": median,
            "p95_lag_seconds": median * 1.1, "mean_lag_seconds": median,
            "last_lag_seconds": median, "max_lag_seconds": median * 1.2,
            "last_arrivals": 20 if flagged else 0, "last_share": 1.0 if flagged else 0.0,
            "waited_seconds": 20 * median if flagged else 0.0, "flagged": flagged}


def test_the_slowest_ranks_table_names_hosts_lags_and_what_the_others_waited():
    job = {**snapshot()["jobs"][0], "shards": 2,
           "stragglers": [straggler_row(1, "node-b", 0.25, True),
                          straggler_row(0, "node-a", 0.0004, False)]}
    page = Cells(render_html(snapshot(jobs=[job])))
    rows = page.find("tr", data_straggler="1") + page.find("tr", data_straggler="0")
    assert [(a.get("class"), "straggler" in text) for a, text in rows] == [
        ("slowest", True), (None, False)]
    cells = {f: c for f, c in page.cells().items()}  # the last row's, rank 0
    assert cells["host"] == (None, "node-a")
    first = [a["data-straggler"] for a, _ in page.find("tr") if "data-straggler" in a]
    assert first == ["1", "0"]  # slowest first, as the snapshot orders them
    html = render_html(snapshot(jobs=[job]))
    assert "on the coordinator and 2 hub shards" in html
    row = dict(page.find("td", data_field="median_lag_seconds")[0][0])
    assert row["data-value"] == "0.25"
    assert page.find("td", data_field="last_share")[0][1] == "100%"
    assert page.find("td", data_field="waited_seconds")[0][1] == "5.00 s"
    assert "Slowest ranks" not in render_html(snapshot())  # nothing measured: no table


def test_every_user_string_is_escaped():
    failure = {"time": 1_800_000_000.0, "job": HOSTILE, "count": 1,
               "message": f"generation 1: rank 0 of job {HOSTILE!r} was lost"}
    shard = {"slot": 0, "address": HOSTILE, "state": "up", "bytes_in": 0, "bytes_out": 0,
             "jobs": [HOSTILE], "report_age_seconds": 0.1}
    snap = snapshot(failures=[failure], shards={"expected": 1, "slots": [shard]})
    snap["jobs"][0]["name"] = HOSTILE
    second = {**snap["jobs"][0], "name": ATTRIBUTE, "ranks": [], "joining": 1}
    snap["jobs"].append(second)
    text = render_html(snap)

    assert text.count("<script") == 1  # the page's own
    assert "alert(1)</script>" not in text and 'onmouseover="' not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    page = Cells(text)
    # As a browser reads it: the names are text and attribute values, never markup.
    assert [a["data-job"] for a, _ in page.find("tr") if "data-job" in a] == [
        HOSTILE, ATTRIBUTE, HOSTILE]
    assert not any("onmouseover" in a for _, a, _ in page.elements)
    assert any(t == HOSTILE for _, t in page.find("td", data_field="name"))
    assert any(HOSTILE in t for _, t in page.find("td", data_field="message"))


def test_the_content_security_policy_allows_only_the_pages_own_script_and_style():
    page = Cells(render_html(snapshot()))
    (csp, _), = page.find("meta", http_equiv="Content-Security-Policy")

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    policy = dict(part.strip().split(" ", 1) for part in csp["content"].split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == digest("".join(page.scripts))
    assert policy["style-src"] == digest("".join(page.styles))
    assert "fetch(location.pathname" in "".join(page.scripts)


def test_empty_coordinator_and_json():
    snap = snapshot(jobs=[], serving=False, draining=True)
    page = Cells(render_html(snap))
    assert page.find("p", id="no-jobs")
    assert [t for _, t in page.find("span", data_field="serving")] == ["draining"]
    assert json.loads(render_json(snap)) == snap


async def test_routes_serve_a_fresh_snapshot_each_time():
    snaps = iter([snapshot(), snapshot(jobs=[])])
    routes = status_routes(lambda: next(snaps))
    status, kind, body = await routes["/"]()
    assert (status, kind) == (200, "text/html; charset=utf-8") and b'data-job="j"' in body
    status, kind, body = await routes["/status.json"]()
    assert (status, kind) == (200, "application/json") and json.loads(body)["jobs"] == []


def test_page_shows_outer_rounds_with_dropped_replicas_escaped():
    rounds = [{"job": "<j>", "fragments": [{"model": "global", "fragment": 0, "rounds": 7,
                                            "replicas": ["r0", "r1"], "dropped": ["r<2>"]}],
               "replicas": [{"replica": "r<2>", "joins": 2, "rounds": 5, "missed": 1,
                             "late": 0, "last_seen_seconds": 3.5}]}]
    page = render_html(snapshot(rounds=rounds))
    assert "<h2>Outer rounds</h2>" in page and "<h3>&lt;j&gt;</h3>" in page
    assert 'class="text failed">r&lt;2&gt;</td>' in page
    assert "<script>" not in page.split("Outer rounds")[1].split("</main>")[0]
    assert "Outer rounds" not in render_html(snapshot())  # no section without rounds


async def test_snapshot_lists_rounds_of_the_rounds_table():
    import numpy as np

    from gradstar.coordinator.rounds import AveragingStore, Policy, RoundsTable

    table = RoundsTable(AveragingStore(), max_numel=100, max_held_bytes=1 << 20)
    for name in ("a", "b"):
        table.seed("j", "m", 0, name, np.zeros(2, np.float32))
    for name in ("a", "b"):
        table.contribute("j", "m", 0, name, 0, Policy(1.0, 0.0, True, 2, 5.0),
                         np.ones(2, np.float32))
    status = CoordinatorStatus(Rendezvous(5.0), rounds=table)
    (job,) = status.snapshot()["rounds"]
    assert job["job"] == "j"
    assert job["fragments"] == [{"model": "m", "fragment": 0, "rounds": 1,
                                 "replicas": ["a", "b"], "dropped": []}]
    assert [(r["replica"], r["joins"], r["rounds"], r["missed"]) for r in job["replicas"]] == [
        ("a", 1, 1, 0), ("b", 1, 1, 0)]


def test_page_shows_an_elastic_jobs_size_limits_and_who_waits_at_its_next_boundary():
    elastic = snapshot()
    elastic["jobs"][0].update(min_world_size=2, max_world_size=4, resizes=3,
                              joining_at_boundary=1)
    page = Cells(render_html(elastic))
    cells = page.cells(data_job="j")
    assert cells["size"] == (None, "2..4 (+1 -0 next step)")
    assert cells["resizes"] == ("3", "3")

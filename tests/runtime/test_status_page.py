"""The status page in a real headless browser: a ``gradstar coordinator`` process, a 2-rank job
of real processes (rank 1 the straggler), a job with a hostile name, and Chromium (Debian's
``chromium`` package; ``make test`` installs it as root through scripts/ensure_chromium.sh)
loading ``/`` with its script running, then what the DOM shows."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.conftest import close_all, communicate_or_kill, join_all, rank_env
from tests.integration.test_stragglers import check_slow_first
from tests.unit.test_status_page import Cells

from .conftest import GRADSTAR, Lines, clean_env, http_get, stop_process

RANK = Path(__file__).with_name("status_rank.py")
JOB = "spirals-ddp"
ROUNDS, FLOATS, LATE = 5, 250_000, 0.3
#: What the hub receives from the job's ranks: every rank's payload of every all_reduce.
BYTES_IN = ROUNDS * 2 * FLOATS * 4
#: A job name that would run script if the page did not escape it (and CSP did not stop it).
HOSTILE = ("<script>document.title='pwned'</script>"
           "<img src=x onerror=\"document.title='pwned'\">")
INSTALL = ("Chromium is not installed; install it with 'sudo apt-get install -y chromium' "
           "(`make test` does, as root) to run the status page test")


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    pytest.fail(INSTALL, pytrace=False)


async def browse(browser: str, url: str, profile: Path, budget_ms: int = 5000) -> Cells:
    """The DOM of ``url`` after ``budget_ms`` of (virtual) time with its scripts running."""
    proc = await asyncio.create_subprocess_exec(
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
        "--dump-dom", url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL)
    out, err, hung = await communicate_or_kill(proc, 90)
    assert not hung and proc.returncode == 0, f"chromium failed:\n{err.decode()[-3000:]}"
    return Cells(out.decode())


def refreshes(page: Cells) -> int:
    (body, _), = page.find("body")
    return int(body.get("data-refreshes", "0"))


async def test_the_page_shows_a_real_job_in_a_headless_browser(tmp_path):
    browser = chromium()
    coordinator = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--shards", "0", "--log-level", "WARNING", env=clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    ranks: list[asyncio.subprocess.Process] = []
    hostile = []
    try:
        said = Lines(coordinator.stdout)
        Lines(coordinator.stderr)  # drained, so the coordinator never blocks on a full pipe
        port = (await said.wait_for(r"listening on 127\.0\.0\.1:(\d+)$", 30))[1]
        address = f"127.0.0.1:{port}"
        page_port = (await said.wait_for(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", 30))[1]
        url = f"http://127.0.0.1:{page_port}/"
        for r in range(2):
            ranks.append(await asyncio.create_subprocess_exec(
                sys.executable, str(RANK), str(ROUNDS), str(FLOATS), str(LATE),
                env=rank_env(address, JOB, 2, r), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT))
        outputs = [Lines(p.stdout) for p in ranks]
        for lines in outputs:
            await lines.wait_for(r"^ready$", 120)
        hostile = await join_all(address, 1, job=HOSTILE)
        await hostile[0].all_reduce(np.ones(4, np.float32))

        page = await browse(browser, url, tmp_path / "profile")
        # The script ran: it re-fetched the page and swapped in the new <main>; nothing the
        # hostile name carries ran.
        assert refreshes(page) >= 1
        assert [t for _, t in page.find("title")] == ["gradstar coordinator"]
        job = page.cells(data_job=JOB)
        assert job["name"] == (None, JOB)
        assert job["state"][1] == "running"
        assert job["world_size"] == ("2", "2") and job["generation"][0] == "1"
        assert job["members"][0] == "2"
        assert job["bytes_in"] == (str(BYTES_IN), f"{BYTES_IN / 1e6:.1f} MB")
        assert int(job["bytes_out"][0]) >= BYTES_IN  # every rank gets the whole result
        assert job["collectives_completed"][0] == str(ROUNDS)
        rows = {a["data-rank"]: a for a, _ in page.find("tr", in_data_ranks_of=JOB)
                if "data-rank" in a}
        assert sorted(rows) == ["0", "1"]
        rank = {r: page.cells(data_ranks_of=JOB, data_rank=r) for r in rows}
        assert [rank[r]["state"][1] for r in "01"] == ["live", "live"]
        # Rank 1 arrived LATE seconds after rank 0 at every all_reduce: the straggler. Each
        # collective counted once; rank 1's mean lag at least about the sleep (a lower bound),
        # rank 0's at most half of it: relative (a loaded machine delays both ranks), with the
        # margin of the page's own rule for "slowest", which so marks rank 1.
        assert [rank[r]["collectives"][0] for r in "01"] == [str(ROUNDS)] * 2
        means = {r: float(rank[r]["mean_lag_seconds"][0]) for r in "01"}
        assert means["1"] >= LATE / 2 and 2 * means["0"] <= means["1"], means
        assert rows["1"].get("class") == "slowest" and rows["0"].get("class") is None
        # Each all_reduce had one last rank: rank 1 in most (rank 0 only where it stalled
        # longer than LATE).
        lasts = {r: int(rank[r]["last_arrivals"][0]) for r in "01"}
        assert sum(lasts.values()) == ROUNDS and lasts["1"] > ROUNDS / 2, lasts
        odd = page.cells(data_job=HOSTILE)
        assert odd["name"] == (None, HOSTILE) and odd["state"][1] == "running"

        for p in ranks:
            p.stdin.write(b"done\n")
            await p.stdin.drain()
        for p, lines in zip(ranks, outputs, strict=True):
            await lines.wait_for(r"^closed$", 60)
            assert await asyncio.wait_for(p.wait(), 30) == 0, lines.text
        await close_all(hostile)
        hostile = []

        page = await browse(browser, url, tmp_path / "profile")
        job = page.cells(data_job=JOB)
        assert job["state"][1] == "completed" and job["members"][0] == "0"
        assert int(job["bytes_in"][0]) >= BYTES_IN
        assert [page.cells(data_ranks_of=JOB, data_rank=r)["state"][1] for r in "01"] == [
            "finished", "finished"]
        assert page.cells(data_job=HOSTILE)["state"][1] == "completed"
        assert page.find("p", id="no-failures")  # clean closes are no failures

        status, kind, body = await http_get(int(page_port), "/status.json")
        data = {j["name"]: j for j in json.loads(body)["jobs"]}
        assert (status, kind) == (200, "application/json")
        assert data[JOB]["state"] == "completed" and data[HOSTILE]["state"] == "completed"
    finally:
        if hostile:
            await close_all(hostile)
        for p in ranks:
            await stop_process(p)
        await stop_process(coordinator)


async def test_the_slowest_ranks_table_names_a_late_rank_behind_hub_shards(tmp_path):
    """3 ranks on ``--shards 2`` (the shards measure; the coordinator merges their reports):
    rank 1 heads the table, flagged, with its host and a lag close to LATE; it stays there as
    the page refreshes itself."""
    browser = chromium()
    coordinator = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--shards", "2", "--log-level", "WARNING", env=clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    ranks: list[asyncio.subprocess.Process] = []
    job = "sharded-ddp"
    try:
        said = Lines(coordinator.stdout)
        Lines(coordinator.stderr)
        port = (await said.wait_for(r"listening on 127\.0\.0\.1:(\d+)$", 30))[1]
        page_port = (await said.wait_for(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", 30))[1]
        for r in range(3):
            ranks.append(await asyncio.create_subprocess_exec(
                sys.executable, str(RANK), str(ROUNDS), "4096", str(LATE),
                env=rank_env(f"127.0.0.1:{port}", job, 3, r, GRADSTAR_CHUNK_BYTES=1024),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT))
        outputs = [Lines(p.stdout) for p in ranks]
        for lines in outputs:
            await lines.wait_for(r"^ready$", 120)
        # The shards report every second: wait (bounded) until the coordinator's view has
        # every rank's every collective; from then on its figures no longer change.
        deadline = time.monotonic() + 10
        while True:
            _, _, body = await http_get(int(page_port), "/status.json")
            (mine,) = [j for j in json.loads(body)["jobs"] if j["name"] == job]
            rows = mine["stragglers"]
            complete = len(rows) == 3 and all(r["collectives"] == ROUNDS for r in rows)
            if complete or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        # What the scenario makes of them, whatever the machine's load (see
        # tests/integration/test_stragglers.py): consistent figures, flags as the rule says (rank
        # 1 alone in a quiet run), rank 1 first, each collective counted once, a lag and a wait
        # of at least about the sleep, last in most rounds (another rank is last only where it
        # stalls longer than LATE), the others' lags below half its own (relative: load delays
        # every rank).
        check_slow_first(rows, [1], 3, LATE * 0.7)
        assert all(r["collectives"] == ROUNDS for r in rows), rows
        assert sum(r["last_arrivals"] for r in rows) == ROUNDS, rows
        slow = rows[0]
        assert slow["host"] == socket.gethostname(), rows
        assert slow["waited_seconds"] >= LATE * 0.7 * ROUNDS, slow
        assert slow["last_arrivals"] > ROUNDS / 2, slow

        page = await browse(browser, f"http://127.0.0.1:{page_port}/", tmp_path / "profile")
        assert refreshes(page) >= 1  # the table is part of what refreshes
        assert page.find("table", data_stragglers_of=job)
        # The table shows those rows, in that order, with the same figures and flags.
        shown = [a for a, _ in page.find("tr", in_data_stragglers_of=job) if "data-straggler" in a]
        assert [a["data-straggler"] for a in shown] == [str(r["rank"]) for r in rows]
        for a, r in zip(shown, rows, strict=True):
            cells = page.cells(data_stragglers_of=job, data_straggler=str(r["rank"]))
            assert cells["host"][1] == r["host"]
            for field in ("median_lag_seconds", "p95_lag_seconds", "last_share",
                          "waited_seconds"):
                assert cells[field][0] == f"{r[field]:.6g}", (field, cells, r)
            assert cells["last_share"][1] == f"{r['last_share'] * 100:.0f}%"
            assert cells["collectives"][0] == str(r["collectives"])
            assert cells["flag"][1] == ("straggler" if r["flagged"] else "")
            assert a.get("class") == ("slowest" if r["flagged"] else None)
        assert any("2 hub shards" in text for _, text in page.find("p"))
        for p in ranks:
            p.stdin.write(b"done\n")
            await p.stdin.drain()
        for p, lines in zip(ranks, outputs, strict=True):
            await lines.wait_for(r"^closed$", 60)
            assert await asyncio.wait_for(p.wait(), 30) == 0, lines.text
    finally:
        for p in ranks:
            await stop_process(p)
        await stop_process(coordinator)


async def test_the_page_and_its_json_sit_beside_metrics(start_coordinator):
    hub = await start_coordinator(metrics_port=0)
    groups = await join_all(hub.address, 2, job="side")
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(1000, np.float32)) for g in groups))
        status, kind, body = await http_get(hub.metrics_port, "/")
        assert (status, kind) == (200, "text/html; charset=utf-8")
        page = Cells(body.decode())
        assert page.cells(data_job="side")["bytes_in"][0] == str(2 * 4000)
        status, kind, body = await http_get(hub.metrics_port, "/status.json")
        (job,) = json.loads(body)["jobs"]
        assert (status, job["name"], job["state"], job["bytes_in"]) == (200, "side", "running",
                                                                        8000)
        assert [r["state"] for r in job["ranks"]] == ["live", "live"]
        status, _, body = await http_get(hub.metrics_port, "/nothing")
        assert status == 404 and b"/status.json" in body
    finally:
        await close_all(groups)

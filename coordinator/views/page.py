"""The coordinator's status page: ``GET /`` (HTML) and ``GET /status.json`` on the metrics port.

Pure functions of a :meth:`~.status.CoordinatorStatus.snapshot`: :func:`render_html` and
:func:`render_json`; :func:`status_routes` adapts them to
:func:`gradstar.transport.http.serve_http`.

The page is self-contained: inline CSS and a few lines of inline JavaScript that re-fetch the page
every :data:`REFRESH_SECONDS` and swap its ``<main>`` (without JavaScript, a meta refresh in
``<noscript>`` reloads it). Every value written into the HTML goes through :func:`html.escape`
(job names and failure messages come from users), and a Content-Security-Policy allows only this
page's own script and style (by hash), so an escaping slip still could not run a script.

It shows what ``/metrics`` shows and the failure messages ``gradstar admin status`` shows, and is
exposed the same way: on ``metrics_host``, loopback unless an operator opens it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import time
from collections.abc import Awaitable, Callable

from gradstar.config import size_limits_text

from .leadership import leadership_html

#: Seconds between refreshes of the page.
REFRESH_SECONDS = 2
#: Rows shown per job and jobs shown; /status.json has them all.
MAX_RANKS_SHOWN = 64
MAX_JOBS_SHOWN = 200
#: Rows of a job's "slowest ranks" table.
STRAGGLERS_SHOWN = 8
#: A rank is marked the straggler when its mean arrival lag is at least this many seconds and
#: twice any other rank's: a few milliseconds of jitter marks nobody.
STRAGGLER_LAG = 0.01

_STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em;color:#1d232a;
background:#f6f7f9}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
h3{font-size:1em;margin:1em 0 .3em}
table{border-collapse:collapse;background:#fff;margin-bottom:.6em}
th,td{border:1px solid #d5d9de;padding:.25em .6em;text-align:right;white-space:nowrap}
th{background:#eceff2;font-weight:600}td.text,th.text{text-align:left;white-space:normal}
.state{font-weight:600}.running,.live,.up,.serving{color:#17803d}
.failed,.lost,.draining{color:#b42318}.completed,.finished{color:#475467}
.forming,.idle{color:#a15c07}.slowest{background:#fff4e5}.muted{color:#667085}
code{font-size:.95em}
"""
_SCRIPT = """
let refreshes = 0;
setInterval(async () => {
  try {
    const reply = await fetch(location.pathname, {cache: "no-store"});
    if (!reply.ok) throw new Error(reply.status);
    const next = new DOMParser().parseFromString(await reply.text(), "text/html");
    document.querySelector("main").replaceWith(next.querySelector("main"));
    document.body.dataset.refreshes = String(++refreshes);
    document.body.dataset.stale = "0";
  } catch (e) {
    document.body.dataset.stale = "1";
  }
}, REFRESH_MS);
""".replace("REFRESH_MS", str(REFRESH_SECONDS * 1000))


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


_CSP = (f"default-src 'none'; connect-src 'self'; script-src {_sha256(_SCRIPT)}; "
        f"style-src {_sha256(_STYLE)}; base-uri 'none'; form-action 'none'")


def render_json(snapshot: dict) -> bytes:
    return json.dumps(snapshot, indent=1, sort_keys=True).encode()


def render_html(snapshot: dict) -> str:
    """The whole page for ``snapshot``."""
    jobs = snapshot["jobs"]
    serving = "serving" if snapshot["serving"] else (
        "draining" if snapshot["draining"] else "not serving")
    head = (f'<meta charset="utf-8"><meta http-equiv="Content-Security-Policy" '
            f'content="{_e(_CSP)}"><meta name="viewport" content="width=device-width">'
            f"<title>gradstar coordinator</title><style>{_STYLE}</style>"
            f'<noscript><meta http-equiv="refresh" content="{REFRESH_SECONDS * 3}"></noscript>')
    running = sum(1 for j in jobs if j["state"] == "running")
    main = [
        f'<p>Coordinator <span class="state {_e(serving.replace(" ", "-"))}" '
        f'data-field="serving">{_e(serving)}</span>, up {_e(_duration(snapshot["uptime_seconds"]))}'
        f"; {len(jobs)} job{'s' if len(jobs) != 1 else ''} ({running} running). "
        f'<span class="muted">As of {_e(_clock(snapshot["generated_at"]))}; rates over the '
        f"last {snapshot['rate_window_seconds']:g} s; refreshes every "
        f"{REFRESH_SECONDS} s.</span></p>",
        leadership_html(snapshot.get("leadership")),
        _jobs_table(jobs),
        *(_ranks_table(job) for job in jobs[:MAX_JOBS_SHOWN]),
        _failures(snapshot["failures"], snapshot["generated_at"]),
        _shards(snapshot["shards"]),
        _rounds(snapshot.get("rounds", [])),
        _steps(snapshot.get("steps", [])),
    ]
    return (f"<!doctype html><html lang=\"en\"><head>{head}</head><body>"
            f"<h1>gradstar coordinator</h1><main>{''.join(main)}</main>"
            f'<p class="muted">Data as JSON: <a href="/status.json">/status.json</a>; '
            f'Prometheus: <a href="/metrics">/metrics</a>.</p>'
            f"<script>{_SCRIPT}</script></body></html>")


def _jobs_table(jobs: list[dict]) -> str:
    if not jobs:
        return '<h2>Jobs</h2><p class="muted" id="no-jobs">No jobs yet.</p>'
    rows = []
    for job in jobs[:MAX_JOBS_SHOWN]:
        done = sum(job["collectives_completed"].values())
        failed = sum(job["collectives_failed"].values())
        size = size_limits_text(job["world_size"], job["min_world_size"], job["max_world_size"],
                                job["resizes"], job["joining_at_boundary"],
                                job["departing_at_boundary"])
        rows.append(
            f'<tr data-job="{_e(job["name"])}">'
            f'<td class="text" data-field="name">{_e(job["name"])}</td>'
            f'<td class="text state {_e(job["state"])}" data-field="state">{_e(job["state"])}'
            "</td>"
            f'{_cell("world_size", job["world_size"])}'
            f'<td data-field="size">{_e(size)}</td>{_cell("resizes", job["resizes"])}'
            f'{_cell("generation", job["generation"])}'
            f'{_cell("members", job["members"])}'
            f'{_cell("collectives_completed", done)}{_cell("collectives_failed", failed)}'
            f'{_cell("bytes_in", job["bytes_in"], _bytes)}'
            f'{_cell("bytes_out", job["bytes_out"], _bytes)}'
            f'{_cell("bytes_in_per_second", job["bytes_in_per_second"], _rate)}'
            f'{_cell("bytes_out_per_second", job["bytes_out_per_second"], _rate)}'
            "</tr>")
    more = len(jobs) - MAX_JOBS_SHOWN
    note = f'<p class="muted">… and {more} more jobs (see /status.json).</p>' if more > 0 else ""
    return ('<h2>Jobs</h2><table id="jobs"><thead><tr><th class="text">Job</th>'
            '<th class="text">State</th><th>World size</th><th>Size limits</th><th>Resizes</th>'
            "<th>Generation</th><th>Live ranks</th>"
            "<th>Collectives</th><th>Failed</th><th>Bytes in</th><th>Bytes out</th>"
            "<th>In /s</th><th>Out /s</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>" + note)


def _rebuilds(job: dict) -> str:
    """A line on the coordinator restarts the job rode through, if any."""
    if not job.get("rebuilds"):  # a snapshot without the field: none
        return ""
    return (f'<p class="muted" data-rebuilds-of="{_e(job["name"])}">Generation rebuilt from its '
            f'rejoining ranks after {_e(job["rebuilds"])} coordinator restart(s); ranks waited '
            f'up to {_seconds(job["rejoin_wait_seconds"])} at the latest.</p>')


def _ranks_table(job: dict) -> str:
    title = f'<h3>Ranks of <code>{_e(job["name"])}</code>'
    ranks = job["ranks"]
    if not ranks:
        joining = job["joining"]
        return (f'{title}</h3><p class="muted" data-ranks-of="{_e(job["name"])}">'
                f"{_e(joining)} of {_e(job['world_size'])} ranks joining.</p>")
    slowest = _slowest(ranks)
    rows = []
    for r in ranks[:MAX_RANKS_SHOWN]:
        mark = ' class="slowest"' if r["rank"] == slowest else ""
        rows.append(
            f'<tr data-rank="{_e(r["rank"])}"{mark}>{_cell("rank", r["rank"])}'
            f'<td class="text state {_e(r["state"])}" data-field="state">{_e(r["state"])}</td>'
            f'{_cell("heartbeat_age_seconds", r["heartbeat_age_seconds"], _seconds)}'
            f'{_cell("collectives", r["collectives"])}'
            f'{_cell("last_lag_seconds", r["last_lag_seconds"], _seconds)}'
            f'{_cell("mean_lag_seconds", r["mean_lag_seconds"], _seconds)}'
            f'{_cell("last_arrivals", r["last_arrivals"])}'
            f'<td class="text">{"slowest" if r["rank"] == slowest else ""}</td></tr>')
    more = len(ranks) - MAX_RANKS_SHOWN
    note = f'<p class="muted">… and {more} more ranks (see /status.json).</p>' if more > 0 else ""
    return (f"{title} (generation {_e(job['generation'])})</h3>" + _rebuilds(job)
            + f'<table class="ranks" data-ranks-of="{_e(job["name"])}"><thead><tr><th>Rank</th>'
            '<th class="text">State</th><th>Heartbeat age</th><th>Collectives</th>'
            '<th title="seconds after the first rank\'s header of its latest collective">'
            'Last lag</th><th title="mean over its collectives">Mean lag</th>'
            '<th title="collectives in which every other rank waited for it">Arrived last</th>'
            '<th class="text"></th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>"
            + note + _stragglers_table(job))


def _stragglers_table(job: dict) -> str:
    """The job's :data:`STRAGGLERS_SHOWN` slowest ranks (its ``stragglers``, slowest first)."""
    rows = job.get("stragglers") or []
    if not rows:
        return ""
    body = []
    for r in rows[:STRAGGLERS_SHOWN]:
        mark = ' class="slowest"' if r["flagged"] else ""
        body.append(
            f'<tr data-straggler="{_e(r["rank"])}"{mark}>{_cell("rank", r["rank"])}'
            f'<td class="text" data-field="host">{_e(r["host"] or "-")}</td>'
            f'{_cell("median_lag_seconds", r["median_lag_seconds"], _seconds)}'
            f'{_cell("p95_lag_seconds", r["p95_lag_seconds"], _seconds)}'
            f'{_cell("last_share", r["last_share"], _percent)}'
            f'{_cell("waited_seconds", r["waited_seconds"], _seconds)}'
            f'{_cell("collectives", r["collectives"])}'
            f'<td class="text" data-field="flag">{"straggler" if r["flagged"] else ""}</td>'
            "</tr>")
    where = (f"on the coordinator and {job['shards']} hub shard{'s' if job['shards'] != 1 else ''}"
             if job["shards"] else "on the coordinator")
    return (f'<h3>Slowest ranks of <code>{_e(job["name"])}</code></h3>'
            f'<table class="stragglers" data-stragglers-of="{_e(job["name"])}"><thead><tr>'
            '<th>Rank</th><th class="text">Host</th>'
            '<th title="seconds after the first rank\'s header, median of its collectives">'
            'Median lag</th><th title="95th percentile">p95 lag</th>'
            '<th title="share of its collectives in which every other rank waited for it">'
            'Arrived last</th>'
            '<th title="seconds the collectives it was last in waited for it alone">'
            'Others waited</th><th>Collectives</th><th class="text"></th></tr></thead><tbody>'
            + "".join(body) + "</tbody></table>"
            f'<p class="muted">Measured {_e(where)}, slowest first (by recent lag); '
            f"{len(rows)} rank{'s' if len(rows) != 1 else ''} in all (see /status.json).</p>")


def _slowest(ranks: list[dict]) -> int | None:
    """The rank the others wait for: the highest mean arrival lag, if it stands out (at least
    :data:`STRAGGLER_LAG` seconds, and twice any other rank's)."""
    lagged = sorted((r["mean_lag_seconds"], r["rank"]) for r in ranks
                    if r["mean_lag_seconds"] is not None)
    if len(lagged) < 2 or lagged[-1][0] < max(STRAGGLER_LAG, 2 * lagged[-2][0]):
        return None
    return lagged[-1][1]


def _failures(failures: list[dict], now: float) -> str:
    if not failures:
        return '<h2>Recent failures</h2><p class="muted" id="no-failures">None.</p>'
    rows = "".join(
        f'<tr data-job="{_e(f["job"])}"><td class="text">{_e(_clock(f["time"]))}</td>'
        f'<td>{_e(_duration(max(now - f["time"], 0)))} ago</td>'
        f'<td class="text">{_e(f["job"])}</td>'
        f'<td class="text" data-field="message">{_e(f["message"])}{_times(f["count"])}</td></tr>'
        for f in failures)
    return ('<h2>Recent failures</h2><table id="failures"><thead><tr><th class="text">Time</th>'
            '<th>Age</th><th class="text">Job</th><th class="text">Message</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>")


def _times(count: int) -> str:
    return f" (x{count})" if count > 1 else ""


def _shards(shards: dict) -> str:
    slots = shards["slots"]
    if not slots and not shards["expected"]:
        return ('<h2>Hub shards</h2><p class="muted" id="no-shards">None: the coordinator '
                "carries the collectives itself.</p>")
    rows = "".join(
        f'<tr data-shard="{_e(s["slot"])}">{_cell("slot", s["slot"])}'
        f'<td class="text">{_e(s["address"])}</td>'
        f'<td class="text state {_e(s["state"])}">{_e(s["state"])}</td>'
        f'{_cell("bytes_in", s["bytes_in"], _bytes)}'
        f'{_cell("bytes_out", s["bytes_out"], _bytes)}'
        f'<td class="text">{_e(", ".join(s["jobs"]))}</td>'
        f'{_cell("report_age_seconds", s["report_age_seconds"], _seconds)}'
        "</tr>" for s in slots)
    return (f"<h2>Hub shards ({len([s for s in slots if s['state'] == 'up'])} up of "
            f"{_e(shards['expected'])} expected)</h2><table id=\"shards\"><thead><tr><th>Slot</th>"
            '<th class="text">Address</th><th class="text">State</th><th>Bytes in</th>'
            '<th>Bytes out</th><th class="text">Jobs</th><th>Last report</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>")


def _rounds(jobs: list[dict]) -> str:
    """Fault-tolerant outer rounds (StreamingDiLoCo): only when some job has them."""
    if not jobs:
        return ""
    parts = ["<h2>Outer rounds</h2>"]
    for job in jobs[:MAX_JOBS_SHOWN]:
        frags = "".join(
            f'<tr><td class="text">{_e(f["model"])}</td>{_cell("fragment", f["fragment"])}'
            f'{_cell("rounds", f["rounds"])}<td class="text">{_e(", ".join(f["replicas"]))}</td>'
            f'<td class="text failed">{_e(", ".join(f["dropped"]))}</td></tr>'
            for f in job["fragments"])
        reps = "".join(
            f'<tr><td class="text">{_e(r["replica"])}</td>{_cell("joins", r["joins"])}'
            f'{_cell("rounds", r["rounds"])}{_cell("missed", r["missed"])}'
            f'{_cell("late", r["late"])}'
            f'{_cell("last_seen_seconds", r["last_seen_seconds"], _seconds)}</tr>'
            for r in job["replicas"][:MAX_RANKS_SHOWN])
        parts.append(
            f'<h3>{_e(job["job"])}</h3><table><thead><tr><th class="text">Model</th>'
            '<th>Fragment</th><th>Rounds</th><th class="text">Last round</th>'
            f'<th class="text">Dropped</th></tr></thead><tbody>{frags}</tbody></table>'
            '<table><thead><tr><th class="text">Replica</th><th>Joins</th><th>Rounds</th>'
            '<th>Missed</th><th>Late</th><th>Last seen</th></tr></thead>'
            f"<tbody>{reps}</tbody></table>")
    return "".join(parts)


def _cell(field: str, value, show: Callable[[float], str] | None = None) -> str:
    """A number cell; ``data-value`` holds the exact value, the text a readable one (by
    ``show``)."""
    exact = "" if value is None else (f"{value:.6g}" if isinstance(value, float) else value)
    if value is None:
        shown = "-"
    else:
        shown = show(value) if show is not None else f"{value:,}"
    return f'<td data-field="{_e(field)}" data-value="{_e(exact)}">{_e(shown)}</td>'


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _percent(value: float) -> str:
    return f"{value * 100:.0f}%"


def _rate(n: float) -> str:
    return _bytes(n) + "/s"


def _seconds(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


Handler = Callable[[], Awaitable[tuple[int, str, bytes]]]


def status_routes(snapshot: Callable[[], dict]) -> dict[str, Handler]:
    """``/`` and ``/status.json`` for :func:`gradstar.transport.http.serve_http`, each rendering
    a fresh ``snapshot()``."""

    async def page() -> tuple[int, str, bytes]:
        return 200, "text/html; charset=utf-8", render_html(snapshot()).encode()

    async def data() -> tuple[int, str, bytes]:
        return 200, "application/json", render_json(snapshot())

    return {"/": page, "/status.json": data}


def _steps(models: list[dict]) -> str:
    """DDP's sync-mode steps (Quorum, BoundedStaleness, Asynchronous): only when some job has
    them; a rank out of the live set is marked."""
    if not models:
        return ""
    parts = ["<h2>Sync-mode steps</h2>"]
    for m in models[:MAX_JOBS_SHOWN]:
        stale = ", ".join(f"{k}: {n}" for k, n in m["staleness"].items()) or "-"
        ranks = "".join(
            f'<tr><td class="text">{_e(r["rank"])}</td>'
            f'<td class="text{"" if r["live"] else " failed"}">'
            f'{"live" if r["live"] else "out"}</td>{_cell("base", r["base"])}'
            f'{_cell("contributed", r["contributed"])}{_cell("dropped", r["dropped"])}</tr>'
            for r in m["ranks"][:MAX_RANKS_SHOWN])
        parts.append(
            f'<h3>{_e(m["job"])} / {_e(m["model"])}: {_e(m["mode"])}</h3>'
            f'<p>{_e(m["steps"])} steps closed; {len(m["live"])} of {_e(m["world_size"])} '
            f'ranks live; {_e(m["dropped"])} contributions dropped; staleness {_e(stale)}.</p>'
            '<table class="steps"><thead><tr><th class="text">Rank</th><th class="text">State'
            '</th><th>At step</th><th>Contributed</th><th>Dropped</th></tr></thead>'
            f"<tbody>{ranks}</tbody></table>")
    return "".join(parts)

"""The coordinator's Prometheus endpoint: real collectives, a straggler, Prometheus' own parser."""

from __future__ import annotations

import asyncio

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from gradstar.coordinator.metrics import Histogram
from tests.integration.conftest import close_all, join_all

from .conftest import GRADSTAR, clean_env, http_get, stop_process


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} as Prometheus would read the page."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_count_collectives_bytes_and_show_the_straggler(start_coordinator):
    hub = await start_coordinator(metrics_port=0)
    groups = await join_all(hub.address, 2, job="m")
    try:
        x = np.ones(1000, np.float32)
        for _ in range(2):
            await asyncio.gather(*(g.all_reduce(x) for g in groups))
        # Rank 1 is the straggler of the third collective: it arrives 0.3 s after the hub saw
        # rank 0's header.
        early = asyncio.ensure_future(groups[0].all_reduce(x))
        generation = hub.rendezvous.jobs["m"].generation
        for _ in range(200):
            if generation.collectives:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        await asyncio.wait_for(asyncio.gather(early, groups[1].all_reduce(x)), 20)

        status, kind, body = await http_get(hub.metrics_port, "/metrics")
    finally:
        await close_all(groups)
    assert status == 200 and kind.startswith("text/plain; version=0.0.4")
    got = samples(body.decode())

    def value(name: str, **labels: str) -> float:
        return got[(name, frozenset(labels.items()))]

    assert value("gradstar_serving") == 1
    assert value("gradstar_collectives_completed_total", job="m", op="all_reduce") == 3
    assert value("gradstar_bytes_received_total", job="m") == 3 * 2 * 4000
    assert value("gradstar_job_generation", job="m") == 1
    assert value("gradstar_collective_duration_seconds_count", job="m", op="all_reduce",
                 outcome="completed") == 3
    assert value("gradstar_collective_duration_seconds_sum", job="m", op="all_reduce",
                 outcome="completed") >= 0.3
    lagged = value("gradstar_rank_arrival_lag_seconds_sum", job="m", rank="1")
    assert value("gradstar_rank_arrival_lag_seconds_count", job="m", rank="1") == 3
    assert lagged >= 0.3
    assert value("gradstar_rank_arrival_lag_seconds_bucket", job="m", rank="1", le="0.25") <= 2
    assert value("gradstar_rank_arrival_lag_seconds_bucket", job="m", rank="1", le="+Inf") == 3
    assert value("gradstar_rank_last_arrival_lag_seconds", job="m", rank="1") >= 0.3
    assert value("gradstar_rank_last_arrivals_total", job="m", rank="1") >= 1
    assert sum(value("gradstar_rank_last_arrivals_total", job="m", rank=r) for r in "01") == 3

    status, _, _ = await http_get(hub.metrics_port, "/nothing")
    assert status == 404


def test_histogram_buckets_are_cumulative_and_bounds_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = h.lines("lag", {"rank": "0"})
    assert lines == ['lag_bucket{rank="0",le="0.1"} 2', 'lag_bucket{rank="0",le="1.0"} 3',
                     'lag_bucket{rank="0",le="+Inf"} 4', 'lag_sum{rank="0"} 3.65',
                     'lag_count{rank="0"} 4']


async def test_the_coordinator_command_serves_metrics():
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, "coordinator", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--shards", "0", "--log-level", "WARNING", env=clean_env(), stdout=asyncio.subprocess.PIPE)
    try:
        first = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        second = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert first.startswith("gradstar coordinator listening on 127.0.0.1:")
        assert second.startswith("gradstar coordinator metrics on http://127.0.0.1:")
        port = int(second.rsplit(":", 1)[1].split("/")[0])
        status, _, body = await http_get(port, "/metrics")
        assert status == 200
        assert samples(body.decode())[("gradstar_serving", frozenset())] == 1
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        await stop_process(proc)

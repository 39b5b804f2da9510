"""Per-group timeouts over backend "gradstar": ``new_group(timeout=...)`` and
``init_process_group(timeout=...)`` bound every collective, barrier and receive of that group,
and the error says "Timed out" (what torch's own tests and users grep for).

Two real rank processes of ``torch_probe_script.py`` against a coordinator in this process;
rank 0 alone calls each collective, so only the timeout can end it. The timings asserted are
loose on purpose: at least the group's timeout, and far below the default group's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from gradstar.client.torch_backend import backend
from gradstar.client.torch_backend.work import labelled
from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator
from gradstar.errors import CollectiveTimeoutError

from . import torch_probe_script as probe
from .conftest import finish, kill_all

WORLD = 2
pytestmark = pytest.mark.timeout(240)


async def run_probe(scenario: str, world: int, timeout: float, *extra: str,
                    gloo_init: str | None = None) -> list[dict]:
    """``world`` ranks of the probe script over gradstar (over gloo from ``gloo_init``, if
    given); each rank's report."""
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
    await hub.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    procs = []
    try:
        url = f"gradstar://{hub.address}?job={scenario}&join_timeout=60"
        how = ["--backend", "gloo", "--init-method", gloo_init] if gloo_init else [
            "--backend", "gradstar", "--init-method", url]
        for rank in range(world):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(probe.SCRIPT), scenario, *how, "--rank", str(rank),
                "--world-size", str(world), *extra,
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        results = await asyncio.gather(*(finish(p, timeout) for p in procs))
    finally:
        await kill_all(procs)
        await hub.stop(grace=0)
    reports = []
    for rank, (code, out, err) in enumerate(results):
        # The gloo reference is torch's own: once in CI its rank 0 aborted after its report was
        # out, in destroy_process_group ("terminate called without an active exception", no
        # gradstar process involved). What it reported still stands as the reference; a
        # gradstar rank must exit cleanly.
        torn_down = (gloo_init is not None and code == -signal.SIGABRT
                     and "terminate called" in err and out.rstrip().endswith("}"))
        assert code == 0 or torn_down, (
            f"rank {rank} exited with {code}:\n{out[-2000:]}\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def assert_timed_out(report: list, what: str, timeout: float, default: float) -> None:
    seconds, name, message = report
    assert name == "CollectiveTimeoutError", (what, report)
    # The rank label first, then the words torch's suite and users grep for.
    assert message.startswith("[Rank 0] Timed out"), (what, message)
    assert seconds >= timeout, (what, seconds)
    assert seconds < default / 4, (what, seconds)  # the group's timeout, not the default's


def test_a_1_s_group_timeout_fires_in_about_1_s_for_every_collective():
    reports = asyncio.run(run_probe("timeouts", WORLD, 180))
    report = reports[0]
    assert sorted(k for k in report if k not in ("scenario", "rank")) == sorted(
        ["barrier", "all_reduce", "broadcast", "all_gather", "recv", "monitored_barrier"])
    for what in ("barrier", "all_reduce", "broadcast", "all_gather"):
        assert_timed_out(report[what], what, probe.GROUP_TIMEOUT, probe.DEFAULT_TIMEOUT)
        assert "ranks [1] never arrived" in report[what][2]
    assert_timed_out(report["recv"], "recv", probe.GROUP_TIMEOUT, probe.DEFAULT_TIMEOUT)
    assert "from rank 1" in report["recv"][2]
    # monitored_barrier names the missing ranks in gloo's words, and is a RuntimeError as gloo's.
    seconds, name, message = report["monitored_barrier"]
    assert name == "MonitoredBarrierError", report["monitored_barrier"]
    assert message.startswith("Rank 0 timed out in monitoredBarrier after 1000 ms: Ranks 1 "
                              "failed to pass monitoredBarrier in 1000 ms ("), message
    assert probe.GROUP_TIMEOUT <= seconds < probe.DEFAULT_TIMEOUT / 4


def test_init_process_group_timeout_bounds_the_default_group(tmp_path):
    reports = asyncio.run(run_probe("global_timeout", WORLD, 180, "--timeout", "1",
                                    "--scratch", str(tmp_path)))
    assert_timed_out(reports[0]["barrier"], "barrier", 1.0, probe.DEFAULT_TIMEOUT)
    assert reports[1]["saw_rank0_done"]


# -- which timeout a group gets (no processes) -------------------------------------------------

ONE_S, TORCH_DEFAULT = timedelta(seconds=1), dist.default_pg_timeout


@pytest.mark.parametrize(("options", "given", "timeout", "is_default", "env", "want"), [
    # The default group: torch's timeout unless the URL, pg_options or GRADSTAR_* say otherwise.
    ({}, {}, ONE_S, True, {}, {"timeout": 1.0, "join_timeout": 1.0}),
    ({"timeout": 60.0}, {}, ONE_S, True, {}, {"join_timeout": 1.0}),
    ({}, {}, ONE_S, True, {"GRADSTAR_TIMEOUT": "9"}, {"join_timeout": 1.0}),
    ({"timeout": 5.0}, {"timeout": 5.0}, ONE_S, True, {}, {"join_timeout": 1.0}),
    # A subgroup: new_group(timeout=...) wins over what it inherits from the default group...
    ({"timeout": 60.0, "join_timeout": 60.0}, {}, ONE_S, False, {},
     {"timeout": 1.0, "join_timeout": 1.0}),
    ({}, {}, ONE_S, False, {"GRADSTAR_TIMEOUT": "9"}, {"timeout": 1.0, "join_timeout": 1.0}),
    # ... but not torch's default (what torch passes when new_group is given none) ...
    ({"timeout": 60.0, "join_timeout": 60.0}, {}, TORCH_DEFAULT, False, {}, {}),
    # ... and pg_options win over both.
    ({"timeout": 5.0}, {"timeout": 5.0}, ONE_S, False, {}, {"join_timeout": 1.0}),
])
def test_which_timeout_a_group_gets(monkeypatch, options, given, timeout, is_default, env, want):
    for name in ("GRADSTAR_TIMEOUT", "GRADSTAR_JOIN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert backend._timeouts(options, given, timeout, is_default) == want


def test_errors_through_torch_name_the_rank_on_a_copy():
    shared = CollectiveTimeoutError("Timed out after 1 s: barrier", missing_ranks=[1])
    named = labelled(shared, "[Rank 0] ")
    assert type(named) is CollectiveTimeoutError and named.missing_ranks == [1]
    assert str(named) == "[Rank 0] Timed out after 1 s: barrier"
    assert str(shared) == "Timed out after 1 s: barrier"  # raised by other calls too
    assert labelled(named, "[Rank 0] ") is named  # once
    other = ValueError("not gradstar's")
    assert labelled(other, "[Rank 0] ") is other

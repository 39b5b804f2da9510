"""Fixtures for multi-process training tests: the integration fixtures, and whole runs of a rank
script against a coordinator started for that run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

import pytest

import gradstar
from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator
from tests.integration.conftest import (  # noqa: F401  (fixtures, re-exported for this folder)
    coordinator,
    finish,
    rank_env,
    start_coordinator,
)


async def run_world(script: Path, world_size: int, job: str, *args: str,
                    timeout: float = 120) -> list[list[dict]]:
    """Start a coordinator on 127.0.0.1:0 and ``world_size`` processes of ``script``; return each
    rank's JSON stdout lines (indexed by rank). Every process is bounded by ``timeout`` seconds.

    Raises:
        AssertionError: a rank exited non-zero or hung (its stderr tail is in the message).
    """
    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
    await hub.start()
    procs = []
    try:
        for rank in range(world_size):
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, str(script), *args,
                env=rank_env(hub.address, job, world_size, rank),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
        results = await asyncio.gather(*(finish(p, timeout) for p in procs),
                                       return_exceptions=True)
    finally:
        await kill_all(procs)
        await hub.stop(grace=0)
    return [rank_lines(rank, result) for rank, result in enumerate(results)]


async def kill_all(procs: list[asyncio.subprocess.Process]) -> None:
    """Kill and reap each of ``procs`` that is still running."""
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def kill_coordinators(hubs) -> None:
    """SIGKILL and reap each coordinator process of ``hubs`` (spawn_standby's tuples)."""
    for proc, *_ in hubs:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()


def rank_lines(rank: int, result: tuple[int, str, str] | BaseException) -> list[dict]:
    """The JSON stdout lines of a rank process from its :func:`finish` result (as gathered with
    ``return_exceptions=True``).

    Raises:
        BaseException: ``result``, if it is one.
        AssertionError: the rank exited non-zero (its output tail is in the message).
    """
    if isinstance(result, BaseException):
        raise result
    code, out, err = result
    assert code == 0, f"rank {rank} exited with {code}:\n{out[-2000:]}\n{err[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture
async def solo(coordinator):  # noqa: F811  (the fixture imported above)
    """A blocking process group of world_size 1, joined on a worker thread."""
    pg = await asyncio.to_thread(gradstar.init_process_group, coordinator=coordinator.address,
                                 job="solo", world_size=1, rank=0, timeout=20, join_timeout=20)
    yield pg
    await asyncio.wait_for(asyncio.to_thread(pg.close), 20)


async def on_thread(body, *args):
    """``body(*args)`` on a worker thread, bounded by 30 seconds."""
    return await asyncio.wait_for(asyncio.to_thread(body, *args), 30)


def reports_by_scenario(reports: list[list[dict]], scenarios, world: int) -> dict[str, list[dict]]:
    """{scenario: [report of rank 0, ...]} from each rank's JSON lines (:func:`run_world`):
    every rank reported every one of ``scenarios``, none of them fatally, under its own rank."""
    by_scenario: dict[str, list[dict]] = {}
    for rank, lines in enumerate(reports):
        for line in lines:
            assert line["rank"] == rank
            assert "fatal" not in line, line
            by_scenario.setdefault(line["scenario"], []).append(line)
    assert sorted(by_scenario) == sorted(scenarios)
    assert all(len(v) == world for v in by_scenario.values())
    return by_scenario

"""Fixtures for multi-process training tests: the integration fixtures, and whole runs of a rank
script against a coordinator started for that run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

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
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        await hub.stop(grace=0)
    reports = []
    for rank, result in enumerate(results):
        if isinstance(result, BaseException):
            raise result
        code, out, err = result
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-2000:]}\n{err[-3000:]}"
        reports.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return reports

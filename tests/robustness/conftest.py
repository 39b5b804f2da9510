"""Fixtures for robustness tests: the coordinator as its own process, as in a deployment, so
that its memory, mappings and descriptors can be read from /proc."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.integration.conftest import spawn_coordinator


@pytest.fixture
async def start_hub():
    """Factory: ``await start_hub(*flags)`` -> (process, address) of ``gradstar coordinator``
    on 127.0.0.1:0 with extra command-line ``flags``; terminated after the test."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
        proc, address = await spawn_coordinator(*flags)
        procs.append(proc)
        return proc, address

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)


@pytest.fixture
async def hub(start_hub):
    """``gradstar coordinator`` in a subprocess on 127.0.0.1:0: (process, address)."""
    return await start_hub()

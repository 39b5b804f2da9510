"""Fixtures for integration tests: a real coordinator on 127.0.0.1:0 in the test's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import pytest

import gradstar
from benchmarks._etcd import start_etcd, stop_etcd
from gradstar.config import CoordinatorSettings
from gradstar.coordinator import Coordinator

RANK_SCRIPT = Path(__file__).with_name("rank_script.py")


async def until(predicate, what: str = "the condition", seconds: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (polled every 5 ms; the in-process hub runs between
    looks), for at most ``seconds`` of the loop's time; AssertionError naming ``what`` past it.
    Tests wait for the hub's state this way instead of sleeping and hoping it got there."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not within {seconds:g} s: {what}")
        await asyncio.sleep(0.005)


@pytest.fixture
async def start_coordinator():
    """Factory: ``await start_coordinator(**settings)`` -> a started Coordinator, stopped after."""
    started: list[Coordinator] = []

    async def start(**overrides) -> Coordinator:
        settings = CoordinatorSettings(**{"host": "127.0.0.1", "port": 0, **overrides})
        coordinator = Coordinator(settings)
        await coordinator.start()
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        await coordinator.stop(grace=0)


@pytest.fixture
async def coordinator(start_coordinator):
    return await start_coordinator()


async def join_all(address: str, world_size: int, job: str = "test", **options):
    """``world_size`` AsyncProcessGroups of one job in this process (real sockets)."""
    options.setdefault("timeout", 20)
    options.setdefault("join_timeout", 20)
    groups = await asyncio.wait_for(asyncio.gather(*(
        gradstar.init_process_group_async(coordinator=address, job=job, world_size=world_size,
                                          rank=r, **options)
        for r in range(world_size)
    )), 30)
    return sorted(groups, key=lambda g: g.rank)


async def close_all(groups) -> None:
    await asyncio.wait_for(asyncio.gather(*(g.close() for g in groups)), 20)


def rank_env(address: str, job: str, world_size: int, rank: int, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    env.update(GRADSTAR_COORDINATOR=address, GRADSTAR_JOB=job,
               GRADSTAR_WORLD_SIZE=str(world_size), GRADSTAR_RANK=str(rank))
    env.update({k: str(v) for k, v in extra.items()})
    return env


async def spawn_ranks(scenario: str, address: str, world_size: int, job: str, *args: str,
                      **env_extra) -> list[asyncio.subprocess.Process]:
    """Start ``world_size`` real rank processes running ``rank_script.py scenario``."""
    return [
        await asyncio.create_subprocess_exec(
            sys.executable, str(RANK_SCRIPT), scenario, *args,
            env=rank_env(address, job, world_size, r, **env_extra),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        for r in range(world_size)
    ]


async def communicate_or_kill(proc: asyncio.subprocess.Process,
                              timeout: float) -> tuple[bytes, bytes, bool]:
    """``proc.communicate()`` bounded by ``timeout``: (stdout, stderr, hung), where ``hung`` says
    the process outlived ``timeout`` and was killed (the output is what it wrote until then)."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        out, err = await proc.communicate()
        return out, err, True
    return out, err, False


async def spawn_coordinator(*flags: str, timeout: float = 20) -> tuple[
        asyncio.subprocess.Process, str]:
    """``gradstar coordinator`` on 127.0.0.1:0 as a process of its own (stdout piped), with
    ``flags`` after the defaults, and the address of its "listening on" line.

    ``--shards 0`` by default, so that it is one process on any machine (``--shards auto``
    starts one per two cores beyond two, whose own lines would come first).
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port", "0",
        "--shards", "0", "--log-level", "WARNING", *flags, stdout=asyncio.subprocess.PIPE)

    async def address() -> str:
        while True:
            line = (await proc.stdout.readline()).decode()
            assert line, "the coordinator exited before it listened"
            if line.startswith("gradstar coordinator listening on "):
                return line.split()[-1]

    try:
        return proc, await asyncio.wait_for(address(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise


async def finish(proc: asyncio.subprocess.Process, timeout: float) -> tuple[int, str, str]:
    """Wait for a rank process; kill it if it outlives ``timeout``."""
    out, err, hung = await communicate_or_kill(proc, timeout)
    if hung:
        raise AssertionError(f"rank process hung; stderr:\n{err.decode()[-3000:]}")
    return proc.returncode, out.decode(), err.decode()


@contextlib.asynccontextmanager
async def etcd_server(data_dir: Path):
    """A real etcd (Debian's etcd-server, ``make etcd``) on 127.0.0.1 with free ports and its
    data in ``data_dir``, killed afterwards; yields its client URL as ``--ha`` takes it.
    Fails, naming what is missing, where there is no etcd."""
    proc, url = await asyncio.to_thread(start_etcd, data_dir)
    try:
        yield url
    finally:
        await asyncio.to_thread(stop_etcd, proc)


async def spawn_standby(etcd: str, *flags: str, timeout: float = 20) -> tuple[
        asyncio.subprocess.Process, str, str]:
    """``gradstar coordinator --ha etcd`` as a process of its own (see spawn_coordinator):
    the process, its address and whether it came up as the "leader" or a "standby"."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port", "0",
        "--shards", "0", "--log-level", "WARNING", "--ha", etcd, *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(next_line(proc, "gradstar coordinator listening on ",
                                                "gradstar coordinator standby on "), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    role = "leader" if "listening on" in line else "standby"
    return proc, line.split()[4 if role == "standby" else -1], role


async def next_line(proc: asyncio.subprocess.Process, *starts: str) -> str:
    """The next line of ``proc``'s stdout that starts with one of ``starts``."""
    while True:
        line = (await proc.stdout.readline()).decode()
        assert line, f"the process exited before it printed {starts[0]!r}"
        if line.startswith(starts):
            return line.strip()

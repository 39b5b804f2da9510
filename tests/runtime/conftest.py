"""Fixtures for the runtime tests: the integration fixtures, and running ``gradstar`` commands
as real processes with a bound on every wait."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys

from tests.integration.conftest import (  # noqa: F401  (fixtures, re-exported for this folder)
    communicate_or_kill,
    coordinator,
    start_coordinator,
)

GRADSTAR = (sys.executable, "-m", "gradstar")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without GRADSTAR_* settings (a developer's shell may have some)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


async def run_gradstar(*args: str, timeout: float, env: dict[str, str] | None = None,
                       ) -> tuple[int, str, str]:
    """Run ``gradstar ARGS`` to completion; kill it and fail if it outlives ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        *GRADSTAR, *args, env=env or clean_env(), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err, hung = await communicate_or_kill(proc, timeout)
    if hung:
        raise AssertionError(f"`gradstar {' '.join(args)}` hung:\n{out.decode()[-3000:]}\n"
                             f"{err.decode()[-3000:]}")
    return proc.returncode, out.decode(), err.decode()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie waiting to be reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class Lines:
    """Collects a process stream's lines as they arrive; :meth:`wait_for` a matching one."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._pump(stream))

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.lines.append(line.decode("utf-8", "replace").rstrip("\n"))
            self._changed.set()
        self._changed.set()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    async def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first line matching ``pattern``; AssertionError if none within ``timeout``."""
        async def find():
            while True:
                for line in self.lines:
                    if match := re.search(pattern, line):
                        return match
                if self._task.done():
                    raise AssertionError(f"stream ended without {pattern!r}:\n{self.text[-3000:]}")
                self._changed.clear()
                await self._changed.wait()

        try:
            return await asyncio.wait_for(find(), timeout)
        except TimeoutError:
            raise AssertionError(f"no line matched {pattern!r} within {timeout} s:\n"
                                 f"{self.text[-3000:]}") from None

    async def finish(self, timeout: float = 10) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._task, timeout)


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, str, bytes]:
    """(status, content type, body) of ``GET path``, with a deadline on every step."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("Content-Type", ""), body


async def stop_process(proc: asyncio.subprocess.Process, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; no-op for a process that already ended."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()

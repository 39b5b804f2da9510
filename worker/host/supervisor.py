"""Starting, watching, restarting and stopping a host's rank processes.

One :class:`RankSupervisor` is the core of both ``gradstar launch`` (no restarts: the first
failure stops every rank) and the ``gradstar worker`` agent (``max_restarts`` restarts in total).
Its contract:

- Each local rank runs ``argv`` in its own session (process group), with the environment
  ``env_for(local_rank, restart)`` returns and stdin closed. Its stdout and stderr lines go to
  ``on_line(local_rank, stream, line)`` as they come (by default: this process's stdout and
  stderr, prefixed ``[rank N]``).
- A rank that exits 0 is done. One that exits otherwise, or is killed by a signal, is restarted
  while restarts remain, and otherwise every other rank is stopped (SIGTERM to its process
  group, SIGKILL after ``stop_grace`` seconds) and :meth:`run` returns an :class:`Outcome`
  naming the rank and how it ended.
- :meth:`request_stop` (for SIGINT/SIGTERM of the launcher) stops every rank the same way.

Nothing waits without a bound except the rank processes themselves, which are the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

#: Longest line handed to ``on_line`` at once; longer output arrives in pieces of this size.
LINE_LIMIT = 1 << 20
#: How long a rank's output may keep flowing after it exited (its own children may hold the
#: pipes open), before the supervisor stops reading it.
DRAIN_SECONDS = 2.0


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by signal 9 (SIGKILL)"``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"was killed by signal {number}"
    return f"was killed by signal {number} ({name})"


def shell_exit_code(returncode: int) -> int:
    """The exit status a shell would show for ``returncode`` (128 + signal for a signal)."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass
class RankStatus:
    """What the supervisor knows of one local rank (also what the agent's health shows)."""

    local_rank: int
    state: str = "starting"  # starting, running, succeeded, restarting, failed, stopped
    pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_exit: str = ""

    def as_dict(self, now: float) -> dict:
        return {"local_rank": self.local_rank, "state": self.state, "pid": self.pid,
                "restarts": self.restarts, "last_exit": self.last_exit,
                "uptime_seconds": round(now - self.started_at, 1)
                if self.state == "running" else None}


@dataclass(frozen=True)
class Outcome:
    """How a run ended. ``failed_rank`` is None when every rank succeeded."""

    exit_code: int
    message: str
    failed_rank: int | None = None
    returncode: int | None = None


@dataclass
class _Running:
    proc: asyncio.subprocess.Process
    pumps: list[asyncio.Task] = field(default_factory=list)


def _default_on_line(label: str) -> Callable[[int, str, str], None]:
    def on_line(local_rank: int, stream: str, line: str) -> None:
        target = sys.stdout if stream == "stdout" else sys.stderr
        target.write(f"[{label} {local_rank}] {line}\n")
        target.flush()

    return on_line


def _default_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RankSupervisor:
    """Runs ``nproc`` local ranks of ``argv`` to completion; see the module docstring."""

    def __init__(
        self,
        argv: Sequence[str],
        nproc: int,
        env_for: Callable[[int, int], dict[str, str]],
        *,
        max_restarts: int = 0,
        stop_grace: float = 5.0,
        on_line: Callable[[int, str, str], None] | None = None,
        log: Callable[[str], None] = _default_log,
        name: str = "gradstar",
        label: str = "rank",
    ) -> None:
        if nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        if not argv:
            raise ValueError("no command to run for the ranks")
        self.argv = list(argv)
        self.nproc = nproc
        self.env_for = env_for
        self.max_restarts = max_restarts
        self.stop_grace = stop_grace
        self.on_line = on_line or _default_on_line(label)
        self.log = log
        self.name = name
        self.label = label
        self.restarts = 0
        self.status = [RankStatus(r) for r in range(nproc)]
        self.state = "starting"  # starting, running, succeeded, failed, stopped
        self._running: dict[int, _Running] = {}
        self._exits: asyncio.Queue = asyncio.Queue()
        self._stop_signal: int | None = None
        self._waiters: set[asyncio.Task] = set()

    # -- public ------------------------------------------------------------------------------

    async def run(self) -> Outcome:
        """Start every rank and supervise them until all succeed, one fails for good, or a stop
        is requested. Every rank process has ended when this returns; the caller reports the
        outcome's message (the supervisor logs only starts, exits and restarts).

        Raises:
            OSError: a rank's command could not be started (not found, not executable); the
                ranks already started are stopped first.
        """
        try:
            for local_rank in range(self.nproc):
                await self._start(local_rank)
            self.state = "running"
            return await self._supervise()
        finally:
            await self._stop_all()

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop every rank and make :meth:`run` return (call from the event loop's thread)."""
        self._stop_signal = signum
        self._exits.put_nowait(None)

    def snapshot(self) -> dict:
        now = time.monotonic()
        return {"state": self.state, "nproc": self.nproc, "restarts": self.restarts,
                "max_restarts": self.max_restarts,
                "ranks": [s.as_dict(now) for s in self.status]}

    # -- machinery ---------------------------------------------------------------------------

    async def _start(self, local_rank: int) -> None:
        status = self.status[local_rank]
        env = self.env_for(local_rank, status.restarts)
        proc = await asyncio.create_subprocess_exec(
            *self.argv, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # signals reach the rank's own children too
            limit=LINE_LIMIT,
        )
        running = _Running(proc)
        running.pumps = [asyncio.create_task(self._pump(local_rank, proc.stdout, "stdout")),
                         asyncio.create_task(self._pump(local_rank, proc.stderr, "stderr"))]
        self._running[local_rank] = running
        status.pid, status.state, status.started_at = proc.pid, "running", time.monotonic()
        self.log(f"{self.name}: started {self.label} {local_rank} (pid {proc.pid})"
                 + (f", restart {status.restarts}" if status.restarts else ""))
        waiter = asyncio.create_task(self._wait(local_rank, running))
        self._waiters.add(waiter)
        waiter.add_done_callback(self._waiters.discard)

    async def _pump(self, local_rank: int, reader: asyncio.StreamReader, stream: str) -> None:
        while True:
            try:
                raw = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as end:  # EOF; maybe a last unterminated line
                raw = end.partial
                if not raw:
                    return
            except asyncio.LimitOverrunError as long:  # a line over LINE_LIMIT: in pieces
                raw = await reader.read(max(long.consumed, 1))
            self.on_line(local_rank, stream, raw.decode("utf-8", "replace").rstrip("\r\n"))

    async def _wait(self, local_rank: int, running: _Running) -> None:
        returncode = await running.proc.wait()
        _, pending = await asyncio.wait(running.pumps, timeout=DRAIN_SECONDS)
        for task in pending:
            task.cancel()
        self._exits.put_nowait((local_rank, running, returncode))

    async def _supervise(self) -> Outcome:
        while True:
            event = await self._exits.get()
            if event is None:
                self.state = "stopped"
                signum = self._stop_signal or signal.SIGTERM
                name = signal.Signals(signum).name
                return Outcome(128 + signum, f"{self.name}: stopped every {self.label} on {name}")
            local_rank, running, returncode = event
            if self._running.get(local_rank) is not running:
                continue  # a process the supervisor already stopped
            del self._running[local_rank]
            status = self.status[local_rank]
            status.last_exit = describe_exit(returncode)
            how = (f"{self.label} {local_rank} (pid {running.proc.pid}) {status.last_exit}")
            if returncode == 0:
                status.state = "succeeded"
                self.log(f"{self.name}: {how}")
                if not self._running:
                    self.state = "succeeded"
                    return Outcome(0, f"{self.name}: all {self.nproc} {self.label}s succeeded")
                continue
            if self.restarts < self.max_restarts:
                self.restarts += 1
                status.restarts += 1
                status.state = "restarting"
                self.log(f"{self.name}: {how}; restarting it (restart {self.restarts} of "
                         f"{self.max_restarts})")
                await self._start(local_rank)
                continue
            status.state = "failed"
            self.state = "failed"
            if self.max_restarts:
                why = f"; no restarts left ({self.max_restarts} used)"
            else:
                why = ""
            others = len(self._running)
            message = (f"{self.name}: {how}{why}"
                       + (f"; stopped the other {others} {self.label}(s)" if others else ""))
            return Outcome(shell_exit_code(returncode) or 1, message, local_rank, returncode)

    async def _stop_all(self) -> None:
        """SIGTERM every running rank's process group, SIGKILL what is left after the grace."""
        if not self._running:
            return
        running = dict(self._running)
        self._running.clear()
        for local_rank, r in running.items():
            self.status[local_rank].state = "stopped"
            _signal_group(r.proc, signal.SIGTERM)
        waits = [asyncio.ensure_future(r.proc.wait()) for r in running.values()]
        _, pending = await asyncio.wait(waits, timeout=self.stop_grace)
        if pending:
            for r in running.values():
                _signal_group(r.proc, signal.SIGKILL)
            await asyncio.wait(pending, timeout=10)
        for r in running.values():
            _, slow = await asyncio.wait(r.pumps, timeout=DRAIN_SECONDS)
            for task in slow:
                task.cancel()
        for local_rank, r in running.items():
            if r.proc.returncode is not None:
                self.status[local_rank].last_exit = describe_exit(r.proc.returncode)


def _signal_group(proc: asyncio.subprocess.Process, signum: int) -> None:
    if proc.returncode is not None:
        return  # reaped: its pid may already belong to another process
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def rank_env(base: Mapping[str, str], *, coordinator: str, job: str, world_size: int,
             local_rank: int, nproc: int, restart: int, rank: int | None) -> dict[str, str]:
    """The environment of one rank process: ``base`` without inherited ``GRADSTAR_*`` rank
    settings, plus what :func:`gradstar.init_process_group` and the script need.

    ``rank=None`` leaves ``GRADSTAR_RANK`` unset so the coordinator assigns one (agents on
    several hosts cannot know each other's ranks).
    """
    env = {k: v for k, v in base.items()
           if k not in ("GRADSTAR_RANK", "GRADSTAR_LOCAL_RANK", "GRADSTAR_RESTART_COUNT")}
    env.update(PYTHONUNBUFFERED="1",  # rank output arrives line by line, not at exit
               GRADSTAR_COORDINATOR=coordinator, GRADSTAR_JOB=job,
               GRADSTAR_WORLD_SIZE=str(world_size), GRADSTAR_LOCAL_RANK=str(local_rank),
               GRADSTAR_LOCAL_WORLD_SIZE=str(nproc), GRADSTAR_RESTART_COUNT=str(restart))
    if rank is not None:
        env["GRADSTAR_RANK"] = str(rank)
    return env


async def run_with_signals(supervisor: RankSupervisor) -> Outcome:
    """``supervisor.run()``, with SIGINT and SIGTERM stopping the ranks instead of orphaning
    them."""
    loop = asyncio.get_running_loop()
    installed = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, supervisor.request_stop, signum)
            installed.append(signum)
    try:
        return await supervisor.run()
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
